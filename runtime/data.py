"""Training batches: deterministic synthetic tokens, or a flat token file.

Both are pure functions of (step, data-parallel rank), so a run, its eager reference and a
resumed run read the same tokens. Tensor-parallel ranks of one data-parallel rank read the
same batch.

Token file layout: a flat array of little-endian uint16 or uint32 token ids, no header.
Batch b of data-parallel rank r at step s reads sequences (s * dp + r) * b + i for i < b,
each seq_len + 1 consecutive tokens starting at (sequence index * seq_len) modulo the number of
whole windows in the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

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


class TokenFile:
    def __init__(self, path: str | Path, *, dtype: str, vocab_size: int, batch_size: int, seq_len: int,
                 dp_rank: int, dp_degree: int):
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"--data-dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--data {path}: no such file")
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        if path.stat().st_size % itemsize:
            raise ValueError(f"--data {path}: size is not a multiple of {itemsize} bytes; is --data-dtype {dtype} right?")
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"--data {path}: {len(self.tokens)} tokens is fewer than one sequence of {seq_len + 1}")
        self.vocab_size, self.batch_size, self.seq_len = vocab_size, batch_size, seq_len
        self.dp_rank, self.dp_degree = dp_rank, dp_degree

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for i in range(self.batch_size):
            index = ((step * self.dp_degree + self.dp_rank) * self.batch_size + i) % self.windows
            start = index * self.seq_len
            rows.append(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        seq = torch.from_numpy(np.stack(rows))
        top = int(seq.max())
        if top >= self.vocab_size:
            raise ValueError(f"--data holds token id {top}, outside this model's vocabulary of {self.vocab_size}")
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
