"""The torchtitan rows of train_bench.py: torchtitan's own trainer on titan's data.

    python benchmarks/peer_torchtitan.py --mode tt-eager|tt-compile[-flex]|tt-toolkit[-nocg] --flavor 1B ...
    (one process per rank, launched by train_bench.py; torchtitan 0.2.2 and its needs come from
    the wheels pinned in benchmarks/peer_wheels.txt)

torchtitan 0.2.2 is the newest release that runs on the GPU host's torch 2.11 (0.3.0 imports
torch.distributed.fsdp.DataParallelMeshDims and its graph trainer torch.cuda._graph_annotations,
both newer than 2.11). Its API is the JobConfig / TrainSpec one:

tt-eager:   torchtitan's `Trainer` with its Llama 3 model and `parallelize_llama` (FSDP2 with
            MixedPrecisionPolicy(bf16, fp32); TP with sequence parallel and a loss-parallel
            cross-entropy), its fused AdamW.
tt-compile: the same with `compile.enable` (torchtitan compiles each block and the loss).
tt-toolkit: torchtitan's `experiments/compiler_toolkit`, 0.2.2's predecessor of the graph
            trainer: simple_fsdp, the joint forward + backward traced ahead of time
            (dynamo_graph_capture_for_export + aot_export_joint_with_descriptors) and its passes
            `regional_inductor` and `cudagraph` (CUDA graphs over the forward and backward
            graphs), plus `autobucketing_reordering` where there is FSDP communication. The loss
            and the optimizer run eagerly outside the graphs.
-nocg:      tt-toolkit without its `cudagraph` pass.
tt-compile-flex: tt-compile with torchtitan's FlexAttention and its document mask
            (attn_type "flex", attn_mask_type "block_causal": its flex_attention compiled with
            "max-autotune-no-cudagraphs", the block mask made from the batch's end-of-document
            tokens each step), the separator id from TITAN_BENCH_EOS; the row titan's flex
            document rows are measured against (benchmarks/gpu/gpu_flex.sh).

TITAN_BENCH_DATA (a titan-data token file): every row reads its batches from it (as titan-run
--data does: the same windows in the same order) instead of titan's synthetic tokens, whose
uniform ids hold almost no document boundaries.

Pipeline layouts (pp*, bench_pipeline.py): tt-eager and tt-compile run torchtitan's own pipeline,
its Llama 3 TrainSpec's `pipelining_fn` (pipeline_llm: pipeline_module_split into
PipelineStages, parallelize_llama on each stage, build_pipeline_schedule), with the layout's
schedule (`pipeline_parallel_schedule`: 1F1B, GPipe, Interleaved1F1B, ZBVZeroBubble), a local
batch of --microbatches x --batch-size sequences cut into micro-batches of --batch-size
(`pipeline_parallel_microbatch_size`), and titan's stage split given as
`module_fqns_per_model_part`. torchtitan 0.2.2 has no mixed precision under PP without FSDP
(maybe_enable_amp), so where the layout has no data-parallel shards the worker applies
torchtitan's apply_fsdp to each stage over the mesh's one-rank `fsdp` dimension (titan's policy,
as at world size 1), with torchtitan's PP setting (no reshard after forward). Its schedules run
with `scale_grads=False` and a summed loss: gradients are those of the summed token loss, not
titan's mean (AdamW is nearly scale-free and both clip; the step's work is the same).
tt-toolkit does not run pipelines (torchtitan 0.2.2's toolkit spec has no pipelining_fn).

Precision, as titan's rows: bf16 parameters and activations, fp32 gradient reduction, fp32
master weights. torchtitan 0.2.2 applies FSDP2 only when data_parallel_shard_degree > 1 (its
single-device policy is fp32 parameters under bf16 autocast), so at world size 1 this worker
shards the model over a one-rank mesh itself, with torchtitan's own apply_fsdp (simple_fsdp's
data_parallel for tt-toolkit), and runs the step without the autocast. With TP alone (no
data-parallel shards) torchtitan's own policy stays: no mixed precision (fp32), which the row
name does not hide: the README's table says so.

What else is set to match titan's rows (the rest is torchtitan's defaults): the model shapes of
titan's flavor (titan's untied `1B`, SDPA attention), batch, sequence length, no activation
checkpointing, AdamW lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 (torchtitan's
defaults already), plain cross-entropy summed over the global tokens, titan's synthetic tokens.
The step is the trainer's own `forward_backward_step`, then (with `--max-norm`) the clip that
`Trainer.train_step` makes (`dist_utils.clip_grad_norm_`, foreach), then its optimizers and lr
schedulers; without its metric logging.

torchtitan places its model on CUDA: without a GPU this worker builds the configuration, the
model on the meta device and a batch (on a pipeline layout also torchtitan's stages of this rank,
from its pipeline_module_split over a gloo pp group, and their schedule), then exits with
"needs CUDA".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_worker import StepRecord, worker_args  # noqa: E402
from profile_steps import step_profiler_from_env  # noqa: E402
from bench_pipeline import bench_pipeline  # noqa: E402
from train_bench import LAYOUTS, PEER_MODES  # noqa: E402

MODES = [m for m, worker in PEER_MODES.items() if worker == Path(__file__).name]
SPEC_NAME = "titan_bench_llama3"  # the TrainSpec this worker registers
TOOLKIT_CONFIG = "torchtitan.experiments.compiler_toolkit.job_config"


def model_args(flavor: str, *, flex: bool = False):
    """torchtitan's TransformerModelArgs with titan's shapes for `flavor` (SDPA, causal; or
    FlexAttention with the document mask)."""
    from torchtitan.models.llama3 import TransformerModelArgs

    from titan.builder.models.llama3.config import FLAVORS

    c = FLAVORS[flavor]
    return TransformerModelArgs(dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                                vocab_size=c.vocab_size, multiple_of=c.multiple_of,
                                ffn_dim_multiplier=c.ffn_dim_multiplier, norm_eps=c.norm_eps,
                                rope_theta=c.rope_theta, attn_type="flex" if flex else "sdpa",
                                attn_mask_type="block_causal" if flex else "causal")


class SeparatorTokenizer:
    """What torchtitan's flex document mask asks of a tokenizer: the separator id."""

    def __init__(self, eos_id: int) -> None:
        self.eos_id = eos_id


