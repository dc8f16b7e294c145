"""Structural checks of an artifact's manifest and of one rank's metadata against its graphs,
run before anything executes. An artifact is untrusted input: its hashes can be consistent
and its content still crafted, so every assumption the runtime makes is checked here."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from titan.runtime.contract.graph_doc import MAX_ELEMENTS
from titan.runtime.contract.layout import MESH_DIMS, Layout
from titan.runtime.shards import shard_box

if TYPE_CHECKING:
    import torch.fx as fx

_REL_PATH = re.compile(r"(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
INIT_KINDS = ("normal", "trunc_normal", "ones", "zeros")


class ArtifactCheckError(ValueError):
    """A structural check failed; the artifact was not built by titan-build or was altered."""


def _fail(where: str, what: str):
    raise ArtifactCheckError(f"{where}: {what}; rebuild the artifact with titan-build")


def _int(v, where: str, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        _fail(where, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _shape(v, where: str) -> list[int]:
    if not isinstance(v, list) or len(v) > 8:
        _fail(where, f"expected a shape, got {v!r}")
    total = 1
    for d in v:
        total *= _int(d, where, 1)
    _int(total, where, 1)
    return v


def check_rel_path(rel, where: str) -> str:
    if not isinstance(rel, str) or not _REL_PATH.fullmatch(rel) or ".." in rel.split("/"):
        _fail(where, f"{rel!r} is not a plain relative path inside the artifact")
    return rel


def check_manifest(m: dict) -> None:
    where = "manifest"
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        _fail(where, "'files' must map paths to sha256 digests")
    for rel, digest in files.items():
        check_rel_path(rel, f"{where} files")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            _fail(where, f"files[{rel!r}] is not a sha256 digest")
    if not isinstance(m.get("torch_version"), str) or not re.fullmatch(r"[0-9][0-9A-Za-z.+_-]{0,63}", m["torch_version"]):
        _fail(where, f"torch_version {m.get('torch_version')!r} is not a version string")
    world = _int(m.get("world_size"), f"{where} world_size", 1, 1 << 16)
    mesh = m.get("mesh")
    if not isinstance(mesh, list):
        _fail(where, "'mesh' must be a list")
    product, seen = 1, []
    for dim in mesh:
        if (not isinstance(dim, list) or len(dim) != 2 or dim[0] not in MESH_DIMS or dim[0] in seen):
            _fail(where, f"bad mesh dimension {dim!r}")
        seen.append(dim[0])
        product *= _int(dim[1], f"{where} mesh {dim[0]}", 2, 1 << 16)
    if seen != sorted(seen, key=MESH_DIMS.index):
        _fail(where, "mesh dimensions out of order")
    if product != world:
        _fail(where, f"mesh {mesh} does not multiply to world size {world}")
    layout = m.get("layout")
    if not isinstance(layout, dict) or any(
            _int(layout.get(n), f"{where} layout {n}", 1, 1 << 16) != dict(mesh).get(n, 1) for n in MESH_DIMS):
        _fail(where, "'layout' disagrees with 'mesh'")
    _int(m.get("batch_size"), f"{where} batch_size", 1, 1 << 20)
    _int(m.get("seq_len"), f"{where} seq_len", 2, 1 << 24)
    cfg = m.get("model_config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("vocab_size"), int) or cfg["vocab_size"] < 2:
        _fail(where, "'model_config' lacks a vocabulary size")
    programs = m.get("programs")
    if not isinstance(programs, list) or not 1 <= len(programs) <= world:
        _fail(where, f"'programs' must list between 1 and {world} programs")
    for i, entry in enumerate(programs):
        if not isinstance(entry, dict):
            _fail(where, f"program {i} is malformed")
        for key in ("meta", "forward", "backward"):
            rel = check_rel_path(entry.get(key), f"{where} program {i} {key}")
            if rel not in files:
                _fail(where, f"program {i} {key} file {rel} is not listed in 'files'")
    assignment = m.get("rank_programs")
    if not isinstance(assignment, list) or len(assignment) != world:
        _fail(where, f"'rank_programs' must give a program for each of the {world} ranks")
    for r, index in enumerate(assignment):
        _int(index, f"{where} rank_programs[{r}]", 0, len(programs) - 1)
    _check_kernels(m.get("kernels", {}), files, where)


_KERNEL_KEY = re.compile(r"[0-9a-f]{32}")
MAX_KERNELS = 1 << 16


def _check_kernels(kernels, files: dict, where: str) -> None:
    """Compiled regions the artifact carries (titan-build --kernels): kernel key -> listed file.
    They are code; the manifest's digest of each is what lets the runtime load it."""
    if not isinstance(kernels, dict) or len(kernels) > MAX_KERNELS:
        _fail(where, "'kernels' must map kernel keys to files")
    for key, rel in kernels.items():
        if not _KERNEL_KEY.fullmatch(key):
            _fail(where, f"kernel key {key[:40]!r} is not a kernel key")
        if check_rel_path(rel, f"{where} kernels") not in files:
            _fail(where, f"kernel file {rel} is not listed in 'files'")


