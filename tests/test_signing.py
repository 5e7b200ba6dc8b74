"""Signed checkpoints, with the real OpenSSF model_signing package as the peer on the other side.

integrity_fs signs, model_signing verifies (both granularities); model_signing signs, integrity_fs
verifies (locally and on S3); and the attack a manifest alone cannot catch: a byte flipped and the
manifest rewritten to match.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import fsspec
import model_signing
import pytest
from conftest import Backend, backends
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import (
    MANIFEST_FILENAME,
    IntegrityError,
    ManifestNotFoundError,
    SignatureError,
    formats,
)

CHUNK = 64 * 1024
SIGNATURE_FILENAME = "model.sig"

store = backends("local", "s3")
FILES = {
    "a.bin": bytes(i * 7 % 251 for i in range(300_000)),  # 5 chunks, the last one short
    "a/x.bin": b"sorts after a.bin as a string, before it as a path",
    "sub/b.bin": bytes(i * 13 % 251 for i in range(5000)),
    "sub/deep/c.bin": bytes(i % 199 for i in range(2 * CHUNK)),  # exactly 2 chunks
    "empty.bin": b"",
}


class Keys:
    def __init__(self, root: Path, name: str) -> None:
        self.private_key = ec.generate_private_key(ec.SECP256R1())
        self.private = root / f"{name}.pem"
        self.public = root / f"{name}.pub"
        self.private.write_bytes(
            self.private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        self.public.write_bytes(
            self.private_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"), "key")


@pytest.fixture(scope="module")
def other_key(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("other-keys"), "other")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "step_100"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def _ms_verify(root: Path, public: Path, shard_size: int | None = None) -> None:
    """model_signing's Python API: verify ``root`` against its model.sig (raises ValueError)."""
    config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public)
    if shard_size is not None:
        config.set_hashing_config(model_signing.hashing.Config().use_shard_serialization(shard_size=shard_size))
    config.verify(root, root / SIGNATURE_FILENAME)


def _ms_payload(root: Path, shard_size: int | None) -> dict[str, Any]:
    """The statement model_signing would sign for ``root`` (hashed by model_signing itself)."""
    from google.protobuf import json_format

    hashing = model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILENAME, MANIFEST_FILENAME])
    if shard_size is not None:
        hashing.use_shard_serialization(shard_size=shard_size)
    payload = model_signing._signing.signing.Payload(hashing.hash(root))
    statement: dict[str, Any] = json.loads(json_format.MessageToJson(payload.statement.pb))
    return statement


def _ms_sign(root: Path, private: Path, shard_size: int | None = None) -> None:
    """model_signing's Python API signs ``root`` into root/model.sig, as its CLI does (the
    signature path ignored)."""
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILENAME, MANIFEST_FILENAME])
    if shard_size is not None:
        hashing.use_shard_serialization(shard_size=shard_size)
    config = model_signing.signing.Config().use_elliptic_key_signer(private_key=private)
    config.set_hashing_config(hashing).sign(root, root / SIGNATURE_FILENAME)


def _reseal_without_key(root: Path, **kwargs: Any) -> None:
    """What someone with write access and no key does: rewrite the manifest to match the files."""
    (root / MANIFEST_FILENAME).unlink()
    ifs.seal(root, **kwargs)


def _pae(body: bytes) -> bytes:
    """DSSE's pre-authentication encoding of an in-toto statement: what the signature signs."""
    kind = b"application/vnd.in-toto+json"
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def _signed(root: Path, key: Keys, edit: Any) -> None:
    """``root``'s model.sig with its statement changed by ``edit`` (in place) and signed again
    with ``key``, as someone holding the key could: the bundle stays well formed and verifies."""
    bundle = _bundle(root)
    statement = _statement(root)
    edit(statement)
    raw = json.dumps(statement).encode()
    signature = key.private_key.sign(_pae(raw), ec.ECDSA(hashes.SHA256()))
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(raw).decode()
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(signature).decode()
    (root / SIGNATURE_FILENAME).write_text(json.dumps(bundle))


def _bundle(root: Path) -> dict[str, Any]:
    bundle: dict[str, Any] = json.loads((root / SIGNATURE_FILENAME).read_bytes())
    return bundle


def _statement(root: Path) -> dict[str, Any]:
    statement: dict[str, Any] = json.loads(base64.b64decode(_bundle(root)["dsseEnvelope"]["payload"]))
    return statement


# --- integrity_fs signs, model_signing verifies ---------------------------------------------------


def test_model_signing_verifies_a_file_granularity_signature(ckpt: Path, key: Keys) -> None:
    manifest = ifs.seal(ckpt, private_key=key.private)
    statement = _statement(ckpt)
    assert statement["predicateType"] == "https://model_signing/signature/v1.0"
    assert statement["subject"][0]["name"] == "step_100"
    assert statement["predicate"]["serialization"]["method"] == "files"
    ignored = {MANIFEST_FILENAME, SIGNATURE_FILENAME}
    assert set(statement["predicate"]["serialization"]["ignore_paths"]) == ignored
    signed = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert signed == dict(manifest.files)
    theirs = _ms_payload(ckpt, None)
    assert statement["subject"][0]["digest"] == theirs["subject"][0]["digest"]
    assert statement["predicate"]["resources"] == theirs["predicate"]["resources"]
    _ms_verify(ckpt, key.public)  # guesses the files serialization from the signature
    assert ifs.verify(ckpt, public_key=key.public, strict=True).files_checked == len(FILES)
    _flip(ckpt / "sub" / "b.bin", 3)
    with pytest.raises(ValueError, match="sub/b.bin"):
        _ms_verify(ckpt, key.public)