def synthetic_loader(vocab_size: int, microbatches: int = 1):
    """torchtitan's dataloader protocol fed by titan's SyntheticTokens; with `microbatches` > 1
    (a pipeline) each batch is that many of titan's micro-batches, concatenated in the order
    titan-run reads them (runtime/train_loop.py), which torchtitan's schedule cuts apart again."""
    from torchtitan.components.dataloader import BaseDataLoader

    from titan.runtime.data import SyntheticTokens

    class SyntheticLoader(BaseDataLoader):
        def __init__(self, *, dp_rank: int, dp_degree: int, local_batch_size: int, seq_len: int) -> None:
            batch_size = local_batch_size // microbatches  # titan's micro-batch
            data = os.environ.get("TITAN_BENCH_DATA")
            if data:
                from titan.runtime.data import TokenFile
                self.tokens = TokenFile(data, dtype=None, vocab_size=vocab_size, batch_size=batch_size,
                                        seq_len=seq_len, dp_rank=dp_rank, dp_degree=dp_degree)
            else:
                self.tokens = SyntheticTokens(vocab_size=vocab_size, batch_size=batch_size, seq_len=seq_len,
                                              seed=0, dp_rank=dp_rank)

        def __iter__(self):
            step = 0
            while True:
                parts = [self.tokens.batch(step * microbatches + k) for k in range(microbatches)]
                tokens, labels = (torch.cat(t) for t in zip(*parts))
                yield {"input": tokens}, labels
                step += 1

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    def build(*, dp_world_size: int, dp_rank: int, tokenizer, job_config) -> SyntheticLoader:
        return SyntheticLoader(dp_rank=dp_rank, dp_degree=dp_world_size,
                               local_batch_size=job_config.training.local_batch_size,
                               seq_len=job_config.training.seq_len)

    return build


