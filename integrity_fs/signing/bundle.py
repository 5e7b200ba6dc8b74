"""model.sig as OpenSSF model_signing writes it with a key: a Sigstore bundle (media type v0.3)
holding a DSSE envelope over the in-toto statement of :mod:`.statement`.

Pure: bytes in, bytes out. The one parser of bundles (``formats`` reads them too).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import TYPE_CHECKING, Any

from ..errors import ManifestError, SignatureError
from ..manifest import Manifest, parse_json
from ..report import SIGNATURE_FILENAME
from .keys import PrivateKey, PublicKey, ecdsa, key_hint, load_private_key, load_public_key
from .statement import Signed, read_statement, statement

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey

__all__ = ["BUNDLE_MEDIA_TYPE", "PAYLOAD_TYPE", "open_bundle", "pae", "pae_compat", "read_envelope", "sign"]


BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"

PAYLOAD_TYPE = "application/vnd.in-toto+json"


def pae(payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding of an in-toto payload: the bytes actually signed."""
    return b"DSSEv1 %d %s %d " % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload)) + payload


def pae_compat(payload: bytes) -> bytes:
    """The encoding model_signing signed before 1.0 (``DSSEV1``, the payload as Python writes a
    bytes literal), which its 1.1.1 verifier still accepts when :func:`pae` does not verify."""
    return f"DSSEV1 {len(PAYLOAD_TYPE)} {PAYLOAD_TYPE} {len(payload)} {payload!r}".encode()


def sign(manifest: Manifest, private_key: PrivateKey, model_name: str) -> bytes:
    """``model.sig`` bytes: ``manifest``'s digests signed with ``private_key``, the statement
    naming the checkpoint ``model_name`` (its directory's name, as model_signing names it)."""
    key = load_private_key(private_key)
    payload = statement(manifest, model_name)
    signature = key.sign(pae(payload), ecdsa(key.curve.name))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(key.public_key())}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode("ascii"),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode("ascii"), "keyid": ""}],
        },
    }
    return json.dumps(bundle, separators=(",", ":")).encode("utf-8")


def read_envelope(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A model_signing bundle's JSON object and the in-toto statement it carries (the DSSE
    payload's bytes); the signature is not checked here. ``ManifestError`` says what is wrong."""
    bundle = parse_json(data, "the bundle")
    if not isinstance(bundle, dict):
        raise ManifestError(f"the bundle must be a JSON object, not {type(bundle).__name__}")
    envelope = bundle.get("dsseEnvelope")
    if not isinstance(envelope, dict):
        raise ManifestError("not a model_signing bundle: no 'dsseEnvelope' (only DSSE bundles are supported)")
    if envelope.get("payloadType") != PAYLOAD_TYPE:
        raise ManifestError(f"payload type {envelope.get('payloadType')!r} is not supported (expected {PAYLOAD_TYPE})")
    return bundle, _b64(envelope.get("payload"), "the DSSE payload")


def _b64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise ManifestError(f"{what} is not a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ManifestError(f"{what} is not valid base64 ({exc})") from exc


def open_bundle(data: bytes, public_key: PublicKey, *, location: str = "") -> Signed:
    """Check that ``data`` (``model.sig`` bytes) is signed by ``public_key``; what it covers.

    Any failure (not a bundle, another key, a bad signature, a statement that is not
    model_signing's or whose root digest does not match its resources) is a ``SignatureError``.
    """
    key = load_public_key(public_key)
    try:
        return _open_bundle(data, key, location)
    except ManifestError as exc:
        raise SignatureError(f"{SIGNATURE_FILENAME}: {exc}", location=location) from exc
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:  # a value of the wrong type
        raise SignatureError(
            f"{SIGNATURE_FILENAME} is malformed ({type(exc).__name__}: {exc})", location=location
        ) from exc


def _open_bundle(data: bytes, key: EllipticCurvePublicKey, location: str) -> Signed:
    where = SIGNATURE_FILENAME
    bundle, payload = read_envelope(data)
    if bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        raise SignatureError(f"{where} is not a Sigstore bundle of media type {BUNDLE_MEDIA_TYPE}", location=location)
    material = bundle.get("verificationMaterial")
    if not isinstance(material, dict):
        raise SignatureError(f"{where} has no verificationMaterial", location=location)
    hint = material.get("publicKey", {}).get("hint")  # not a dict: AttributeError, "malformed"
    if hint and hint != key_hint(key):
        raise SignatureError(f"{where} was signed by another key (key hint {hint})", location=location)
    signatures = bundle["dsseEnvelope"].get("signatures")
    if not isinstance(signatures, list) or not signatures or not isinstance(signatures[0], dict):
        raise SignatureError(f"{where} holds no signature", location=location)
    raw = _b64(signatures[0].get("sig"), f"{where} signature")
    from cryptography.exceptions import InvalidSignature

    algorithm = ecdsa(key.curve.name)
    try:
        key.verify(raw, pae(payload), algorithm)
    except InvalidSignature:
        try:  # as model_signing 1.1.1 does: a signature made before 1.0
            key.verify(raw, pae_compat(payload), algorithm)
        except InvalidSignature as exc:
            raise SignatureError(
                f"{where}: the signature does not verify with the given public key", location=location
            ) from exc
    return read_statement(payload)
