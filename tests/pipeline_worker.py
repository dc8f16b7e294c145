"""One pp rank of a Llama 3 debug pipeline over gloo (tests/e2e/test_pipeline_bitwise.py starts
one per rank, torchrun style).

    python pipeline_worker.py OUT --case SCHEDULE:MICROBATCHES:SPLIT [--case ...] --steps S [--dp N]

e.g. `--case gpipe:3:3,1`: GPipe, 3 micro-batches, 3 layers on stage 0 and 1 on stage 1;
`--case interleaved-1f1b:4:1,1,1,1` on 2 ranks: two stages per rank (`zbv:4:1,1,1,1`: two in a
V, the backward split into I and W). Each case runs in turn in the same processes (one start-up
for all). With --dp N, the world holds N pipelines (pp outermost)
reading their own rows of each batch, their gradients averaged over the pipelines.

The rank builds the same seeded model, keeps its stage's layers (builder/models/decoder_stage.py:
the first stage the embedding, the last the final norm, output and loss) and trains it three
times from the same weights: with PyTorch's own torch.distributed.pipelining (PipelineStage and
ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble, "torch"), and with
titan's schedule record run by titan's executor (runtime/pipeline_executor.py) on the eager stage
("titan") and on the stage's program, traced (builder/trace/stage_trace.py), written and read back
in the titan graph format ("graph"; zbv's I and W run the program's backward split in two by
runtime/backward_split.py). Writes OUT/<case index>/rank{r}.safetensors (each step's loss on the
rank of the last stage, every parameter after the last step, for each mode) and rank{r}.json (the
order torch ran this rank's forwards and backwards: F, B, I and W).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                   ScheduleZBVZeroBubble)

from titan.builder.models.decoder_stage import DecoderStage, mean_token_loss
from titan.builder.trace.stage_trace import trace_stage
from titan.runtime.contract.graph_decode import load_graph
from titan.runtime.pipeline_stage import GraphStage
from titan.builder.models.llama3.config import FLAVORS
from titan.builder.models.llama3.model import Llama3
from titan.builder.spec.pipeline_order import pipeline_schedule
from titan.builder.spec.stage_split import layer_spans
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.pipeline_schedule import COMPUTE
from titan.runtime.pipeline_executor import run_pipeline_step

SEQ, MICROBATCH_ROWS = 32, 1


class EagerStage:
    """titan's StageRunner on an eager DecoderStage: one step's micro-batches."""

    def __init__(self, module: DecoderStage, *, first: bool, last: bool, tokens, labels, microbatches: int, dim: int):
        self.module, self.first, self.last, self.dim = module, first, last, dim
        self.tokens, self.labels = tokens.chunk(microbatches), labels.chunk(microbatches)
        self.saved: dict[int, tuple] = {}
        self.losses: dict[int, torch.Tensor] = {}

    def forward(self, mb, inputs):
        x = self.tokens[mb] if self.first else inputs.requires_grad_()
        out = self.module(x)
        if self.last:
            loss = mean_token_loss(out, self.labels[mb])
            self.losses[mb] = loss.detach()
            self.saved[mb] = (x, loss)
            return None
        self.saved[mb] = (x, out)
        return out.detach()

    def backward(self, mb, grad_output):
        x, out = self.saved.pop(mb)
        torch.autograd.backward(out, grad_output)
        return None if self.first else x.grad

    # I runs the whole backward on an eager stage and W nothing: a parameter's gradients still add
    # up per stage in micro-batch order, so this checks the executor's I/W wiring and hand-overs;
    # the graph mode runs the real split (runtime/backward_split.py).
    backward_input = backward

    def backward_weight(self, mb):
        pass

    def input_buffer(self, mb):
        return torch.empty(MICROBATCH_ROWS, SEQ, self.dim)

    def output_grad_buffer(self, mb):
        return torch.empty(MICROBATCH_ROWS, SEQ, self.dim)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--case", action="append", required=True, help="SCHEDULE:MICROBATCHES:SPLIT")
    parser.add_argument("--steps", type=int, default=3, help="at least 2")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel pipelines (pp x dp ranks, pp outermost)")
    args = parser.parse_args()
    # A transfer that never comes (a wrong peer, a deadlock) fails the test in a minute, not hangs it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    layout = Layout(pp=dist.get_world_size() // args.dp, dp_replicate=args.dp)
    # Every rank creates every group, in the same order: one pipeline per data-parallel
    # coordinate (torch's stages talk within it) and one data-parallel group per stage.
    pipelines = [dist.new_group([layout.pipeline_peer(d, p) for p in range(layout.pp)]) for d in range(args.dp)]
    replicas = [dist.new_group(list(range(p * args.dp, (p + 1) * args.dp))) for p in range(layout.pp)]
    coords = layout.coordinates(dist.get_rank())
    place = Place(layout=layout, pp_rank=coords["pp"], dp_rank=coords["dp_replicate"],
                  pipeline=pipelines[coords["dp_replicate"]], replicas=replicas[coords["pp"]])
    for index, case in enumerate(args.case):
        schedule, microbatches, split = case.split(":")
        out = args.out / str(index)
        out.mkdir(exist_ok=True)
        run_case(out, place, schedule=schedule, microbatches=int(microbatches), split=split, steps=args.steps)
    dist.destroy_process_group()


@dataclasses.dataclass
class Place:
    """This process's place: its pipeline coordinate and pipeline, its data-parallel replicas."""
    layout: Layout
    pp_rank: int
    dp_rank: int
    pipeline: object
    replicas: object


