"""Qwen3, dense (the debug flavor: tied embeddings) and with a mixture of experts (debug-moe: a
dense first block, then routed experts), as a user runs them: titan-build + titan-verify bitwise
equal to eager on every rank of the layouts that matter for each (tied weights under tp x
FSDP; expert parallel alone, with FSDP, and the experts under tensor parallel); the first-step
loss of transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on the same weights, read through
the artifact's hf_checkpoint record; and a Hugging Face checkpoint through titan-run
--init-from-hf and titan-export back bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import hf_round_trip, param_spec, read_metrics, titan
from titan.builder.models.moe.expert_parallel import set_dispatch
from titan.builder.models.qwen3 import SPEC
from titan.builder.models.qwen3.hf_names import hf_config_kwargs
from titan.builder.models.qwen3.model import Qwen3
from titan.runtime.hf_weights import HFCheckpoint

transformers = pytest.importorskip("transformers")
BATCH, SEQ = 2, 64  # per data-parallel rank
STEPS = 4
LAYOUTS = {
    "dense-tp2-dp_shard2": ("debug", {"tp": 2, "dp_shard": 2}),
    "moe-ep2": ("debug-moe", {"ep": 2}),
    "moe-tp2": ("debug-moe", {"tp": 2}),
    "moe-dp_shard2-ep2": ("debug-moe", {"dp_shard": 2, "ep": 2}),
}
HF_CLASSES = {"debug": ("Qwen3Config", "Qwen3ForCausalLM"), "debug-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
# fp32 throughout; transformers and titan differ in summation order only (rotate-half against
# interleaved RoPE, eager against flash attention, experts summed by expert against by token):
# measured below 1e-6 relative here. 1e-5 is ~85 fp32 ulps at these losses, far below what a
# mapping error costs (each test checks that a wrong permutation would fail it).
RTOL = 1e-5


@pytest.fixture(scope="module")
def qwen3_artifact(tmp_path_factory):
    """qwen3_artifact(name) -> the built artifact of LAYOUTS[name] (built once)."""
    root = tmp_path_factory.mktemp("qwen3")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            flavor, layout = LAYOUTS[name]
            flags = [x for dim, size in layout.items() for x in (f"--{dim.replace('_', '-')}", size)]
            out = root / name
            r = titan("build", "--model", "qwen3", "--flavor", flavor, "--batch-size", BATCH, "--seq-len", SEQ,
                      *flags, "--out", out)
            assert r.returncode == 0, r.stdout + r.stderr
            built[name] = out
        return built[name]

    return get


# One dense and one MoE layout in the default tier; the others join the long one (CI time).
@pytest.mark.parametrize("name", [n if n in ("dense-tp2-dp_shard2", "moe-ep2") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_titan_verify_is_bitwise_equal_to_eager_on_every_rank(name, qwen3_artifact, tmp_path):
    flavor, layout = LAYOUTS[name]
    cfg = SPEC.flavors[flavor]
    out = tmp_path / "verify.json"
    r = titan("verify", qwen3_artifact(name), "--steps", STEPS, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    # A tied model trains one embedding: no output.weight of its own.
    n_params = len(SPEC.init_specs(cfg))
    assert (f"parameters after step {STEPS}: all bitwise equal ({n_params} tensors per rank, "
            f"{math.prod(layout.values())} ranks)") in r.stdout
    result = json.loads(out.read_text())
    assert result["parameters_differing"] == 0 and result["eager"] == result["artifact"]
    assert len(result["artifact"]) == STEPS


def _save_hf_model(flavor: str, path: Path) -> torch.nn.Module:
    """A transformers model of the flavor's shapes with every weight drawn, norms included (the
    router starts at zero and the norms at one in transformers, which would hide a wrong expert
    order or q/k norm permutation), saved with save_pretrained; returns it (eager attention)."""
    config_cls, model_cls = HF_CLASSES[flavor]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, config_cls)(**hf_config_kwargs(SPEC.flavors[flavor]))
    hf_cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def _batch(seed: int = 1) -> dict:
    seq = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(seed))
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:]}


def _hf_loss(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())


def _read_through_record(flavor: str, path: Path) -> dict[str, torch.Tensor]:
    """Every parameter read from `path` as --init-from-hf reads it (whole tensors)."""
    cfg = SPEC.flavors[flavor]
    with torch.device("meta"):
        params = [param_spec(fqn, list(p.shape), []) for fqn, p in Qwen3(cfg).named_parameters()]
    ckpt = HFCheckpoint(path, record=SPEC.hf_checkpoint(cfg, list(SPEC.init_specs(cfg))))
    try:
        return {p.fqn: ckpt.read_shard(p, device=torch.device("cpu")) for p in params}
    finally:
        ckpt.close()


def _titan_loss(flavor: str, state: dict, batch: dict) -> torch.Tensor:
    cfg = SPEC.flavors[flavor]
    model = Qwen3(cfg)
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(k == "output.weight" or k.endswith(("tokens_per_expert", "dropped_tokens")) for k in missing), missing
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    model.loss_scale = float(batch["tokens"].numel())
    if cfg.moe:
        set_dispatch(model, tokens=batch["tokens"].numel())
    with torch.no_grad():
        return model(batch["tokens"], batch["labels"])


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """flavor -> (checkpoint directory, transformers' loss on _batch())."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for flavor in HF_CLASSES:
        model = _save_hf_model(flavor, root / flavor)
        out[flavor] = root / flavor, _hf_loss(model, _batch())
    return out


@pytest.mark.parametrize("flavor", list(HF_CLASSES))
def test_first_step_loss_matches_transformers(flavor, hf_checkpoints):
    """Same weights (read from the saved checkpoint through the record), same tokens: equal to
    RTOL; with the q/k norm weights left in transformers' rotate-half order the loss moves far
    beyond it (so the record's permutation of them is needed and right)."""
    path, expected = hf_checkpoints[flavor]
    state = _read_through_record(flavor, path)
    loss = _titan_loss(flavor, state, _batch())
    print(f"{flavor}: titan {loss.item()!r} transformers {expected.item()!r}")
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0)
    hd = SPEC.flavors[flavor].head_dim
    hf_order = torch.arange(hd).view(2, hd // 2).t().reshape(-1)
    unpermuted = {k: v[hf_order] if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in state.items()}
    wrong = _titan_loss(flavor, unpermuted, _batch())
    assert abs(wrong - expected) > 100 * RTOL * expected, (wrong, expected)


def test_checkpoint_holds_what_the_record_names(hf_checkpoints):
    """The tied checkpoint holds no lm_head; the MoE checkpoint one tensor per expert; the
    record accounts for every tensor of both."""
    from safetensors import safe_open

    for flavor, (path, _) in hf_checkpoints.items():
        cfg = SPEC.flavors[flavor]
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            on_disk = set(f.keys())
        record = SPEC.hf_checkpoint(cfg, list(SPEC.init_specs(cfg)))
        named = set(record.names.values())
        for fqn in record.stacked:
            named |= set(record.hf_names(fqn, cfg.n_experts))
        assert named == on_disk
        assert ("lm_head.weight" in on_disk) == (not cfg.tie_embeddings)


@pytest.mark.parametrize("name", [pytest.param("dense-tp2-dp_shard2", marks=pytest.mark.slow), "moe-ep2"])
def test_hf_round_trip_is_bit_exact_and_the_first_step_matches(name, hf_checkpoints, qwen3_artifact, tmp_path):
    """transformers checkpoint -> `titan-run --init-from-hf --steps 0 --checkpoint-dir` (every rank
    reads its shard: tp x FSDP boxes of the tied embedding, or its half of the experts) ->
    `titan-export`: every tensor back bit for bit, a tied checkpoint written tied, and
    transformers loads it to the same loss. Then one step from the checkpoint on a token file:
    titan-run's first loss is transformers' on the same global batch to RTOL."""
    flavor, layout = LAYOUTS[name]
    path, expected = hf_checkpoints[flavor]
    art = qwen3_artifact(name)
    out = hf_round_trip(art, path, tmp_path)
    config_cls, model_cls = HF_CLASSES[flavor]
    exported = getattr(transformers, model_cls).from_pretrained(out, attn_implementation="eager").eval()
    assert exported.config.tie_word_embeddings == SPEC.flavors[flavor].tie_embeddings
    assert torch.equal(_hf_loss(exported, _batch()), expected)

    dp = layout.get("dp_shard", 1) * layout.get("ep", 1)
    tokens = torch.randint(0, 512, (dp * BATCH * SEQ + 1,), generator=torch.Generator().manual_seed(3))
    token_file = tmp_path / "tokens.u16"
    token_file.write_bytes(tokens.numpy().astype(np.uint16).tobytes())
    metrics = tmp_path / "metrics.jsonl"
    r = titan("run", art, "--init-from-hf", path, "--steps", 1, "--data", token_file, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    # runtime/data.py: step 0's global batch is windows 0 .. dp * batch - 1 of SEQ + 1 tokens.
    windows = torch.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(dp * BATCH)])
    reference = _hf_loss(exported, {"tokens": windows[:, :-1], "labels": windows[:, 1:]}).item()
    loss = read_metrics(metrics)[0]["loss"]
    print(f"{name}: titan-run {loss!r} transformers {reference!r}")
    assert loss == pytest.approx(reference, rel=RTOL)