def one_rank_fsdp(parallelize, apply_dp):
    """`parallelize` followed by `apply_dp(model, mesh, pp_enabled)` over a one-rank mesh where
    torchtitan applies no data parallelism itself (world size 1; a pipeline stage without
    data-parallel shards: the mesh's own `fsdp` dimension, of size 1 there): titan's precision
    policy there too."""

    def wrapped(model, parallel_dims, job_config):
        model = parallelize(model, parallel_dims, job_config)
        if parallel_dims.world_size == 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torchtitan.tools import utils
            model = apply_dp(model, init_device_mesh(utils.device_type, (1,), mesh_dim_names=("fsdp",)), False)
        elif parallel_dims.pp_enabled and not parallel_dims.fsdp_enabled:
            parallel_dims.world_mesh  # builds the meshes: `fsdp` is one of them, at any size
            model = apply_dp(model, parallel_dims._meshes["fsdp"], True)
        return model

    return wrapped


def _fsdp2(model, mesh, pp_enabled: bool):
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=pp_enabled)
    return model


def _simple_fsdp(model, mesh, pp_enabled: bool):
    """simple_fsdp over the one-rank mesh with DTensor compute (full_dtensor): the compiler toolkit
    traces DTensor inputs only (it was written for TP), so the parameters stay DTensors too."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchtitan.experiments.simple_fsdp.simple_fsdp import data_parallel
    _ONE_RANK["mesh"] = mesh
    return data_parallel(model, mesh, mode="fully_shard", full_dtensor=True,
                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


_ONE_RANK: dict = {}  # the toolkit's one-rank mesh, for its inputs


def _toolkit_spec():
    """The compiler toolkit's Llama 3 spec, at world size 1 on a one-rank simple_fsdp mesh."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils._pytree import tree_map

    import torchtitan.experiments.compiler_toolkit.llama3.parallelize as toolkit
    from torchtitan.experiments.compiler_toolkit.llama3 import get_train_spec

    toolkit.simple_fsdp_parallelize_llama = one_rank_fsdp(toolkit.simple_fsdp_parallelize_llama, _simple_fsdp)
    tp_inputs = toolkit.parallelize_inputs

    def inputs(dims, args, kwargs):
        if dims.tp_enabled or "mesh" not in _ONE_RANK:
            return tp_inputs(dims, args, kwargs)
        replicate = lambda t: DTensor.from_local(t, _ONE_RANK["mesh"], [Replicate()]) if isinstance(
            t, torch.Tensor) else t
        return tree_map(replicate, args), kwargs

    toolkit.parallelize_inputs = inputs
    spec = get_train_spec()

    def build_loss(job_config, **kwargs):
        loss = spec.build_loss_fn(job_config, **kwargs)
        # DTensor logits on the one-rank mesh: their local tensor is the whole of them.
        return lambda pred, labels: loss(pred.to_local() if isinstance(pred, DTensor) else pred, labels)

    return dataclasses.replace(spec, build_loss_fn=build_loss)


def _toolkit_buffers_to_dtensor(model) -> None:
    """The toolkit's one-rank mesh: buffers (RoPE's frequencies, set by init_weights) as
    replicated DTensors, like everything else its traced graph sees."""
    from torch.distributed.tensor import DTensor, Replicate
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not isinstance(buf, DTensor):
                module._buffers[name] = DTensor.from_local(buf, _ONE_RANK["mesh"], [Replicate()])