def _check_param(p, where: str) -> None:
    if not isinstance(p, dict) or not isinstance(p.get("fqn"), str) or not p["fqn"]:
        _fail(where, "parameter entry without a name")
    where = f"{where} parameter {p['fqn'][:80]}"
    global_shape = _shape(p.get("global_shape"), where)
    slices = p.get("slices")
    if not isinstance(slices, list) or len(slices) > 4:
        _fail(where, "bad slices")
    for cut in slices:
        if not isinstance(cut, list) or len(cut) != 3:
            _fail(where, f"bad slice {cut!r}")
        dim = _int(cut[0], where, 0, len(global_shape) - 1)
        parts = _int(cut[1], where, 1, 1 << 16)
        _int(cut[2], where, 0, parts - 1)
    # A cut that does not divide its dim leaves padded chunks (runtime/shards.py), as FSDP2 does.
    local = list(shard_box(slices, global_shape).local_shape)
    if local != _shape(p.get("local_shape"), where):
        _fail(where, f"slices of {global_shape} give {local}, not local_shape {p.get('local_shape')}")
    init = p.get("init")
    if not isinstance(init, dict) or init.get("kind") not in INIT_KINDS:
        _fail(where, f"unknown init {init!r}")
    for key in ("std", "a", "b"):
        if key in init and (not isinstance(init[key], (int, float)) or not math.isfinite(init[key])):
            _fail(where, f"init {key} is not a finite number")
    if init["kind"] in ("normal", "trunc_normal") and not 0 < init.get("std", -1) < 1e3:
        _fail(where, "init std out of range")
    if init["kind"] == "trunc_normal" and not init.get("a", 1) < init.get("b", 0):
        _fail(where, "trunc_normal needs a < b")


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm: fx.GraphModule) -> tuple:
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


def check_rank(meta: dict, forward: fx.GraphModule, backward: fx.GraphModule, where: str, *,
               rank: int, layout: dict, graph_hashes: dict[str, str]) -> None:
    """The rank metadata is well formed, belongs to this rank, and describes these two graphs
    (`graph_hashes`: the sha256 of the forward and backward blobs the manifest gave this rank)."""
    for kind, digest in graph_hashes.items():
        if meta.get(f"{kind}_graph") != digest:
            # A program's metadata describes its own graphs: mixing programs trains wrong.
            _fail(where, f"the manifest gives this rank a {kind} graph that is not its program's "
                         "(a rank must never run another program's graph)")
    if meta.get("coords") != Layout.from_dict(layout).coordinates(rank):
        _fail(where, f"coordinates {meta.get('coords')!r} are not rank {rank}'s place in the mesh")
    inputs = meta.get("forward_inputs")
    if not isinstance(inputs, list):
        _fail(where, "'forward_inputs' must be a list")
    kinds = [i.get("kind") if isinstance(i, dict) else None for i in inputs]
    if kinds.count("tokens") != 1 or kinds.count("labels") != 1 or any(
            k not in ("param", "tokens", "labels") for k in kinds):
        _fail(where, "forward inputs must be parameters plus one tokens and one labels input")
    params = meta.get("params")
    if not isinstance(params, list) or len(params) != kinds.count("param"):
        _fail(where, "'params' does not match the parameter inputs")
    for p in params:
        _check_param(p, where)
    fqns = [i.get("fqn") for i in inputs if i["kind"] == "param"]
    if fqns != [p["fqn"] for p in params]:
        _fail(where, "parameter inputs and 'params' name different parameters")
    saved = _int(meta.get("saved_activations"), f"{where} saved_activations", 0, 1 << 20)
    outs = meta.get("backward_outputs")
    if outs != [i.get("fqn") if i["kind"] == "param" else None for i in inputs]:
        _fail(where, "'backward_outputs' does not match the forward inputs")
    fw_in = _placeholders(forward)
    if len(fw_in) != len(inputs):
        _fail(where, f"forward graph takes {len(fw_in)} inputs, metadata lists {len(inputs)}")
    shapes = iter(p["local_shape"] for p in params)
    for node, inp in zip(fw_in, inputs):
        val = node.meta.get("titan_val")
        if inp["kind"] == "param" and (not isinstance(val, dict) or val.get("shape") != next(shapes)):
            _fail(where, f"forward input {node.name} does not have the shape of parameter {inp['fqn']}")
    if len(_outputs(forward)) != saved + 1:
        _fail(where, f"forward graph returns {len(_outputs(forward))} values, expected loss + {saved} saved")
    if len(_placeholders(backward)) != saved + 1:
        _fail(where, f"backward graph takes {len(_placeholders(backward))} inputs, expected {saved} saved + 1")
    if len(_outputs(backward)) != len(inputs):
        _fail(where, f"backward graph returns {len(_outputs(backward))} values for {len(inputs)} forward inputs")
    reductions = meta.get("grad_reductions_owed")
    if reductions != {}:
        _fail(where, "this runtime performs no gradient reductions outside the graph")