def run_case(out: Path, place: Place, *, schedule: str, microbatches: int, split: str, steps: int) -> None:
    rank, pp, dp = place.pp_rank, place.layout.pp, place.layout.dp_replicate
    spans = layer_spans(tuple(int(c) for c in split.split(",")))
    n = len(spans)
    record = pipeline_schedule(schedule, spans=spans, microbatches=microbatches, stages_per_rank=n // pp)
    local = [s for s in range(n) if record.stage_rank[s] == rank]

    torch.manual_seed(0)
    # The debug flavor, narrower (the stages' arithmetic is not what this checks) and deep enough.
    cfg = dataclasses.replace(FLAVORS["debug"], n_layers=spans[-1][1], dim=64, n_heads=4, n_kv_heads=2, vocab_size=512)
    model = Llama3(cfg)
    ours = {s: DecoderStage(model, *spans[s], first=s == 0, last=s == n - 1) for s in local}
    theirs, graphs = copy.deepcopy(ours), copy.deepcopy(ours)
    # This rank's stage programs, traced from the stages on the meta device, written and read back.
    with torch.device("meta"):
        meta_model = Llama3(cfg)
    programs = {}
    for s in local:
        traced = DecoderStage(meta_model, *spans[s], first=s == 0, last=s == n - 1)
        program = trace_stage(traced, inputs=(("tokens",) if s == 0 else ("activations",))
                              + (("labels",) if s == n - 1 else ()), micro_batch=(MICROBATCH_ROWS, SEQ), dim=cfg.dim)
        programs[s] = (program, *(load_graph(blob, device=torch.device("cpu"), groups={})
                                  for blob in (program.forward, program.backward)))
    batch_rows = MICROBATCH_ROWS * microbatches
    # Each data-parallel pipeline reads its own rows of the step's batch.
    data = [torch.randint(0, model.cfg.vocab_size, (2, dp * batch_rows, SEQ),
                          generator=torch.Generator().manual_seed(s))[:, place.dp_rank::dp].contiguous()
            for s in range(steps)]

    # The order torch's schedule runs this rank's forwards and backwards in its second step (the
    # first also runs each stage once to infer shapes; its IR for 1F1B's last stage is off by one:
    # tests/unit/test_pipeline_schedule.py), as its stages are called.
    order: list[str] = []
    recording = [False]
    torch_stages = [PipelineStage(theirs[s], s, n, torch.device("cpu"), group=place.pipeline) for s in local]
    for stage in torch_stages:
        record_calls(stage, order, recording)
    if schedule == "interleaved-1f1b":
        reference = ScheduleInterleaved1F1B(torch_stages, n_microbatches=microbatches, loss_fn=mean_token_loss)
    elif schedule == "zbv":
        reference = ScheduleZBVZeroBubble(torch_stages, n_microbatches=microbatches, loss_fn=mean_token_loss)
    else:
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        reference = schedule_class(torch_stages[0], n_microbatches=microbatches, loss_fn=mean_token_loss)
    results = {}
    for name, modules in (("torch", theirs), ("titan", ours), ("graph", graphs)):
        params = [p for s in local for p in modules[s].parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-2, foreach=False)
        for step, (tokens, labels) in enumerate(data):
            optimizer.zero_grad(set_to_none=True)
            if name == "torch":
                recording[0] = step == 1
                losses: list = []
                if 0 in local:
                    reference.step(tokens, target=labels if n - 1 in local else None, losses=losses)
                else:
                    reference.step(target=labels, losses=losses)
            else:
                runners = {s: runner(name, modules[s], programs[s], first=s == 0, last=s == n - 1, tokens=tokens,
                                     labels=labels, microbatches=microbatches, dim=cfg.dim) for s in local}
                run_pipeline_step(record, pp_rank=rank, stages=runners,
                                  global_rank=lambda p: place.layout.pipeline_peer(dist.get_rank(), p))
                for p in params:  # the mean over micro-batches, as torch's scale_grads
                    p.grad.div_(microbatches)
                losses = [runners[n - 1].losses[m] for m in range(microbatches)] if n - 1 in local else []
            if dp > 1:  # the mean over the data-parallel pipelines, for every mode alike
                for p in params:
                    dist.all_reduce(p.grad, group=place.replicas)
                    p.grad.div_(dp)
            if n - 1 in local:
                results[f"{name}.loss.{step}"] = torch.stack(losses)
            optimizer.step()
        results.update({f"{name}.param.{fqn}": p.detach().clone() for s in local
                        for fqn, p in modules[s].named_parameters()})
    save_file(results, out / f"rank{dist.get_rank()}.safetensors")
    ran = [a for a in record.actions[rank] if a.kind in COMPUTE]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"torch": order, "titan": [str(a) for a in ran]}))


