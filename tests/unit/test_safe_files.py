"""Reading untrusted files (runtime/common/safe_files.py): regular files only, no symbolic link below the
directory the caller chose, sized before they are read and hashed as they are, and JSON bounded
in nesting. Each refusal names the file and what is wrong with it."""

from __future__ import annotations

import hashlib
import os

import pytest

from titan.runtime.common.safe_files import UnsafeFile, loads_json, read_json, read_regular, read_user_file

DOC = b'{"format": "titan-artifact"}'


@pytest.fixture
def root(tmp_path):
    """An artifact-like directory: a document, a subdirectory, and a directory outside it."""
    (tmp_path / "art" / "graphs").mkdir(parents=True)
    (tmp_path / "art" / "manifest.json").write_bytes(DOC)
    (tmp_path / "art" / "graphs" / "g.tgraph").write_bytes(b"graph")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "g.tgraph").write_bytes(b"planted")
    return tmp_path / "art"


def _refused(root, rel: str, **kwargs) -> str:
    with pytest.raises(UnsafeFile) as e:
        read_regular(root, rel, what="the file", **dict(dict(max_size=1 << 20), **kwargs))
    return str(e.value)


def test_a_regular_file_is_read_and_checked_against_its_digest(root):
    assert read_regular(root, "manifest.json", max_size=len(DOC), what="m", sha256=hashlib.sha256(DOC).hexdigest()) == DOC
    assert read_regular(root, "graphs/g.tgraph", max_size=5, what="g") == b"graph"
    assert _refused(root, "manifest.json", sha256="0" * 64) == "the file does not match its sha256 (edited or corrupt)"
    # The directory the user named may itself be a link they made.
    (root.parent / "link-to-art").symlink_to(root)
    assert read_regular(root.parent / "link-to-art", "manifest.json", max_size=64, what="m") == DOC


def test_a_file_over_its_bound_is_refused_before_it_is_read(root):
    assert _refused(root, "manifest.json", max_size=len(DOC) - 1) == \
        f"the file is {len(DOC):,} bytes, over the bound of {len(DOC) - 1:,}"
    with open(root / "graphs" / "g.tgraph", "r+b") as f:
        f.truncate(1 << 40)  # sparse: as large as claimed, costing no disk
    assert _refused(root, "graphs/g.tgraph") == f"the file is {1 << 40:,} bytes, over the bound of {1 << 20:,}"


def test_links_below_the_chosen_directory_are_refused(root):
    (root / "link.json").symlink_to(root / "manifest.json")
    assert _refused(root, "link.json") == "the file is a symbolic link"
    (root / "linked").symlink_to(root.parent / "outside", target_is_directory=True)
    # (O_DIRECTORY | O_NOFOLLOW on a link fails with ENOTDIR on Linux, so the reason names a
    # component that is not a directory.)
    assert _refused(root, "linked/g.tgraph") == \
        "the file: a directory on its path has a path component that is not a directory"


@pytest.mark.parametrize("make, why", [
    (lambda p: os.mkfifo(p), "is not a regular file"),
    (lambda p: p.mkdir(), "is not a regular file"),
    (lambda p: None, "is missing"),
])
def test_what_is_not_a_regular_file_is_refused(root, make, why):
    make(root / "graphs" / "special")
    assert _refused(root, "graphs/special") == f"the file {why}"
    assert _refused(root, "manifest.json/x") == "the file: a directory on its path has a path component that is not a directory"


def test_a_file_the_user_names_may_be_their_link_but_must_end_at_a_regular_file(root, tmp_path):
    (tmp_path / "mine.jsonl").symlink_to(root / "manifest.json")
    assert read_user_file(tmp_path / "mine.jsonl", max_size=64, what="metrics") == DOC
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(UnsafeFile, match="^metrics is not a regular file$"):
        read_user_file(tmp_path / "zero", max_size=64, what="metrics")
    assert read_json(tmp_path / "mine.jsonl", what="manifest") == {"format": "titan-artifact"}


@pytest.mark.parametrize("text, message", [
    ("[" * 33 + "]" * 33, "doc nests deeper than 32 levels"),
    ("[" * 100_000 + "]" * 100_000, "doc holds 100,000 lists or objects and 0 strings in 200,000 bytes, more than any document titan writes"),
    ('{"a": [[[[{"b": 1}]]]]', "doc is not valid JSON"),
])
def test_json_that_is_malformed_or_too_deep_is_refused(text, message):
    assert loads_json(b"[" * 32 + b"]" * 32, "doc") is not None
    with pytest.raises(UnsafeFile) as e:
        loads_json(text.encode(), "doc")
    assert str(e.value).startswith(message)
    with pytest.raises(UnsafeFile, match="^doc is not valid JSON"):
        loads_json(b'"\xff\xfe"', "doc")
