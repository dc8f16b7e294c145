"""Text files -> a flat token file and its sidecar (layout in runtime/data.py), for titan-data.

Tokenizers, both optional dependencies (`pip install -e '.[data]'` from a clone):
- a Hugging Face `tokenizers` JSON file (tokenizer.json): documents are encoded as that file
  defines, its post-processor included (Llama-3's adds <|begin_of_text|>);
- a tiktoken BPE ranks file (lines `<base64 token> <rank>`, as Llama-3's tokenizer.model) with
  a named spec for what the file does not hold, the pre-tokenizer pattern and the special
  tokens. `llama3`: Llama-3's pattern and 256 special tokens numbered after the ranks,
  <|begin_of_text|> = n, <|end_of_text|> = n + 1 (n ranks); each document is encoded as
  <|begin_of_text|> + text, as Llama-3's tokenizer.json's post-processor does, so that both
  forms of the Llama-3 tokenizer frame documents alike (not checked here against the real
  files, which the tests do not have); long documents are cut as Llama-3's reference
  tokenizer cuts them (_llama3_pieces).
In a tiktoken document, special-token text is encoded as plain text, never as a special
token; a tokenizer.json matches its own added tokens in text, as it defines.

Separator rule: after every document comes the end-of-text token, `--eos` when given, else the
first of EOS_CANDIDATES that the tokenizer has; with none (or `--eos none`) documents are
simply concatenated. A document is a whole input file, or each non-empty line (`--documents line`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from titan.runtime.contract.artifact import file_sha256
from titan.runtime.common.token_sidecar import sidecar_path

EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
# Documents handed to the tokenizer at once (both libraries encode a batch on several threads).
DOCUMENTS_PER_BATCH = 256
INSTALL_HINT = "pip install -e '.[data]' from a clone (or: pip install tokenizers tiktoken)"

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL_COUNT = 256
TIKTOKEN_SPECS = ("llama3",)
LLAMA3_SLICE_CHARS = 400_000
LLAMA3_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{LLAMA3_RUN_CHARS + 1},}}|\S{{{LLAMA3_RUN_CHARS + 1},}}")


@dataclass(kw_only=True, slots=True)
class TextTokenizer:
    encode: Callable[[list[str]], list[list[int]]]
    """Documents -> each one's token ids (without the separator)."""
    vocab_size: int
    """Every id is below this."""
    eos_id: int | None
    """Separator appended after each document, or None."""
    record: dict
    """What the sidecar says about the tokenizer (kind, path, sha256, spec)."""