def test_model_signing_cli_verifies_a_signature(ckpt: Path, key: Keys) -> None:
    """The command the README gives."""
    ifs.seal(ckpt, private_key=key.private)
    command = [sys.executable, "-m", "model_signing", "verify", "key", str(ckpt)]
    command += ["--signature", str(ckpt / SIGNATURE_FILENAME), "--public_key", str(key.public)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Verification succeeded" in done.stdout


def test_model_signing_verifies_a_chunk_granularity_signature(ckpt: Path, key: Keys) -> None:
    manifest = ifs.seal(ckpt, granularity="chunk", chunk_size=CHUNK, private_key=key.private_key)
    statement = _statement(ckpt)
    assert statement["predicate"]["serialization"]["method"] == "shards"
    assert statement["predicate"]["serialization"]["shard_size"] == CHUNK
    names = [r["name"] for r in statement["predicate"]["resources"]]
    assert names[:2] == ["a/x.bin:0:50", "a.bin:0:65536"]  # model_signing's order: by path components
    assert not any(n.startswith("empty.bin") for n in names)
    theirs = _ms_payload(ckpt, CHUNK)
    assert statement["subject"][0]["digest"] == theirs["subject"][0]["digest"]
    assert statement["predicate"]["resources"] == theirs["predicate"]["resources"]
    assert all(r["algorithm"] == f"sha256-sharded-{CHUNK}" for r in statement["predicate"]["resources"])
    assert manifest.chunks is not None
    assert [r["digest"] for r in statement["predicate"]["resources"][1:6]] == list(manifest.chunks["a.bin"])
    _ms_verify(ckpt, key.public, shard_size=CHUNK)
    _ms_verify(ckpt, key.public)  # our integer shard_size lets model_signing take its settings from model.sig
    assert ifs.verify(ckpt, public_key=key.public).ok
    _flip(ckpt / "a.bin", 2 * CHUNK + 1)
    with pytest.raises(ValueError, match="a.bin:131072:196608"):
        _ms_verify(ckpt, key.public, shard_size=CHUNK)


# --- model_signing signs, integrity_fs verifies ---------------------------------------------------


@pytest.mark.parametrize("shard_size", [None, CHUNK], ids=["files", "shards"])
def test_integrity_fs_verifies_what_model_signing_signed(ckpt: Path, key: Keys, shard_size: int | None) -> None:
    _ms_sign(ckpt, key.private, shard_size)
    # No manifest: the signed digests are the manifest (with shards, and the empty file while empty).
    report = ifs.verify(ckpt, public_key=key.public)
    signed_files = len(FILES)
    assert report.files_checked == signed_files
    with pytest.raises(ManifestNotFoundError):
        ifs.verify(ckpt)  # without a key, the signature is ignored
    # Sealed as well: the manifest must agree with the signature.
    granularity = {"granularity": "chunk", "chunk_size": shard_size} if shard_size else {}
    ifs.seal(ckpt, **granularity)
    assert ifs.verify(ckpt, public_key=key.public, strict=True).files_checked == signed_files
    _flip(ckpt / "a.bin", 100)
    with pytest.raises(IntegrityError) as caught:
        ifs.verify(ckpt, public_key=key.public)
    assert not isinstance(caught.value, SignatureError)
    assert [p.path for p in caught.value.report.problems] == ["a.bin"]


@pytest.mark.parametrize("shard_size", [None, CHUNK], ids=["files", "shards"])
def test_integrity_fs_verifies_a_model_signing_signature_on_s3(
    ckpt: Path, key: Keys, s3_backend: Any, shard_size: int | None
) -> None:
    _ms_sign(ckpt, key.private, shard_size)
    s3_backend.fs.put(f"{ckpt}/", s3_backend.root, recursive=True)
    s3_backend.fs.invalidate_cache()
    assert SIGNATURE_FILENAME in s3_backend.listdir()
    options = s3_backend.storage_options
    report = ifs.verify(s3_backend.url, storage_options=options, public_key=key.public)
    assert report.bytes_checked == sum(map(len, FILES.values()))
    s3_backend.corrupt("sub/b.bin", 7)
    with pytest.raises(IntegrityError, match="sub/b.bin"):
        ifs.verify(s3_backend.url, storage_options=options, public_key=key.public)
    s3_backend.corrupt("sub/b.bin", 7)
    # The signature on S3 is checked too: one written by another key is refused.
    s3_backend.write(SIGNATURE_FILENAME, b"{" + s3_backend.read(SIGNATURE_FILENAME))
    with pytest.raises(SignatureError, match="not valid JSON"):
        ifs.verify(s3_backend.url, storage_options=options, public_key=key.public)


def _put(ckpt: Path, store: Backend) -> None:
    for path in sorted(ckpt.rglob("*")):
        if path.is_file():
            store.write(path.relative_to(ckpt).as_posix(), path.read_bytes())


def test_an_empty_file_under_model_signing_shards_passes_while_it_is_empty(
    ckpt: Path, key: Keys, store: Backend
) -> None:
    """model_signing's shards give an empty file no shard, and its verifier accepts one: so does
    ours, while it is empty, with or without a manifest (whose entry for it must be the empty
    file's digest). A non-empty file no shard covers is refused by both."""
    _ms_sign(ckpt, key.private, CHUNK)
    assert not any(r["name"].startswith("empty.bin") for r in _statement(ckpt)["predicate"]["resources"])
    assert "integrity_fs" not in _statement(ckpt)["predicate"]  # model_signing's own statement
    _ms_verify(ckpt, key.public, CHUNK)  # the peer accepts the empty file no shard covers
    _put(ckpt, store)
    where = {"storage_options": store.storage_options}
    keyed = {**where, "public_key": key.public}

    def both(name: str, data: bytes) -> None:  # the same change on the store and on the peer's copy
        (ckpt / name).write_bytes(data)
        store.write(name, data)

    assert ifs.verify(store.url, strict=True, **keyed).files_checked == len(FILES)  # no manifest
    assert ifs.verify(store.url, attested=True, **keyed).ok
    assert ifs.verify(store.url, quick=True, **keyed).ok
    with ifs.open(store.url, "empty.bin", **keyed) as f:  # a verified read of it, too: no bytes
        assert f.read() == b""
    both("empty.bin", b"x")
    with pytest.raises(FileNotFoundError, match="empty.bin"):  # made non-empty: no longer vouched for
        ifs.open(store.url, "empty.bin", **keyed)
    both("empty.bin", b"")
    sealed = ifs.seal(store.url, granularity="chunk", chunk_size=CHUNK, **where)
    assert sealed.chunks is not None and sealed.chunks["empty.bin"] == (hashlib.sha256(b"").hexdigest(),)
    assert ifs.verify(store.url, strict=True, **keyed).files_checked == len(FILES)
    assert ifs.seal(ckpt, granularity="chunk", chunk_size=CHUNK) == sealed
    _ms_verify(ckpt, key.public, CHUNK)  # the peer too, beside the manifest

    # A manifest entry for the empty file that is not the empty file's digest is refused.
    chunks = {**sealed.chunks, "empty.bin": (hashlib.sha256(b"x").hexdigest(),)}
    files = {**sealed.files, "empty.bin": hashlib.sha256(bytes.fromhex(chunks["empty.bin"][0])).hexdigest()}
    store.write(MANIFEST_FILENAME, dataclasses.replace(sealed, files=files, chunks=chunks).to_json())
    with pytest.raises(SignatureError, match="empty.bin: in the manifest but not signed") as forged:
        ifs.verify(store.url, **keyed)
    assert [(p.path, p.kind) for p in forged.value.report.problems] == [("empty.bin", "missing")]
    store.write(MANIFEST_FILENAME, sealed.to_json())

    # The empty file made non-empty: refused with the manifest (its size), and without (not covered).
    both("empty.bin", b"x")
    with pytest.raises(IntegrityError) as resized:
        ifs.verify(store.url, **keyed)
    assert [(p.path, p.kind) for p in resized.value.report.problems] == [("empty.bin", "size")]
    store.remove(MANIFEST_FILENAME)
    with pytest.raises(SignatureError, match="does not cover: empty.bin$"):
        ifs.verify(store.url, **keyed)
    with pytest.raises(ValueError, match="empty.bin"):
        _ms_verify(ckpt, key.public, CHUNK)  # and the peer agrees

    # Any other file no shard covers is refused, by both.
    both("empty.bin", b"")
    both("added.bin", b"data")
    with pytest.raises(SignatureError, match="does not cover: added.bin$"):
        ifs.verify(store.url, **keyed)
    with pytest.raises(ValueError, match="added.bin"):
        _ms_verify(ckpt, key.public, CHUNK)


def test_integrity_fs_seals_and_signs_on_s3(ckpt: Path, key: Keys, s3_backend: Any, tmp_path: Path) -> None:
    s3_backend.fs.put(f"{ckpt}/", s3_backend.root, recursive=True)
    s3_backend.fs.invalidate_cache()
    ifs.seal(s3_backend.url, storage_options=s3_backend.storage_options, private_key=key.private)
    local = tmp_path / "downloaded"
    s3_backend.fs.get(f"{s3_backend.root}/", str(local), recursive=True)
    _ms_verify(local, key.public)


def test_a_model_signing_signature_that_lists_our_manifest_verifies(tmp_path: Path) -> None:
    """`model_signing sign` over a sealed checkpoint without --ignore-paths lists the manifest
    too: that entry is left out (as formats.load always did), the rest is checked."""
    model_signing = pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "key.pem"
    pem.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    root = tmp_path / "step_1"
    root.mkdir()
    (root / "model.bin").write_bytes(os.urandom(1000))
    ifs.seal(root)
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILENAME])
    config = model_signing.signing.Config().use_elliptic_key_signer(private_key=pem)
    config.set_hashing_config(hashing).sign(root, root / SIGNATURE_FILENAME)

    assert ifs.verify(root, public_key=private.public_key()).files_checked == 1
    assert set(formats.load((root / SIGNATURE_FILENAME).read_bytes()).files) == {"model.bin"}
    (root / "model.bin").write_bytes(os.urandom(1000))
    with pytest.raises(IntegrityError, match="model.bin"):
        ifs.verify(root, public_key=private.public_key())