def register_spec(mode: str, flavor: str, microbatches: int = 1) -> None:
    """A TrainSpec: torchtitan's Llama 3 (or the compiler toolkit's) with titan's shapes and data;
    its pipelining_fn torchtitan's own (the toolkit's spec has none)."""
    from torchtitan.protocols.train_spec import register_train_spec

    if mode.startswith("tt-toolkit"):
        spec = _toolkit_spec()
    else:
        from torchtitan.models.llama3 import get_train_spec
        spec = get_train_spec()
        spec = dataclasses.replace(spec, parallelize_fn=one_rank_fsdp(spec.parallelize_fn, _fsdp2))
    flex = mode.endswith("-flex")
    args = model_args(flavor, flex=flex)
    tokenizer = (lambda job_config: SeparatorTokenizer(int(os.environ["TITAN_BENCH_EOS"]))) if flex else None
    # The spec's own pipelining_fn stays: the tt rows of a pp layout run torchtitan's pipeline.
    spec = dataclasses.replace(spec, model_args={flavor: args}, build_tokenizer_fn=tokenizer,
                               build_dataloader_fn=synthetic_loader(args.vocab_size, microbatches),
                               build_validator_fn=None, state_dict_adapter=None)
    register_train_spec(SPEC_NAME, spec)


def job_config(mode: str, flavor: str, layout_name: str, batch: int, seq_len: int, steps: int, dump: str, *,
               pipeline=None):
    """torchtitan's JobConfig for this row (its defaults, less what matches titan's rows);
    `pipeline` a bench_pipeline.BenchPipeline."""
    from torchtitan.config import ConfigManager

    toolkit = mode.startswith("tt-toolkit")
    c = ConfigManager().parse_args(["--job.custom_config_module", TOOLKIT_CONFIG] if toolkit else [])
    sizes = LAYOUTS[layout_name]
    c.job.dump_folder = dump
    c.model.name, c.model.flavor = SPEC_NAME, flavor
    c.training.local_batch_size, c.training.seq_len, c.training.steps = batch, seq_len, steps
    c.parallelism.data_parallel_shard_degree = sizes.get("dp_shard", 1)
    c.parallelism.tensor_parallel_degree = sizes.get("tp", 1)
    if pipeline is not None:
        from peer_torchtitan_pipeline import set_pipeline
        set_pipeline(c, pipeline, batch=batch)
    c.activation_checkpoint.mode = "none"
    c.checkpoint.enable = False
    c.validation.enable = False
    c.metrics.log_freq = 10**9
    c.compile.enable = mode in ("tt-compile", "tt-compile-flex")
    if toolkit:
        fsdp_comm = sizes.get("dp_shard", 1) > 1
        c.compile.passes = (["autobucketing_reordering"] if fsdp_comm else []) + ["regional_inductor"] + (
            [] if mode.endswith("-nocg") else ["cudagraph"])
    return c


