"""Train one rank from an artifact: load -> verify -> bind -> materialize -> loop."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from titan.runtime.contract.artifact import Artifact, ArtifactError, open_artifact
from titan.runtime.kernels.artifact_trust import kernels_trusted
from titan.runtime.buffer_state import BufferState
from titan.runtime.data import SyntheticTokens, TokenFile
from titan.runtime.kernels.background import KernelWait, start_in_background
from titan.runtime.kernels.fusion import FusionStats, KernelSources, compile_program_regions
from titan.runtime.distributed import RankEnv, init_process_group, pick_device, shutdown
from titan.runtime.init import materialize
from titan.runtime.contract.layout import group_names
from titan.runtime.contract.manifest import Manifest
from titan.runtime.optim import AdamW
from titan.runtime.param_copies import ParamCopies, param_grad_dtypes, upcast_gradients
from titan.runtime.grad_clip import GlobalNormClip
from titan.runtime.recipe import Recipe
from titan.runtime.run_config import RunConfig
from titan.runtime.train_loop import StepResults, Validation, train_loop
from titan.runtime.startup import rank_phases
from titan.runtime.grad_accumulation import accumulate_grads
from titan.runtime.loss_only import loss_only
from titan.runtime.step_log import StepLog
from titan.runtime.contract.rank_record import BufferSpec, ParamSpec
from titan.runtime.contract.memory_estimate import check_device, estimate_from_graphs
from titan.runtime.rank_graphs import load_rank_graphs


def make_optimizer(params: list[torch.Tensor], recipe: Recipe, device: torch.device | None = None, *,
                   fused: bool = True, copies: ParamCopies | None = None) -> AdamW:
    """AdamW over `params` with the recipe's hyperparameters and LR schedule: on a GPU (with
    triton) one kernel per parameter, elsewhere op by op; both round exactly as
    torch.optim.AdamW(foreach=False) does. `copies`: the parameters' compute-dtype copies the
    forward takes (runtime/param_copies.py), which each step writes too."""
    kw = dict(lr=recipe.schedule.lr, schedule=recipe.schedule, copies=copies.copies if copies else None,
              **recipe.adamw)
    if fused and device is not None and device.type == "cuda":
        from titan.runtime.fused_adamw import FusedAdamW, fused_adamw_available, start_compiling
        if fused_adamw_available(params):
            # Its kernel compiles while the first step's forward and backward run.
            start_compiling(device, params, kw["copies"], copies.low_grads if copies else None,
                            clipped=recipe.max_norm is not None)
            return FusedAdamW(params, **kw)
    return AdamW(params, **kw)


def op_by_op_update(program: GraphProgram, clip: GlobalNormClip, optimizer: AdamW) -> Callable[[], torch.Tensor]:
    """The step's update, op by op: the global gradient norm of the program's parameters
    (clipping them to the recipe's max_norm), computed on the device (runtime/grad_clip.py),
    then the optimizer step."""
    def update() -> torch.Tensor:
        norm = clip(upcast_gradients(program.params, optimizer.copies))
        optimizer.step()
        return norm
    return update


def make_data(manifest: Manifest, cfg: RunConfig, coords: dict[str, int], *, validation: bool = False):
    """This rank's slice of the training data (or of --val-data)."""
    layout = manifest.layout
    dp_rank = layout.dp_rank(coords)
    common = dict(vocab_size=manifest.vocab_size, batch_size=manifest.batch_size, seq_len=manifest.seq_len)
    path = cfg.val_data if validation else cfg.data
    if path is None:
        return SyntheticTokens(seed=cfg.seed, dp_rank=dp_rank, **common)
    return TokenFile(path, dtype=cfg.data_dtype, dp_rank=dp_rank, dp_degree=layout.dp_degree, **common)


def make_validation(forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], manifest: Manifest,
                    cfg: RunConfig, coords: dict[str, int], *, device: torch.device, mesh) -> Validation | None:
    """The run's validation (None without --val-data)."""
    if cfg.val_data is None:
        return None
    return Validation(forward_loss, make_data(manifest, cfg, coords, validation=True), steps=cfg.val_steps,
                      every=cfg.val_every, device=device, mesh=mesh)


