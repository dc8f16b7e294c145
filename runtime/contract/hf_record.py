"""The artifact's Hugging Face record (manifest field `hf_checkpoint`): what --init-from-hf and
titan-export need of a model, written at build time by the model's spec so that the runtime
never imports model code. Typed, with its JSON form and the checks that reading it runs (an
artifact is untrusted input). No torch import: the builder writes it on its cache-hit path."""

from __future__ import annotations

from dataclasses import dataclass, field

RECORD = "hf_checkpoint"
"""The manifest (and checkpoint description) field that holds the record."""
STACK_INDEX = "{i}"
"""Where a stacked parameter's row index goes in its tensor name pattern."""
ROPE_PREFIX = "rope_parameters."
"""`config` keys with this prefix are entries of config.json's rope_parameters (rope_scaling,
as transformers < 5 writes it), e.g. 'rope_parameters.factor' for YaRN."""
ROPE_TYPE = ROPE_PREFIX + "rope_type"
"""The RoPE variant ('default' when a config has none; transformers < 5 spells it 'type')."""


MAX_CONFIG_LIST = 1 << 12
"""The longest list a config value may be (layer numbers)."""


MAX_CONFIG_STR = 256
"""The longest string a config value may be."""


def plain_config_value(v) -> bool:
    """A model config's value, as an artifact may carry it: None, a number, a short string, or a
    bounded list of integers (layer numbers, e.g. Qwen3's mlp_only_layers; a tuple before the
    record is written as JSON)."""
    if isinstance(v, (list, tuple)):
        return len(v) <= MAX_CONFIG_LIST and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    return v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= MAX_CONFIG_STR)


@dataclass(kw_only=True, frozen=True)
class HFRecord:
    model_type: str
    """config.json's model_type (e.g. 'llama'); a checkpoint of another type is refused."""
    architectures: tuple[str, ...]
    """config.json's architectures, for exported checkpoints."""
    config: dict[str, str | int | float | bool | list[int]]
    """config.json values that must match the artifact's model (Hugging Face's defaults fill
    what a checkpoint leaves out); titan-export writes them. A list holds layer numbers (Qwen3
    MoE's mlp_only_layers)."""
    names: dict[str, str]
    """titan parameter (or state buffer a checkpoint holds, e.g. a MoE balancing bias) ->
    Hugging Face tensor name."""
    tied_names: dict[str, str]
    """Replacements of `names` for a checkpoint with tie_word_embeddings."""
    rope_permuted: dict[str, int]
    """Parameter -> head size, for rows stored in rotate-half order within each head (titan's
    RoPE pairs are interleaved)."""
    stacked: dict[str, str] = field(default_factory=dict)
    """Parameter -> the pattern of the tensors stacked on its dim 0, with one STACK_INDEX where
    the index goes: row i of the parameter is that tensor with i in place of the mark (the
    routed experts of a mixture of experts, one tensor per expert in the checkpoint). Such a
    parameter has no entry in `names`."""

    def hf_names(self, fqn: str, rows: int) -> list[str]:
        """The checkpoint tensors that hold parameter `fqn` (of `rows` rows on dim 0)."""
        if fqn in self.stacked:
            return [self.stacked[fqn].replace(STACK_INDEX, str(i)) for i in range(rows)]
        return [self.names[fqn]]

    def to_json(self) -> dict:
        return {"model_type": self.model_type, "architectures": list(self.architectures), "config": self.config,
                "names": self.names, "tied_names": self.tied_names, "rope_permuted": self.rope_permuted,
                "stacked": self.stacked}

    @staticmethod
    def from_json(d, where: str) -> HFRecord:
        def str_map(v) -> bool:
            return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())

        ok = (isinstance(d, dict) and isinstance(d.get("model_type"), str)
              and isinstance(d.get("architectures"), list) and all(isinstance(a, str) for a in d["architectures"])
              and str_map(d.get("names")) and str_map(d.get("tied_names"))
              and isinstance(d.get("config"), dict)
              and all(plain_config_value(v) for v in d["config"].values())
              and isinstance(d.get("rope_permuted"), dict)
              and all(isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= 1 << 16 and v % 2 == 0
                      for v in d["rope_permuted"].values())
              and str_map(d.get("stacked", {}))
              and all(p.count(STACK_INDEX) == 1 for p in d.get("stacked", {}).values())
              and not set(d.get("stacked", {})) & (set(d["names"]) | set(d["rope_permuted"])))
        if not ok:
            raise ValueError(f"{where}: malformed {RECORD} record; rebuild the artifact with titan-build")
        return HFRecord(model_type=d["model_type"], architectures=tuple(d["architectures"]), config=d["config"],
                        names=d["names"], tied_names=d["tied_names"], rope_permuted=d["rope_permuted"],
                        stacked=d.get("stacked", {}))


def required(record: HFRecord | None, where: str) -> HFRecord:
    """`record`, which a Hugging Face checkpoint of the model needs (None: the model has none)."""
    if record is None:
        raise ValueError(f"{where}: this model has no Hugging Face counterpart in titan (or the artifact predates "
                         "it); rebuild the artifact with titan-build")
    return record


def hf_record(source: dict, where: str) -> HFRecord:
    """The record of a checkpoint description, checked."""
    return required(None if source.get(RECORD) is None else HFRecord.from_json(source[RECORD], where), where)
