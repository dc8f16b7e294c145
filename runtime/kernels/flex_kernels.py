"""`titan::flex_attention` on CUDA: FlexAttention's fused, block-sparse Triton kernels (issue 31).

The op's CPU kernel is dense (runtime/contract/flex_attention.py). On a GPU the op runs the
kernels inductor generates for torch's FlexAttention higher-order op (its Triton templates; the
graphs they come from: runtime/kernels/flex_graphs.py): the forward kernel, and for the
backward a small reduction (each row's out . grad_out) and the backward kernel. They read the
block mask, which each call builds on the device from the document ids
(runtime/kernels/flex_block_mask.py): no host read, nothing of a batch in any kernel's code, so a
CUDA graph captured once replays new boundaries at every step.

The kernels are compiled regions like the fusion regions (runtime/kernels/fusion.py), under the
same rules: keyed by what shapes their code (direction, mask kind, input layouts, settings, GPU
kind, torch and triton versions), stored as kernel plans (cubins and launches as data, run
through torch's static launcher, no inductor imported), taken from the artifact when its kernels
are trusted, else the kernel store, else compiled here (on the GPU, under the key's lock) and
stored. `prepare_flex` loads them for a program's graphs before anything runs (so a CUDA-graph
capture never compiles); a call whose kernels were not prepared (the eager reference of
titan-verify, tests) loads or compiles them at its first call. Loaded kernels are kept per
process by key, so the eager reference and the artifact's program of one titan-verify run the
same kernels.

Every input's layout is part of the key; the template is compiled for a sequence that is a
multiple of the tile (128), the only shape FlexAttention's block mask is built for here.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import torch
import torch.fx as fx

from titan.runtime.kernels.flex_block_mask import BLOCK, block_mask_tensors

FORWARD, BACKWARD = "flex_forward", "flex_backward"
"""The two kinds of flex kernel (region kinds in the fusion statistics)."""
FLEX_FORMAT = 1
"""Bumped when the graphs or the block mask layout change what a kernel computes."""
_OPS = {"titan.flex_attention.default": FORWARD, "titan.flex_attention_backward.default": BACKWARD}

_LOADED: dict[str, Callable] = {}
"""Kernel key -> the loaded kernels (a kernel plan, or inductor's compiled graph where none)."""
_RECORDED: dict[str, str] = {}
"""Kernel key -> sha256 of the plan loaded for it (what titan-build --kernels records)."""
_CONTEXTS: dict[int, dict] = {}
"""Device index -> its kernel context (GPU kind, torch and triton versions), asked once."""
_ORIGINS: dict[str, str] = {}
"""Kernel key -> where its kernels came from: 'the artifact', 'the kernel store' or 'compiled here'."""
_ARTIFACT_KERNEL: list[Callable[[str], bytes | None]] = []
"""The trusted artifact's kernels, for calls whose kernels no program prepared (serve_artifact_kernels)."""


def serve_artifact_kernels(artifact_kernel: Callable[[str], bytes | None]) -> None:
    """Let calls whose kernels no program prepared take them from a trusted artifact first
    (titan-verify's eager reference, which runs before the artifact's program is loaded)."""
    _ARTIFACT_KERNEL[:] = [artifact_kernel]


def origins() -> str:
    """Where this process's FlexAttention kernels came from ('' when none were loaded)."""
    counts: dict[str, int] = {}
    for where in _ORIGINS.values():
        counts[where] = counts.get(where, 0) + 1
    return ", ".join(f"{n} from {where}" if where != "compiled here" else f"{n} compiled here"
                     for where, n in sorted(counts.items()))


def _layout(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch.")}


def _block_layouts(batch: int, seq: int) -> list[dict]:
    tiles = seq // BLOCK
    counts = {"shape": [batch, 1, tiles], "stride": [tiles, tiles, 1], "dtype": "int32"}
    indices = {"shape": [batch, 1, tiles, tiles], "stride": [tiles * tiles, tiles * tiles, tiles, 1], "dtype": "int32"}
    return [counts, indices] * 4


def call_layouts(kind: str, tensors: list[dict], documents: dict | None) -> list[dict]:
    """Every input's layout, in the kernels' order: `tensors` (q, k, v; the backward's q, k, v,
    out, logsumexp, grad_out), the document ids where there are, the block mask's eight."""
    batch, _, seq, _ = tensors[0]["shape"]
    return [*tensors, *([documents] if documents is not None else []), *_block_layouts(batch, seq)]


def flex_key(kind: str, layouts: list[dict], context: dict) -> str:
    from titan.runtime.kernels.flex_graphs import KERNEL_OPTIONS
    from titan.runtime.kernels.fusion import settings_asked

    return hashlib.sha256(json.dumps([kind, FLEX_FORMAT, BLOCK, KERNEL_OPTIONS, layouts, context, settings_asked(kind)],
                                     sort_keys=True).encode()).hexdigest()[:32]


def documents_in(layouts: list[dict], kind: str) -> bool:
    return len(layouts) - 8 > (3 if kind == FORWARD else 6)


def flex_calls(gm: fx.GraphModule) -> list[tuple[str, list[dict]]]:
    """(kind, input layouts) of each flex op call in `gm`, in graph order."""
    out = []
    for n in gm.graph.nodes:
        kind = _OPS.get(str(n.target)) if n.op == "call_function" else None
        if kind is None:
            continue
        *tensors, documents = n.args
        if kind == BACKWARD:  # the op takes grad_out first, the kernels last
            tensors = [*tensors[1:], tensors[0]]
        assert all(isinstance(a, fx.Node) for a in tensors), f"{n}: a flex input is not a tensor"
        out.append((kind, call_layouts(kind, [a.meta["titan_val"] for a in tensors],
                                       None if documents is None else documents.meta["titan_val"])))
    return out


def _checked_seq(seq: int) -> None:
    if seq % BLOCK:
        raise ValueError(f"FlexAttention's GPU kernels take a sequence length that is a multiple of {BLOCK}, not "
                         f"{seq}; rebuild with --seq-len {max(BLOCK, seq // BLOCK * BLOCK)} (or run on the CPU)")


def recording_inputs(layouts: list[dict], kind: str, device: torch.device) -> list[torch.Tensor]:
    """Inputs a compiled flex kernel may run on while its plan is recorded
    (runtime/kernels/plan_recorder.py): random q, k, v (and out, logsumexp, grad_out), document
    ids of random boundaries, and the block mask built from them (random indices would send the
    kernels out of bounds)."""
    from titan.runtime.kernels.plan_recorder import random_input

    has_documents = documents_in(layouts, kind)
    tensors = [random_input(v, device) for v in layouts[:3 if kind == FORWARD else 6]]
    batch, _, seq, _ = layouts[0]["shape"]
    documents = None
    if has_documents:
        ends = torch.rand(batch, seq, device=device) < 4.0 / BLOCK
        documents = (torch.cumsum(ends.long(), dim=1) - ends.long())
        documents = torch.as_strided(documents.contiguous(), layouts[len(tensors)]["shape"], layouts[len(tensors)]["stride"])
    blocks = block_mask_tensors(documents, batch=batch, seq=seq, device=device)
    return [*tensors, *([documents] if has_documents else []), *blocks]


def _context(device: torch.device) -> dict:
    from titan.runtime.kernels.fusion import device_tag, kernel_context

    index = device.index or 0
    if index not in _CONTEXTS:
        _CONTEXTS[index] = kernel_context(device_tag(device))
    return _CONTEXTS[index]


def _load(kind: str, layouts: list[dict], device: torch.device, sources, stats) -> Callable:
    """The kernels of one flex call, from the process's loaded ones, or through `sources`
    (fusion.KernelSources: the artifact, the kernel store, compiled here)."""
    from titan.runtime.kernels.fusion import load_kernel

    key = flex_key(kind, layouts, _context(device))
    kernel = _LOADED.get(key)
    if kernel is not None:
        stats.reused += 1
        if key in _RECORDED:
            sources.recorded[key] = _RECORDED[key]
        return kernel

    def compile_here():
        from titan.runtime.kernels.fusion import compile_region
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlexAttention's kernels for a call were not loaded before a CUDA graph capture "
                               f"({kind}, q {layouts[0]}); run with --no-cuda-graphs and report it")
        return compile_region(lambda: flex_graph(kind, layouts), layouts, kind, device,
                              inputs=lambda: recording_inputs(layouts, kind, device))

    before = (stats.from_artifact, stats.loaded)
    kernel = load_kernel(key, compile_here, device, sources, stats)
    _LOADED[key] = kernel
    _ORIGINS[key] = ("the artifact" if stats.from_artifact > before[0] else
                     "the kernel store" if stats.loaded > before[1] else "compiled here")
    if key in sources.recorded:
        _RECORDED[key] = sources.recorded[key]
    return kernel


def flex_graph(kind: str, layouts: list[dict]) -> fx.GraphModule:
    """The traced graph of one flex call's kernels, on fake CUDA inputs of `layouts`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan.runtime.kernels.flex_graphs import backward_graph, forward_graph

    with FakeTensorMode():
        examples = [torch.empty_strided(v["shape"], v["stride"], dtype=getattr(torch, v["dtype"]), device="cuda")
                    for v in layouts]
    trace = forward_graph if kind == FORWARD else backward_graph
    return trace(examples, documents=documents_in(layouts, kind))


def flex_kernel_specs(gm: fx.GraphModule, *, device: str) -> dict[str, tuple[str, Callable, list[dict]]]:
    """Each distinct flex call of `gm` as kernel key -> (kind, a function making its graph, input
    layouts), keyed for a device whose device_tag is `device` (as fusion.region_kernels keys
    the regions: titan-build --kernels --gpu builds them without a GPU)."""
    from titan.runtime.kernels.fusion import kernel_context

    context = kernel_context(device)
    out = {}
    for kind, layouts in flex_calls(gm):
        _checked_seq(layouts[0]["shape"][2])
        out[flex_key(kind, layouts, context)] = (kind, lambda kind=kind, layouts=layouts: flex_graph(kind, layouts),
                                                 layouts)
    return out


def prepare_flex(gm: fx.GraphModule, *, device: torch.device, sources, stats) -> None:
    """Load (or compile) the kernels of every flex call in `gm` before it runs."""
    for kind, layouts in flex_calls(gm):
        _checked_seq(layouts[0]["shape"][2])
        _load(kind, layouts, device, sources, stats)
        stats.regions += 1
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1


_BY_CALL: dict[tuple, Callable] = {}
"""(kind, device, every input's shape, stride and dtype) -> its loaded kernels: a step's calls
find them without building the key (the layouts as JSON, hashed) at every call."""


def _kernel_for(kind: str, inputs: list[torch.Tensor], documents: torch.Tensor | None) -> Callable:
    from titan.runtime.kernels.fusion import FusionStats, KernelSources

    tensors = [*inputs, *([documents] if documents is not None else [])]
    call = (kind, inputs[0].device, *((tuple(t.shape), t.stride(), t.dtype) for t in tensors))
    kernel = _BY_CALL.get(call)
    if kernel is None:
        _checked_seq(inputs[0].shape[2])
        layouts = call_layouts(kind, [_layout(t) for t in inputs], None if documents is None else _layout(documents))
        sources = KernelSources(device=inputs[0].device,
                                artifact_kernel=_ARTIFACT_KERNEL[0] if _ARTIFACT_KERNEL else None)
        kernel = _BY_CALL[call] = _load(kind, layouts, inputs[0].device, sources, FusionStats())
    return kernel


def flex_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp in base 2), contiguous, as the CPU kernel returns them (the layouts the
    graphs record, which the kernels after them are compiled for)."""
    blocks = block_mask_tensors(documents, batch=q.shape[0], seq=q.shape[2], device=q.device)
    kernel = _kernel_for(FORWARD, [q, k, v], documents)
    out, lse = kernel(q, k, v, *([documents] if documents is not None else []), *blocks)[:2]
    # FlexAttention's templates write their outputs in q's stride order (a (batch, seq, heads,
    # dim) tensor seen as (batch, heads, seq, dim) gives a transposed out): found on an H100, where
    # the exact regions after the op were compiled for the contiguous results the graph records.
    return out.contiguous(), lse.contiguous()


def flex_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, documents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = block_mask_tensors(documents, batch=q.shape[0], seq=q.shape[2], device=q.device)
    kernel = _kernel_for(BACKWARD, [q, k, v, out, lse, grad_out], documents)
    grad_q, grad_k, grad_v = kernel(q, k, v, out, lse, grad_out, *([documents] if documents is not None else []),
                                    *blocks)[:3]
    return grad_q.contiguous(), grad_k.contiguous(), grad_v.contiguous()  # as in flex_forward
