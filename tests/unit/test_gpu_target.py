"""The GPUs titan-build --kernels --gpu NAME builds for (builder/export/gpu_target.py)."""

from __future__ import annotations

import pytest
import torch

from titan.builder.export.gpu_target import TARGETS, gpu_target, toolchain_problem
from titan.runtime.kernels.fusion import kernel_context


def test_a_target_is_named_by_gpu_model_and_keys_kernels_as_that_gpu_does():
    h100 = gpu_target("H100")
    assert h100 is TARGETS["h100"]
    # fusion.device_tag on that GPU: "<torch.cuda.get_device_name()> sm<major><minor>"
    assert h100.tag == "NVIDIA H100 80GB HBM3 sm90" and h100.capability == 90
    assert kernel_context(h100.tag)["device"] == h100.tag
    assert gpu_target("h200").tag == "NVIDIA H200 sm90"


@pytest.mark.parametrize("name, words", [("sm90", "an architecture alone"), ("a100x", "unknown GPU")])
def test_an_unknown_target_is_refused_with_the_known_ones(name, words):
    with pytest.raises(ValueError) as e:
        gpu_target(name)
    assert words in str(e.value) and "h100, h200" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_a_cpu_build_of_torch_cannot_build_gpu_kernels_and_says_what_to_install():
    problem = toolchain_problem(TARGETS["h100"])
    assert problem is not None and "not a CUDA build" in problem and "pip install torch==" in problem
    assert torch.__version__ in problem and "\n" not in problem
