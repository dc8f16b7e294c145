"""DeepSeek-V3's model spec and expert-parallel dispatch plan, in process: every flavor's
parameters initialized, the layouts it refuses, and the dispatch buffers' sizes (the step on
real ranks: e2e/test_deepseek_v3.py)."""

from __future__ import annotations

import pytest
import torch

from deepseek_debug import CFG
from titan.builder.models.deepseek_v3 import SPEC
from titan.builder.models.deepseek_v3.config import FLAVORS
from titan.builder.models.moe.dispatch import make_plan


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_spec_initializes_every_parameter_of_each_flavor(flavor):
    cfg = FLAVORS[flavor]
    with torch.device("meta"):
        model = SPEC.build(cfg)
    assert set(SPEC.init_specs(cfg)) == {fqn for fqn, _ in model.named_parameters()}
    assert SPEC.config_from_dict(cfg.as_dict()) == cfg
    assert len(model.moe_layers()) == cfg.n_moe_layers


def test_spec_refuses_layouts_it_cannot_build():
    from titan.runtime.contract.layout import Layout

    SPEC.check_layout(CFG, Layout(dp_shard=2, ep=2, tp=2))
    with pytest.raises(ValueError, match=r"--tp 3 does not divide the attention heads \(4\)"):
        SPEC.check_layout(CFG, Layout(tp=3))
    with pytest.raises(ValueError, match=r"--ep 3 does not divide the routed experts \(8\)"):
        SPEC.check_layout(CFG, Layout(ep=3))
    with pytest.raises(ValueError, match=r"--dp-shard 3 does not divide the embedding rows \(512\)"):
        SPEC.check_layout(CFG, Layout(dp_shard=3))


def test_dispatch_plan_sizes():
    """Dropless blocks hold every assignment a rank can send one peer; a capacity factor sizes
    them from the balanced load, never beyond the dropless bound."""
    dropless = make_plan(n_experts=8, ep=2, tokens=32, top_k=3)
    assert (dropless.capacity, dropless.buffer_rows, dropless.dropless) == (32 * 3, 2 * 32 * 3, True)
    # A token reaches at most experts_per_rank distinct experts on one peer.
    assert make_plan(n_experts=8, ep=4, tokens=32, top_k=3).capacity == 32 * 2
    capped = make_plan(n_experts=8, ep=2, tokens=32, top_k=3, capacity_factor=1.25)
    assert (capped.capacity, capped.dropless) == (60, False)
    assert make_plan(n_experts=8, ep=2, tokens=32, top_k=3, capacity_factor=10.0).capacity == 96
    with pytest.raises(ValueError, match="does not divide the 8 routed experts"):
        make_plan(n_experts=8, ep=3, tokens=32, top_k=3)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="capacity factor must be a positive number"):
            make_plan(n_experts=8, ep=2, tokens=32, top_k=3, capacity_factor=bad)
