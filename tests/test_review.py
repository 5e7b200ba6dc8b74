"""Adversarial review of formats, signing, checkpoints and attested verification: each test is a
defect found by attacking the public API (a wrong exception class, a crash over a checkpoint
deleted by rotation, a read of a vanished file raised as a storage error)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

import integrity_fs as ifs
from integrity_fs import IntegrityError, ManifestError, checkpoints, formats

HUGE = "9" * 5000  # more digits than Python converts to int by default (4300)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bundle(resources: list[dict[str, Any]], *, method: str = "shards", shard_size: float = 4.0) -> bytes:
    """An unsigned model_signing bundle over ``resources`` (formats.load checks no signature)."""
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
    serialization: dict[str, Any] = {"method": method, "hash_type": "sha256"}
    if method == "shards":
        serialization["shard_size"] = shard_size
    statement = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "m", "digest": {"sha256": root}}],
        "predicateType": "https://model_signing/signature/v1.0",
        "predicate": {"serialization": serialization, "resources": resources},
    }
    payload = base64.b64encode(json.dumps(statement).encode()).decode()
    return json.dumps({"dsseEnvelope": {"payloadType": "application/vnd.in-toto+json", "payload": payload}}).encode()


# --- formats: every parse failure is a ManifestError (CLI exit 3), never a plain ValueError ----------


@pytest.mark.parametrize("format", ["auto", "megatron", "integrity_fs"])
def test_json_manifest_with_a_huge_integer_is_a_manifest_error(format: str) -> None:
    data = f'{{"files": {{"a": "{_sha(b"")}"}}, "n": {HUGE}}}'.encode()
    with pytest.raises(ManifestError):
        formats.load(data, format)


def test_bundle_whose_payload_holds_a_huge_integer_is_a_manifest_error() -> None:
    data = _bundle([{"name": "a:0:4", "algorithm": "sha256-sharded-4", "digest": _sha(b"abcd")}])
    bundle = json.loads(data)
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    text = json.dumps(statement).replace('"shard_size": 4.0', f'"shard_size": {HUGE}')
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(text.encode()).decode()
    with pytest.raises(ManifestError):
        formats.load(json.dumps(bundle).encode())


def test_shard_offsets_with_huge_integers_are_a_manifest_error() -> None:
    data = _bundle([{"name": f"a:{HUGE}:{HUGE}1", "algorithm": "sha256-sharded-4", "digest": _sha(b"x")}])
    with pytest.raises(ManifestError, match="shard"):
        formats.load(data)


def test_verify_with_a_manifest_file_holding_a_huge_integer_is_a_manifest_error(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "integrity.json").write_text(f'{{"files": {{"a": "{_sha(b"x")}"}}, "n": {HUGE}}}')
    with pytest.raises(ManifestError, match="integrity.json"):
        ifs.verify(tmp_path, manifest="integrity.json")


def test_sha256sum_file_with_leading_blank_lines_is_read(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "SUMS").write_text(f"\n\n{_sha(b'x')}  a\n")
    assert ifs.verify(tmp_path, manifest="SUMS").files_checked == 1
    (tmp_path / "a").write_bytes(b"y")
    with pytest.raises(IntegrityError, match="a: mismatch"):
        ifs.verify(tmp_path, manifest="SUMS")


def test_shard_offsets_are_ascii_digits_only() -> None:
    # Arabic-Indic digits: not a name model_signing writes; int() would take it.
    data = _bundle([{"name": "a:\u0660:\u0664", "algorithm": "sha256-sharded-4", "digest": _sha(b"abcd")}])
    with pytest.raises(ManifestError, match="shard name"):
        formats.load(data)


# --- checkpoints: a candidate deleted by rotation is skipped, never raised as an outage -----------


def _sealed_checkpoint(root: Path, name: str) -> None:
    (root / name).mkdir()
    (root / name / "model.bin").write_bytes(os.urandom(100))
    ifs.seal(root / name)


class _DeleteOnSkip(logging.Handler):
    """Deletes ``victim`` when latest_verified logs that it skips a newer checkpoint: the run's
    rotation removing an old checkpoint while a resume looks for the newest good one."""

    def __init__(self, victim: Path) -> None:
        super().__init__(logging.WARNING)
        self.victim = victim

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("skipping") and self.victim.exists():
            for file in self.victim.iterdir():
                file.unlink()
            self.victim.rmdir()


def test_latest_verified_skips_a_candidate_that_vanishes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("step_1", "step_2", "step_3"):
        _sealed_checkpoint(tmp_path, name)
    (tmp_path / "step_3" / "model.bin").write_bytes(b"damaged")
    handler = _DeleteOnSkip(tmp_path / "step_2")
    logger = logging.getLogger("integrity_fs")
    logger.addHandler(handler)
    try:
        found = ifs.latest_verified(tmp_path)
    finally:
        logger.removeHandler(handler)
    assert found is not None and found[0] == str(tmp_path / "step_1")
    assert any("step_2" in r.getMessage() and "vanished" in r.getMessage() for r in caplog.records)


class _PhantomMemory(MemoryFileSystem):  # type: ignore[misc]
    """A listing that still shows ``run/step_9``, deleted since (an eventually consistent store,
    or a rotation between the listing and the reads)."""

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        out = super().ls(path, detail=detail, **kwargs)
        if path.rstrip("/").endswith("/run") and detail:
            out = [*out, {"name": path.rstrip("/") + "/step_9", "type": "directory", "size": 0}]
        return out


def test_status_leaves_out_a_candidate_that_vanishes() -> None:
    fs = _PhantomMemory()
    root = f"/review-{os.getpid()}/run"
    fs.pipe(f"{root}/step_1/model.bin", b"weights")
    ifs.seal(f"{root}/step_1", fs=fs)
    try:
        rows = checkpoints.status(root, fs=fs)
        assert [(r.name, r.verdict) for r in rows] == [("step_1", "ok")]
        assert ifs.latest_verified(root, fs=fs) is not None
    finally:
        fs.rm(f"/review-{os.getpid()}", recursive=True)


# --- attested verification: a file gone since the listing is "missing", never an OSError -----------


# --- signing: one parser for bundles, so what formats reads a signature check reads too ---------


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
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=[ifs.SIGNATURE_FILENAME])
    config = model_signing.signing.Config().use_elliptic_key_signer(private_key=pem)
    config.set_hashing_config(hashing).sign(root, root / ifs.SIGNATURE_FILENAME)

    assert ifs.verify(root, public_key=private.public_key()).files_checked == 1
    assert set(formats.load((root / ifs.SIGNATURE_FILENAME).read_bytes()).files) == {"model.bin"}
    (root / "model.bin").write_bytes(os.urandom(1000))
    with pytest.raises(IntegrityError, match="model.bin"):
        ifs.verify(root, public_key=private.public_key())


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


@pytest.mark.parametrize("tool", ["sha256sum", "megatron"])
def test_a_foreign_manifest_made_over_a_signed_checkpoint_verifies(tmp_path: Path, tool: str) -> None:
    """`sha256sum *` (or Megatron's writer) run over a sealed and signed checkpoint lists the
    manifest and model.sig too; model.sig is never content, so listing it is no "missing" file."""
    from cryptography.hazmat.primitives.asymmetric import ec

    (tmp_path / "a.bin").write_bytes(os.urandom(1000))
    ifs.seal(tmp_path, private_key=ec.generate_private_key(ec.SECP256R1()))
    digests = {p.name: _sha(p.read_bytes()) for p in sorted(tmp_path.iterdir())}
    assert set(digests) == {"a.bin", ifs.MANIFEST_FILENAME, ifs.SIGNATURE_FILENAME}
    if tool == "sha256sum":
        (tmp_path / "SUMS").write_text("".join(f"{d}  {n}\n" for n, d in digests.items()))
    else:
        (tmp_path / "SUMS").write_text(json.dumps({"algorithm": "sha256", "files": digests}))
    assert ifs.verify(tmp_path, manifest="SUMS").files_checked == 1
    (tmp_path / "a.bin").write_bytes(os.urandom(1000))
    with pytest.raises(IntegrityError, match="a.bin: mismatch"):
        ifs.verify(tmp_path, manifest="SUMS")
