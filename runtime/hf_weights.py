"""Hugging Face Llama checkpoints: read this rank's shards straight from safetensors, and the
name / layout mapping that titan-export uses to write them back.

Only JSON (config.json, model.safetensors.index.json) and safetensors headers and slices are
read: no pickle. Each parameter's shard is a box of the global tensor (runtime/init.py
`shard_box`), read with `safe_open(...).get_slice`, so a rank reads only what it holds.

Hugging Face stores q_proj / k_proj rows permuted for its rotate-half RoPE: within each head,
HF row j * (head_dim / 2) + i holds what titan's interleaved-pair layout keeps in row 2 i + j.
Loading undoes that permutation, exporting redoes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from titan.runtime.init import shard_box

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FFN_PARAM = "layers.0.feed_forward.w1.weight"
"""Its global shape gives the SwiGLU width (the runtime does not import the model config code)."""


def hf_name(fqn: str, *, tied: bool = False) -> str:
    """The Hugging Face tensor that holds titan parameter `fqn`."""
    if fqn == "tok_embeddings.weight" or (fqn == "output.weight" and tied):
        return "model.embed_tokens.weight"
    if fqn == "output.weight":
        return "lm_head.weight"
    if fqn == "norm.weight":
        return "model.norm.weight"
    parts = fqn.split(".")
    assert parts[0] == "layers" and len(parts) >= 4, fqn
    block, rest = parts[1], ".".join(parts[2:])
    return f"model.layers.{block}.{_BLOCK_NAMES[rest]}"


_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def rope_permuted(fqn: str) -> bool:
    """q and k rows are stored in HF's rotate-half order."""
    return fqn.endswith(("attention.wq.weight", "attention.wk.weight"))


def titan_rows_from_hf(head_dim: int) -> torch.Tensor:
    """Index i: the HF row (within a head) that holds titan row i."""
    return torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)


def hf_rows_from_titan(head_dim: int) -> torch.Tensor:
    """Index r: the titan row (within a head) that holds HF row r."""
    return torch.argsort(titan_rows_from_hf(head_dim))


def to_hf_layout(fqn: str, full: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A full titan parameter in HF's row order (export)."""
    if not rope_permuted(fqn):
        return full
    rows = full.unflatten(0, (-1, head_dim))[:, hf_rows_from_titan(head_dim)]
    return rows.flatten(0, 1).contiguous()


def check_hf_config(hf_dir: Path, model_config: dict, ffn_hidden: int) -> dict:
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
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} is not 'llama'; titan's llama3 model "
                         "loads Llama checkpoints only")
    # transformers < 5 writes rope_theta and rope_scaling; >= 5 writes rope_parameters (theta and type).
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: rope_scaling / rope_parameters is not a JSON object; re-download or re-save "
                         "the model")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in (None, "default"):
        raise ValueError(f"{where}: RoPE scaling {rope_type!r} is not implemented by titan's llama3 model (plain "
                         "RoPE only); use a checkpoint without rope_scaling (e.g. Llama 3 8B, not 3.1)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ValueError(f"{where}: {flag} is true but titan's llama3 model has no biases; use a Llama "
                             "checkpoint without them")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg.get('hidden_act')!r}; titan's llama3 model uses silu")
    expected = {
        "hidden_size": model_config["dim"],
        "num_hidden_layers": model_config["n_layers"],
        "num_attention_heads": model_config["n_heads"],
        "num_key_value_heads": model_config["n_kv_heads"],
        "vocab_size": model_config["vocab_size"],
        "intermediate_size": ffn_hidden,
        "rms_norm_eps": model_config["norm_eps"],
        "rope_theta": model_config["rope_theta"],
        "head_dim": model_config["dim"] // model_config["n_heads"],
    }
    # Hugging Face's defaults for fields a config may leave out (or null).
    given = {k: v for k, v in cfg.items() if v is not None}
    given.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
    given.setdefault("head_dim", expected["head_dim"])
    if "rope_theta" not in given and "rope_theta" in rope:
        given["rope_theta"] = rope["rope_theta"]
    wrong = []
    for key, want in expected.items():
        if key not in given:
            raise ValueError(f"{where} lacks {key!r}; it is not a complete Llama config")
        if given[key] != want:
            wrong.append(f"{key} {given[key]!r} (artifact: {want!r})")
    if wrong:
        raise ValueError(f"{where} does not describe this artifact's model: {', '.join(wrong)}; build an artifact "
                         "for this model (titan-build --flavor ...) or use the matching checkpoint")
    return cfg