class GraphProgram:
    """The program this rank runs (its forward and backward graphs, bound to this rank's
    coordinates), this rank's parameter shards and the model's buffers (runtime/buffer_state.py)."""

    def __init__(self, artifact: Artifact, rank: int, *, device: torch.device, mesh, seed: int,
                 micro_batches: int = 1,
                 load_param: Callable[[ParamSpec], torch.Tensor] | None = None,
                 load_buffer: Callable[[BufferSpec], torch.Tensor | None] = lambda spec: None,
                 params_from: str = "seeded init", artifact_kernels: bool = False,
                 kernels_in_background: bool = False):
        """`micro_batches`: how many micro-batches make an optimizer step (each one's loss and
        gradients are divided by it: runtime/recipe.py). `kernels_in_background`: the exact
        kernels this host lacks compile while the first steps run without them
        (runtime/kernels/background.py), instead of before the first step."""
        phases = rank_phases()
        with phases(f"rank {rank}: loading and checking its program", short="program"):
            self._load(artifact, rank, device=device, mesh=mesh, artifact_kernels=artifact_kernels,
                       background=kernels_in_background)
        with phases(f"rank {rank}: materializing its parameters ({params_from})", short="parameters"):
            record = artifact.rank_record(rank)
            load_param = load_param or (lambda p: materialize(p, seed=seed, device=device))
            self.specs = record.params
            self.params = [load_param(p) for p in record.params]
            # The compute-dtype copies the forward takes instead of some parameters, and whether
            # the backward gives their gradients.
            self.copies = ParamCopies(record.forward_inputs, self.params, param_grad_dtypes(record, self.backward))
            self.micro_batches = micro_batches
            self.buffers = BufferState(record, device=device, load=load_buffer)

    def _load(self, artifact: Artifact, rank: int, *, device: torch.device, mesh, artifact_kernels: bool,
              background: bool) -> None:
        record = artifact.rank_record(rank)
        # The program is shared by ranks: its rank-specific values bind to this rank's coordinates.
        self.forward, self.backward = load_rank_graphs(artifact, rank, device=device, groups=group_names(mesh))
        # Before anything is allocated: a program that cannot fit this device is one line, not an OOM.
        estimate = estimate_from_graphs(record, self.forward, self.backward, dense_flex=device.type != "cuda")
        check_device(estimate, device, name=f"{artifact.root} rank {rank}")
        # --fuse artifacts: regions become generated kernels (the only path that imports inductor).
        # The artifact's own kernels only when they are trusted (`artifact_kernels`: kernels_trusted).
        sources = KernelSources(device=device, artifact_kernel=artifact.kernel if artifact_kernels else None)
        # A bounded MoE dispatch's two programs must run the same kernels from the first step.
        background = background and device.type == "cuda" and not artifact.manifest.redo_programs
        mine = (start_in_background(self.forward, self.backward, device, sources, rank_needs=estimate.at_least)
                if background else None)
        self.fusion = None if mine is not None else compile_program_regions(self.forward, self.backward, device,
                                                                           sources=sources)
        self.kernel_wait = KernelWait(mine, device) if background else None
        self.on_kernels: Callable[[FusionStats], None] = lambda stats: None
        """Called when kernels compiled in the background come into use (run_rank says so)."""
        self.inputs = record.forward_inputs
        self.coords = record.coords
        self._loss_only: fx.GraphModule | None = None  # made on first use: most runs never validate
        self.redo = None
        if artifact.manifest.redo_programs:  # a bounded MoE dispatch: runtime/moe_redo.py
            from titan.runtime.moe_redo import OverflowRedo
            forward, backward = load_rank_graphs(artifact, rank, device=device, groups=group_names(mesh), redo=True)
            dropless = artifact.rank_record(rank, redo=True)
            # The redo runs alone (the bounded attempt's tensors are freed first): it must fit too.
            check_device(estimate_from_graphs(dropless, forward, backward, dense_flex=device.type != "cuda"),
                         device, name=f"{artifact.root} rank {rank} (its dropless redo program)")
            # Its regions are compiled as the bounded program's are: both must run the same kernels.
            compile_program_regions(forward, backward, device,
                                    artifact_kernel=artifact.kernel if artifact_kernels else None)
            self.redo = OverflowRedo(record, dropless, forward, backward, where=f"{artifact.root} rank {rank}")

    def forward_args(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """The forward's inputs (the same for the bounded and the dropless program of a MoE)."""
        params = iter(self.copies.forward_values())
        return [next(params) if inp.kind == "param" else self.buffers.tensors[inp.fqn] if inp.kind == "buffer"
                else tokens if inp.kind == "tokens" else labels for inp in self.inputs]

    @torch.no_grad()
    def forward_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's loss of a held-out batch; training goes on as if it had not run. The forward
        graph cut down to its loss (runtime/loss_only.py), so neither the activations the backward
        would read nor the buffer updates (a MoE's load and bias) are computed. A bounded MoE
        dispatch's is its dropless program's: the loss a redo would give, and the bounded one's
        bit for bit when it does not overflow, without the decision (a host read) in between."""
        if self._loss_only is None:
            forward = self.forward if self.redo is None else self.redo.forward
            self._loss_only = loss_only(forward, len(self.buffers.mutated))
        (loss,) = self._loss_only(*self.forward_args(tokens, labels))
        return loss

    @torch.no_grad()
    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's loss and the gradient of each parameter (in self.params order), both of
        the micro-batch's share of the step: divided by the number of micro-batches, as autograd
        divides the seed of `(loss / n).backward()`."""
        args = self.forward_args(tokens, labels)
        outputs, backward = self.forward(*args), self.backward
        if self.redo is not None and self.redo.overflowed(self.redo.overflow_count(outputs)):
            # The bounded dispatch overflowed: nothing was applied yet; redo it dropless.
            del outputs
            outputs, backward = self.redo.forward(*args), self.redo.backward
        del args
        return self.finish(outputs, backward)

    @torch.no_grad()
    def finish(self, outputs: Sequence[torch.Tensor], backward: fx.GraphModule) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The rest of forward_backward after a forward (`outputs`: its buffer updates, loss and
        saved activations; `backward`: its program's): the backward, then the buffers' new values."""
        n_updates = len(self.buffers.mutated)
        updates, loss, saved = outputs[:n_updates], outputs[n_updates], outputs[n_updates + 1:]
        seed = torch.ones_like(loss)
        if self.micro_batches > 1:
            seed, loss = seed / self.micro_batches, loss / self.micro_batches
        grads = backward(*saved, seed)
        del saved
        self.buffers.copy_back(updates)  # after the backward: it may recompute from the old values
        return loss, [g for inp, g in zip(self.inputs, grads) if inp.kind == "param"]

    def drop_gradients(self) -> None:
        """Every parameter's gradient (and its copy's) released."""
        for p, copy in zip(self.params, self.copies.copies):
            p.grad = None
            if copy is not None:
                copy.grad = None

    def step_metrics(self) -> dict:
        """What the step's record gets from the program: the expert load (read from the
        buffers) and, for a bounded MoE dispatch, the micro-batches redone dropless."""
        out = self.buffers.metrics() if len(self.buffers) else {}
        return out if self.redo is None else out | self.redo.metrics()

    @property
    def kernels_pending(self) -> bool:
        """Whether the job still waits for kernels compiled in the background (its steps then
        run on eager's kernels and are not captured)."""
        return self.kernel_wait is not None and self.kernel_wait.pending

    def _take_kernels_when_ready(self) -> None:
        stats = self.kernel_wait.poll()
        if stats is not None:
            self.fusion = stats
            self._loss_only = None  # cut again from the forward that now calls the kernels
            self.on_kernels(stats)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward + backward of one micro-batch; sets (first micro-batch) or adds to .grad of
        each parameter; returns this rank's loss (its share of the step's)."""
        if self.kernels_pending:
            self._take_kernels_when_ready()
        loss, grads = self.forward_backward(tokens, labels)
        accumulate_grads(self.params, grads)
        return loss


def _step_logger(cfg: RunConfig, is_rank0: bool, total: int, start: int):
    if not is_rank0:
        return None
    return StepLog(total=total, metrics=cfg.metrics, tensorboard=cfg.tensorboard, show=not cfg.quiet,
                   resume_after=start if cfg.resume else None, config=cfg.as_dict())


def _say(env: RankEnv, cfg: RunConfig, log: StepLog | None, text: str) -> None:
    """A line from rank 0 (above the progress bar, when one is drawn)."""
    if env.rank == 0 and not cfg.quiet:
        if log is not None:
            log.note(text)
        else:
            print(text, flush=True)


# Passes whose regions titan-run compiles into kernels on the device (CPU included for --fuse).
COMPILED_ON_ANY_DEVICE = ("fuse_regions", "fuse_blocks")


def compiles_regions(manifest: Manifest, device: torch.device) -> bool:
    """Whether a run of this artifact on `device` compiles (or loads) kernels for its regions
    (on a GPU, FlexAttention's fused kernels too: runtime/kernels/flex_kernels.py)."""
    return (any(p in COMPILED_ON_ANY_DEVICE or (p == "fuse_exact" and device.type == "cuda") for p in manifest.passes)
            or (device.type == "cuda" and manifest.model_config.get("attention") == "flex"))


def run_rank(artifact_path: str, cfg: RunConfig, env: RankEnv,
             on_step: Callable[[int], None] | None = None) -> StepResults:
    """Train this rank; `on_step(step)` (if given) runs after each step's bookkeeping."""
    from titan.runtime.common import timings
    from titan.runtime import startup
    from titan.runtime.launch import register_rank, run_start_key
    from titan.runtime.run_state import RunState

    started = startup.job_started()
    phases = rank_phases()
    artifact = open_artifact(artifact_path)
    if env.world_size != artifact.world_size:
        raise ArtifactError(f"{artifact_path} was built for world size {artifact.world_size}, but this job has "
                            f"{env.world_size} ranks; launch {artifact.world_size} ranks or rebuild for this layout")
    # Initial state (seed / --init-from-hf / --resume), checkpoints and the one check of the run's
    # options against the artifact: runtime/run_state.py.
    params = artifact.rank_params(env.rank)
    reader = " (importing torch's checkpoint reader)" if cfg.resume or cfg.checkpoint_dir else ""
    with phases(f"rank {env.rank}: checking the run's options and files{reader}", short="checks"):
        run_state = RunState(cfg, artifact.manifest, params, buffers=artifact.rank_buffers(env.rank),
                             model_params=artifact.model_params(env.rank),
                             model_buffers=artifact.model_buffers(env.rank))
    if startup.STARTED_ENV not in os.environ:  # not spawned by titan-run, which said these already (torchrun)
        for note in run_state.notes:
            _say(env, cfg, None, note)
        _say(env, cfg, None, f"start: {run_state.origin()}")
    device = pick_device(cfg.device, env, deterministic=cfg.deterministic)
    run_state.device = device
    if device.type == "cuda" and cfg.cuda_graphs:
        from titan.runtime.cudagraph import disable_expandable_segments
        if disable_expandable_segments() and env.rank == 0:
            print("note: expandable_segments turned off for this run (it breaks CUDA graphs that capture "
                  "NCCL collectives); --no-cuda-graphs keeps it", flush=True)
    with phases(f"rank {env.rank}: joining the other {env.world_size - 1} rank(s)", short="process group"):
        init_process_group(env, device, timeout_s=cfg.timeout_s)
    if dist.is_initialized():
        register_rank(dist.distributed_c10d._get_default_store(), env.rank)
    layout = artifact.layout
    mesh = layout.build_mesh(device.type)
    m = artifact.manifest
    key = f"{m.cache_key}-{device.type}"
    run_key = run_start_key(m, cfg.device)
    compiles = compiles_regions(m, device)
    trusted = False
    if compiles:
        trusted, note = kernels_trusted(artifact, cfg.kernel_trust)
        if note:
            _say(env, cfg, None, note)
        where = "the artifact, then the kernel store" if trusted else "the kernel store"
        _say(env, cfg, None, f"loading this artifact's kernels from {where}, compiling the ones it "
                             f"lacks{timings.expectation('fusion', key) or ' (the first run on a device compiles all)'}")
    t_load = time.perf_counter()
    recipe = run_state.recipe
    if m.pipeline is not None:
        from titan.runtime.pipeline_program import PipelineProgram
        program = PipelineProgram(artifact, env.rank, device=device, mesh=mesh, seed=cfg.seed,
                                  load_param=run_state.load_param, load_buffer=run_state.load_buffer,
                                  params_from=run_state.params_from(), artifact_kernels=trusted,
                                  gather_per_step=cfg.pp_gather_per_step, reduce_per_step=cfg.pp_reduce_per_step)
    else:
        program = GraphProgram(artifact, env.rank, device=device, mesh=mesh, seed=cfg.seed,
                               micro_batches=recipe.micro_batches, load_param=run_state.load_param,
                               load_buffer=run_state.load_buffer, params_from=run_state.params_from(),
                               artifact_kernels=trusted, kernels_in_background=cfg.compile_in_background)
    if compiles and env.rank == 0 and not getattr(program, "kernels_pending", False):
        timings.record("fusion", key, time.perf_counter() - t_load)
    if program.fusion is not None:
        _say(env, cfg, None, program.fusion.line())
    if getattr(program, "redoes", False) and device.type == "cuda" and cfg.cuda_graphs:
        _say(env, cfg, None, "note: this pipeline redoes overflowing MoE forwards dropless, a decision on the host per "
                             "stage and micro-batch: its steps run op by op, without CUDA graphs")
    optimizer = make_optimizer(program.params, recipe, device, fused=cfg.fused_adamw,
                               copies=getattr(program, "copies", None))
    with phases(f"rank {env.rank}: loading the checkpoint {run_state.resume_from}", short="checkpoint load"):
        start = run_state.restore(program.params, optimizer, buffers=program.buffers.tensors)
        if getattr(program, "copies", None):
            program.copies.refresh()  # the resumed parameters' copies
    log = _step_logger(cfg, env.rank == 0, cfg.steps, start)

    def checkpointed(s: int) -> None:
        t0 = time.perf_counter()
        written = run_state.after_step(s, program.params, optimizer, buffers=program.buffers.tensors)
        if written is not None:
            _say(env, cfg, log, f"checkpoint: wrote {written} in {time.perf_counter() - t0:.1f} s")

    if start == cfg.steps:  # --steps 0: only the initial state is checkpointed
        checkpointed(start)
    data = make_data(artifact.manifest, cfg, program.coords)
    tokens_per_step = m.tokens_per_step
    startup_s = None

    def after_step(s: int) -> None:
        nonlocal startup_s
        if s == start + 1 and env.rank == 0:
            startup_s = time.time() - started
            timings.record("run-start", run_key, startup_s)
        checkpointed(s)
        if on_step is not None:
            on_step(s)

    records: list[dict] = []
    log_all = None if log is None else (lambda rec: (records.append(rec), log(rec)))
    if getattr(program, "kernels_pending", False):
        say_kernels_in_background(program, lambda text: _say(env, cfg, log, text), started=started,
                                  steps_done=lambda: len(records) + start)
    with step_functions(program, cfg, device, recipe, mesh, optimizer) as (step, update, forward_loss):
        results = train_loop(step, optimizer, data, steps=cfg.steps, device=device, mesh=mesh,
                             tokens_per_step=tokens_per_step, log=log_all, start=start, after_step=after_step,
                             micro_batches=recipe.micro_batches, update=update,
                             validation=make_validation(forward_loss, m, cfg, program.coords, device=device,
                                                        mesh=mesh),
                             step_metrics=program.step_metrics if len(program.buffers) else None,
                             pipeline_step=pipeline_step(program, step))
    if getattr(program, "kernel_wait", None) is not None:
        finished = program.kernel_wait.finish()  # a run that ended before its kernels were in
        if finished is not None:
            _say(env, cfg, None, f"kernels: {len(finished.stored)} compiled into the kernel store by "
                                 f"{finished.workers} processes for the next run, {time.time() - started:.1f} s "
                                 "after the start (this run ended before they were in)")
    if env.rank == 0 and not cfg.quiet:
        startup.launcher_phase(phases)
        print(run_summary(records, started=started, startup_s=startup_s, device=device, artifact=artifact,
                          params=params), flush=True)
    return results


def say_kernels_in_background(program: GraphProgram, say: Callable[[str], None], *, started: float,
                              steps_done: Callable[[], int]) -> None:
    """Tell the user that steps run without the kernels the background compiles, and when they
    come into use (runtime/kernels/background.py)."""
    mine = program.kernel_wait.mine
    if mine is None:
        say("kernels: waiting for other ranks' kernels, which compile while the first steps run on eager's "
            "kernels (the same numbers, slower)")
    else:
        say(f"kernels: compiling the {mine.workers.jobs} this host lacks in {mine.workers.count} process"
            f"{'es' if mine.workers.count > 1 else ''} while the first steps run on eager's kernels (the same "
            "numbers, slower until they are in; --no-compile-in-background waits for them instead)")

    def in_use(stats: FusionStats) -> None:
        say(f"{stats.line()}; in use from step {steps_done() + 1}, {time.time() - started:.1f} s after the start")
    program.on_kernels = in_use


def run_summary(records: list[dict], *, started: float, startup_s: float | None, device: torch.device,
                artifact: Artifact, params) -> str:
    """The paragraph that ends a run (rank 0), from its step records."""
    from titan.runtime import startup
    from titan.runtime.mfu import mfu_text

    speeds = [r["tokens_per_s"] for r in records]
    gpu = device.type == "cuda"
    mfu = ""
    if gpu and speeds:
        import statistics
        mfu = mfu_text(artifact.manifest, params, tokens_per_s=statistics.median(speeds),
                       device_name=torch.cuda.get_device_name(device))
    from titan.runtime.moe_redo import redo_summary
    redo = redo_summary(records)
    text = startup.summary(
        steps_run=len(records), total_steps=records[-1]["step"] if records else 0, wall_s=time.time() - started,
        startup_s=startup_s, phases=rank_phases(), tokens_per_s=speeds,
        first_loss=(records[0]["step"], records[0]["loss"]) if records else None,
        last_loss=(records[-1]["step"], records[-1]["loss"]) if records else None,
        memory=startup.peak_memory_text(device.type, torch.cuda.max_memory_allocated(device) if gpu else None),
        mfu=mfu)
    return text if not redo else f"{text}\n{redo}."


def pipeline_step(program, step: Callable) -> Callable | None:
    """train_loop's step over all of a step's micro-batches: step_functions' `step` for a pipeline
    program (its schedule), None for a whole-model program (which trains micro-batch by micro-batch)."""
    from titan.runtime.pipeline_program import PipelineProgram
    return step if isinstance(program, PipelineProgram) else None


@contextlib.contextmanager
def step_functions(program: GraphProgram, cfg: RunConfig, device: torch.device, recipe: Recipe, mesh,
                   optimizer: AdamW):
    """The program's (micro-batch step, update, validation loss) for train_loop: on a GPU unless
    disabled, each captured in a CUDA graph (the update when the optimizer is the one-kernel
    AdamW); released on exit. A pipeline program's step runs all of a step's micro-batches
    through its schedule, on a GPU captured with the update in one graph
    (runtime/captured_pipeline.py)."""
    pipeline = getattr(program, "pp_group", None)
    clip = GlobalNormClip([p.placements for p in program.specs], mesh, max_norm=recipe.max_norm,
                          pipeline_group=pipeline)
    update = op_by_op_update(program, clip, optimizer)
    # A pipeline's dropless redo decides per stage and micro-batch on the host (one read after each
    # bounded forward), inside the step: one graph of the whole step cannot hold that; op by op.
    if pipeline is not None and (device.type != "cuda" or not cfg.cuda_graphs or program.redoes):
        yield program.step, update, None
        return
    from titan.runtime.fused_adamw import FusedAdamW
    if pipeline is not None:
        from titan.runtime.captured_pipeline import CapturedPipelineStep
        captured = CapturedPipelineStep(program, clip=clip, update_op_by_op=update,
                                        optimizer=optimizer if isinstance(optimizer, FusedAdamW) else None)
        try:
            yield captured.step, captured.update, None
        finally:
            captured.close()
        return
    if device.type != "cuda" or not cfg.cuda_graphs:
        yield program.step, update, program.forward_loss
        return
    from titan.runtime.cudagraph import CapturedLoss, CapturedStep
    if program.redo is None:
        step = CapturedStep(program)
    else:  # a bounded MoE dispatch: three captures and the decision between them
        from titan.runtime.captured_redo import CapturedRedoStep
        step = CapturedRedoStep(program)
    forward_loss = CapturedLoss(program.forward_loss)
    captured = [step, forward_loss]
    if isinstance(optimizer, FusedAdamW):
        from titan.runtime.captured_update import CapturedUpdate
        update = CapturedUpdate(clip, optimizer, eager_while=lambda: program.kernels_pending)
        captured.append(update)
    try:
        yield step, update, forward_loss
    finally:
        for graph in reversed(captured):
            graph.close()


def _train(artifact_path: str, cfg: RunConfig, env: RankEnv) -> int:
    run_rank(artifact_path, cfg, env)
    return 0


def rank_main(artifact_path: str, cfg: RunConfig,
              work: Callable[[str, RunConfig, RankEnv], int] = _train) -> int:
    """Entry point of one rank process: runs `work` (training by default), which returns the
    exit code, and turns the ways a rank can fail into one line and an exit status."""
    from titan.runtime.run_state import RunOptionError

    env = None
    try:
        env = RankEnv.from_environ()
        code = work(artifact_path, cfg, env)
    except RunOptionError as e:  # every rank finds the same mistake: one of them says it
        if env.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except ValueError as e:  # ArtifactError and bad options: the user's to fix
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except torch.OutOfMemoryError as e:
        first = str(e).strip().splitlines()[0][:200]
        print(f"error: rank {env.rank}: out of GPU memory ({first}); rebuild the artifact with activation "
              "checkpointing (titan-build --ac full), a smaller --batch-size, or more ranks", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        if not dist.is_initialized():
            raise
        # Collectives fail like this when a peer rank died or stopped answering.
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        print(f"error: rank {env.rank}: a collective failed because {_which_peer(env)}; stopping. ({first})",
              file=sys.stderr, flush=True)
        return 1
    shutdown()
    return code


def _which_peer(env: RankEnv) -> str:
    """Name the dead peers when they ran on this host (their process ids are in the store)."""
    from titan.runtime.launch import dead_peers
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=2))
        dead = dead_peers(store, env.rank, env.world_size)
    except Exception:  # the store went with the job (its host died): say what is known
        dead = []
    if dead:
        return f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died"
    return "another rank died or stopped answering"
