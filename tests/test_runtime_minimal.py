"""The runtime stays minimal: training from an artifact imports neither builder/model code nor
torch._dynamo / torch._inductor, also when it writes TensorBoard scalars."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from titan.runtime.train import RunConfig, rank_main
code = rank_main(sys.argv[1], RunConfig(steps=2, quiet=True, tensorboard=sys.argv[2] or None))
bad = sorted(m for m in sys.modules if m.startswith(("titan.builder", "torch._dynamo", "torch._inductor")))
print("BAD", bad)
print("TENSORBOARD", "torch.utils.tensorboard" in sys.modules)
sys.exit(code)
"""


@pytest.mark.parametrize("tensorboard", [False, True], ids=["plain", "tensorboard"])
def test_training_imports_no_builder_or_compiler(debug_artifact, tmp_path, tensorboard):
    if tensorboard:
        pytest.importorskip("tensorboard")
    art = debug_artifact()
    r = subprocess.run([sys.executable, "-c", PROBE, str(art), str(tmp_path / "tb") if tensorboard else ""],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "BAD []" in r.stdout, r.stdout
    assert f"TENSORBOARD {tensorboard}" in r.stdout
