"""The bounded MoE dispatch's step as CUDA graphs run it (runtime/captured_redo.py: bounded
forward, then the bounded backward or the dropless step), on the CPU: tests/redo_steps.py drives
CapturedRedoStep with EagerReplays in place of the graphs (each replay rewrites the first run's
tensors, as a graph rewrites its static outputs) against GraphProgram.step, the eager redo, on
DeepSeek-V3 debug built with --moe-capacity on one rank. Every micro-batch's loss, gradients and
buffers and every step's parameters are bitwise equal, with both branches taken in one run and
with gradient accumulation. The CUDA graphs themselves: gpu/test_captured_redo_cuda.py."""

from __future__ import annotations

import pytest
import torch

from conftest import titan
from redo_steps import compare_captured_redo

# Each build traces the bounded program (and once per session the dropless one): 1-2 minutes on
# the loaded 2-core machine.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """factor -> a debug artifact (one rank) built with --moe-capacity factor. On one rank every
    assignment goes to the one peer: below 1 each micro-batch overflows, at 1 none can."""
    built = {}

    def build(factor: float):
        if factor not in built:
            out = tmp_path_factory.mktemp("bounded") / f"cap-{factor}"
            r = titan("build", "--model", "deepseek_v3", "--flavor", "debug", "--moe-capacity", factor, "--out", out)
            assert r.returncode == 0, r.stdout + r.stderr
            built[factor] = out
        return built[factor]
    return build


@pytest.fixture(autouse=True)
def one_thread():
    """Two programs of the debug model in this process: one thread each op (20x faster than two
    on the shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_both_branches_in_one_run_equal_the_eager_redo(bounded, micro_batches):
    # Micro-batches 2, 3 and 5 (of 1 eager warm-up + 7) go to the dropless branch: forced, since
    # none overflows at capacity 1, and a redo of one that did not overflow changes no bit.
    force = {2, 3, 5}
    taken = compare_captured_redo(bounded(1.0), device=torch.device("cpu"), steps=8 // micro_batches,
                                  micro_batches=micro_batches, force=force)
    assert [i for i, redo in enumerate(taken) if redo] == sorted(force)


def test_every_micro_batch_overflowing_equals_the_eager_redo(bounded):
    taken = compare_captured_redo(bounded(0.5), device=torch.device("cpu"), steps=3)
    assert taken == [True] * 3
