"""The public options objects: ``VerifyOptions`` and ``SealOptions`` check every field when they are
made (before anything is read), take keywords only, and mean what the keywords of ``verify`` and
``seal`` mean, on a real backend."""

from __future__ import annotations

import dataclasses
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
        (lambda: SealOptions(granularity="chunk", chunk_size=True), ValueError, "chunk_size"),
        (lambda: SealOptions(granularity="file", chunk_size=CHUNK), ValueError, "chunk_size"),
        (lambda: SealOptions(algorithm="md5"), NotImplementedError, "md5"),
        (lambda: SealOptions(granularity="block"), NotImplementedError, "block"),
        (lambda: SealOptions(private_key="/no/such/key.pem"), (ValueError, OSError), "key"),
        (lambda: VerifyOptions(attested="yes"), ValueError, "attested"),
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


def test_the_collectives_take_options_or_keywords_never_both(backend: Backend) -> None:
    """Without a process group the collectives are the local functions: an options object made once
    seals and verifies as the same keywords do, on a real store."""
    backend.write("w.bin", bytes(range(256)) * 1024)
    where = {"storage_options": backend.storage_options}
    sealing = SealOptions(granularity="chunk", chunk_size=CHUNK)
    manifest = collectives.seal(backend.url, options=sealing, **where)
    assert (manifest.granularity, manifest.chunk_size) == ("chunk", CHUNK)
    assert ifs.read_manifest(backend.url, **where) == manifest

    checks = VerifyOptions(strict=True)
    assert collectives.verify(backend.url, options=checks, **where).files_checked == 1
    backend.write("extra.bin", b"x")
    with pytest.raises(ifs.IntegrityError, match="extra"):
        collectives.verify(backend.url, options=checks, **where)
    assert collectives.verify(backend.url, options=dataclasses.replace(checks, strict=False), **where).ok

    with pytest.raises(TypeError, match="not both"):
        collectives.verify(backend.url, options=checks, strict=True, **where)
    with pytest.raises(TypeError, match="VerifyOptions"):
        collectives.verify(backend.url, options=sealing, **where)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both"):
        collectives.seal(backend.url, options=sealing, overwrite=True, **where)


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
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"weights")
    collectives.seal(ckpt, options=sealing)
    checks = VerifyOptions(public_key=tmp_path / "key.pub", expected_name="ckpt")
    assert isinstance(checks.public_key, ec.EllipticCurvePublicKey)
    assert collectives.verify(ckpt, options=checks).ok
    with pytest.raises(ifs.SignatureError):
        collectives.verify(ckpt, options=dataclasses.replace(checks, expected_name="other"))
