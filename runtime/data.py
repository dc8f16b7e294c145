"""Training batches: deterministic synthetic tokens, or a flat token file.

Both are pure functions of (step, data-parallel rank), so a run, its eager reference and a
resumed run read the same tokens. Tensor-parallel ranks of one data-parallel rank read the
same batch.

The data position is the step. Batch s (0-based: the batch of optimizer step s + 1) depends on
s and the data-parallel rank alone, so a run resumed after k completed steps reads batch k next,
with no reader state to save or restore; `TokenFile.windows_at(s, ...)` names the windows.

Token file layout (written by titan-data): a flat array of little-endian uint16 or uint32 token
ids, no header, documents concatenated, each followed by the tokenizer's end-of-text token
when it has one. Beside it, `<file>.json` (the sidecar) records:
    format          "titan-tokens"
    format_version  1
    dtype           "uint16" (vocabulary <= 65536) or "uint32"
    vocab_size      the tokenizer's vocabulary size (every id is below it)
    tokens          number of tokens in the file (its size / the dtype's size)
    eos_id          the separator appended after each document, or null
    documents       number of documents encoded
    tokenizer       {"kind": "tokenizers" | "tiktoken", "path", "sha256", "spec"}
    sources         [{"path", "bytes", "sha256"}] of the text files, in order
titan-run takes the dtype from the sidecar and refuses a file whose vocab_size exceeds the
model's; without a sidecar the dtype is --data-dtype (default uint16) and ids are checked per
batch.
Batch b of data-parallel rank r at step s reads sequences (s * dp + r) * b + i for i < b,
each seq_len + 1 consecutive tokens starting at (sequence index * seq_len) modulo the number of
whole windows in the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from titan.runtime.common.token_sidecar import sidecar_path
from titan.runtime.contract.manifest import Manifest

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def _seed(*parts) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SyntheticTokens:
    """Sequences that step by a per-sequence stride plus noise, t' = (t + stride + e) mod V with
    e in {0, 1}: random enough to be non-trivial, regular enough that the loss visibly falls.

    Sequence i of the global batch at step s depends on (seed, s, i) alone, so data-parallel
    rank r (reading sequences r*b .. r*b+b-1) and a single process with the whole global batch
    see the same tokens.
    """

    def __init__(self, *, vocab_size: int, batch_size: int, seq_len: int, seed: int, dp_rank: int):
        self.vocab_size, self.batch_size, self.seq_len = vocab_size, batch_size, seq_len
        self.seed, self.dp_rank = seed, dp_rank

    def _sequence(self, step: int, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed(self.seed, "data", step, index))
        n, v = self.seq_len + 1, self.vocab_size
        start = torch.randint(0, v, (1,), generator=g)
        stride = torch.randint(1, 64, (1,), generator=g)
        steps = stride + torch.randint(0, 2, (n,), generator=g)
        steps[0] = 0
        return (start + steps.cumsum(0)) % v

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.dp_rank * self.batch_size
        seq = torch.stack([self._sequence(step, first + i) for i in range(self.batch_size)])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def token_file_dtype(path: str | Path, *, dtype: str | None, vocab_size: int) -> str:
    """The token file's dtype: from its sidecar when there is one (which must agree with an
    explicit --data-dtype and fit the model's vocabulary), else `dtype` or uint16."""
    path = Path(path)
    if dtype is not None and dtype not in TOKEN_DTYPES:
        raise ValueError(f"--data-dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    side = sidecar_path(path)
    if not side.is_file():
        return dtype or "uint16"
    try:
        info = json.loads(side.read_text())
        recorded, vocab, tokens = info["dtype"], int(info["vocab_size"]), int(info["tokens"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--data {path}: its sidecar {side} is unreadable ({e}); rewrite it with titan-data, "
                         "or delete it and pass --data-dtype") from None
    if recorded not in TOKEN_DTYPES:
        raise ValueError(f"--data {path}: sidecar {side} names dtype {recorded!r}; rewrite it with titan-data")
    if dtype is not None and dtype != recorded:
        raise ValueError(f"--data-dtype {dtype} contradicts {side} ({recorded}); drop --data-dtype")
    if vocab > vocab_size:
        raise ValueError(f"--data {path} was tokenized with a vocabulary of {vocab} tokens, more than this model's "
                         f"{vocab_size}; tokenize with the model's tokenizer or build a model with a larger vocabulary")
    if path.stat().st_size != tokens * np.dtype(TOKEN_DTYPES[recorded]).itemsize:
        raise ValueError(f"--data {path}: its size does not match the {tokens} {recorded} tokens its sidecar {side} "
                         "records (file replaced or truncated?); rewrite both with titan-data")
    return recorded


def _token_count(path: Path, *, dtype: str | None, vocab_size: int) -> tuple[str, int]:
    """The dtype and token count of a usable token file; ValueError for a missing, empty or text
    file, or one whose size does not fit its dtype or sidecar."""
    dtype = token_file_dtype(path, dtype=dtype, vocab_size=vocab_size)
    size = path.stat().st_size
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size == 0:
        raise ValueError(f"--data {path} is empty; write a token file with titan-data")
    if not sidecar_path(path).is_file() and _looks_like_text(path):
        raise ValueError(f"--data {path} is text, not a token file; tokenize it with "
                         f"titan-data {path} -o TOKENS --tokenizer tokenizer.json and pass --data TOKENS")
    if size % itemsize:
        raise ValueError(f"--data {path}: size is not a multiple of {itemsize} bytes; is --data-dtype {dtype} right?")
    return dtype, size // itemsize


def _windows(path: Path, tokens: int, seq_len: int) -> int:
    windows = (tokens - 1) // seq_len
    if windows < 1:
        raise ValueError(f"--data {path}: {tokens} tokens is fewer than one sequence of {seq_len + 1}; "
                         "give a longer token file")
    return windows


def check_token_file(path: str | Path, *, dtype: str | None, manifest: Manifest, steps: int) -> list[str]:
    """Refuse what is not a usable token file for this artifact; returns notes to print (that
    the run reads the file more than once)."""
    path = Path(path)
    _, tokens = _token_count(path, dtype=dtype, vocab_size=manifest.vocab_size)
    _check_separator(path, manifest)
    seq_len = manifest.seq_len
    windows = _windows(path, tokens, seq_len)
    needed = steps * manifest.batch_size * manifest.dp_degree
    if needed > windows:
        return [f"note: --data {path} holds {windows:,} sequences of {seq_len + 1} tokens and {steps} steps read "
                f"{needed:,}: the run goes over the file {needed / windows:.1f} times (from its start again each time)"]
    return []


def _check_separator(path: Path, manifest: Manifest) -> None:
    """An artifact built with --mask document finds documents by its --eos-id: a file whose sidecar
    records another separator (or none) would train without its document boundaries."""
    eos = manifest.model_config.get("eos_id")
    side = sidecar_path(path)
    if eos is None or not side.is_file():
        return
    recorded = json.loads(side.read_text()).get("eos_id")  # readable: token_file_dtype read it
    if recorded != eos:
        ends = "no separator" if recorded is None else f"separator id {recorded}"
        fix = (f"rebuild it with --eos-id {recorded}" if recorded is not None else
               "tokenize with a separator (titan-data --eos) or build it with --mask causal")
        raise ValueError(f"--data {path} was written with {ends} ({side}) but the artifact masks documents that "
                         f"end with token {eos}; {fix}")


def describe_token_file(path: str | Path, *, dtype: str | None, vocab_size: int) -> str:
    """'FILE (1,234,567 tokens, uint16)' for a file check_token_file accepted."""
    dtype, tokens = _token_count(Path(path), dtype=dtype, vocab_size=vocab_size)
    return f"{path} ({tokens:,} tokens, {dtype})"


def _looks_like_text(path: Path) -> bool:
    """A token file's bytes are ids: small ids have a zero high byte, and random ones are not
    UTF-8. Text is UTF-8 without NUL bytes."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3  # only a character cut at the end of the sample
    return True


class TokenFile:
    def __init__(self, path: str | Path, *, dtype: str | None, vocab_size: int, batch_size: int, seq_len: int,
                 dp_rank: int, dp_degree: int):
        path = Path(path)
        dtype, tokens = _token_count(path, dtype=dtype, vocab_size=vocab_size)
        self.windows = _windows(path, tokens, seq_len)
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
        self.vocab_size, self.batch_size, self.seq_len = vocab_size, batch_size, seq_len
        self.dp_rank, self.dp_degree = dp_rank, dp_degree

    def windows_at(self, step: int) -> list[int]:
        """Indices of the windows this rank reads for batch `step` (the data position is the step)."""
        first = (step * self.dp_degree + self.dp_rank) * self.batch_size
        return [(first + i) % self.windows for i in range(self.batch_size)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [np.asarray(self.tokens[w * self.seq_len:w * self.seq_len + self.seq_len + 1], dtype=np.int64)
                for w in self.windows_at(step)]
        seq = torch.from_numpy(np.stack(rows))
        top = int(seq.max())
        if top >= self.vocab_size:
            raise ValueError(f"--data holds token id {top}, outside this model's vocabulary of {self.vocab_size}")
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
