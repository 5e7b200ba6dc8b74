"""The public options objects: ``VerifyOptions`` and ``SealOptions`` check every field when they are
made (before anything is read), take keywords only, and mean what the keywords of ``verify`` and
``seal`` mean, on a real backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Backend

import integrity_fs as ifs
from integrity_fs import SealOptions, VerifyOptions
from integrity_fs import distributed as collectives

CHUNK = 64 * 1024


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SealOptions(chunk_size=0), ValueError, "chunk_size"),
        (lambda: SealOptions(granularity="chunk", chunk_size=True), TypeError, "chunk_size"),
        (lambda: SealOptions(granularity="chunk", chunk_size=1.5), TypeError, "chunk_size"),
        (lambda: SealOptions(granularity="file", chunk_size=CHUNK), ValueError, "chunk_size"),
        (lambda: SealOptions(algorithm="md5"), NotImplementedError, "md5"),
        (lambda: SealOptions(granularity="block"), NotImplementedError, "block"),
        (lambda: SealOptions(overwrite="yes"), TypeError, "overwrite"),
        (lambda: SealOptions(max_workers=0), ValueError, "max_workers"),
        (lambda: SealOptions(private_key="/no/such/key.pem"), (ValueError, OSError), "key"),
        (lambda: SealOptions.of(callback=print), TypeError, "callback"),
        (lambda: VerifyOptions(attested="yes"), TypeError, "attested"),
        (lambda: VerifyOptions(attested="crc"), TypeError, "attested"),
        (lambda: VerifyOptions(quick=1), TypeError, "quick"),
        (lambda: VerifyOptions(strict="false"), TypeError, "strict"),
        (lambda: VerifyOptions(max_workers=2.0), TypeError, "max_workers"),
        (lambda: VerifyOptions(quick=True, attested=True), ValueError, "quick"),
        (lambda: VerifyOptions(manifest_format="xml"), ValueError, "xml"),
        (lambda: VerifyOptions(manifest=""), ValueError, "empty"),
        (lambda: VerifyOptions(manifest=3), TypeError, "manifest"),
        (lambda: VerifyOptions(expected_name="step_1"), ValueError, "public_key"),
    ],
)
def test_a_bad_field_is_refused_when_the_object_is_made(make: Any, error: Any, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_fields_are_keywords_only() -> None:
    """Seven flags in a row are too easy to misorder: a positional one is a ``TypeError``."""
    with pytest.raises(TypeError):
        VerifyOptions(True)  # type: ignore[misc]
    with pytest.raises(TypeError):
        SealOptions("sha256")  # type: ignore[misc]


def test_seal_options_fill_in_the_default_chunk_size() -> None:
    assert SealOptions(granularity="chunk").chunk_size == 64 * 1024 * 1024
    assert SealOptions().chunk_size is None


def test_verify_and_seal_refuse_a_bad_keyword_before_reading_anything(backend: Backend) -> None:
    """The keywords are the options' fields, checked by type: a truthy string never turns a hash
    into a size check, and an unknown keyword is a ``TypeError``."""
    backend.write("w.bin", bytes(range(256)) * 16)
    where = {"storage_options": backend.storage_options}
    ifs.seal(backend.url, **where)
    backend.corrupt("w.bin")
    loose: Any = ifs
    with pytest.raises(TypeError, match="quick"):
        loose.verify(backend.url, quick="false", **where)
    with pytest.raises(TypeError):
        loose.verify(backend.url, no_such_option=True, **where)
    with pytest.raises(TypeError, match="overwrite"):
        loose.seal(backend.url, overwrite="true", **where)
    with pytest.raises(ifs.IntegrityError):  # nothing re-sealed the damage
        ifs.verify(backend.url, **where)


def test_the_collectives_take_the_same_keywords_without_a_process_group(backend: Backend) -> None:
    """Without a process group the collectives are the local functions: the same keywords seal
    and verify as ``seal`` and ``verify`` do, on a real store, and are checked the same way."""
    backend.write("w.bin", bytes(range(256)) * 1024)
    where = {"storage_options": backend.storage_options}
    manifest = collectives.seal(backend.url, granularity="chunk", chunk_size=CHUNK, **where)
    assert (manifest.granularity, manifest.chunk_size) == ("chunk", CHUNK)
    assert ifs.read_manifest(backend.url, **where) == manifest

    assert collectives.verify(backend.url, strict=True, **where).files_checked == 1
    backend.write("extra.bin", b"x")
    with pytest.raises(ifs.IntegrityError, match="extra"):
        collectives.verify(backend.url, strict=True, **where)
    assert collectives.verify(backend.url, **where).ok
    loose: Any = collectives
    with pytest.raises(TypeError, match="strict"):
        loose.verify(backend.url, strict="yes", **where)
    with pytest.raises(TypeError, match="overwrite"):
        loose.seal(backend.url, overwrite=1, **where)


def test_an_options_object_carries_a_loaded_key(tmp_path: Path) -> None:
    """A key named by path is loaded once, when the options are made: the object then holds the key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (tmp_path / "key.pub").write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    sealing = SealOptions(private_key=tmp_path / "key.pem")
    assert isinstance(sealing.private_key, ec.EllipticCurvePrivateKey)
    with pytest.raises(ValueError, match="sha256"):
        SealOptions(algorithm="blake3", private_key=tmp_path / "key.pem")  # only SHA-256 manifests are signed
    checks = VerifyOptions(public_key=tmp_path / "key.pub", expected_name="ckpt")
    assert isinstance(checks.public_key, ec.EllipticCurvePublicKey)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"weights")
    ifs.seal(ckpt, private_key=tmp_path / "key.pem")
    assert ifs.verify(ckpt, public_key=tmp_path / "key.pub", expected_name="ckpt").ok
    with pytest.raises(ifs.SignatureError):
        ifs.verify(ckpt, public_key=tmp_path / "key.pub", expected_name="other")