def _is_tokenizers_json(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(64).lstrip().startswith(b"{")


def _library_call(fn: Callable, path: Path, doing: str):
    """fn(), a call into a tokenizer library, whose failures become one ValueError line: the Rust
    libraries raise plain Exception for bad input, and a panic inside them (a tokenizer.json whose
    post-processor names a token it lacks; issue 29) surfaces as pyo3's PanicException, a
    BaseException. Rust writes a panic's own report (a backtrace, with RUST_BACKTRACE) to stderr
    before Python sees it, so stderr is held aside during the call and dropped on a failure."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                result = fn()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # PanicException is a BaseException
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise ValueError(f"--tokenizer {path} failed while {doing} ({first}); "
                                 "fix the tokenizer file or use another: the tokenizer library itself fails on it") from None
            finally:
                os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read(1 << 16))  # a success: what the library printed is the user's to see
            return result
    finally:
        os.close(saved)


def load_tokenizer(path: Path, *, eos: str | None, tiktoken_spec: str | None = None) -> TextTokenizer:
    """A tokenizer.json or a tiktoken ranks file (told apart by content); `eos` names the
    separator token ('none' for no separator, None for the EOS_CANDIDATES rule);
    `tiktoken_spec` (ranks files only) the pattern and special tokens, default llama3."""
    if not path.is_file():
        raise ValueError(f"--tokenizer {path}: no such file")
    record = {"path": str(path), "sha256": file_sha256(path)}
    if _is_tokenizers_json(path):
        if tiktoken_spec is not None:
            raise ValueError(f"--tiktoken-spec applies to tiktoken ranks files; {path} is a tokenizer.json, which "
                             "carries its own pattern and special tokens: drop --tiktoken-spec")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"--tokenizer {path} is a tokenizer.json, which needs the tokenizers package: "
                             f"{INSTALL_HINT}") from None
        tok = _library_call(lambda: Tokenizer.from_file(str(path)), path, "loading it as a tokenizer.json")
        ids = list(tok.get_vocab(with_added_tokens=True).values())
        vocab = max(tok.get_vocab_size(with_added_tokens=True), max(ids) + 1 if ids else 0)
        lookup = tok.token_to_id

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in _library_call(lambda: tok.encode_batch(texts), path, "encoding text")]
        record.update(kind="tokenizers", spec=None)
    else:
        try:
            import tiktoken
        except ImportError:
            raise ValueError(f"--tokenizer {path} is a tiktoken ranks file, which needs the tiktoken package: "
                             f"{INSTALL_HINT}") from None
        tiktoken_spec = tiktoken_spec or "llama3"
        if tiktoken_spec not in TIKTOKEN_SPECS:
            raise ValueError(f"--tiktoken-spec {tiktoken_spec!r} is unknown; available: {', '.join(TIKTOKEN_SPECS)}")
        ranks = _read_ranks(path)
        n = len(ranks)
        names = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>"
                                                            for i in range(LLAMA3_SPECIAL_COUNT - 2)]
        special = {name: n + i for i, name in enumerate(names)}
        enc = tiktoken.Encoding(name=f"titan-{tiktoken_spec}", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                special_tokens=special)
        bos = special["<|begin_of_text|>"]
        vocab = n + LLAMA3_SPECIAL_COUNT
        lookup = special.get

        def encode(texts: list[str]) -> list[list[int]]:
            pieces = [_llama3_pieces(t) for t in texts]
            ids = iter(_library_call(lambda: enc.encode_ordinary_batch([p for ps in pieces for p in ps]), path,
                                     "encoding text"))
            return [[bos, *(i for _ in ps for i in next(ids))] for ps in pieces]
        record.update(kind="tiktoken", spec=tiktoken_spec)
    if eos == "none":
        eos_id = None
    elif eos is not None:
        eos_id = lookup(eos)
        if eos_id is None:
            raise ValueError(f"--eos {eos!r} is not a token of {path}; name one of its special tokens, or --eos none")
    else:
        eos_id = next((i for i in map(lookup, EOS_CANDIDATES) if i is not None), None)
    return TextTokenizer(encode=encode, vocab_size=vocab, eos_id=eos_id, record=record)


def _llama3_pieces(text: str) -> list[str]:
    """Cut a document as Llama-3's reference tokenizer does before encoding (its tiktoken
    backend fails on very long inputs): into slices of LLAMA3_SLICE_CHARS characters, and
    inside those every LLAMA3_RUN_CHARS characters of one unbroken run of whitespace or of
    non-whitespace."""
    pieces = []
    for start in range(0, len(text), LLAMA3_SLICE_CHARS):
        part = text[start:start + LLAMA3_SLICE_CHARS]
        cuts = [cut for run in _LONG_RUN.finditer(part)
                for cut in range(run.start() + LLAMA3_RUN_CHARS, run.end(), LLAMA3_RUN_CHARS)]
        bounds = [0, *cuts, len(part)]
        pieces += [part[a:b] for a, b in zip(bounds, bounds[1:])]
    return pieces


def _read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file: one `<base64 token> <rank>` per line, ranks 0..n-1."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"--tokenizer {path}: line {number} is not '<base64 token> <rank>'; give a tiktoken "
                             "ranks file or a tokenizer.json") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer {path}: ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def documents(paths: list[Path], *, per_line: bool) -> Iterator[str]:
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if per_line:
            yield from (line for line in text.splitlines() if line.strip())
        elif text:
            yield text


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(kw_only=True, slots=True)
class TokenFileSummary:
    dtype: str
    """uint16 or uint32."""
    tokens: int
    """Tokens written."""
    documents: int
    """Documents encoded."""
    sidecar: dict
    """The sidecar's content."""


def _temp_path(path: Path) -> Path:
    """A fresh name beside `path` (same file system, so the final rename is atomic)."""
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def write_token_file(texts: list[Path], out: Path, tokenizer: TextTokenizer, *, per_line: bool) -> TokenFileSummary:
    """Encode `texts` into `out` and `out`.json, each written to a temporary file and renamed
    into place (the sidecar last, so it never describes a half-written file)."""
    for path in texts:
        if not path.is_file():
            raise ValueError(f"{path}: no such text file")
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    out.parent.mkdir(parents=True, exist_ok=True)
    side = sidecar_path(out)
    side.unlink(missing_ok=True)
    count = docs = 0
    tmp = _temp_path(out)
    try:
        with open(tmp, "xb") as f:
            for batch in _batches(documents(texts, per_line=per_line), DOCUMENTS_PER_BATCH):
                for ids in tokenizer.encode(batch):
                    if tokenizer.eos_id is not None:
                        ids.append(tokenizer.eos_id)
                    f.write(np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
                    count += len(ids)
                docs += len(batch)
        if count == 0:
            raise ValueError(f"no text in {', '.join(map(str, texts))}: nothing to tokenize")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    sidecar = {"format": "titan-tokens", "format_version": 1, "dtype": dtype, "vocab_size": tokenizer.vocab_size,
               "tokens": count, "eos_id": tokenizer.eos_id, "documents": docs, "tokenizer": tokenizer.record,
               "sources": [{"path": str(p), "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in texts]}
    tmp = _temp_path(side)
    with open(tmp, "x") as f:
        f.write(json.dumps(sidecar, indent=1) + "\n")
    os.replace(tmp, side)
    return TokenFileSummary(dtype=dtype, tokens=count, documents=docs, sidecar=sidecar)
