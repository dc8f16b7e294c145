"""Code in artifacts (docs/trust.md): a run loads an artifact's compiled kernels only when its
manifest is signed by a key the user trusts, or with --trust-unsigned-kernels; otherwise it
says so in one line, compiles them itself and goes on. Nothing from an artifact is unpickled."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import msgpack
import pytest

from conftest import titan
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.kernels.artifact_trust import KernelTrust, describe_code, kernels_trusted, sign_artifact, signing_key
from titan.runtime.store.signing import KeyFileError, key_id, load_key


class _Canary:
    """Unpickling this creates the canary file: the code execution a pickled kernel would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _rehash(art: Path, m: dict) -> None:
    for rel in m["files"]:
        m["files"][rel] = hashlib.sha256((art / rel).read_bytes()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(m))


def _with_kernels(src: Path, dst: Path, payload: bytes, *, keys=("0" * 32,), tag: bool = False) -> Path:
    """A copy of `src` as a crafted artifact: built with --fuse blocks by its manifest, carrying
    `payload` as the kernel of `keys`, hashes consistent; `tag` marks a forward node a region."""
    shutil.copytree(src, dst)
    (dst / "manifest.sig").unlink()  # crafted: unsigned (titan-build signed the original with the user's key)
    m = json.loads((dst / "manifest.json").read_text())
    m["passes"] = m["passes"] + ["fuse_blocks"]
    sha = hashlib.sha256(payload).hexdigest()
    (dst / "kernels").mkdir()
    (dst / "kernels" / f"{sha}.kernel").write_bytes(payload)
    m["files"][f"kernels/{sha}.kernel"] = sha
    m["kernels"] = {key: f"kernels/{sha}.kernel" for key in keys}
    if tag:
        rel = m["programs"][0]["forward"]
        doc = msgpack.unpackb((dst / rel).read_bytes(), raw=False)
        node = next(n for n in doc["nodes"] if n.get("op") == "call_function" and "add" in str(n.get("target")))
        node["region"] = "block#0"
        (dst / rel).write_bytes(msgpack.packb(doc, use_bin_type=True))
        meta = dst / m["programs"][0]["meta"]  # the program names its graphs' digests too
        meta.write_text(meta.read_text().replace(m["files"][rel], hashlib.sha256((dst / rel).read_bytes()).hexdigest()))
    _rehash(dst, m)
    return dst


@pytest.fixture(scope="module")
def plain(debug_artifact):
    return debug_artifact()


@pytest.fixture
def keys(tmp_path):
    """Two key files: the builder's, and someone else's."""
    mine, theirs = tmp_path / "keys" / "team.key", tmp_path / "keys" / "other.key"
    return mine, theirs


def test_trust_decision_follows_the_signature_and_the_keys_named(plain, tmp_path, keys):
    team, other = keys
    art = _with_kernels(plain, tmp_path / "art", b"not a plan")
    unsigned = open_artifact(art)
    trusted, line = kernels_trusted(unsigned, KernelTrust())
    assert not trusted and "ignoring the artifact's 1 compiled kernel (it is unsigned)" in line
    assert "unsigned" in describe_code(unsigned) and "code: 1 compiled kernel" in describe_code(unsigned)
    trusted, line = kernels_trusted(unsigned, KernelTrust(unsigned=True))
    assert trusted and "--trust-unsigned-kernels" in line

    team_id = sign_artifact(art, signing_key(str(team)))
    assert (team.stat().st_mode & 0o777) == 0o600
    signed = open_artifact(art)
    assert team_id == key_id(load_key(team, create=False, what="k", fix=""))
    assert f"signed by key {team_id} (not yours" in describe_code(signed)
    trusted, line = kernels_trusted(signed, KernelTrust())
    assert not trusted and f"signed by key {team_id}, which you did not --trust" in line
    sign_artifact(art, signing_key(str(other)))  # a key made elsewhere: trusting it is not trusting team's
    trusted, _ = kernels_trusted(open_artifact(art), KernelTrust(keys=(str(team),)))
    assert not trusted
    sign_artifact(art, signing_key(str(team)))
    trusted, line = kernels_trusted(open_artifact(art), KernelTrust(keys=(str(other), str(team))))
    assert trusted and "signed by a key you trust" in line
    # Edited after signing (hashes made consistent again): the signature no longer verifies.
    m = json.loads((art / "manifest.json").read_text())
    m["name"] = "edited"
    (art / "manifest.json").write_text(json.dumps(m))
    trusted, line = kernels_trusted(open_artifact(art), KernelTrust(keys=(str(team),)))
    assert not trusted and "does not verify" in line
    # A signature file that is not one, or a link: unsigned, never followed.
    (art / "manifest.sig").write_text("[" * 100)
    assert not kernels_trusted(open_artifact(art), KernelTrust(keys=(str(team),)))[0]
    (art / "manifest.sig").unlink()
    (art / "manifest.sig").symlink_to(tmp_path / "keys" / "team.key")
    trusted, line = kernels_trusted(open_artifact(art), KernelTrust(keys=(str(team),)))
    assert not trusted and "symbolic link" in line
    # Your own key is trusted without naming it.
    (art / "manifest.sig").unlink()
    sign_artifact(art, signing_key(None))
    trusted, line = kernels_trusted(open_artifact(art), KernelTrust())
    assert trusted and "your own key" in line and "signed by your own key" in describe_code(open_artifact(art))