def timed_trainer(base):
    """`base` (torchtitan's Trainer or the toolkit's) whose steps are timed into a StepRecord."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    class Timed(base):
        record: StepRecord
        on_step = None

        def __init__(self, config) -> None:
            super().__init__(config)
            if self.parallel_dims.world_size == 1:  # bf16 parameters (one_rank_fsdp): no autocast
                self.maybe_enable_amp = contextlib.nullcontext()
                if "mesh" in _ONE_RANK:
                    _toolkit_buffers_to_dtensor(self.model_parts[0])

        def train_step(self, data_iterator) -> None:
            input_dict, labels = next(data_iterator)
            input_dict = {k: v.to(self.device) for k, v in input_dict.items()}
            labels = labels.to(self.device)
            self.record.start()
            self.optimizers.zero_grad()
            local_tokens = (labels != IGNORE_INDEX).sum()
            if self.parallel_dims.dp_enabled:
                global_tokens = dist_utils.dist_sum(local_tokens, self.parallel_dims.get_mesh("batch"))
            else:
                global_tokens = local_tokens.float()
            loss = self.forward_backward_step(input_dict=input_dict, labels=labels,
                                              global_valid_tokens=global_tokens)
            if self.job_config.training.max_norm > 0:
                dist_utils.clip_grad_norm_([p for m in self.model_parts for p in m.parameters()],
                                           self.job_config.training.max_norm, foreach=True,
                                           pp_mesh=self.parallel_dims.get_optional_mesh("pp"),
                                           ep_enabled=self.parallel_dims.ep_enabled)
            self.optimizers.step()
            self.lr_schedulers.step()
            if self.parallel_dims.pp_enabled:  # the last stage's loss, on every pp rank
                loss = loss.detach().reshape(()) if self.pp_has_last_stage else torch.zeros((), device=self.device)
                torch.distributed.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
            # The loss is this rank's sum over the global token count: the mean is their sum.
            if self.parallel_dims.dp_cp_enabled:
                reported = dist_utils.dist_sum(loss.detach(), self.parallel_dims.get_optional_mesh("loss"))
            else:
                reported = loss.item()
            self.record.stop(float(reported))
            if self.on_step is not None:
                self.on_step(self.step)

    return Timed


def trainer_class(mode: str):
    if mode.startswith("tt-toolkit"):
        from torchtitan.experiments.compiler_toolkit.train import CompilerToolkitTrainer
        return CompilerToolkitTrainer
    from torchtitan.train import Trainer
    return Trainer


def check_without_gpu(mode: str, config, flavor: str, batch: int, seq_len: int, pipeline=None) -> None:
    """What can be checked on a host without CUDA: the spec, its model on meta and a batch (and
    this rank's pipeline stages)."""
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(config.model.name)
    args = spec.model_args[config.model.flavor]
    args.update_from_config(config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    n = sum(p.numel() for p in model.parameters())
    inputs, labels = next(iter(spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None,
                                                        job_config=config)))
    if pipeline is not None:
        from peer_torchtitan_pipeline import stages_without_gpu
        stages = "; " + stages_without_gpu(spec, config, model, pipeline)
    else:
        stages = ""
    raise SystemExit(f"error: {mode} needs CUDA (torchtitan places its model on the GPU); built here: the "
                     f"config, torchtitan's Llama 3 with titan's {flavor} shapes on meta ({n:,} parameters) "
                     f"and a batch {tuple(inputs['input'].shape)}{stages}")


def run(mode: str, flavor: str, layout_name: str, batch: int, seq_len: int, steps: int, out: str, *,
        max_norm: float = 0.0, microbatches: int = 1) -> None:
    pipeline = bench_pipeline(layout_name, flavor=flavor, seq_len=seq_len, microbatches=microbatches)
    if pipeline is not None and mode.startswith("tt-toolkit"):
        raise SystemExit(f"error: {mode} does not run pipeline layouts (torchtitan 0.2.2's compiler toolkit has "
                         "no pipelining_fn); tt-eager and tt-compile run torchtitan's pipeline")
    register_spec(mode, flavor, pipeline.microbatches if pipeline else 1)
    config = job_config(mode, flavor, layout_name, batch, seq_len, steps, tempfile.mkdtemp(prefix="tt-bench-"),
                        pipeline=pipeline)
    config.training.max_norm = max_norm
    if not torch.cuda.is_available():
        check_without_gpu(mode, config, flavor, batch, seq_len, pipeline)
    trainer = timed_trainer(trainer_class(mode))(config)
    trainer.record = StepRecord(trainer.device)
    trainer.on_step = step_profiler_from_env(f"{layout_name}-{mode}", steps, torch.distributed.get_rank())
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.get_rank() == 0:
        trainer.record.write(out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    a = worker_args(MODES)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    run(a.mode, a.flavor, a.layout, a.batch_size, a.seq_len, a.steps, a.json, max_norm=a.max_norm,
        microbatches=a.microbatches)


if __name__ == "__main__":
    main()