# --- the attack, and every other way a signature fails ----------------------------------------------


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_resealed_tampering_passes_plain_verify_and_fails_the_signature(
    ckpt: Path, key: Keys, granularity: str
) -> None:
    options: dict[str, Any] = {"granularity": granularity}
    if granularity == "chunk":
        options["chunk_size"] = CHUNK
    ifs.seal(ckpt, private_key=key.private, **options)
    _flip(ckpt / "a.bin", 3 * CHUNK + 5)
    _reseal_without_key(ckpt, **options)
    assert ifs.verify(ckpt).ok  # a manifest alone cannot catch this
    with pytest.raises(SignatureError) as caught:
        ifs.verify(ckpt, public_key=key.public)
    assert isinstance(caught.value, IntegrityError)
    assert "a.bin: signed digest differs from the manifest's" in str(caught.value)
    (problem,) = caught.value.report.problems
    assert (problem.path, problem.kind) == ("a.bin", "mismatch")
    if granularity == "chunk":
        assert problem.byte_ranges == ((3 * CHUNK, 4 * CHUNK),)
    with pytest.raises(ValueError, match="a.bin"):  # and the peer agrees
        _ms_verify(ckpt, key.public, CHUNK if granularity == "chunk" else None)


def test_signature_by_another_key_is_refused(ckpt: Path, key: Keys, other_key: Keys) -> None:
    ifs.seal(ckpt, private_key=other_key.private)
    with pytest.raises(SignatureError, match="signed by another key"):
        ifs.verify(ckpt, public_key=key.public)
    bundle = _bundle(ckpt)
    del bundle["verificationMaterial"]["publicKey"]["hint"]  # no hint: the signature itself must fail
    (ckpt / SIGNATURE_FILENAME).write_text(json.dumps(bundle))
    with pytest.raises(SignatureError, match="does not verify with the given public key"):
        ifs.verify(ckpt, public_key=key.public)
    assert ifs.verify(ckpt, public_key=other_key.public).ok


