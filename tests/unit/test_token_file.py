"""Reading a token file (runtime/data.py) in process: the data position is the step, and a
sidecar must describe its file. (titan-data and titan-run --data: e2e/test_data.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest


def test_data_position_is_the_step(tmp_path):
    """Ranks of a data-parallel group read disjoint windows; a reader created at step k (a
    resumed run) reads what one that started at 0 reads at step k."""
    from titan.runtime.data import TokenFile

    path = tmp_path / "ids.bin"
    np.arange(10_000, dtype="<u2").tofile(path)
    common = dict(dtype="uint16", vocab_size=2**16, batch_size=2, seq_len=16, dp_degree=2)
    r0, r1 = TokenFile(path, dp_rank=0, **common), TokenFile(path, dp_rank=1, **common)
    assert r0.windows_at(3) == [12, 13] and r1.windows_at(3) == [14, 15]
    for _ in range(5):
        r0.batch(_)
    resumed = TokenFile(path, dp_rank=0, **common)
    tokens, labels = resumed.batch(5)
    assert tokens[0].tolist() == list(range(20 * 16, 21 * 16)) and labels[0, -1].item() == 21 * 16
    assert all(r0.batch(5)[0].equal(tokens) for _ in range(2))


def test_sidecar_must_describe_its_token_file(tmp_path):
    from titan.runtime.data import token_file_dtype

    path = tmp_path / "ids.bin"
    np.arange(100, dtype="<u2").tofile(path)
    side = {"format": "titan-tokens", "format_version": 1, "dtype": "uint16", "vocab_size": 100, "tokens": 100}
    (tmp_path / "ids.bin.json").write_text(json.dumps(side))
    assert token_file_dtype(path, dtype=None, vocab_size=2048) == "uint16"
    np.arange(99, dtype="<u2").tofile(path)  # replaced behind the sidecar's back
    with pytest.raises(ValueError) as e:
        token_file_dtype(path, dtype=None, vocab_size=2048)
    assert str(e.value) == (f"--data {path}: its size does not match the 100 uint16 tokens its sidecar "
                            f"{path}.json records (file replaced or truncated?); rewrite both with titan-data")
