"""The manifest (manifest.json): what an artifact was built for, the programs its ranks run and
the sha256 of every file it holds (spec: artifacts/README.md). titan-build writes it with
`to_json`; the runtime and the tools read it with `from_json`, which runs every check of it. No
torch import: titan-build's cache-hit path writes it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from titan.runtime.contract.checks import ArtifactError, check_int, check_rel_path, check_str, fail
from titan.runtime.contract.hf_record import RECORD, HFRecord, plain_config_value, required
from titan.runtime.contract.layout import MESH_DIMS, Layout
from titan.runtime.contract.pipeline_schedule import MAX_STAGES, PipelineSchedule

ARTIFACT_FORMAT = "titan-artifact"
ARTIFACT_VERSION = 2  # 2: programs shared by ranks, rank values bound at load
MOE_CAPACITY_VERSION = 3
"""3: version 2 plus a bounded MoE dispatch (`moe_capacity`, and the dropless `redo_programs`
unless it drops): a runtime that cannot redo an overflowing step must refuse it, not run it
capped. Every other artifact stays version 2."""
PARAM_COPIES_VERSION = 4
"""4: programs that take parameters as their compute-dtype copies and return the copies'
gradients (GraphInput.cast: the `fold_param_casts` pass in a low-precision build), with or
without a bounded MoE dispatch: a runtime that would pass the parameters as they are must
refuse it."""
READ_VERSIONS = (ARTIFACT_VERSION, MOE_CAPACITY_VERSION, PARAM_COPIES_VERSION)


def format_version(*, passes, dtype, moe_capacity) -> int:
    """The format version an artifact of these passes, dtype and MoE capacity is written in."""
    if isinstance(passes, (list, tuple)) and "fold_param_casts" in passes and dtype != "float32":
        return PARAM_COPIES_VERSION
    return ARTIFACT_VERSION if moe_capacity is None else MOE_CAPACITY_VERSION
MANIFEST = "manifest.json"
REQUIRED = ("world_size", "mesh", "programs", "rank_programs", "files", "torch_version", "batch_size", "seq_len",
            "model_config")
"""Fields without which nothing about the artifact can be checked ("lacks '...'")."""
DESCRIBED = ("model", "flavor", "dtype", "ac", "param_dtype", "builder_version", "created", "name", "cache_key")
"""Fields that describe the build (strings the tools print and compare)."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+_-]{0,63}")
_KERNEL_KEY = re.compile(r"[0-9a-f]{32}")
MAX_KERNELS = 1 << 16

MAX_KERNEL_BYTES = 256 << 20
"""Largest compiled region read (real ones are tens of KiB)."""


@dataclass(kw_only=True, frozen=True)
class ProgramFiles:
    """The files of one program: its metadata (a RankRecord) and its two graphs."""
    meta: str
    forward: str
    backward: str

    def to_json(self) -> dict:
        return {"meta": self.meta, "forward": self.forward, "backward": self.backward}


@dataclass(kw_only=True, frozen=True)
class MoECapacity:
    """A bounded mixture-of-experts dispatch (titan-build --moe-capacity)."""
    factor: float
    """The capacity factor the dispatch buffers are sized by."""
    drop: bool
    """True: assignments past a buffer are dropped (numerics change); False: an overflowing
    step is redone by the redo programs (dropless)."""

    def to_json(self) -> dict:
        return {"factor": self.factor, "drop": self.drop}

    def describe(self) -> str:
        return f"MoE capacity {self.factor:g}, " + ("drop-and-pad (changes numerics)" if self.drop
                                                     else "overflow redone dropless")


@dataclass(kw_only=True, frozen=True)
class PipelinePlan:
    """A pipeline artifact's stages (docs/pipeline.md): the schedule every pp rank runs, and the
    program of each stage on each rank of it."""
    schedule: PipelineSchedule
    stage_programs: tuple[tuple[int, ...], ...]
    """Per stage, per place in the stage's block of ranks (rank % (world / pp): pp is the
    outermost mesh dimension), the index of the program it runs."""
    redo_stage_programs: tuple[tuple[int, ...], ...] = ()
    """With a bounded MoE dispatch that does not drop: as stage_programs, the index of each
    stage's dropless redo program (in the manifest's redo_programs); empty otherwise."""

    def to_json(self) -> dict:
        d = {"schedule": self.schedule.to_json(), "stage_programs": [list(p) for p in self.stage_programs]}
        if self.redo_stage_programs:
            d["redo_stage_programs"] = [list(p) for p in self.redo_stage_programs]
        return d


