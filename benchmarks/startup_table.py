"""Issue 30's start-up table: how long until a first training step, from the launch of one
process, for titan and for an independent plain Llama (plain_llama.py), on one GPU.

    python benchmarks/startup_table.py --kernels-artifact A --artifact B [--flavor 1B]
        [--seq-len 2048] [--steps 6] [--repeat 1] [--json out.json] [--logs DIR] [--device cuda]

A is built with `titan-build --kernels` and B without, both with this flavor, sequence length
and batch 1 (the build is not part of a row). Each row is one process launched alone, on
compiler caches of its own, in this order (with --repeat, the whole order again):

  plain-eager         plain_llama.py, no compile
  plain-compile-cold  per-block torch.compile, inductor's and Triton's caches in a new empty directory
  plain-compile-warm  the same on the caches the cold row left (a second job on the same host)
  titan-kernels       titan-run A on an empty TITAN_CACHE_DIR (a fresh host: no kernel store,
                      no compiler caches; the kernels come from the artifact)
  titan-fresh         titan-run B on an empty TITAN_CACHE_DIR: the default flow's first run on a
                      fresh host (its kernels compiled by workers while its first steps run on
                      eager's kernels; the note says when they came in or were stored)
  titan-store         titan-run B again on that cache (the second job: kernels from the store)

first step: launch to the end of the first optimizer step (titan-run's metrics `time`, the plain
model's own record); process: launch to exit; tok/s: median step of steps 3..N; noise: lines of
the row's output that match warn, traceback or deprecat (a first run should print none); note:
where the row's start went, as the row itself tells it.
The targets (issue 30): titan-kernels / plain-compile-warm <= 0.25 and titan-fresh /
plain-compile-cold <= 0.5, first step to first step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import failure_reason  # noqa: E402

ROWS = ("plain-eager", "plain-compile-cold", "plain-compile-warm", "titan-kernels", "titan-fresh", "titan-store")
TARGETS = (("titan-kernels", "plain-compile-warm", 0.25), ("titan-fresh", "plain-compile-cold", 0.5))
NOISE = re.compile(r"warn|traceback|deprecat", re.IGNORECASE)


def titan_run() -> list[str]:
    """What a user types: the titan-run console script (else the same module under python)."""
    exe = shutil.which("titan-run")
    return [exe] if exe else [sys.executable, "-m", "titan.cli.run"]


_running: subprocess.Popen | None = None
"""The row's process now running: its whole group is stopped with this script (see main)."""


def stop_running_row(*_) -> None:
    if _running is not None and _running.poll() is None:
        os.killpg(_running.pid, signal.SIGKILL)  # titan-run's rank processes with it
    sys.exit(1)


def run_row(cmd: list[str], env: dict, log: Path, timeout: float) -> dict:
    """One process (and what it starts) in a group of its own: launch time, wall time, output; a
    failure says why."""
    global _running
    env = dict(env, PYTHONUNBUFFERED="1")
    t0 = time.time()
    env["BENCH_T0"] = str(t0)
    with log.open("w") as f:
        _running = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = _running.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(_running.pid, signal.SIGKILL)
            _running.wait()
            return {"failed": f"timed out after {timeout:.0f} s", "t0": t0}
    out = {"t0": t0, "process_s": time.time() - t0}
    text = log.read_text(errors="replace")
    out["noise"] = sum(1 for line in text.splitlines() if NOISE.search(line))
    if code:
        out["failed"] = f"exit {code}: {failure_reason(log)}"
    return out


def plain_row(name: str, a, cache: Path, logs: Path) -> dict:
    record = logs / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).parent / "plain_llama.py"), "--flavor", a.flavor,
           "--seq-len", str(a.seq_len), "--batch-size", "1", "--steps", str(a.steps), "--json", str(record),
           "--compile", "none" if name == "plain-eager" else "blocks", "--inductor-cache", str(cache),
           "--device", a.device]
    r = run_row(cmd, dict(os.environ), logs / f"{name}.log", a.timeout)
    if "failed" not in r:
        rec = json.loads(record.read_text())
        r.update(first_step_s=rec["first_step_s"], step_times=rec["step_times"],
                 note=f"torch import {rec['import_s']:.1f} s, model + AdamW {rec['setup_s']:.1f} s, "
                      f"step 1 {rec['step_times'][0]:.1f} s")
    return r


def titan_note(log: str) -> str:
    """titan-run's own account of its start (the phases of its closing line) and its kernels."""
    phases = re.search(r"to the end of the first step \((.*?)\);", log)
    fusion = re.search(r"fusion: (\d+) regions.*?: (\d+) compiled, (\d+) loaded from the kernel store, "
                       r"(\d+) from the artifact.*? in ([\d.]+) s", log)
    kernels = (f"; kernels: {fusion[2]} compiled, {fusion[3]} from the store, {fusion[4]} from the artifact "
               f"({fusion[5]} s)") if fusion else ""
    # Kernels compiled in the background (runtime/kernels/background.py): when they came in.
    came_in = re.search(r"in use from step (\d+), ([\d.]+) s after the start", log)
    stored = re.search(r"kernels: (\d+) compiled into the kernel store by .*?, ([\d.]+) s after the start", log)
    if came_in:
        kernels += f", in use from step {came_in[1]} at {came_in[2]} s"
    elif stored:
        kernels += f"; {stored[1]} compiled in the background, stored at {stored[2]} s (after the last step)"
    return (phases[1] if phases else "") + kernels