class HFCheckpoint:
    """A Hugging Face model directory, opened for slice reads."""

    def __init__(self, hf_dir: str | Path, *, model_config: dict, ffn_hidden: int):
        self.root = Path(hf_dir)
        if not self.root.is_dir():
            raise ValueError(f"--init-from-hf {self.root}: no such directory")
        self.config = check_hf_config(self.root, model_config, ffn_hidden)
        self.tied = bool(self.config.get("tie_word_embeddings", False))
        self.head_dim = model_config["dim"] // model_config["n_heads"]
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
                             "not a Llama model")
        key = str(path)
        if key not in self._open:
            self._open[key] = self._safe_open(path).__enter__()
        return self._open[key].get_slice(name)

    def check_shape(self, param: dict) -> str:
        """The HF name of `param`, after checking that its tensor has the parameter's global shape."""
        name = hf_name(param["fqn"], tied=self.tied)
        shape = list(self._slice(name).get_shape())
        if shape != list(param["global_shape"]):
            raise ValueError(f"--init-from-hf {self.root}: {name} has shape {shape} but the artifact's "
                             f"{param['fqn']} is {param['global_shape']}; use the checkpoint of the model the "
                             "artifact was built for")
        return name

    def read_shard(self, param: dict, *, device: torch.device) -> torch.Tensor:
        """This rank's shard of `param` (artifact rank metadata), read as a box of the HF tensor."""
        name = self.check_shape(param)
        offsets, sizes = shard_box(param["slices"], param["global_shape"])
        box = [slice(o, o + s) for o, s in zip(offsets, sizes)]
        dtype = getattr(torch, param.get("dtype", "float32"))
        if not rope_permuted(param["fqn"]):
            return self._slice(name)[tuple(box)].to(device=device, dtype=dtype).contiguous()
        # Rows of a head are permuted: read the whole heads that the box's rows touch, then pick.
        hd = self.head_dim
        first, stop = offsets[0], offsets[0] + sizes[0]
        head0, head1 = first // hd, -(-stop // hd)
        block = self._slice(name)[(slice(head0 * hd, head1 * hd), *box[1:])]
        rows = torch.arange(first, stop)
        picked = (rows // hd - head0) * hd + titan_rows_from_hf(hd)[rows % hd]
        return block[picked].to(device=device, dtype=dtype).contiguous()

    def close(self) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def hf_config_for(description: dict, *, dtype: str) -> dict:
    """config.json for an exported checkpoint: the source model's config when the run started
    from one (--init-from-hf), with the shapes and dtype set from the checkpoint."""
    mc = description["model_config"]
    shapes = description["params"]
    cfg = dict(description.get("hf_config") or {})
    cfg.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": mc["dim"], "num_hidden_layers": mc["n_layers"], "num_attention_heads": mc["n_heads"],
        "num_key_value_heads": mc["n_kv_heads"], "head_dim": mc["dim"] // mc["n_heads"],
        "vocab_size": mc["vocab_size"], "intermediate_size": shapes[FFN_PARAM][0],
        "rms_norm_eps": mc["norm_eps"], "attention_bias": False, "mlp_bias": False,
        # titan trains the output projection separately from the embedding.
        "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype,
    })
    cfg.setdefault("max_position_embeddings", max(8192, description.get("seq_len", 0)))
    if "rope_parameters" in cfg:  # transformers >= 5 keeps rope_theta here
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], rope_theta=mc["rope_theta"])
    else:
        cfg["rope_theta"] = mc["rope_theta"]
    return cfg


def export_hf(out: Path, description: dict, tensors: dict[str, torch.Tensor], *, dtype: str) -> None:
    """Write `tensors` (full titan parameters by fqn) as a Hugging Face Llama directory at `out`
    (config.json + model.safetensors), put in place by one rename."""
    from safetensors.torch import save_file

    head_dim = description["model_config"]["dim"] // description["model_config"]["n_heads"]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = {hf_name(fqn): to_hf_layout(fqn, t, head_dim).to(torch_dtype).contiguous() for fqn, t in tensors.items()}
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(hf, str(partial / SINGLE_FILE), metadata={"format": "pt"})
    (partial / CONFIG).write_text(json.dumps(hf_config_for(description, dtype=dtype), indent=2) + "\n")
    partial.rename(out)