def test_truncated_bundle_is_refused(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, private_key=key.private)
    data = (ckpt / SIGNATURE_FILENAME).read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        (ckpt / SIGNATURE_FILENAME).write_bytes(data[:cut])
        with pytest.raises(SignatureError) as caught:
            ifs.verify(ckpt, public_key=key.public)
        assert [p.path for p in caught.value.report.problems] == [SIGNATURE_FILENAME]


def test_edited_payload_is_refused(ckpt: Path, key: Keys) -> None:
    """Digests changed in the bundle without the key: the signature no longer verifies."""
    ifs.seal(ckpt, private_key=key.private)
    _flip(ckpt / "a" / "x.bin", 0)
    _reseal_without_key(ckpt)
    bundle = _bundle(ckpt)
    payload = _statement(ckpt)
    for resource in payload["predicate"]["resources"]:
        if resource["name"] == "a/x.bin":
            resource["digest"] = ifs.read_manifest(ckpt).files["a/x.bin"]
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(payload, indent=2).encode()).decode()
    (ckpt / SIGNATURE_FILENAME).write_text(json.dumps(bundle))
    with pytest.raises(SignatureError, match="does not verify"):
        ifs.verify(ckpt, public_key=key.public)


def test_signed_statement_with_a_wrong_root_digest_is_refused(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, private_key=key.private)
    _signed(ckpt, key, lambda statement: statement["subject"][0]["digest"].update(sha256="0" * 64))
    with pytest.raises(SignatureError, match="do not hash to its root digest"):
        ifs.verify(ckpt, public_key=key.public)


def test_signed_digests_that_differ_from_the_manifest_name_each_file(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, private_key=key.private)
    (ckpt / "new.bin").write_bytes(b"added after signing")
    (ckpt / "sub" / "b.bin").unlink()
    _reseal_without_key(ckpt)
    assert ifs.verify(ckpt).ok
    with pytest.raises(SignatureError) as caught:
        ifs.verify(ckpt, public_key=key.public)
    message = str(caught.value)
    assert "new.bin: in the manifest but not signed" in message
    assert "sub/b.bin: signed but not in the manifest" in message
    kinds = {p.path: p.kind for p in caught.value.report.problems}
    assert kinds == {"new.bin": "missing", "sub/b.bin": "extra"}


def test_signature_of_the_other_granularity_is_refused(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, granularity="chunk", chunk_size=CHUNK, private_key=key.private)
    _reseal_without_key(ckpt)
    with pytest.raises(SignatureError, match=f"covers shards of {CHUNK} bytes but the manifest has sha256 file"):
        ifs.verify(ckpt, public_key=key.public)
    _reseal_without_key(ckpt, granularity="chunk", chunk_size=2 * CHUNK)
    with pytest.raises(SignatureError, match="covers shards"):
        ifs.verify(ckpt, public_key=key.public)


