"""Whose code an artifact carries: its manifest's signature, and whether a run may load the
compiled kernels it lists (docs/trust.md).

An artifact's kernels (titan-build --kernels) are GPU code. titan-build signs every artifact it
writes: with the key file given to --sign, else with the user's own cache key ($TITAN_KEY_FILE).
A run loads an artifact's kernels only when the manifest is signed with a key the user trusts:
their own cache key, or a key file they name with `titan-run --trust KEYFILE`; or when they opt in with
`--trust-unsigned-kernels`. Otherwise the kernels are ignored, the run says so in one line and
compiles the regions itself (from its own kernel store when it has them). The manifest names
every file of the artifact by sha256, so signing it signs them all.

The signature is `manifest.sig` beside the manifest: {"format", "version", "key_id", "mac"},
where mac is the HMAC-SHA256 of the manifest's bytes (runtime/store/signing.py, the one signing
mechanism titan has; kind "artifact-manifest") and key_id names the key without revealing it.
With HMAC whoever can check a signature can also make one: give a key only to builders you
trust with code in your jobs (the same people who could hand you a wheel).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from titan.runtime.contract.manifest import MANIFEST
from titan.runtime.store.signing import KeyFileError, key_file, key_id, load_key, mac, user_key
from titan.runtime.common.safe_files import UnsafeFile, loads_json, read_regular

SIGNATURE = "manifest.sig"
SIGNATURE_FORMAT = "titan-artifact-signature"
SIGNATURE_VERSION = 1
KIND = "artifact-manifest"
MAX_SIGNATURE_BYTES = 4096
_KEY_ID_HEX = frozenset("0123456789abcdef")


@dataclass(kw_only=True, frozen=True, slots=True)
class KernelTrust:
    """Which artifacts' kernels a run loads (titan-run / titan-verify options)."""
    keys: tuple[str, ...] = ()
    """Key files (--trust KEYFILE): an artifact signed with one of them is trusted."""
    unsigned: bool = False
    """--trust-unsigned-kernels: load the artifact's kernels whoever signed it, or no one."""


@dataclass(frozen=True, slots=True)
class Signature:
    key_id: str
    mac: str


def signing_key(path: str | None) -> bytes:
    """The key titan-build signs with: the key file given to --sign (made, 0600, if there is
    none), else the user's own cache key (so that the user's own artifacts carry their kernels
    to wherever that key is)."""
    if path is None:
        return user_key()
    return load_key(Path(path), create=True, what="the signing key",
                    fix="give --sign a key file only you can read (a new one is made where none is)")


def sign_artifact(root: Path, key: bytes) -> str:
    """Sign the manifest of the artifact at `root` with `key`; returns the key's id."""
    data = read_regular(root, MANIFEST, max_size=64 << 20, what=str(root / MANIFEST))
    doc = {"format": SIGNATURE_FORMAT, "version": SIGNATURE_VERSION, "key_id": key_id(key),
           "mac": mac(key, KIND, MANIFEST, data)}
    tmp = root / f".{SIGNATURE}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc) + "\n")
    os.replace(tmp, root / SIGNATURE)
    return doc["key_id"]


def read_signature(root: Path) -> Signature | str | None:
    """The artifact's signature; None when it has none; a string saying what is wrong with a
    malformed one (a run then treats the artifact as unsigned)."""
    if not os.path.lexists(root / SIGNATURE):
        return None
    try:
        doc = loads_json(read_regular(root, SIGNATURE, max_size=MAX_SIGNATURE_BYTES, what=str(root / SIGNATURE)),
                         str(root / SIGNATURE), max_depth=2)
    except UnsafeFile as e:
        return str(e)
    if not (isinstance(doc, dict) and doc.get("format") == SIGNATURE_FORMAT and doc.get("version") == SIGNATURE_VERSION
            and _hex(doc.get("key_id"), 16) and _hex(doc.get("mac"), 64)):
        return f"{root / SIGNATURE} is not a titan signature"
    return Signature(key_id=doc["key_id"], mac=doc["mac"])


def _hex(value, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and set(value) <= _KEY_ID_HEX


def own_key() -> bytes | None:
    """The user's own key, if there is a usable one (never made here)."""
    try:
        return load_key(key_file(), create=False, what="the cache signing key", fix="")
    except KeyFileError:
        return None


def signed_by(manifest_bytes: bytes, signature: Signature, keys: list[bytes]) -> bytes | None:
    """The key among `keys` whose MAC of the manifest is the signature's, if any."""
    for key in keys:
        if key_id(key) == signature.key_id and hmac.compare_digest(mac(key, KIND, MANIFEST, manifest_bytes),
                                                                    signature.mac):
            return key
    return None


def check_keys(trust: KernelTrust) -> list[bytes]:
    """The keys of the --trust key files; KeyFileError (one line) for one that cannot be used."""
    return [load_key(Path(k), create=False, what="the --trust key",
                     fix="give --trust a key file made by titan-build --sign (mode 0600)") for k in trust.keys]


def kernels_trusted(art, trust: KernelTrust) -> tuple[bool, str]:
    """Whether a run loads the kernels the artifact carries, and the one line it says about
    them ('' when it carries none). A key file named with --trust that cannot be used is an
    error (the user asked for it); everything about the artifact is only a reason to ignore."""
    count = len(art.manifest.kernels)
    if not count:
        return False, ""
    named = check_keys(trust)
    what = f"the artifact's {count} compiled kernel{'s' * (count > 1)}"
    signature = read_signature(art.root)
    if isinstance(signature, Signature):
        mine = own_key()
        key = signed_by(art.manifest_bytes, signature, named + ([mine] if mine is not None else []))
        if key is not None:
            whose = "your own key" if key == mine else "a key you trust (--trust)"
            return True, f"kernels: {what} are signed by {whose} ({signature.key_id}); loading them"
        known = named + ([mine] if mine is not None else [])
        why = (f"the signature by {signature.key_id} does not verify: the manifest changed after signing"
               if any(key_id(k) == signature.key_id for k in known)
               else f"they are signed by key {signature.key_id}, which you did not --trust")
    elif signature is None:
        why = "it is unsigned"
    else:
        why = f"its signature is unusable: {signature}"
    if trust.unsigned:
        return True, f"kernels: loading {what} although {why} (--trust-unsigned-kernels)"
    return False, (f"kernels: ignoring {what} ({why}); compiling them here (titan-run --trust KEYFILE trusts its "
                   "signer's key, --trust-unsigned-kernels any)")


def describe_code(art) -> str:
    """titan-show's line: whether the artifact carries code, and who signed it."""
    count = len(art.manifest.kernels)
    head = (f"code: {count} compiled kernel{'s' * (count > 1)} (kernel plans: GPU code)" if count else
            "code: none (graphs and metadata only; titan-run generates any kernels itself)")
    signature = read_signature(art.root)
    if not isinstance(signature, Signature):
        why = "unsigned" if signature is None else signature
        return f"{head}; {why}" + (": titan-run ignores them unless given --trust-unsigned-kernels" if count else "")
    mine = own_key()
    if mine is not None and signed_by(art.manifest_bytes, signature, [mine]) is not None:
        return f"{head}; signed by your own key ({signature.key_id})"
    return (f"{head}; signed by key {signature.key_id} (not yours" +
            (": titan-run loads them with --trust KEYFILE for that key)" if count else ")"))