def record_calls(stage: PipelineStage, order: list[str], recording: list[bool]) -> None:
    """Log each forward, backward (B, or I when torch splits it) and weight backward (W) torch's
    schedule runs on `stage`, as `1F0`, `1I0`, `1W0`, while recording[0]."""
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def log(kind: str, mb: int) -> None:
        if recording[0]:
            order.append(f"{stage.stage_index}{kind}{mb}")

    def forward_one_chunk(mb, *args, **kwargs):
        log("F", mb)
        return forward(mb, *args, **kwargs)

    def backward_one_chunk(mb, *args, full_backward: bool = True, **kwargs):
        log("B" if full_backward else "I", mb)
        return backward(mb, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(mb, *args, **kwargs):
        log("W", mb)
        return weight(mb, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def runner(mode: str, module: DecoderStage, program, *, first: bool, last: bool, tokens, labels, microbatches: int,
           dim: int):
    """The stage as titan's executor runs it: the eager module ("titan") or its program ("graph")."""
    if mode == "titan":
        return EagerStage(module, first=first, last=last, tokens=tokens, labels=labels, microbatches=microbatches,
                          dim=dim)
    stage_program, forward, backward = program
    named = dict(module.named_parameters())
    return GraphStage(forward=forward, backward=backward, params=[named[p] for p in stage_program.params],
                      inputs=stage_program.inputs, tokens=tokens.chunk(microbatches), labels=labels.chunk(microbatches),
                      activation_shape=(MICROBATCH_ROWS, SEQ, dim), dtype=torch.float32)


if __name__ == "__main__":
    main()
