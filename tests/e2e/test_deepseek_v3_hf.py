"""DeepSeek-V3 Hugging Face checkpoints on expert-parallel ranks (real processes): a tiny
transformers DeepseekV3ForCausalLM saved with save_pretrained, read through the artifact's
hf_checkpoint record exactly as --init-from-hf reads it (runtime/hf_weights.py: one tensor per
expert stacked on the expert dim, the balancing bias included), gives titan's model the same
first-step loss on the same tokens on two expert-parallel ranks (each reads only its own
experts) and through `titan-build --ep 2` + `titan-run --init-from-hf`; titan-export writes it
back. (The record and the loss on one rank, in process: unit/test_deepseek_v3_hf_one_rank.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import hf_round_trip, param_spec, read_metrics, titan
from deepseek_debug import CFG, debug_batch, run_ep_ranks
from hf_deepseek import hf_debug, hf_loss, read_through_record, titan_loss, transformers  # noqa: F401 (a fixture)
from titan.builder.models.deepseek_v3 import SPEC
from titan.builder.models.deepseek_v3.hf_names import BALANCING_BIAS
from titan.runtime.hf_weights import HFCheckpoint

EP2 = ("--model", "deepseek_v3", "--ep", "2")
"""titan-build flags of the debug DeepSeek-V3 artifact with two expert-parallel ranks."""


def test_first_step_loss_matches_transformers_with_two_expert_parallel_ranks(hf_debug, tmp_path):
    """Each expert-parallel rank reads only its own experts (its slice of the expert dim, as the
    artifact's rank metadata cuts it) and the two ranks' loss agrees with transformers' to
    rtol 1e-5 (the expert outputs are summed in another order than on one rank)."""
    path, expected = hf_debug
    full = read_through_record(CFG, path)
    record = SPEC.hf_checkpoint(CFG, list(SPEC.init_specs(CFG)))
    ckpt = HFCheckpoint(path, record=record)
    try:
        for fqn in record.stacked:
            shape = list(full[fqn].shape)
            for rank in range(2):
                part = ckpt.read_shard(param_spec(fqn, shape, [[0, 2, rank]]), device=torch.device("cpu"))
                assert torch.equal(part, full[fqn].chunk(2)[rank])
    finally:
        ckpt.close()
    for out in run_ep_ranks(tmp_path / "ep2", full, debug_batch()):
        torch.testing.assert_close(out["eager.loss"], expected, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_export_round_trip_with_two_expert_parallel_ranks(hf_debug, debug_artifact, tmp_path):
    """Hugging Face -> `titan-run --init-from-hf --steps 0 --checkpoint-dir` on the ep=2 artifact
    (each rank holds half the experts) -> `titan-export`: every tensor of the checkpoint comes
    back bit for bit, one tensor per expert and the balancing bias included, and transformers
    loads the written directory to the same loss."""
    path, expected = hf_debug
    out = hf_round_trip(debug_artifact(extra=EP2), path, tmp_path)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert torch.equal(hf_loss(model.eval(), debug_batch()), expected)


def test_titan_run_from_the_checkpoint_with_two_expert_parallel_ranks(hf_debug, debug_artifact, tmp_path):
    """`titan-run --init-from-hf` on the ep=2 debug artifact (float32): the first step's loss is
    transformers' on the same global batch to rtol 1e-5 (here 6.3179855 vs 6.3179860: 4.8e-7
    apart, float32 summation order), and the same weights with the balancing bias left at zero
    give a loss 5.5e-4 away, 9 times that tolerance (so the bias came from the checkpoint too)."""
    path, _ = hf_debug
    ep2_artifact = debug_artifact(extra=EP2)
    manifest = json.loads((ep2_artifact / "manifest.json").read_text())
    seq_len, n_seq = manifest["seq_len"], manifest["batch_size"] * manifest["layout"]["ep"]
    tokens = torch.randint(0, CFG.vocab_size, (n_seq * seq_len + 1,), generator=torch.Generator().manual_seed(3))
    token_file = tmp_path / "tokens.u16"
    token_file.write_bytes(tokens.numpy().astype(np.uint16).tobytes())
    metrics = tmp_path / "metrics.jsonl"
    r = titan("run", ep2_artifact, "--init-from-hf", path, "--steps", 1, "--data", token_file, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    record = read_metrics(metrics)[0]

    # runtime/data.py: step 0's global batch is windows 0 .. n_seq - 1 of seq_len + 1 tokens.
    windows = torch.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n_seq)])
    batch = {"tokens": windows[:, :-1], "labels": windows[:, 1:]}
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    reference = hf_loss(model, batch).item()
    assert record["loss"] == pytest.approx(reference, rel=1e-5), (record["loss"], reference)
    state = read_through_record(CFG, path)
    unbiased = titan_loss(CFG, {k: torch.zeros_like(v) if k.endswith(BALANCING_BIAS) else v
                                for k, v in state.items()}, batch).item()
    print(f"titan {record['loss']!r} transformers {reference!r} with a zero bias {unbiased!r}")
    assert abs(unbiased - reference) > 5 * 1e-5 * reference
    # Dropless, and the expert load of the step as the metrics report it.
    assert record["dropped_tokens"] == 0
    assert record["expert_load_mean"] == n_seq * seq_len * CFG.top_k / CFG.n_routed_experts
