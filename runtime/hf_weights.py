"""Hugging Face checkpoints: read this rank's shards straight from safetensors (--init-from-hf),
and write a titan checkpoint back in Hugging Face's layout (titan-export).

What this needs of the model (each parameter's HF tensor name, which rows are permuted, the
config.json values that describe the same model) comes from the artifact's manifest, the
record (runtime/contract/hf_record.py) that the model's spec wrote at build time: the runtime never
imports model code.

Only JSON (config.json, model.safetensors.index.json) and safetensors headers and slices are
read: no pickle. Each parameter's shard is a box of the global tensor (runtime/contract/shards.py
`shard_box`), read with `safe_open(...).get_slice`, so a rank reads only what it holds (and
pads it as FSDP's uneven cuts require).

Hugging Face stores Llama's q_proj / k_proj rows permuted for its rotate-half RoPE (the record's
`rope_permuted`: parameter -> head size): within each head, HF row j * (head_dim / 2) + i holds
what titan's interleaved-pair layout keeps in row 2 i + j. Loading undoes that permutation,
exporting redoes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from titan.runtime.contract.hf_record import ROPE_PREFIX, ROPE_TYPE, HFRecord, hf_record
from titan.runtime.contract.rank_record import ParamSpec
from titan.runtime.contract.shard_tensors import pad_shard
from titan.runtime.contract.shards import ShardBox, shard_box

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
"""safetensors dtypes a parameter may be read from (the names safetensors' get_dtype() gives)."""


def titan_rows_from_hf(head_dim: int) -> torch.Tensor:
    """Index i: the HF row (within a head) that holds titan row i."""
    return torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)


def hf_rows_from_titan(head_dim: int) -> torch.Tensor:
    """Index r: the titan row (within a head) that holds HF row r."""
    return torch.argsort(titan_rows_from_hf(head_dim))