@dataclass(kw_only=True, frozen=True)
class Manifest:
    model: str
    """The model family (builder/models/ registry name)."""
    flavor: str
    model_config: dict
    """The model's configuration, as its spec writes it (has at least `vocab_size`)."""
    layout: Layout
    world_size: int
    batch_size: int
    """Sequences per data-parallel rank per step."""
    seq_len: int
    dtype: str
    """The compute dtype (parameters are `param_dtype`)."""
    ac: str
    param_dtype: str
    torch_version: str
    builder_version: str
    passes: tuple[str, ...]
    hf_checkpoint: HFRecord | None
    """What --init-from-hf and titan-export need of the model; None: it has no Hugging Face
    counterpart."""
    created: str
    name: str
    cache_key: str
    programs: tuple[ProgramFiles, ...]
    rank_programs: tuple[int, ...]
    """Per rank, the index of the program it runs."""
    files: dict[str, str]
    """Every file of the artifact (path relative to it) -> its sha256."""
    kernels: dict[str, str] = field(default_factory=dict)
    """Compiled regions (titan-build --kernels): kernel key -> listed file."""
    moe_capacity: MoECapacity | None = None
    """A bounded MoE dispatch; None: dropless buffers."""
    redo_programs: tuple[ProgramFiles, ...] = ()
    """With a capacity that does not drop: the dropless programs that redo an overflowing step."""
    redo_rank_programs: tuple[int, ...] = ()
    """Per rank, the index of its redo program (empty without redo programs)."""
    pipeline: PipelinePlan | None = None
    """With pp > 1: the schedule and each stage's programs; `rank_programs` then gives each
    rank the program of its first stage."""

    def redo_program_of(self, rank: int, stage: int | None = None) -> ProgramFiles:
        """The dropless redo program `rank` runs (of pipeline stage `stage`, one of stages_of(rank))."""
        if stage is None:
            return self.redo_programs[self.redo_rank_programs[rank]]
        assert stage in self.stages_of(rank), (rank, stage)
        return self.redo_programs[self.pipeline.redo_stage_programs[stage][rank % (self.world_size // self.layout.pp)]]

    @property
    def dp_degree(self) -> int:
        return self.layout.dp_degree

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]

    @property
    def microbatches(self) -> int:
        """Micro-batches of `batch_size` sequences a step reads per data-parallel rank: a
        pipeline's (its schedule's), else 1 (gradient accumulation is the run's choice)."""
        return 1 if self.pipeline is None else self.pipeline.schedule.microbatches

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one micro-batch over every data-parallel rank (a step reads `microbatches`
        of them, or the run's accumulation steps)."""
        return self.batch_size * self.seq_len * self.layout.dp_degree

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The pipeline stages `rank` runs, in stage order (() without a pipeline)."""
        if self.pipeline is None:
            return ()
        pp_coord = self.layout.coordinates(rank)["pp"]
        return tuple(s for s, r in enumerate(self.pipeline.schedule.stage_rank) if r == pp_coord)

    def program_of(self, rank: int, stage: int | None = None) -> ProgramFiles:
        """The program `rank` runs (of pipeline stage `stage`, one of stages_of(rank))."""
        if stage is None:
            return self.programs[self.rank_programs[rank]]
        assert stage in self.stages_of(rank), (rank, stage)
        return self.programs[self.pipeline.stage_programs[stage][rank % (self.world_size // self.layout.pp)]]

    def hf_record(self, where: str) -> HFRecord:
        """The Hugging Face record (ValueError naming `where` if the model has none)."""
        return required(self.hf_checkpoint, where)

    def to_json(self) -> dict:
        d = {"format": ARTIFACT_FORMAT, "model": self.model,
             "flavor": self.flavor, "model_config": self.model_config, "layout": self.layout.as_dict(),
             "mesh": [list(d) for d in self.layout.mesh_shape()], "world_size": self.world_size,
             "batch_size": self.batch_size, "seq_len": self.seq_len, "dtype": self.dtype, "ac": self.ac,
             "param_dtype": self.param_dtype, "torch_version": self.torch_version,
             "builder_version": self.builder_version, "passes": list(self.passes),
             RECORD: None if self.hf_checkpoint is None else self.hf_checkpoint.to_json(),
             "created": self.created, "name": self.name, "cache_key": self.cache_key,
             "programs": [p.to_json() for p in self.programs], "rank_programs": list(self.rank_programs),
             "files": self.files}
        if self.kernels:
            d["kernels"] = self.kernels
        d["format_version"] = format_version(passes=self.passes, dtype=self.dtype, moe_capacity=self.moe_capacity)
        if self.moe_capacity is not None:
            d["moe_capacity"] = self.moe_capacity.to_json()
        if self.redo_programs:
            d["redo_programs"] = [p.to_json() for p in self.redo_programs]
            d["redo_rank_programs"] = list(self.redo_rank_programs)
        if self.pipeline is not None:
            d["pipeline"] = self.pipeline.to_json()
        return d

    @staticmethod
    def from_json(m, root: str | Path) -> Manifest:
        """The manifest of the artifact at `root`, checked: ArtifactError (one line, with the fix)
        for anything titan-build would not have written."""
        mpath = Path(root) / MANIFEST
        if not isinstance(m, dict) or m.get("format") != ARTIFACT_FORMAT:
            raise ArtifactError(f"{mpath} is not a titan artifact manifest; rebuild with titan-build")
        if m.get("format_version") not in READ_VERSIONS:
            raise ArtifactError(f"{root} has artifact format {m.get('format_version')!r}; this runtime reads "
                                f"formats {READ_VERSIONS[0]} to {READ_VERSIONS[-1]}: rebuild it with this "
                                "version's titan-build")
        for key in REQUIRED:
            if key not in m:
                raise ArtifactError(f"{mpath} lacks '{key}'; rebuild with titan-build")
        return _checked(m)


def _checked(m: dict) -> Manifest:
    where = "manifest"
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        fail(where, "'files' must map paths to sha256 digests")
    for rel, digest in files.items():
        check_rel_path(rel, f"{where} files")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            fail(where, f"files[{rel!r}] is not a sha256 digest")
    if not isinstance(m.get("torch_version"), str) or not _VERSION.fullmatch(m["torch_version"]):
        fail(where, f"torch_version {m.get('torch_version')!r} is not a version string")
    world = check_int(m.get("world_size"), f"{where} world_size", 1, 1 << 16)
    layout = _layout(m, world, where)
    check_int(m.get("batch_size"), f"{where} batch_size", 1, 1 << 20)
    check_int(m.get("seq_len"), f"{where} seq_len", 2, 1 << 24)
    cfg = m.get("model_config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("vocab_size"), int) or not 2 <= cfg["vocab_size"] <= 1 << 31:
        fail(where, "'model_config' lacks a vocabulary size")
    if len(cfg) > 256 or not all(isinstance(k, str) and len(k) <= 64 and plain_config_value(v) for k, v in cfg.items()):
        fail(where, "'model_config' must map at most 256 names to plain values (numbers, short strings, "
                    "lists of layer numbers)")
    # A pipeline's ranks may run several stages each, a program per stage.
    most = world * (MAX_STAGES if "pipeline" in m else 1)
    programs, assignment = _programs(m, "programs", "rank_programs", files, world, where, most=most)
    capacity, redo, redo_assignment = _moe_capacity(m, files, world, where, most=most)
    pipeline = _pipeline(m, layout, cfg, len(programs), assignment, where, redo=(len(redo), redo_assignment))
    kernels = m.get("kernels", {})
    _check_kernels(kernels, files, where)
    passes = m.get("passes")
    if not isinstance(passes, list) or not all(isinstance(p, str) for p in passes):
        fail(where, "'passes' must list pass names")
    copies = format_version(passes=passes, dtype=m.get("dtype"), moe_capacity=None) == PARAM_COPIES_VERSION
    if copies != (m["format_version"] == PARAM_COPIES_VERSION):
        fail(where, f"format version {PARAM_COPIES_VERSION} belongs with a low-precision build's fold_param_casts "
                    "pass, and only with it")
    described = {key: check_str(m.get(key), where, key) for key in DESCRIBED}
    hf = None if m.get(RECORD) is None else HFRecord.from_json(m[RECORD], where)
    return Manifest(**described, model_config=cfg, layout=layout, world_size=world, batch_size=m["batch_size"],
                    seq_len=m["seq_len"], torch_version=m["torch_version"], passes=tuple(passes),
                    hf_checkpoint=hf, files=files, kernels=kernels,
                    programs=programs, rank_programs=assignment, moe_capacity=capacity, redo_programs=redo,
                    redo_rank_programs=redo_assignment, pipeline=pipeline)


def _programs(m: dict, key: str, assignment_key: str, files: dict, world: int,
              where: str, most: int | None = None) -> tuple[tuple[ProgramFiles, ...], tuple[int, ...]]:
    """A list of programs (at most `most`, by default one per rank) whose files are listed, and
    the program of each rank."""
    programs = m.get(key)
    most = world if most is None else most
    if not isinstance(programs, list) or not 1 <= len(programs) <= most:
        fail(where, f"'{key}' must list between 1 and {most} programs")
    for i, entry in enumerate(programs):
        if not isinstance(entry, dict):
            fail(where, f"program {i} is malformed")
        for part in ("meta", "forward", "backward"):
            rel = check_rel_path(entry.get(part), f"{where} program {i} {part}")
            if rel not in files:
                fail(where, f"program {i} {part} file {rel} is not listed in 'files'")
    assignment = m.get(assignment_key)
    if not isinstance(assignment, list) or len(assignment) != world:
        fail(where, f"'{assignment_key}' must give a program for each of the {world} ranks")
    for r, index in enumerate(assignment):
        check_int(index, f"{where} {assignment_key}[{r}]", 0, len(programs) - 1)
    return (tuple(ProgramFiles(meta=p["meta"], forward=p["forward"], backward=p["backward"]) for p in programs),
            tuple(assignment))


def _pipeline(m: dict, layout: Layout, cfg: dict, n_programs: int, assignment: tuple[int, ...],
              where: str, *, redo: tuple[int, tuple[int, ...]]) -> PipelinePlan | None:
    """The pipeline: present exactly when the mesh has a pp dimension; its schedule checked
    (complete, deadlock-free: runtime/contract/pipeline_schedule.py) for the model's layers; every
    rank of every stage given a program, and each rank's `rank_programs` entry its first stage's.
    `redo`: the count of redo programs and each rank's (a bounded MoE dispatch that does not
    drop): then every rank of every stage is given a redo program too, alike."""
    raw = m.get("pipeline")
    if (raw is None) != (layout.pp == 1):
        fail(where, "'pipeline' belongs with a pp mesh dimension, and a pp dimension needs it")
    if raw is None:
        return None
    n_redo, redo_assignment = redo
    keys = {"schedule", "stage_programs"} | ({"redo_stage_programs"} if n_redo else set())
    if not isinstance(raw, dict) or set(raw) != keys:
        fail(where, f"'pipeline' must hold exactly {' and '.join(repr(k) for k in sorted(keys))} (the redo programs "
                    "exactly with a bounded MoE dispatch that does not drop)")
    n_layers = check_int(cfg.get("n_layers"), f"{where} model_config n_layers", 1, 1 << 16)
    schedule = PipelineSchedule.from_json(raw["schedule"], f"{where} pipeline schedule", n_layers=n_layers,
                                          pp=layout.pp)
    per_stage = layout.world_size // layout.pp

    def per_stage_programs(name: str, count: int, firsts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        table = raw[name]
        if not isinstance(table, list) or len(table) != schedule.n_stages or not all(
                isinstance(p, list) and len(p) == per_stage for p in table):
            fail(where, f"'{name}' must give each of the {schedule.n_stages} stages a program for each of its "
                        f"{per_stage} rank(s)")
        for s, programs in enumerate(table):
            for index in programs:
                check_int(index, f"{where} {name}[{s}]", 0, count - 1)
        for rank, index in enumerate(firsts):
            first = schedule.stage_rank.index(layout.coordinates(rank)["pp"])
            if table[first][rank % per_stage] != index:
                fail(where, f"rank {rank}'s program in '{name}' is not its first stage's ({first})")
        return tuple(tuple(p) for p in table)

    return PipelinePlan(schedule=schedule, stage_programs=per_stage_programs("stage_programs", n_programs, assignment),
                        redo_stage_programs=(per_stage_programs("redo_stage_programs", n_redo, redo_assignment)
                                             if n_redo else ()))


def _moe_capacity(m: dict, files: dict, world: int, where: str,
                  *, most: int) -> tuple[MoECapacity | None, tuple[ProgramFiles, ...], tuple[int, ...]]:
    """The bounded MoE dispatch: format version 3 exactly when there is one, and redo programs
    exactly when it does not drop."""
    raw = m.get("moe_capacity")
    if (raw is None and m.get("format_version") == MOE_CAPACITY_VERSION) or (
            raw is not None and m.get("format_version") not in (MOE_CAPACITY_VERSION, PARAM_COPIES_VERSION)):
        fail(where, f"'moe_capacity' belongs with format version {MOE_CAPACITY_VERSION} (or "
                    f"{PARAM_COPIES_VERSION}, which also has it)")
    if raw is None:
        if "redo_programs" in m:
            fail(where, "'redo_programs' without 'moe_capacity'")
        return None, (), ()
    factor, drop = (raw.get("factor"), raw.get("drop")) if isinstance(raw, dict) else (None, None)
    if (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1e9
            or not isinstance(drop, bool)):
        fail(where, "'moe_capacity' must hold a positive 'factor' and a boolean 'drop'")
    capacity = MoECapacity(factor=float(factor), drop=drop)
    if drop:
        if "redo_programs" in m:
            fail(where, "a drop-and-pad 'moe_capacity' has no 'redo_programs'")
        return capacity, (), ()
    return (capacity, *_programs(m, "redo_programs", "redo_rank_programs", files, world, where, most=most))


def _layout(m: dict, world: int, where: str) -> Layout:
    """The layout, which must agree with the mesh (of the dimensions of size > 1, in order)."""
    mesh = m.get("mesh")
    if not isinstance(mesh, list):
        fail(where, "'mesh' must be a list")
    product, seen = 1, []
    for dim in mesh:
        if (not isinstance(dim, list) or len(dim) != 2 or dim[0] not in MESH_DIMS or dim[0] in seen):
            fail(where, f"bad mesh dimension {dim!r}")
        seen.append(dim[0])
        product *= check_int(dim[1], f"{where} mesh {dim[0]}", 2, 1 << 16)
    if seen != sorted(seen, key=MESH_DIMS.index):
        fail(where, "mesh dimensions out of order")
    if product != world:
        fail(where, f"mesh {mesh} does not multiply to world size {world}")
    layout = m.get("layout")
    if not isinstance(layout, dict) or any(
            check_int(layout.get(n, 1) if n == "pp" else layout.get(n), f"{where} layout {n}", 1, 1 << 16)
            != dict(mesh).get(n, 1) for n in MESH_DIMS):
        fail(where, "'layout' disagrees with 'mesh'")
    return Layout.from_dict(layout)


def _check_kernels(kernels, files: dict, where: str) -> None:
    """Compiled regions the artifact carries (titan-build --kernels): kernel key -> listed file.
    They are code; the manifest's digest of each is what lets the runtime load it."""
    if not isinstance(kernels, dict) or len(kernels) > MAX_KERNELS:
        fail(where, "'kernels' must map kernel keys to files")
    for key, rel in kernels.items():
        if not _KERNEL_KEY.fullmatch(key):
            fail(where, f"kernel key {key[:40]!r} is not a kernel key")
        if check_rel_path(rel, f"{where} kernels") not in files:
            fail(where, f"kernel file {rel} is not listed in 'files'")
