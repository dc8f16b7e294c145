"""Reading a titan-run --metrics file (runtime/metrics_file.py) in process: the records, or one
error naming the line; and the summary titan-report prints. (titan-report as a command:
e2e/test_watch.py.)"""

from __future__ import annotations

import json
import os

import pytest

from titan.runtime.metrics_file import read_metrics, summary


def _record(step: int, **changes) -> dict:
    return {"step": step, "loss": 8.0 - step / 4, "tokens_per_s": 1000.0 * step, "step_time_s": 0.5, "time": 1.0 + step,
            **changes}


def _write(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_records_come_back_as_written_and_blank_lines_are_skipped(tmp_path):
    records = [_record(s) for s in (1, 2, 3)]
    path = _write(tmp_path / "m.jsonl", [json.dumps(records[0]), "", json.dumps(records[1]), "  ", json.dumps(records[2])])
    assert read_metrics(path) == records


@pytest.mark.parametrize("lines, message", [
    ([], "{path} holds no steps; point titan-report at the file a run wrote with --metrics"),
    (["", " "], "{path} holds no steps; point titan-report at the file a run wrote with --metrics"),
    ([json.dumps(_record(1)), '{"step": 2, "lo'], "{path}: line 2 is not JSON; is this a titan-run --metrics file?"),
    (['{"epoch": 1}'], "{path}: line 1 lacks step, loss, tokens_per_s, step_time_s (numbers); is this a titan-run "
                       "--metrics file?"),
    ([json.dumps(_record(1, loss="low"))], "{path}: line 1: loss is 'low', not a number; is this a titan-run --metrics file?"),
    (["[1, 2]"], "{path}: line 1 lacks step, loss, tokens_per_s, step_time_s (numbers); is this a titan-run "
                 "--metrics file?"),
    (["[" * 20 + "]" * 20], "{path}: line 1 is not JSON; is this a titan-run --metrics file?"),
])
def test_a_file_that_is_not_a_metrics_file_is_one_error_naming_the_line(tmp_path, lines, message):
    path = _write(tmp_path / "m.jsonl", lines)
    with pytest.raises(ValueError) as e:
        read_metrics(path)
    assert str(e.value) == message.format(path=path)


def test_a_special_file_is_refused_not_read_forever(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=f"^metrics file {tmp_path / 'fifo'} is not a regular file$"):
        read_metrics(tmp_path / "fifo")


def test_the_summary_states_steps_losses_throughput_and_peak_memory():
    records = [_record(s, peak_mem_gib=40.0 + s) for s in (1, 2, 3, 4)]
    records[2]["loss"] = float("nan")  # a diverged step is never the lowest
    assert summary(records) == ["steps        1-4 (4 records)",
                                "loss         first 7.750000, last 7.000000, min 7.000000 (step 4)",
                                "tokens/s     median 2,500",
                                "step time    median 0.5000 s",
                                "peak memory  max 44.00 GiB"]
    assert len(summary([_record(1)])) == 4, "no peak memory on CPU"