def titan_row(name: str, artifact: str, a, cache: Path, logs: Path) -> dict:
    metrics = logs / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, TITAN_CACHE_DIR=str(cache))
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # titan points them into TITAN_CACHE_DIR
        env.pop(var, None)
    cmd = [*titan_run(), artifact, "--steps", str(a.steps), "--device", a.device, "--metrics", str(metrics)]
    log = logs / f"{name}.log"
    r = run_row(cmd, env, log, a.timeout)
    if "failed" not in r:
        recs = [x for x in map(json.loads, metrics.read_text().splitlines()) if "step" in x]
        r.update(first_step_s=recs[0]["time"] - r["t0"], step_times=[x["step_time_s"] for x in recs])
        r["note"] = titan_note(log.read_text(errors="replace"))
    return r


def one_round(a, index: int, logs: Path, scratch: Path) -> dict:
    """Every row once, in ROWS order, each on the caches its name says (paths not yet made, as
    on a host that never ran it)."""
    caches = {"plain-eager": scratch / f"eager-{index}", "plain-compile-cold": scratch / f"plain-{index}",
              "plain-compile-warm": scratch / f"plain-{index}", "titan-kernels": scratch / f"titan-kernels-{index}",
              "titan-fresh": scratch / f"titan-{index}", "titan-store": scratch / f"titan-{index}"}
    out = {}
    for name in ROWS:
        if name.startswith("plain"):
            out[name] = plain_row(name, a, caches[name], logs)
        else:
            artifact = a.kernels_artifact if name == "titan-kernels" else a.artifact
            out[name] = titan_row(name, artifact, a, caches[name], logs)
        r = out[name]
        print(f"{name}: " + (f"FAILED ({r['failed']})" if "failed" in r else
                             f"first step {r['first_step_s']:.1f} s, process {r['process_s']:.1f} s"), flush=True)
    return out


def summarize(rounds: list[dict], seq_len: int) -> dict:
    """Per row: the median over rounds of first step, process and steady tokens/s; the range."""
    rows = {}
    for name in ROWS:
        ok = [r[name] for r in rounds if "failed" not in r[name]]
        if not ok:
            rows[name] = {"failed": rounds[-1][name]["failed"]}
            continue
        steady = [seq_len / statistics.median(r["step_times"][2:] or r["step_times"][-1:]) for r in ok]
        rows[name] = {k: statistics.median(v) for k, v in (
            ("first_step_s", [r["first_step_s"] for r in ok]), ("process_s", [r["process_s"] for r in ok]),
            ("tokens_per_s", steady))}
        rows[name].update(first_step_range=[min(r["first_step_s"] for r in ok), max(r["first_step_s"] for r in ok)],
                          noise=max(r["noise"] for r in ok), note=ok[0].get("note", ""), runs=len(ok))
    return rows


def print_table(rows: dict, *, flavor: str, seq_len: int, steps: int, repeat: int) -> None:
    print(f"== start-up: {flavor} seq {seq_len} batch 1, {steps} steps, one process per row, {repeat} round(s), median")
    print(f"{'row':20s}{'1st step s':>11s}{'process s':>10s}{'tok/s':>9s}{'noise':>6s}  note")
    for name, r in rows.items():
        if "failed" in r:
            print(f"{name:20s}  FAILED: {r['failed'][:200]}")
            continue
        span = "" if r["runs"] < 2 else f" [{r['first_step_range'][0]:.1f}-{r['first_step_range'][1]:.1f}]"
        print(f"{name:20s}{r['first_step_s']:11.1f}{r['process_s']:10.1f}{r['tokens_per_s']:9,.0f}{r['noise']:6d}  "
              f"{r['note'][:150]}{span}")
    for titan, plain, target in TARGETS:
        if "failed" in rows[titan] or "failed" in rows[plain]:
            print(f"target {titan} / {plain} <= {target}: not measured (a row failed)")
            continue
        first = rows[titan]["first_step_s"] / rows[plain]["first_step_s"]
        whole = rows[titan]["process_s"] / rows[plain]["process_s"]
        print(f"target {titan} / {plain} <= {target}: first step {first:.2f} "
              f"({'met' if first <= target else 'NOT met'}), process {whole:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels-artifact", required=True, help="built with titan-build --kernels")
    p.add_argument("--artifact", required=True, help="the same build without --kernels")
    p.add_argument("--flavor", default="1B")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (the figures mean nothing)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds one row may run")
    p.add_argument("--json", default=None)
    p.add_argument("--logs", default=None, help="each row's output and record (default: a temporary directory)")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, stop_running_row)  # `timeout` stops this script: the row's group too
    logs = Path(a.logs or tempfile.mkdtemp(prefix="startup-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="startup-caches-") as scratch:
        rounds = [one_round(a, i, logs, Path(scratch)) for i in range(a.repeat)]
    rows = summarize(rounds, a.seq_len)
    if a.json:
        Path(a.json).write_text(json.dumps({"flavor": a.flavor, "seq_len": a.seq_len, "steps": a.steps,
                                            "rows": rows, "rounds": rounds}, indent=1))
    print_table(rows, flavor=a.flavor, seq_len=a.seq_len, steps=a.steps, repeat=a.repeat)


if __name__ == "__main__":
    main()
