"""Signing keys: elliptic-curve keys (P-256, P-384, P-521) from PEM files, PEM bytes or
``cryptography`` objects, as model_signing's key method takes them. ``cryptography`` (extra
``sign``) is imported when a key is used."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, TypeAlias, cast

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey, EllipticCurvePublicKey

__all__ = ["INSTALL_HINT", "PrivateKey", "PublicKey", "ecdsa", "key_hint", "load_private_key", "load_public_key"]


INSTALL_HINT = "pip install 'integrity-fs[sign]'"

_CURVES = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}

#: A PEM file path, PEM bytes, or a ``cryptography`` key object.
PrivateKey: TypeAlias = "str | os.PathLike[str] | bytes | EllipticCurvePrivateKey"

PublicKey: TypeAlias = "str | os.PathLike[str] | bytes | EllipticCurvePublicKey"


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as exc:
        raise ImportError(f"signatures need the cryptography package: {INSTALL_HINT}") from exc
    return hashes, serialization, ec


def _pem(key: str | os.PathLike[str] | bytes) -> bytes:
    """PEM bytes, read from a local key file (a missing key file is a bad argument: ``ValueError``)."""
    if isinstance(key, bytes):
        return key
    try:
        with open(key, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the key file {os.fspath(key)!r}: {exc}") from exc


def load_private_key(key: PrivateKey) -> EllipticCurvePrivateKey:
    """An EC private key from a PEM file path, PEM bytes, or a ``cryptography`` key (returned as is).

    Only unencrypted keys on the curves model_signing supports (P-256, P-384, P-521).
    """
    _hashes, serialization, ec = _crypto()
    if isinstance(key, ec.EllipticCurvePrivateKey):
        private = key
    elif isinstance(key, (str, os.PathLike, bytes)):
        pem = _pem(key)
        try:
            private = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"cannot load the private key {_name(key)}: {exc}") from exc
    else:
        raise TypeError(f"private_key must be a PEM path or an EC private key, not {type(key).__name__}")
    if not isinstance(private, ec.EllipticCurvePrivateKey):
        raise ValueError(f"the private key {_name(key)} is not an elliptic-curve key")
    _check_curve(private.curve.name)
    return cast("EllipticCurvePrivateKey", private)


def load_public_key(key: PublicKey) -> EllipticCurvePublicKey:
    """An EC public key from a PEM file path, PEM bytes, or a ``cryptography`` key (returned as is)."""
    _hashes, serialization, ec = _crypto()
    if isinstance(key, ec.EllipticCurvePublicKey):
        public = key
    elif isinstance(key, (str, os.PathLike, bytes)):
        pem = _pem(key)
        try:
            public = serialization.load_pem_public_key(pem)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"cannot load the public key {_name(key)}: {exc}") from exc
    else:
        raise TypeError(f"public_key must be a PEM path or an EC public key, not {type(key).__name__}")
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise ValueError(f"the public key {_name(key)} is not an elliptic-curve key")
    _check_curve(public.curve.name)
    return cast("EllipticCurvePublicKey", public)


def _name(key: object) -> str:
    return (
        "(PEM bytes)" if isinstance(key, bytes) else repr(os.fspath(key)) if isinstance(key, (str, os.PathLike)) else ""
    )


def _check_curve(curve: str) -> None:
    if curve not in _CURVES:
        raise ValueError(f"unsupported curve {curve!r} (model_signing supports {', '.join(_CURVES)})")


def key_hint(public: EllipticCurvePublicKey) -> str:
    """model_signing's key identifier: the SHA-256 of the public key's PEM (SubjectPublicKeyInfo)."""
    _hashes, serialization, _ec = _crypto()
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def ecdsa(curve: str) -> Any:
    hashes, _serialization, ec = _crypto()
    return ec.ECDSA(getattr(hashes, _CURVES[curve])())