def test_missing_signature_with_a_key_is_a_signature_error(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt)
    assert ifs.verify(ckpt).ok
    with pytest.raises(SignatureError, match="not signed") as caught:
        ifs.verify(ckpt, public_key=key.public)
    assert [(p.path, p.kind) for p in caught.value.report.problems] == [(SIGNATURE_FILENAME, "missing")]
    (ckpt / MANIFEST_FILENAME).unlink()  # neither manifest nor signature: still the signature's error
    with pytest.raises(SignatureError, match="not signed"):
        ifs.verify(ckpt, public_key=key.public)
    with pytest.raises(FileNotFoundError) as gone:
        ifs.verify(ckpt / "no-such-step", public_key=key.public)
    assert not isinstance(gone.value, ManifestNotFoundError)


def test_signature_file_is_not_content(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, private_key=key.private)
    assert SIGNATURE_FILENAME not in ifs.read_manifest(ckpt).files
    report = ifs.verify(ckpt, strict=True)
    assert report.extra == () and report.files_checked == len(FILES)
    (ckpt / "sub" / SIGNATURE_FILENAME).write_bytes(b"nested: only the root's model.sig is the signature")
    assert ifs.verify(ckpt).extra == (f"sub/{SIGNATURE_FILENAME}",)


def test_bad_keys_are_refused_before_anything_is_read(ckpt: Path, tmp_path: Path) -> None:
    rsa_pem = tmp_path / "not-a-key.pem"
    rsa_pem.write_text("not a key")
    with pytest.raises(ValueError, match="cannot load the private key"):
        ifs.seal(ckpt, private_key=rsa_pem)
    with pytest.raises(ValueError, match="cannot read the key file"):
        ifs.seal(ckpt, private_key=tmp_path / "absent.pem")
    with pytest.raises(ValueError, match="unsupported curve"):
        ifs.seal(ckpt, private_key=ec.generate_private_key(ec.SECP256K1()))
    assert not (ckpt / MANIFEST_FILENAME).exists()


# --- sign: verify first, then sign ----------------------------------------------------------------


def test_sign_verifies_then_signs_and_replaces_a_signature(ckpt: Path, key: Keys, other_key: Keys) -> None:
    with pytest.raises(ManifestNotFoundError):
        ifs.sign(ckpt, private_key=key.private)
    manifest = ifs.seal(ckpt, private_key=key.private)
    assert ifs.sign(ckpt, private_key=other_key.private) == manifest
    assert ifs.verify(ckpt, public_key=other_key.public).ok
    with pytest.raises(SignatureError, match="another key"):
        ifs.verify(ckpt, public_key=key.public)
    _ms_verify(ckpt, other_key.public)


def test_sign_never_signs_damaged_content(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, granularity="chunk", chunk_size=CHUNK)
    _flip(ckpt / "a.bin", 9)
    with pytest.raises(IntegrityError) as caught:
        ifs.sign(ckpt, private_key=key.private)
    assert not isinstance(caught.value, SignatureError)
    assert not (ckpt / SIGNATURE_FILENAME).exists()


# --- no second read --------------------------------------------------------------------------------


class _CountingFile(MemoryFile):  # type: ignore[misc]
    def read(self, *args: Any) -> bytes:
        data: bytes = super().read(*args)
        self.fs.bytes_read += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n: int = super().readinto(buffer)
        self.fs.bytes_read += n
        return n


class CountingMemoryFS(MemoryFileSystem):  # type: ignore[misc]
    """The in-memory store, counting every byte read from files opened through it."""

    protocol = "countingmemory"

    def __init__(self) -> None:
        super().__init__(skip_instance_cache=True)
        self.bytes_read = 0

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "r" in mode:
            return _CountingFile(self, f.path, f.getvalue())
        return f

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        data: bytes = super().cat_file(path, start, end, **kwargs)
        self.bytes_read += len(data)
        return data


def test_seal_with_a_key_reads_each_byte_once(key: Keys) -> None:
    fs = CountingMemoryFS()
    root = f"/signing-{uuid.uuid4().hex}"
    total = 0
    for name, data in FILES.items():
        fs.pipe_file(f"{root}/{name}", data)
        total += len(data)
    try:
        for options in ({}, {"granularity": "chunk", "chunk_size": CHUNK}):
            fs.bytes_read = 0
            if fs.exists(f"{root}/{MANIFEST_FILENAME}"):
                fs.rm_file(f"{root}/{MANIFEST_FILENAME}")
            ifs.seal(root, fs=fs, private_key=key.private, **options)
            assert fs.bytes_read == total, options
            assert fs.exists(f"{root}/{SIGNATURE_FILENAME}")
            assert ifs.verify(root, fs=fs, public_key=key.public).ok
    finally:
        fs.rm(root, recursive=True)


# --- across ranks (every rank raising the same SignatureError: test_distributed.py) ------------


