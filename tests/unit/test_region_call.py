"""A region's call checks that its inputs arrive in the layouts its kernels were compiled for
(runtime/kernels/fusion.py: a kernel plan would read another layout wrong, silently)."""

from __future__ import annotations

import pytest
import torch

from titan.runtime.kernels.fusion import _region_call

LAYOUTS = [{"shape": [2, 3, 4], "stride": [12, 4, 1], "dtype": "float32"},
           {"shape": [2, 1, 4], "stride": [4, 4, 1], "dtype": "float32"}]


def _call():
    return _region_call(lambda *args: tuple(a + 1 for a in args), "exact_region", LAYOUTS)


def test_inputs_in_the_compiled_layouts_run():
    a, b = torch.zeros(2, 3, 4), torch.zeros(2, 1, 4)
    out = _call()(a, b)
    assert torch.equal(out[0], torch.ones(2, 3, 4)) and torch.equal(out[1], torch.ones(2, 1, 4))
    # A dimension of size 1 has no stride that matters: any is taken.
    assert torch.equal(_call()(a, torch.zeros(2, 4, 1).transpose(1, 2))[1], torch.ones(2, 1, 4))


@pytest.mark.parametrize("bad, words", [
    (torch.zeros(2, 4, 3).transpose(1, 2), "strides (12, 1, 3)"),
    (torch.zeros(2, 3, 5)[:, :, :4], "strides (15, 5, 1)"),
    (torch.zeros(2, 3, 4, dtype=torch.bfloat16), "torch.bfloat16"),
    (torch.zeros(3, 3, 4), "(3, 3, 4)"),
])
def test_an_input_in_another_layout_is_refused_before_any_kernel_reads_it(bad, words):
    with pytest.raises(RuntimeError, match="input 0 arrives as") as e:
        _call()(bad, torch.zeros(2, 1, 4))
    assert words in str(e.value) and "compiled for (2, 3, 4) torch.float32 strides (12, 4, 1)" in str(e.value)


def test_a_call_site_checks_its_first_call_only():
    # What reaches one call site has one layout at every step: after the first call, no check.
    call = _call()
    call(torch.zeros(2, 3, 4), torch.zeros(2, 1, 4))
    out = call(torch.zeros(2, 4, 3).transpose(1, 2), torch.zeros(2, 1, 4))
    assert torch.equal(out[0], torch.ones(2, 3, 4))
    with pytest.raises(RuntimeError, match="input 0 arrives as"):
        _call()(torch.zeros(2, 4, 3).transpose(1, 2), torch.zeros(2, 1, 4))
