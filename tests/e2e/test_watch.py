"""A run a person can watch: plain step lines or a progress bar (terminal), per-rank build
progress, TensorBoard scalars equal to the metrics file, and titan-report."""

from __future__ import annotations

import os
import pty
import re
import statistics
import struct
import subprocess
import sys

import pytest

from conftest import read_metrics, titan


def on_terminal(command: str, *args, timeout: float = 300) -> tuple[int, str]:
    """Run a titan command with stdout and stderr on a pseudo-terminal; returns (code, output)."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", f"titan.cli.{command}", *map(str, args)],
                            stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every holder of the terminal's other end has exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=timeout), b"".join(chunks).decode()


@pytest.fixture(scope="module")
def watched_run(debug_artifact, tmp_path_factory):
    """A 4-step run (stdout not a terminal) with --metrics and --tensorboard."""
    root = tmp_path_factory.mktemp("watched")
    art = debug_artifact()
    r = titan("run", art, "--steps", 4, "--metrics", root / "m.jsonl", "--tensorboard", root / "tb")
    assert r.returncode == 0, r.stderr
    return r, read_metrics(root / "m.jsonl"), root


def test_run_prints_one_plain_line_per_step_when_not_a_terminal(watched_run):
    r, records, _ = watched_run
    first, *rest, summary = r.stdout.splitlines()
    assert first.startswith("titan-run ") and summary.startswith("done: 4 step(s) in ")
    # Before the steps: what it starts from, the spawn, and start-up phases that took over a second.
    head = rest[:rest.index("starting 1 rank(s)") + 1]
    assert [line for line in head if not line.endswith(" ...")] == [
        "start: fresh weights (seeded init, seed 0), to train steps 1-4; data: synthetic tokens (seed 0)",
        "starting 1 rank(s)"]
    steps = [line for line in rest[len(head):] if not line.endswith(" ...")]
    assert steps == [
        f"step {m['step']:>4}/4 | loss {m['loss']:.6f} | tokens/s {m['tokens_per_s']:,.0f} | step {m['step_time_s']:.3f} s"
        for m in records]
    assert "\r" not in r.stdout


def test_run_redraws_a_progress_bar_on_a_terminal(debug_artifact, tmp_path):
    code, out = on_terminal("run", debug_artifact(), "--steps", 4, "--metrics", tmp_path / "m.jsonl")
    assert code == 0, out
    records = read_metrics(tmp_path / "m.jsonl")
    # What it does, at once, and its start-up; then the bar, redrawn in place; then the summary.
    head, out = out.split("\n\rstep 1/4", 1)
    out = "\rstep 1/4" + out
    lines = [line.removesuffix("\r") for line in head.split("\n")]
    assert lines[0].startswith("titan-run ") and "starting 1 rank(s)" in lines
    assert all(line.endswith(" ...") for line in lines[lines.index("starting 1 rank(s)") + 1:])  # phases
    out, summary = out.rsplit("\x1b[K\r\n", 1)
    out += "\x1b[K\r\n"
    assert summary.startswith("done: 4 step(s) in ") and summary.endswith(".\r\n") and summary.count("\n") == 1
    assert out.startswith("\r") and out.endswith("\x1b[K\r\n") and out.count("\n") == 1
    frames = [f.removesuffix("\x1b[K") for f in out.removesuffix("\r\n").split("\r")[1:]]
    assert len(frames) == 4
    for frame, m in zip(frames, records):
        bar = "#" * (5 * m["step"]) + "-" * (20 - 5 * m["step"])
        head = f"step {m['step']}/4 [{bar}] | loss {m['loss']:.4f} | {m['tokens_per_s']:,.0f} tok/s | ETA "
        assert frame.startswith(head) and re.fullmatch(r"\d+:\d\d", frame[len(head):]), frame
    assert frames[-1].endswith("ETA 0:00")


@pytest.mark.slow
def test_build_reports_rank_stages_as_lines_or_a_status_line(tmp_path):
    shape = ("--flavor", "debug", "--seq-len", 32)  # a shape no other test builds: a cache miss
    plain = titan("build", *shape, "--out", tmp_path / "a", "--cache-dir", tmp_path / "c1")
    assert plain.returncode == 0, plain.stderr
    stages = [line for line in plain.stdout.splitlines() if line.startswith("  rank 0:")]
    assert stages[:4] == ["  rank 0: queued", "  rank 0: tracing", "  rank 0: partitioning", "  rank 0: writing"]
    assert len(stages) == 5 and stages[4].startswith("  rank 0: done: traced in ")
    hit = titan("build", *shape, "--out", tmp_path / "a", "--cache-dir", tmp_path / "c1")
    # A hit traces nothing, so it reports no rank stages: one line for the whole build.
    assert "cache: hit (" in hit.stdout and "  rank 0:" not in hit.stdout

    code, out = on_terminal("build", *shape, "--out", tmp_path / "b", "--cache-dir", tmp_path / "c2")
    assert code == 0, out
    assert "  rank 0: queued" not in out
    frames = [f.removesuffix("\x1b[K") for f in out.split("\r") if f.startswith("ranks [")]
    seen = [re.search(r"\| (queued|tracing|partitioning|writing|done) 0 \|", f).group(1) for f in frames]
    assert [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]] == [
        "queued", "tracing", "partitioning", "writing", "done"]
    assert frames[0].startswith("ranks [--------------------] 0/1 | queued 0 | ")
    assert frames[-1].startswith("ranks [####################] 1/1 | done 0 | ")
    assert re.search(r"\r\x1b\[K  rank 0: done: traced in [^\r]*\r\n", out)
    assert re.search(r"\x1b\[K\r\nwrote ", out)


def test_tensorboard_scalars_equal_the_metrics_file(watched_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    _, records, root = watched_run
    events = EventAccumulator(str(root / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    # No GPU, no memory.
    assert sorted(events.Tags()["tensors"]) == ["grad_norm", "loss", "lr", "step_time_s", "tokens_per_s"]
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        got = [(e.step, make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]
        assert got == [(m["step"], m[tag]) for m in records]


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_plots_and_summarizes_a_run(watched_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, records, root = watched_run
    r = titan("report", root / "m.jsonl", "-o", tmp_path / "report.png", "--summary")
    assert r.returncode == 0, r.stderr
    losses = [m["loss"] for m in records]
    low = min(range(4), key=lambda i: losses[i])
    assert r.stdout.splitlines() == [
        "steps        1-4 (4 records)",
        f"loss         first {losses[0]:.6f}, last {losses[-1]:.6f}, min {losses[low]:.6f} (step {low + 1})",
        f"tokens/s     median {statistics.median(m['tokens_per_s'] for m in records):,.0f}",
        f"step time    median {statistics.median(m['step_time_s'] for m in records):.4f} s",
        f"wrote {tmp_path / 'report.png'}"]
    assert _png_size(tmp_path / "report.png") == (800, 1000)  # loss, lr, grad norm and tokens/s panels
    plain = titan("report", root / "m.jsonl")  # no flags: the summary alone
    assert plain.returncode == 0 and plain.stdout.splitlines() == r.stdout.splitlines()[:-1], plain.stderr

    # A GPU run's file also records peak memory: a third panel and a summary line.
    gpu = tmp_path / "gpu.jsonl"
    gpu.write_text("".join(f'{{"step": {s}, "loss": {5 - s / 10}, "tokens_per_s": {1000 * s}, "step_time_s": 0.5, '
                           f'"peak_mem_gib": {40 + s}}}\n' for s in range(1, 6)))
    r = titan("report", gpu, "-o", tmp_path / "gpu.png", "--summary")
    assert r.returncode == 0, r.stderr
    assert "peak memory  max 45.00 GiB" in r.stdout.splitlines()
    assert _png_size(tmp_path / "gpu.png") == (800, 750)


def test_report_refuses_empty_or_garbled_metrics(tmp_path):
    empty, garbled, foreign = tmp_path / "empty.jsonl", tmp_path / "garbled.jsonl", tmp_path / "foreign.jsonl"
    empty.write_text("")
    garbled.write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 1.0, "step_time_s": 1.0}\n{"step": 2, "lo\n')
    foreign.write_text('{"epoch": 1}\n')
    for path, message in (
            (empty, f"error: {empty} holds no steps; point titan-report at the file a run wrote with --metrics"),
            (garbled, f"error: {garbled}: line 2 is not JSON; is this a titan-run --metrics file?"),
            (foreign, f"error: {foreign}: line 1 lacks step, loss, tokens_per_s, step_time_s (numbers); "
                      "is this a titan-run --metrics file?")):
        r = titan("report", path, "--summary")
        assert (r.returncode, r.stderr.strip(), r.stdout) == (2, message, "")


def test_missing_tensorboard_names_the_install_command(debug_artifact, tmp_path):
    # This process has no tensorboard package (None in sys.modules makes it unfindable).
    code = ("import sys; sys.modules['tensorboard'] = None; sys.argv[0] = 'titan-run'; "
            "from titan.cli.run import main; main()")
    r = subprocess.run([sys.executable, "-c", code, str(debug_artifact()), "--tensorboard", str(tmp_path / "tb")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: --tensorboard needs the tensorboard package: pip install -e '.[watch]' "
                                "from a clone (or: pip install tensorboard)")
