"""The benchmark's independent plain Llama (benchmarks/plain_llama.py) trains on its own, without
any of titan's code: the anchor of issue 30's start-up and steady-state targets must not share
titan's model or runtime. The GPU timings: benchmarks/gpu/gpu_issue30.sh."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plain_llama.py"

# Runs the script as __main__ and then lists what it imported of titan.
RUN_AND_LIST_TITAN = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
print("titan modules:", sorted(m for m in sys.modules if m == "titan" or m.startswith("titan.")))
"""


def test_plain_llama_trains_on_cpu_and_imports_nothing_of_titan(tmp_path):
    record = tmp_path / "record.json"
    out = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST_TITAN, str(SCRIPT), "--flavor", "debug", "--seq-len", "16",
         "--batch-size", "2", "--steps", "3", "--device", "cpu", "--max-norm", "1.0", "--json", str(record)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "titan modules: []" in out.stdout, out.stdout
    assert "plain-eager: debug seq 16 batch 2 on cpu" in out.stdout
    rec = json.loads(record.read_text())
    assert len(rec["step_times"]) == len(rec["losses"]) == 3
    # Uniform random tokens over a 2,048-word vocabulary: the loss starts near ln(2048).
    assert all(abs(loss - math.log(2048)) < 0.5 for loss in rec["losses"]), rec["losses"]
    assert 0 < rec["first_step_s"] < 600
