"""The torchtitan rows of train_bench.py: torchtitan's own trainer classes on titan's data.

    python benchmarks/peer_torchtitan.py --mode tt-eager|tt-compile|tt-graph[-nocg] --flavor 1B ...
    (one process per rank, launched by train_bench.py; torchtitan and its needs come from the
    wheels pinned in benchmarks/peer_wheels.txt)

tt-eager:   torchtitan's `Trainer` with its Llama 3 model and `parallelize_llama` (FSDP2 with
            MixedPrecisionPolicy(bf16, fp32) always, also at one data-parallel rank; TP with
            sequence parallel), its fused AdamW, and its default CUDA graph around forward +
            backward.
tt-compile: the same with `compile.enable` (torchtitan compiles each block and the loss).
tt-graph:   torchtitan's graph trainer (experiments/graph_trainer): its `GraphTrainer` with
            `GraphTrainerCompileConfig(enable=True)`, i.e. aot_fx_trace of the whole step,
            simple_fsdp, its default pass pipeline (bucketing, regional inductor, its memory
            policy, CUDA graphs).
-nocg:      the same without CUDA graphs (training.disable_cuda_graphs; for the graph trainer
            its cudagraph_pass off, which calls torch.cuda.graph(enable_annotations=...), a
            keyword newer than torch 2.11).

What is set to match titan's rows (the rest is torchtitan's defaults): the model shapes of
titan's flavor (`1B` without tied embeddings, as titan's 1B; SDPA attention, as titan's; the
`debug` flavor is torchtitan's debugmodel), batch, sequence length, no activation
checkpointing (titan's rows have none; the graph trainer's memory policy stays its default),
AdamW lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, plain cross-entropy loss over the
global tokens, titan's synthetic tokens. The step is the trainer's own `forward_backward_step`
then its optimizers and lr schedulers, without the gradient clipping and metric logging of
`Trainer.train_step` (titan-run clips nothing).

torchtitan places its model on CUDA: without a GPU this worker builds the configuration and the
model on the meta device and exits with "needs CUDA".
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_worker import StepRecord, worker_args  # noqa: E402
from train_bench import LAYOUTS  # noqa: E402

# titan flavor -> torchtitan's llama3 flavor of the same shapes
TT_FLAVORS = {"debug": "debugmodel", "1B": "1B", "8B": "8B", "70B": "70B", "405B": "405B"}


def _data_classes():
    """torchtitan's tokenizer and dataloader protocols, fed by titan's synthetic tokens."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    from titan.runtime.data import SyntheticTokens

    class NoTokenizer(BaseTokenizer):
        """The data is token ids already: nothing to encode."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Config, **_) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("synthetic token ids need no tokenizer")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("synthetic token ids need no tokenizer")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class SyntheticLoader(BaseDataLoader):
        """titan's SyntheticTokens for this data-parallel rank, step by step."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0
            positions: bool = False

        def __init__(self, config: Config, *, dp_rank: int, seq_len: int, local_batch_size: int, **_) -> None:
            self.positions = config.positions
            self.tokens = SyntheticTokens(vocab_size=config.vocab_size, batch_size=local_batch_size,
                                          seq_len=seq_len, seed=0, dp_rank=dp_rank)

        def __iter__(self):
            step = 0
            while True:
                tokens, labels = self.tokens.batch(step)
                inputs = {"input": tokens}
                if self.positions:  # one document per sequence: FlexAttention's mask is causal
                    inputs["positions"] = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
                yield inputs, labels
                step += 1

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    return NoTokenizer, SyntheticLoader