def test_a_signature_error_pickles_as_itself() -> None:
    """What the collectives send between ranks (test_distributed.py checks the ranks themselves)."""
    report = ifs.Report(problems=(ifs.Problem("a.bin", "mismatch", expected="aa", actual="bb"),))
    original = SignatureError("the signed digests differ from the manifest's: a.bin", report, "s3://b/run")
    rebuilt = pickle.loads(pickle.dumps(original))
    assert type(rebuilt) is SignatureError and isinstance(rebuilt, IntegrityError)
    assert str(rebuilt) == str(original) and rebuilt.report == report and rebuilt.location == "s3://b/run"


def test_fsspec_url_of_a_signed_checkpoint(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, private_key=key.private)
    assert ifs.verify(f"file://{ckpt}", public_key=key.public).ok
    public_key = key.private_key.public_key()
    assert ifs.verify(str(ckpt), fs=fsspec.filesystem("file"), public_key=public_key).ok


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b.update(verificationMaterial=[]),
        lambda b: b["verificationMaterial"].update(publicKey="x"),
        lambda b: b.update(dsseEnvelope={"payloadType": "application/vnd.in-toto+json", "payload": 7}),
        lambda b: b["dsseEnvelope"].update(signatures=[{"sig": "!!"}]),
        lambda b: b["dsseEnvelope"].update(signatures=[]),
        lambda b: b["dsseEnvelope"].update(payloadType="text/plain"),
        lambda b: b.update(mediaType="application/vnd.dev.sigstore.bundle.v0.2+json"),
        lambda b: b.pop("dsseEnvelope"),
    ],
)
def test_malformed_bundles_are_signature_errors(ckpt: Path, key: Keys, edit: Any) -> None:
    ifs.seal(ckpt, private_key=key.private)
    bundle = _bundle(ckpt)
    edit(bundle)
    (ckpt / SIGNATURE_FILENAME).write_text(json.dumps(bundle))
    with pytest.raises(SignatureError):
        ifs.verify(ckpt, public_key=key.public)


def test_signed_shards_that_are_not_chunks_are_refused_without_a_manifest(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt, granularity="chunk", chunk_size=CHUNK, private_key=key.private)
    (ckpt / MANIFEST_FILENAME).unlink()

    def overlapping(statement: dict[str, Any]) -> None:
        resources = statement["predicate"]["resources"]
        resources.insert(1, {**resources[1], "name": "a.bin:0:1000"})  # a second digest for bytes of chunk 0
        root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
        statement["subject"][0]["digest"]["sha256"] = root

    _signed(ckpt, key, overlapping)
    with pytest.raises(SignatureError, match="not consecutive shards"):
        ifs.verify(ckpt, public_key=key.public)