@pytest.mark.parametrize("flags,reason", [
    (("--flavor", "debug", "--ep", "2"),
     "error: --ep 2: this qwen3 flavor is dense (no routed experts to split); drop --ep or pick a "
     "mixture-of-experts flavor (debug-moe, 30B-A3B, 235B-A22B)"),
    (("--flavor", "debug-moe", "--ep", "3"),
     "error: --ep 3 does not divide the routed experts (8); pick a --ep that divides it"),
    (("--flavor", "debug", "--tp", "3"),
     "error: --tp 3 does not divide the attention heads (4); pick a --tp that divides it"),
], ids=["dense-ep2", "moe-ep3", "tp3"])
def test_layouts_that_do_not_fit_get_the_reason(flags, reason, tmp_path):
    r = titan("build", "--model", "qwen3", *flags, "--out", tmp_path / "art")
    assert r.returncode == 2
    assert r.stderr.strip() == reason


def test_a_tied_embedding_stays_one_parameter_that_gets_both_gradients():
    """builder/trace/parallelize.py keeps a shared parameter one (one shard, both modules read it
    through their own accessor): the parallelized model lists no output.weight, and its one
    embedding's gradient is exactly plain PyTorch's for the tied module (the sum of the
    embedding's and the output projection's)."""
    import copy

    from titan.builder.trace.parallelize import parallelize, tied_parameters
    from titan.runtime.contract.layout import Layout

    cfg = SPEC.flavors["debug"]
    torch.manual_seed(0)
    plain = Qwen3(cfg)
    plain.loss_scale = 64.0
    assert tied_parameters(plain) == {"output.weight": "tok_embeddings.weight"}
    titan_model = copy.deepcopy(plain)
    shards = parallelize(titan_model, Layout(), None, {}, tp_plan=SPEC.tp_plan)
    assert "output.weight" not in {s.fqn for s in shards} | {n for n, _ in titan_model.named_parameters()}
    batch = _batch()
    for model in (plain, titan_model):
        model(batch["tokens"], batch["labels"]).backward()
    grads = dict(titan_model.named_parameters())
    for fqn, p in plain.named_parameters():
        assert torch.equal(grads[fqn].grad, p.grad), fqn
    untied = copy.deepcopy(plain)
    untied.output.weight = torch.nn.Parameter(plain.output.weight.detach().clone())
    untied.zero_grad()
    untied(batch["tokens"], batch["labels"]).backward()
    assert not torch.equal(untied.tok_embeddings.weight.grad, plain.tok_embeddings.weight.grad)