def test_a_trust_key_that_cannot_be_used_is_one_error_line(plain, tmp_path, keys):
    team, _ = keys
    with pytest.raises(KeyFileError):
        kernels_trusted(open_artifact(_with_kernels(plain, tmp_path / "art", b"x")), KernelTrust(keys=(str(team),)))
    r = titan("run", plain, "--steps", 1, "--trust", team)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot use the --trust key") and r.stderr.count("\n") == 1
    load_key(team, create=True, what="k", fix="")
    team.chmod(0o644)
    r = titan("run", plain, "--steps", 1, "--trust", team)
    assert r.returncode == 2 and "chmod 600" in r.stderr, r.stderr


def test_signed_build_and_show_say_who_signed_and_whether_it_carries_code(tmp_path, keys):
    team, _ = keys
    out = tmp_path / "art"
    r = titan("build", "--flavor", "debug", "--out", out, "--sign", team)
    assert r.returncode == 0, r.stderr
    assert f"signed: {out}/manifest.sig with key " in r.stdout and (out / "manifest.sig").is_file()
    show = titan("show", out, "--graph", "fw")
    assert show.returncode == 0 and show.stdout.splitlines()[0].startswith("code: none"), show.stdout[:300]
    # A rebuild without --sign is signed with the builder's own cache key: their own runs trust it.
    assert titan("build", "--flavor", "debug", "--out", out).returncode == 0
    assert "signed by your own key" in describe_code(open_artifact(out))


def test_unsigned_artifact_kernels_are_ignored_in_one_line_and_the_run_goes_on(plain, tmp_path):
    art = _with_kernels(plain, tmp_path / "art", pickle.dumps(_Canary(tmp_path / "canary")))
    r = titan("run", art, "--steps", 1, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("kernels: ")]
    assert lines == ["kernels: ignoring the artifact's 1 compiled kernel (it is unsigned); compiling them here "
                     "(titan-run --trust KEYFILE trusts its signer's key, --trust-unsigned-kernels any)"], r.stdout
    assert "step    1/1" in r.stdout
    assert not (tmp_path / "canary").exists()


@pytest.mark.slow
def test_a_pickled_kernel_under_a_live_region_is_never_unpickled_even_when_trusted(plain, tmp_path):
    # The attack of issue 29: an artifact built without --fuse, its passes forged and one node
    # tagged a region, carrying a pickle under the very key the run asks for (an attacker can
    # compute it: it depends only on the region and this host's kind).
    import torch

    import titan.runtime.kernels.fusion as fusion
    from titan.runtime.contract.graph_decode import load_graph, region_kinds

    probe = _with_kernels(plain, tmp_path / "probe", b"x", tag=True)
    art0 = open_artifact(probe)
    gm = load_graph(art0.read_verified(art0.rank_entry(0).forward), device=torch.device("cpu"), groups={},
                    regions=region_kinds(art0.manifest.passes))
    asked = []

    def record(key):
        asked.append(key)
        raise StopIteration

    with pytest.raises(StopIteration):
        fusion.compile_regions(gm, device=torch.device("cpu"), sources=fusion.KernelSources(
            device=torch.device("cpu"), artifact_kernel=record), stats=fusion.FusionStats(), memo={})
    canary = tmp_path / "canary"
    art = _with_kernels(plain, tmp_path / "art", pickle.dumps(_Canary(canary)), keys=tuple(asked), tag=True)
    for trust in ((), ("--trust-unsigned-kernels",)):
        r = titan("run", art, "--steps", 1, "--device", "cpu", *trust)
        assert r.returncode == 0, r.stderr
        assert not canary.exists(), "a kernel from the artifact was unpickled"
        fusion_line = next(line for line in r.stdout.splitlines() if line.startswith("fusion: "))
        assert "1 compiled" in fusion_line and "0 from the artifact" in fusion_line, fusion_line
        if trust:
            assert "1 of the artifact's kernels are not plans for this device" in fusion_line