def test_without_cryptography_signing_says_how_to_install_it(
    ckpt: Path, key: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    ifs.seal(ckpt)
    assert ifs.verify(ckpt).ok  # plain seal and verify never need it
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives", None)
    with pytest.raises(ImportError, match=r"integrity-fs\[sign\]"):
        ifs.verify(ckpt, public_key=key.public)
    with pytest.raises(ImportError, match=r"integrity-fs\[sign\]"):
        ifs.sign(ckpt, private_key=key.private)


def test_a_name_chunk_signatures_cannot_hold_is_refused_before_anything_is_read(tmp_path: Path, key: Keys) -> None:
    """model_signing's shards are ``name:start:end``: a non-empty ``step:1.bin`` cannot be signed in
    chunk granularity. seal and upload say so from the listing, before hashing or sending."""
    root = tmp_path / "ck"
    root.mkdir()
    (root / "step:1.bin").write_bytes(b"weights")
    (root / "ok.bin").write_bytes(b"more")
    progress = fsspec.callbacks.Callback()
    with pytest.raises(ValueError, match=r"'step:1.bin'.*granularity='file'"):
        ifs.seal(root, granularity="chunk", private_key=key.private, callback=progress)
    assert progress.size is None  # refused from the listing: no total announced, nothing hashed
    assert not (root / MANIFEST_FILENAME).exists()
    with pytest.raises(ValueError, match="step:1.bin"):
        ifs.upload(root, str(tmp_path / "dst"), granularity="chunk", private_key=key.private)
    assert not (tmp_path / "dst").exists()
    ifs.seal(root, private_key=key.private)  # file granularity signs any name
    ifs.verify(root, public_key=key.public)


# --- every file covered, in both granularities ----------------------------------------------------


def test_chunk_signatures_cover_empty_files(ckpt: Path, key: Keys) -> None:
    """model_signing's shards give an empty file no shard, so a signature of shards alone would
    let an empty file be deleted, or one added (``trust_remote_code``), with the manifest rewritten
    to match. The statement names the empty files in a field model_signing ignores: its verifier
    still accepts the signature, and ours covers every file."""
    manifest = ifs.seal(ckpt, granularity="chunk", chunk_size=CHUNK, private_key=key.private)
    assert manifest.sizes is not None and manifest.sizes["empty.bin"] == 0
    assert _statement(ckpt)["predicate"]["integrity_fs"] == {"empty_files": ["empty.bin"]}
    _ms_verify(ckpt, key.public, shard_size=CHUNK)
    _ms_verify(ckpt, key.public)
    assert ifs.verify(ckpt, public_key=key.public, strict=True).files_checked == len(FILES)
    signature = (ckpt / SIGNATURE_FILENAME).read_bytes()

    (ckpt / "empty.bin").unlink()  # a signed empty file deleted, the manifest rewritten to match
    _reseal_without_key(ckpt, granularity="chunk", chunk_size=CHUNK)
    with pytest.raises(SignatureError, match="empty.bin: signed but not in the manifest") as caught:
        ifs.verify(ckpt, public_key=key.public, strict=True)
    assert [(p.path, p.kind) for p in caught.value.report.problems] == [("empty.bin", "extra")]
    (ckpt / MANIFEST_FILENAME).unlink()  # no manifest: the signed digests name it, and it is missing
    with pytest.raises(IntegrityError) as missing:
        ifs.verify(ckpt, public_key=key.public)
    assert [(p.path, p.kind) for p in missing.value.report.problems] == [("empty.bin", "missing")]

    (ckpt / "empty.bin").write_bytes(b"")
    (ckpt / "trust_remote_code").write_bytes(b"")  # an empty file added, with its manifest entry
    ifs.seal(ckpt, granularity="chunk", chunk_size=CHUNK)
    assert (ckpt / SIGNATURE_FILENAME).read_bytes() == signature
    with pytest.raises(SignatureError, match="trust_remote_code: in the manifest but not signed"):
        ifs.verify(ckpt, public_key=key.public, strict=True)


@pytest.mark.parametrize("granularity", ["file", "chunk"])
def test_files_the_signature_does_not_cover_are_refused_without_strict(ckpt: Path, key: Keys, granularity: str) -> None:
    """model_signing's verifier refuses files its signature does not list; so does ours, strict or not."""
    shard_size = CHUNK if granularity == "chunk" else None
    ifs.seal(ckpt, granularity=granularity, chunk_size=shard_size, private_key=key.private)
    (ckpt / "sub" / "modeling_evil.py").write_bytes(b"import os")
    (ckpt / "trust_remote_code").write_bytes(b"")
    assert ifs.verify(ckpt).extra == ("sub/modeling_evil.py", "trust_remote_code")  # no key: allowed, listed
    for quick in (False, True):
        with pytest.raises(SignatureError, match="does not cover: sub/modeling_evil.py, trust_remote_code") as caught:
            ifs.verify(ckpt, public_key=key.public, quick=quick)
        assert {(p.path, p.kind) for p in caught.value.report.problems} == {
            ("sub/modeling_evil.py", "extra"),
            ("trust_remote_code", "extra"),
        }
    with pytest.raises(ValueError, match="modeling_evil.py"):  # and the peer agrees
        _ms_verify(ckpt, key.public, shard_size)


def test_a_chunk_manifest_with_a_colon_name_fails_the_signature_check_as_signature_error(tmp_path: Path) -> None:
    """model_signing's shard names cannot hold ':' (it splits on them): such a file is never
    signed, so a signature check over it is a SignatureError, not a ValueError (CLI usage error)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "model.bin").write_bytes(os.urandom(1000))
    ifs.seal(tmp_path, granularity="chunk", chunk_size=256, private_key=private)
    (tmp_path / "ab:c.bin").write_bytes(b"added after signing")
    (tmp_path / ifs.MANIFEST_FILENAME).unlink()
    ifs.seal(tmp_path, granularity="chunk", chunk_size=256)  # resealed without the key
    with pytest.raises(ifs.SignatureError, match="ab:c.bin"):
        ifs.verify(tmp_path, public_key=private.public_key())


# --- what model_signing accepts, and what we declare ----------------------------------------------


def _compat_bundle(statement: bytes, key: Keys, tmp_path: Path) -> bytes:
    """A bundle signed as model_signing signed before 1.0 (its ``pae_compat`` encoding)."""
    from model_signing._signing import sign_sigstore_pb

    signature = key.private_key.sign(sign_sigstore_pb.pae_compat(statement), ec.ECDSA(hashes.SHA256()))
    blank = tmp_path / "blank"
    blank.mkdir()
    ifs.seal(blank, private_key=key.private)  # a bundle of ours, for its shape
    bundle = _bundle(blank)
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(statement).decode()
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(signature).decode()
    return json.dumps(bundle).encode()


@pytest.mark.parametrize("predicate", ["v1.0", "v0.1"])
def test_pre_1_0_signatures_that_model_signing_accepts_are_accepted(
    ckpt: Path, key: Keys, tmp_path: Path, predicate: str
) -> None:
    """model_signing 1.1.1 verifies signatures made over its pre-1.0 encoding (``pae_compat``),
    and statements of its pre-1.0 predicate (``Digests/v0.1``: one subject per file)."""
    if predicate == "v1.0":
        statement = _ms_payload(ckpt, None)
    else:
        subjects = [{"name": n, "digest": {"sha256": hashlib.sha256(d).hexdigest()}} for n, d in FILES.items()]
        statement = {"_type": "https://in-toto.io/Statement/v1", "subject": subjects}
        statement.update(predicateType="https://model_signing/Digests/v0.1", predicate={})
    bundle = _compat_bundle(json.dumps(statement).encode(), key, tmp_path)
    outside = tmp_path / "compat.sig"  # model_signing's own check, with the bundle beside the model
    outside.write_bytes(bundle)
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=key.public).verify(ckpt, outside)
    (ckpt / SIGNATURE_FILENAME).write_bytes(bundle)
    assert ifs.verify(ckpt, public_key=key.public, strict=True).files_checked == len(FILES)
    _flip(ckpt / "a.bin", 7)
    with pytest.raises(IntegrityError, match="a.bin"):
        ifs.verify(ckpt, public_key=key.public)
    if predicate == "v0.1":  # names no checkpoint: refused where the name is checked
        with pytest.raises(SignatureError, match="does not name the checkpoint"):
            ifs.verify(ckpt, public_key=key.public, expected_name="step_100")


def test_in_root_symlinks_are_declared_and_model_signing_verifies_them(ckpt: Path, key: Keys) -> None:
    """seal hashes a symlink inside the root as its target's bytes; the statement says so
    (``allow_symlinks: true``). model_signing 1.1.1's verifier takes its own flag for it, not the
    statement's (``--allow_symlinks``; ``set_allow_symlinks(True)``), and then accepts the signature."""
    (ckpt / "link.bin").symlink_to("sub/b.bin")
    manifest = ifs.seal(ckpt, private_key=key.private)
    assert "link.bin" in manifest.files
    assert _statement(ckpt)["predicate"]["serialization"]["allow_symlinks"] is True
    hashing = model_signing.hashing.Config().set_allow_symlinks(True)
    config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=key.public)
    config.set_hashing_config(hashing).verify(ckpt, ckpt / SIGNATURE_FILENAME)
    assert ifs.verify(ckpt, public_key=key.public, strict=True).ok


