"""One pp rank of a Llama 3 debug pipeline over gloo (tests/e2e/test_pipeline_bitwise.py starts
one per rank, torchrun style).

    python pipeline_worker.py OUT --case SCHEDULE:MICROBATCHES:SPLIT [--case ...] --steps S

e.g. `--case gpipe:3:3,1`: GPipe, 3 micro-batches, 3 layers on stage 0 and 1 on stage 1. Each case
runs in turn in the same processes (one start-up for all).

The rank builds the same seeded model, keeps its stage's layers (the first stage the embedding,
the last the final norm, output and loss) and trains it twice from the same weights: with
PyTorch's own torch.distributed.pipelining (PipelineStage and ScheduleGPipe / Schedule1F1B), and
with titan's schedule record run by titan's executor (runtime/pipeline_executor.py) on eager
stages. Writes OUT/<case index>/rank{r}.safetensors (each step's loss on the last stage, every parameter
after the last step, for both) and rank{r}.json (the order torch ran forwards and backwards).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

from titan.builder.models.decoder import rope_tables
from titan.builder.models.llama3.config import FLAVORS
from titan.builder.models.llama3.model import Llama3
from titan.builder.spec.pipeline_order import pipeline_schedule
from titan.builder.spec.stage_split import layer_spans
from titan.runtime.contract.layout import Layout
from titan.runtime.pipeline_executor import run_pipeline_step

SEQ, MICROBATCH_ROWS = 32, 1


class StageModule(nn.Module):
    """Layers [start, stop) of `model`, with its embedding on the first stage and its norm and
    output on the last: activations in, activations (or logits) out."""

    def __init__(self, model: Llama3, start: int, stop: int, *, first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(start, stop)})
        self.norm, self.output = (model.norm, model.output) if last else (None, None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        cos, sin = rope_tables(h.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device)
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.output(self.norm(h)) if self.output is not None else h


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class EagerStage:
    """titan's StageRunner on an eager StageModule: one step's micro-batches."""

    def __init__(self, module: StageModule, *, first: bool, last: bool, tokens, labels, microbatches: int):
        self.module, self.first, self.last = module, first, last
        self.tokens, self.labels = tokens.chunk(microbatches), labels.chunk(microbatches)
        self.saved: dict[int, tuple] = {}
        self.losses: list[torch.Tensor] = []

    def forward(self, mb, inputs):
        x = self.tokens[mb] if self.first else inputs.requires_grad_()
        out = self.module(x)
        if self.last:
            loss = loss_fn(out, self.labels[mb])
            self.losses.append(loss.detach())
            self.saved[mb] = (x, loss)
            return None
        self.saved[mb] = (x, out)
        return out.detach()

    def backward(self, mb, grad_output):
        x, out = self.saved.pop(mb)
        torch.autograd.backward(out, grad_output)
        return None if self.first else x.grad

    def input_buffer(self, mb):
        return torch.empty(MICROBATCH_ROWS, SEQ, self.module.cfg.dim)

    def output_grad_buffer(self, mb):
        return torch.empty(MICROBATCH_ROWS, SEQ, self.module.cfg.dim)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--case", action="append", required=True, help="SCHEDULE:MICROBATCHES:SPLIT")
    parser.add_argument("--steps", type=int, default=3, help="at least 2")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for index, case in enumerate(args.case):
        schedule, microbatches, split = case.split(":")
        out = args.out / str(index)
        out.mkdir(exist_ok=True)
        run_case(out, schedule=schedule, microbatches=int(microbatches), split=split, steps=args.steps)
    dist.destroy_process_group()


def run_case(out: Path, *, schedule: str, microbatches: int, split: str, steps: int) -> None:
    rank, pp = dist.get_rank(), dist.get_world_size()
    spans = layer_spans(tuple(int(c) for c in split.split(",")))
    record = pipeline_schedule(schedule, spans=spans, microbatches=microbatches)
    first, last = rank == 0, rank == pp - 1

    torch.manual_seed(0)
    # The debug flavor, narrower (the stages' arithmetic is not what this checks) and deep enough.
    model = Llama3(dataclasses.replace(FLAVORS["debug"], n_layers=spans[-1][1], dim=64, n_heads=4, n_kv_heads=2,
                                       vocab_size=512))
    ours = StageModule(model, *spans[rank], first=first, last=last)
    theirs = copy.deepcopy(ours)
    batch_rows = MICROBATCH_ROWS * microbatches
    data = [torch.randint(0, model.cfg.vocab_size, (2, batch_rows, SEQ), generator=torch.Generator().manual_seed(s))
            for s in range(steps)]

    # The order torch's schedule runs this stage's forwards and backwards in its second step (the
    # first also runs the stage once to infer shapes; its IR for 1F1B's last stage is off by one:
    # tests/unit/test_pipeline_schedule.py).
    order: list[str] = []
    recording = [False]

    def log_forward(module, inputs, output):
        if not recording[0]:
            return
        m = sum(a.startswith("F") for a in order)
        order.append(f"F{m}")
        output.register_hook(lambda grad: order.append(f"B{sum(a.startswith('B') for a in order)}"))

    theirs.register_forward_hook(log_forward)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    stage = PipelineStage(theirs, rank, pp, torch.device("cpu"))
    reference = schedule_class(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    results = {}
    for name, module in (("torch", theirs), ("titan", ours)):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=False)
        for step, (tokens, labels) in enumerate(data):
            optimizer.zero_grad(set_to_none=True)
            if name == "torch":
                recording[0] = step == 1
                losses: list = []
                if first:
                    reference.step(tokens)
                else:
                    reference.step(target=labels, losses=losses)
            else:
                runner = EagerStage(module, first=first, last=last, tokens=tokens, labels=labels,
                                    microbatches=microbatches)
                run_pipeline_step(record, pp_rank=rank, stages={rank: runner},
                                  global_rank=lambda p: Layout(pp=pp).pipeline_peer(rank, p))
                for p in module.parameters():  # the mean over micro-batches, as torch's scale_grads
                    p.grad.div_(microbatches)
                losses = runner.losses
            if last:
                results[f"{name}.loss.{step}"] = torch.stack(losses)
            optimizer.step()
        results.update({f"{name}.param.{fqn}": p.detach().clone() for fqn, p in module.named_parameters()})
    save_file(results, out / f"rank{rank}.safetensors")
    ran = [a for a in record.actions[rank] if a.kind in ("F", "B")]
    (out / f"rank{rank}.json").write_text(json.dumps({"torch": order,
                                                           "titan": [f"{a.kind}{a.microbatch}" for a in ran]}))


if __name__ == "__main__":
    main()