def to_hf_layout(full: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """A full titan parameter in HF's row order (export); `head_dim` None: no permutation."""
    if head_dim is None:
        return full
    rows = full.unflatten(0, (-1, head_dim))[:, hf_rows_from_titan(head_dim)]
    return rows.flatten(0, 1).contiguous()


def check_hf_config(hf_dir: Path, record: HFRecord) -> dict:
    """Read config.json and check it describes the artifact's model; returns it."""
    path = hf_dir / CONFIG
    if not path.is_file():
        raise ValueError(f"--init-from-hf {hf_dir}: no {CONFIG}; point it at a Hugging Face model directory "
                         f"(config.json + model.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--init-from-hf {path} is not valid JSON ({e}); re-download or re-save the model") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--init-from-hf {path} is not a JSON object; re-download or re-save the model")
    where = f"--init-from-hf {path}"
    model_type = record.model_type
    if cfg.get("model_type", model_type) != model_type:
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} is not {model_type!r}; this artifact's model "
                         f"loads {model_type} checkpoints only")
    # transformers < 5 writes rope_theta and rope_scaling; >= 5 writes rope_parameters (theta and type).
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: rope_scaling / rope_parameters is not a JSON object; re-download or re-save "
                         "the model")
    expected = record.config
    rope_type, want_rope = rope.get("rope_type", rope.get("type")) or "default", expected.get(ROPE_TYPE, "default")
    if rope_type != want_rope:
        raise ValueError(f"{where}: RoPE scaling {rope_type!r} is not implemented by this artifact's model (its RoPE: "
                         f"{want_rope!r}); use a checkpoint of the artifact's model (for Llama 3, one without "
                         "rope_scaling: e.g. Llama 3 8B, not 3.1)")
    # Hugging Face's defaults for fields a config may leave out (or null).
    given = {k: v for k, v in cfg.items() if v is not None}
    given.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
    given.setdefault("head_dim", expected.get("head_dim"))
    given.setdefault("hidden_act", "silu")
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts (published
    # checkpoints: num_experts).
    if "num_local_experts" in given:
        given.setdefault("num_experts", given["num_local_experts"])
    for flag in ("attention_bias", "mlp_bias"):
        given[flag] = bool(given.get(flag, False))
    if "rope_theta" not in given and "rope_theta" in rope:
        given["rope_theta"] = rope["rope_theta"]
    given.update({ROPE_PREFIX + k: v for k, v in rope.items() if v is not None})
    given[ROPE_TYPE] = rope_type
    wrong = []
    for key, want in expected.items():
        if key not in given:
            raise ValueError(f"{where} lacks {key!r}; it is not a complete {model_type} config")
        if given[key] != want:
            wrong.append(f"{key} {given[key]!r} (artifact: {want!r})")
    if wrong:
        raise ValueError(f"{where} does not describe this artifact's model: {', '.join(wrong)}; build an artifact "
                         "for this model (titan-build --flavor ...) or use the matching checkpoint")
    return cfg


class HFCheckpoint:
    """A Hugging Face model directory, opened for slice reads."""

    def __init__(self, hf_dir: str | Path, *, record: HFRecord):
        self.root = Path(hf_dir)
        if not self.root.is_dir():
            raise ValueError(f"--init-from-hf {self.root}: no such directory")
        self.config = check_hf_config(self.root, record)
        self.names = dict(record.names)
        if self.config.get("tie_word_embeddings", False):
            self.names.update(record.tied_names)
        self.rope_permuted, self.stacked, self.record = record.rope_permuted, record.stacked, record
        self.files = self._weight_map()
        self._open: dict[str, object] = {}

    def _weight_map(self) -> dict[str, Path]:
        index, single = self.root / INDEX_FILE, self.root / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError):
                raise ValueError(f"--init-from-hf {index} is not a safetensors index (JSON with a weight_map); "
                                 "re-download or re-save the model") from None
            files = {name: self.root / rel for name, rel in weight_map.items()}
            for name, path in files.items():
                if path.parent != self.root or not path.is_file():
                    raise ValueError(f"--init-from-hf {index} maps {name} to {path.name}, which is not a file "
                                     f"in {self.root}; re-download the missing shard")
            return files
        if single.is_file():
            with self._safe_open(single) as f:
                return {name: single for name in f.keys()}
        raise ValueError(f"--init-from-hf {self.root}: neither {SINGLE_FILE} nor {INDEX_FILE}; save the model with "
                         "save_pretrained(safe_serialization=True) (titan reads safetensors only)")

    def _safe_open(self, path: Path):
        from safetensors import SafetensorError, safe_open
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"--init-from-hf {path} is not a readable safetensors file ({e}); "
                             "re-download or re-save the model") from None

    def _slice(self, name: str):
        path = self.files.get(name)
        if path is None:
            raise ValueError(f"--init-from-hf {self.root} has no tensor {name}; the checkpoint is incomplete or "
                             "not the artifact's model")
        key = str(path)
        if key not in self._open:
            self._open[key] = self._safe_open(path).__enter__()
        return self._open[key].get_slice(name)

    def holds(self, fqn: str) -> bool:
        """Whether the record names checkpoint tensors for `fqn`."""
        return fqn in self.names or fqn in self.stacked

    def check_shape(self, param: ParamSpec) -> list[str]:
        """The HF names of `param`'s tensors (one, or one per row of a stacked parameter), after
        checking that they hold the parameter's global shape."""
        fqn, shape = param.fqn, list(param.global_shape)
        if not self.holds(fqn):
            raise ValueError(f"--init-from-hf: the artifact's hf_checkpoint record names no tensor for {fqn}; "
                             "rebuild the artifact with titan-build")
        if fqn in self.stacked:
            names, each = self.record.hf_names(fqn, shape[0]), shape[1:]
        else:
            names, each = [self.names[fqn]], shape
        for name in names:
            stored = self._slice(name).get_dtype()
            if stored not in HF_FLOAT_DTYPES:  # an integer or exotic dtype would be cast silently, or fail in torch
                raise ValueError(f"--init-from-hf {self.root}: {name} is stored as {str(stored)[:20]}, not a float "
                                 f"dtype ({', '.join(HF_FLOAT_DTYPES)}); use the checkpoint of the model the artifact "
                                 "was built for")
            found = list(self._slice(name).get_shape())
            if found != each:
                raise ValueError(f"--init-from-hf {self.root}: {name} has shape {found} but the artifact's {fqn} "
                                 f"{'rows are' if fqn in self.stacked else 'is'} {each}; use the checkpoint of the "
                                 "model the artifact was built for")
        return names

    def read_shard(self, param: ParamSpec, *, device: torch.device) -> torch.Tensor:
        """This rank's shard of `param` (artifact rank metadata), read as a box of the HF tensor."""
        names = self.check_shape(param)
        hd = self.rope_permuted.get(param.fqn)
        if hd is not None and param.global_shape[0] % hd:
            raise ValueError(f"--init-from-hf: the artifact permutes rows of {param.fqn} in heads of {hd}, which "
                             f"do not divide its {param.global_shape[0]} rows; rebuild the artifact with titan-build")
        box = shard_box(param.slices, param.global_shape)
        dtype = getattr(torch, param.dtype)
        return pad_shard(self._read_box(names, param.fqn, box).to(device=device, dtype=dtype), box)

    def _read_box(self, names: list[str], fqn: str, box: ShardBox) -> torch.Tensor:
        index = box.global_index()
        if box.empty:
            return torch.empty(box.sizes)
        if fqn in self.stacked:  # one tensor per row: read only the rows in the box
            return torch.stack([self._slice(names[row])[index[1:]] for row in range(index[0].start, index[0].stop)])
        hd = self.rope_permuted.get(fqn)
        if hd is None:
            return self._slice(names[0])[index]
        # Rows of a head are permuted: read the whole heads that the box's rows touch, then pick.
        first, stop = box.offsets[0], box.offsets[0] + box.sizes[0]
        head0, head1 = first // hd, -(-stop // hd)
        block = self._slice(names[0])[(slice(head0 * hd, head1 * hd), *index[1:])]
        rows = torch.arange(first, stop)
        picked = (rows // hd - head0) * hd + titan_rows_from_hf(hd)[rows % hd]
        return block[picked]

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def hf_config_for(description: dict, *, dtype: str) -> dict:
    """config.json for an exported checkpoint: the source model's config when the run started
    from one (--init-from-hf), with the model's values (its hf_checkpoint record) and dtype set."""
    record = hf_record(description, "titan-export")
    cfg = dict(description.get("hf_config") or {})
    rope = {k[len(ROPE_PREFIX):]: v for k, v in record.config.items() if k.startswith(ROPE_PREFIX)}
    cfg.update({k: v for k, v in record.config.items() if not k.startswith(ROPE_PREFIX)})
    if rope:
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = dict(cfg.get("rope_parameters") or {}, **rope)
    cfg.update({
        "architectures": list(record.architectures), "model_type": record.model_type,
        # titan trains the output projection separately from the embedding, unless the model
        # ties them (its record says so, and then holds no output projection).
        "tie_word_embeddings": bool(record.config.get("tie_word_embeddings", False)),
        "torch_dtype": dtype, "dtype": dtype,
    })
    cfg.setdefault("max_position_embeddings", max(8192, description.get("seq_len", 0)))
    if "rope_parameters" in cfg:  # transformers >= 5 keeps rope_theta here
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], rope_theta=cfg.pop("rope_theta"))
    return cfg


def export_hf(out: Path, description: dict, tensors: dict[str, torch.Tensor], *, dtype: str) -> None:
    """Write `tensors` (full titan parameters by fqn) as a Hugging Face model directory at `out`
    (config.json + model.safetensors), put in place by one rename."""
    from safetensors.torch import save_file

    record = hf_record(description, "titan-export")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = {}
    for fqn, t in tensors.items():
        for name, part in zip(record.hf_names(fqn, t.shape[0]), t.unbind(0) if fqn in record.stacked else [t]):
            hf[name] = to_hf_layout(part, record.rope_permuted.get(fqn)).to(torch_dtype).contiguous()
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(hf, str(partial / SINGLE_FILE), metadata={"format": "pt"})
    (partial / CONFIG).write_text(json.dumps(hf_config_for(description, dtype=dtype), indent=2) + "\n")
    partial.rename(out)