@pytest.mark.timeout(20)
def test_a_fifo_named_model_sig_is_a_signature_error_and_nothing_blocks(ckpt: Path, key: Keys) -> None:
    ifs.seal(ckpt)
    os.mkfifo(ckpt / SIGNATURE_FILENAME)
    with pytest.raises(SignatureError, match="FIFO") as caught:
        ifs.verify(ckpt, public_key=key.public)
    assert [(p.path, p.kind) for p in caught.value.report.problems] == [(SIGNATURE_FILENAME, "missing")]
    assert ifs.verify(ckpt).ok  # without a key, model.sig is not looked at


# --- CRC manifests are never signed (issue 38) ----------------------------------------------------


@pytest.mark.parametrize("algorithm", ["crc64nvme", "crc32c", "blake3"])
def test_signing_refuses_a_manifest_that_is_not_sha256_before_anything_is_written(
    ckpt: Path, key: Keys, algorithm: str
) -> None:
    """A CRC only detects accidental damage (anyone can give other bytes the same CRC), and
    model_signing signs SHA-256: seal with a key refuses it before reading or writing anything,
    sign refuses it, and verify with a key says why, signed or not."""
    pytest.importorskip("blake3" if algorithm == "blake3" else "awscrt")
    progress = fsspec.callbacks.Callback()
    with pytest.raises(ValueError, match=f"cannot sign a {algorithm} manifest"):
        ifs.seal(ckpt, algorithm=algorithm, private_key=key.private, callback=progress)
    assert (
        progress.size is None and not (ckpt / MANIFEST_FILENAME).exists() and not (ckpt / SIGNATURE_FILENAME).exists()
    )

    ifs.seal(ckpt, algorithm=algorithm)
    with pytest.raises(ValueError, match=f"cannot sign a {algorithm} manifest"):
        ifs.sign(ckpt, private_key=key.private)
    assert not (ckpt / SIGNATURE_FILENAME).exists()
    why = "a CRC only detects accidental damage" if algorithm.startswith("crc") else "model_signing signs SHA-256"
    with pytest.raises(SignatureError, match=f"a {algorithm} manifest cannot be signed \\({why}\\)") as unsigned:
        ifs.verify(ckpt, public_key=key.public)
    assert [p.path for p in unsigned.value.report.problems] == [SIGNATURE_FILENAME]

    # A signature of the same files' SHA-256 digests beside a CRC manifest: still refused, saying why.
    (ckpt / MANIFEST_FILENAME).unlink()
    ifs.seal(ckpt, private_key=key.private)
    signature = (ckpt / SIGNATURE_FILENAME).read_bytes()
    ifs.seal(ckpt, algorithm=algorithm, overwrite=True)  # removes the signature of the old manifest
    (ckpt / SIGNATURE_FILENAME).write_bytes(signature)
    with pytest.raises(SignatureError, match=f"a {algorithm} manifest cannot be signed"):
        ifs.verify(ckpt, public_key=key.public)
    assert ifs.verify(ckpt).ok  # without a key the CRC manifest verifies as any other


def test_the_cli_refuses_to_sign_a_crc_manifest(ckpt: Path, key: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("awscrt")
    from integrity_fs.cli import main

    assert main(["seal", str(ckpt), "--algorithm", "crc64nvme", "--sign-key", str(key.private)]) == 2
    assert "crc64nvme" in capsys.readouterr().err
    assert not (ckpt / MANIFEST_FILENAME).exists()
    assert main(["seal", str(ckpt), "--algorithm", "crc64nvme"]) == 0
    assert main(["verify", str(ckpt), "--public-key", str(key.public)]) == 1
    assert "cannot be signed" in capsys.readouterr().err
