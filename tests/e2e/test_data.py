"""titan-data: text files -> a token file and sidecar that titan-run trains on, and what
titan-run refuses or notes about a token file. (The reader in process: unit/test_token_file.py.)"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import read_metrics, titan

LINES = ["the quick brown fox jumps over the lazy dog", "a titan trains from an artifact",
         "tokens flow from text to the model", "every rank reads its own window of the file"]


def _tokenizer_json(path):
    """A real BPE tokenizer.json trained on a few lines, with an end-of-text token."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, tokenizers.trainers.BpeTrainer(vocab_size=120,
                                                                  special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(path))
    return tok


def _ranks_file(path, extra: list[bytes]):
    """A tiktoken ranks file: the 256 bytes, then `extra` merged tokens."""
    tokens = [bytes([b]) for b in range(256)] + extra
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))


def test_tokenizer_json_to_a_training_run(tmp_path, debug_artifact):
    tok = _tokenizer_json(tmp_path / "tokenizer.json")
    docs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    docs[0].write_text("\n".join(LINES * 30) + "\n")
    docs[1].write_text("the fox reads the file\n" * 40)
    out = tmp_path / "data" / "train.bin"
    r = titan("data", *docs, "-o", out, "--tokenizer", tmp_path / "tokenizer.json")
    assert r.returncode == 0, r.stderr
    eos = tok.token_to_id("<|endoftext|>")
    expected = []
    for d in docs:
        expected += tok.encode(d.read_text()).ids + [eos]
    assert np.fromfile(out, dtype="<u2").tolist() == expected
    side = json.loads((tmp_path / "data" / "train.bin.json").read_text())
    assert {k: side[k] for k in ("format", "dtype", "vocab_size", "tokens", "eos_id", "documents")} == {
        "format": "titan-tokens", "dtype": "uint16", "vocab_size": tok.get_vocab_size(), "tokens": len(expected),
        "eos_id": eos, "documents": 2}
    assert side["tokenizer"]["kind"] == "tokenizers" and len(side["tokenizer"]["sha256"]) == 64
    assert [s["path"] for s in side["sources"]] == [str(d) for d in docs]
    assert f"{len(expected):,} tokens (uint16) from 2 document(s)" in r.stdout

    art = debug_artifact()
    metrics = tmp_path / "m.jsonl"
    run = titan("run", art, "--steps", 3, "--data", out, "--metrics", metrics)
    assert run.returncode == 0, run.stderr
    losses = [rec["loss"] for rec in read_metrics(metrics)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    # The dtype comes from the sidecar; an explicit one that contradicts it is refused.
    bad = titan("run", art, "--steps", 1, "--data", out, "--data-dtype", "uint32")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"error: --data-dtype uint32 contradicts {out}.json (uint16); drop --data-dtype")


def test_tiktoken_ranks_file_with_llama3_specials(tmp_path):
    pytest.importorskip("tiktoken")
    _ranks_file(tmp_path / "tokenizer.model", [b"th", b"the", b" t", b" th", b" the", b"xx"])
    docs = [tmp_path / "doc1.txt", tmp_path / "doc2.txt", tmp_path / "doc3.txt"]
    docs[0].write_text("the the")
    docs[1].write_text("<|end_of_text|>")
    docs[2].write_text("a" + "x" * 25_002)  # one run of 25,003 non-space characters
    out = tmp_path / "tokens.bin"
    r = titan("data", *docs, "-o", out, "--tokenizer", tmp_path / "tokenizer.model")
    assert r.returncode == 0, r.stderr
    n, xx, x = 262, 261, ord("x")  # ranks; <|begin_of_text|> = n, <|end_of_text|> = n + 1
    assert np.fromfile(out, dtype="<u2").tolist() == [
        n, 257, 260, n + 1,  # "the" then " the" by BPE over the ranks
        n, *b"<|end_of_text|>", n + 1,  # special-token text in a document is plain bytes
        # Cut after 25,000 characters of one run, as Llama-3's reference tokenizer does:
        # "a" + 24,999 "x", then "xxx" (uncut it would be "a" + 12,501 "xx").
        n, ord("a"), *[xx] * 12_499, x, xx, x, n + 1]
    side = json.loads(out.with_name("tokens.bin.json").read_text())
    assert (side["vocab_size"], side["eos_id"], side["dtype"]) == (n + 256, n + 1, "uint16")
    assert side["tokenizer"]["kind"] == "tiktoken" and side["tokenizer"]["spec"] == "llama3"


def test_run_refuses_a_token_file_with_a_larger_vocabulary(tmp_path, debug_artifact):
    pytest.importorskip("tiktoken")
    # 256 bytes + 2000 two-byte tokens + 256 specials = 2512 > the debug model's 2048.
    _ranks_file(tmp_path / "big.model", [bytes([a, b]) for a in range(97, 123) for b in range(256)][:2000])
    (tmp_path / "doc.txt").write_text("plenty of text " * 200)
    out = tmp_path / "big.bin"
    assert titan("data", tmp_path / "doc.txt", "-o", out, "--tokenizer", tmp_path / "big.model").returncode == 0
    r = titan("run", debug_artifact(), "--steps", 1, "--data", out)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: --data {out} was tokenized with a vocabulary of 2512 tokens, more than this "
                                "model's 2048; tokenize with the model's tokenizer or build a model with a larger "
                                "vocabulary")


def test_missing_tokenizer_package_names_the_install_command(tmp_path):
    _tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "doc.txt").write_text("text")
    # This process has no tokenizers package (None in sys.modules makes its import fail).
    code = ("import sys; sys.modules['tokenizers'] = None; sys.argv[0] = 'titan-data'; "
            "from titan.cli.data import main; main()")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "doc.txt"), "-o", str(tmp_path / "o.bin"),
                        "--tokenizer", str(tmp_path / "tokenizer.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: --tokenizer {tmp_path / 'tokenizer.json'} is a tokenizer.json, which needs "
                                "the tokenizers package: pip install -e '.[data]' from a clone (or: pip install tokenizers "
                                "tiktoken)")


@pytest.mark.slow
def test_data_that_is_not_a_usable_token_file_is_one_error_before_any_rank_starts(tmp_path, debug_artifact):
    art = debug_artifact(tp=2)
    empty, text, short = tmp_path / "empty.bin", tmp_path / "notes.txt", tmp_path / "short.bin"
    empty.write_bytes(b"")
    text.write_text("these are words that a tokenizer should see first\n" * 50)
    np.arange(100, dtype="<u2").tofile(short)
    for path, words in ((empty, f"error: --data {empty} is empty; write a token file with titan-data"),
                        (text, f"error: --data {text} is text, not a token file; tokenize it with titan-data {text}"),
                        (short, f"error: --data {short}: 100 tokens is fewer than one sequence of 129")):
        r = titan("run", art, "--steps", 1, "--data", path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(words), r.stderr  # once, not per rank


def test_a_token_file_shorter_than_the_run_is_said_before_it_is_read_again(tmp_path, debug_artifact):
    tokens = tmp_path / "tokens.bin"
    np.arange(5 * 128 + 1, dtype="<u2").tofile(tokens)  # 5 sequences; 3 steps x batch 2 read 6
    r = titan("run", debug_artifact(tp=2), "--steps", 3, "--data", tokens)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: --data")]
    assert notes == [f"note: --data {tokens} holds 5 sequences of 129 tokens and 3 steps read 6: the run goes over "
                     "the file 1.2 times (from its start again each time)"]