def trainer_config(mode: str, flavor: str, layout_name: str, batch: int, seq_len: int, steps: int, dump: str,
                   attention: str):
    """torchtitan's trainer class and its config for this row."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    NoTokenizer, SyntheticLoader = _data_classes()
    spec = model_registry(TT_FLAVORS[flavor])
    spec.model.enable_weight_tying = False
    if attention == "sdpa":
        # As graph_trainer's build_decoder_config_for_backend does: torchtitan's own SDPA
        # module (causal) in place of its default FlexAttention with per-document masks.
        from torchtitan.models.common.attention import ScaledDotProductAttention
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    vocab = decoder_vocab_size(spec)
    sizes = LAYOUTS[layout_name]
    config = Trainer.Config(
        model_spec=spec,
        dump_folder=dump,
        tokenizer=NoTokenizer.Config(vocab_size=vocab),
        dataloader=SyntheticLoader.Config(vocab_size=vocab, positions=attention == "flex"),
        optimizer=default_adamw(lr=8e-4),
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=steps,
                                disable_cuda_graphs=mode.endswith("-nocg")),
        parallelism=ParallelismConfig(data_parallel_shard_degree=sizes.get("dp_shard", 1),
                                      tensor_parallel_degree=sizes.get("tp", 1)),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=mode.startswith("tt-compile")),
        validator=Validator.Config(enable=False),
        metrics=MetricsProcessor.Config(log_freq=10**9),
    )
    if not mode.startswith("tt-graph"):
        return Trainer, config
    from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig, to_graph_trainer_config
    from torchtitan.experiments.graph_trainer.llama3 import model_registry as graph_registry
    from torchtitan.experiments.graph_trainer.trainer import GraphTrainer
    config = to_graph_trainer_config(config, graph_registry)
    config.compile = GraphTrainerCompileConfig(
        enable=True, disable_passes=["cudagraph_pass"] if mode.endswith("-nocg") else [])
    return GraphTrainer, config


def timed_trainer(base):
    """`base` (Trainer or GraphTrainer) whose steps are timed into a StepRecord."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    class Timed(base):
        record: StepRecord
        pre_step = staticmethod(lambda: None)

        def train_step(self, data_iterator) -> None:
            self.pre_step()
            input_dict, labels = next(data_iterator)
            input_dict = {k: v.to(self.device) for k, v in input_dict.items()}
            self.record.start()
            self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
            local_tokens = (labels != IGNORE_INDEX).sum().to(self.device)
            if self.parallel_dims.dp_enabled:
                global_tokens = dist_utils.dist_sum_tensor(local_tokens, self.parallel_dims.get_mesh("batch"))
            else:
                global_tokens = local_tokens
            loss = self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                              global_valid_tokens=global_tokens)
            self.optimizers.step()
            self.lr_schedulers.step()
            # The loss is this rank's sum over the global token count: the mean is their sum.
            loss_mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_enabled else None
            self.record.stop(dist_utils.dist_sum(loss.detach().clone(), loss_mesh))

    return Timed


def _graph_pre_step(trainer):
    """What GraphTrainer.train_step runs before each step: its pass pipeline's hook, if any."""
    from torchtitan.experiments.graph_trainer.registry import PRE_TRAIN_STEP_HOOKS
    hook = PRE_TRAIN_STEP_HOOKS.get(trainer.config.compile.pass_pipeline)
    return (lambda: hook(trainer)) if hook is not None else (lambda: None)


def run(mode: str, flavor: str, layout_name: str, batch: int, seq_len: int, steps: int, out: str,
        attention: str) -> None:
    dump = tempfile.mkdtemp(prefix="tt-bench-")
    base, config = trainer_config(mode, flavor, layout_name, batch, seq_len, steps, dump, attention)
    if not torch.cuda.is_available():
        with torch.device("meta"):
            model = config.model_spec.model.build()
        n = sum(p.numel() for p in model.parameters())
        tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
        loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len,
                                         local_batch_size=batch, snapshot_every_n_steps=None)
        inputs, _ = next(iter(loader))
        raise SystemExit(f"error: {mode} needs CUDA (torchtitan places its model on the GPU); built here: the "
                         f"config, the {TT_FLAVORS[flavor]} model on meta ({n:,} parameters) and a batch "
                         f"{tuple(inputs['input'].shape)}")
    trainer = timed_trainer(base)(config)
    trainer.record = StepRecord(trainer.device)
    if mode.startswith("tt-graph"):
        trainer.pre_step = _graph_pre_step(trainer)
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.get_rank() == 0:
        trainer.record.write(out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    a = worker_args([m + cg for m in ("tt-eager", "tt-compile", "tt-graph") for cg in ("", "-nocg")])
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    run(a.mode, a.flavor, a.layout, a.batch_size, a.seq_len, a.steps, a.json,
        os.environ.get("BENCH_TT_ATTENTION", "sdpa"))


if __name__ == "__main__":
    main()
