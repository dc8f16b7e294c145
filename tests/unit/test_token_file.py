"""Training batches (runtime/data.py) in process: the data position is the step, a token file
and its sidecar are checked before a batch is read, and synthetic batches of data-parallel ranks
are slices of one process's. (titan-data and titan-run --data: e2e/test_data.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch


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


def _token_file(path, **kwargs):
    from titan.runtime.data import TokenFile

    return TokenFile(path, **(dict(dtype=None, vocab_size=2048, batch_size=2, seq_len=128, dp_rank=0, dp_degree=1)
                              | kwargs))


def test_what_is_not_a_usable_token_file_is_one_error_that_says_what_to_do(tmp_path):
    empty, text, short, odd = (tmp_path / n for n in ("empty.bin", "notes.txt", "short.bin", "odd.bin"))
    empty.write_bytes(b"")
    text.write_text("these are words that a tokenizer should see first\n" * 50)
    np.arange(100, dtype="<u2").tofile(short)
    odd.write_bytes(b"\x01\x00\x02")
    for path, message in (
            (empty, f"--data {empty} is empty; write a token file with titan-data"),
            (text, f"--data {text} is text, not a token file; tokenize it with titan-data {text} -o TOKENS "
                   "--tokenizer tokenizer.json and pass --data TOKENS"),
            (short, f"--data {short}: 100 tokens is fewer than one sequence of 129; give a longer token file"),
            (odd, f"--data {odd}: size is not a multiple of 2 bytes; is --data-dtype uint16 right?"),
            (tmp_path / "none.bin", f"--data {tmp_path / 'none.bin'}: no such file")):
        with pytest.raises(ValueError) as e:
            _token_file(path)
        assert str(e.value) == message
    with pytest.raises(ValueError, match="^--data-dtype must be one of uint16, uint32, got 'int8'$"):
        _token_file(short, dtype="int8")


def test_a_token_beyond_the_vocabulary_is_refused_when_its_batch_is_read(tmp_path):
    path = tmp_path / "ids.bin"
    ids = np.arange(1000, dtype="<u2")
    ids[300] = 4000
    ids.tofile(path)
    reader = _token_file(path, batch_size=1, seq_len=100, vocab_size=2048)
    assert reader.batch(1)[0].max() == 199  # window 1: tokens 100..200
    with pytest.raises(ValueError, match="^--data holds token id 4000, outside this model's vocabulary of 2048$"):
        reader.batch(2)  # window 2: tokens 200..300


@pytest.mark.parametrize("side, dtype, message", [
    (dict(dtype="uint32"), "uint16", "--data-dtype uint16 contradicts {side} (uint32); drop --data-dtype"),
    (dict(dtype="int8"), None, "--data {path}: sidecar {side} names dtype 'int8'; rewrite it with titan-data"),
    (dict(vocab_size=4096), None, "--data {path} was tokenized with a vocabulary of 4096 tokens, more than this "
                                  "model's 2048; tokenize with the model's tokenizer or build a model with a larger "
                                  "vocabulary"),
    (dict(tokens="many"), None, "--data {path}: its sidecar {side} is unreadable (invalid literal for int() with base "
                                "10: 'many'); rewrite it with titan-data, or delete it and pass --data-dtype"),
])
def test_a_sidecar_that_contradicts_the_run_is_refused(tmp_path, side, dtype, message):
    from titan.runtime.data import token_file_dtype

    path = tmp_path / "ids.bin"
    np.arange(50, dtype="<u4").tofile(path)
    doc = {"format": "titan-tokens", "format_version": 1, "dtype": "uint32", "vocab_size": 100, "tokens": 50}
    (tmp_path / "ids.bin.json").write_text(json.dumps(doc | side))
    with pytest.raises(ValueError) as e:
        token_file_dtype(path, dtype=dtype, vocab_size=2048)
    assert str(e.value) == message.format(path=path, side=f"{path}.json")


def test_synthetic_data_parallel_batches_are_slices_of_the_one_process_batch():
    """Rank r of a data-parallel group reads rows r*b .. r*b+b-1 of the global batch that one
    process reads at the same step; labels are the tokens shifted by one."""
    from titan.runtime.data import SyntheticTokens

    common = dict(vocab_size=2048, seq_len=32, seed=7)
    whole = SyntheticTokens(batch_size=4, dp_rank=0, **common)
    for step in (0, 5):
        tokens, labels = whole.batch(step)
        assert tokens.shape == labels.shape == (4, 32) and torch.equal(tokens[:, 1:], labels[:, :-1])
        for rank in range(2):
            part = SyntheticTokens(batch_size=2, dp_rank=rank, **common).batch(step)
            assert torch.equal(part[0], tokens[2 * rank:2 * rank + 2]) and torch.equal(part[1], labels[2 * rank:2 * rank + 2])
    assert not torch.equal(whole.batch(0)[0], whole.batch(1)[0])
    assert not torch.equal(whole.batch(0)[0], SyntheticTokens(batch_size=4, dp_rank=0, vocab_size=2048, seq_len=32,
                                                              seed=8).batch(0)[0])
