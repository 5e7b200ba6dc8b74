"""Signatures over a manifest's digests, in the format OpenSSF model_signing writes with a key.

``model.sig`` is a Sigstore bundle (media type v0.3) holding a DSSE envelope over an in-toto v1
statement whose predicate (``https://model_signing/signature/v1.0``) lists every signed resource
with its digest; the subject's digest is the SHA-256 of the resources' raw digests, in order.
File granularity is model_signing's ``files`` serialization (one resource per file, its SHA-256:
our file digest). Chunk granularity is its ``shards`` serialization with ``shard_size =
chunk_size`` (one resource ``name:start:end`` per chunk: our chunk digests; empty files have no
shard and are not signed).

Pure: bytes in, bytes out. Reading and writing ``model.sig`` is ``core``'s job. The signature
itself is ECDSA through ``cryptography`` (extra ``sign``), imported when a key is used.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from .errors import ManifestError, SignatureError
from .hashing import chunk_count, chunk_range, combine_chunk_digests
from .manifest import MANIFEST_FILENAME, Manifest, check_name, parse_json
from .report import SIGNATURE_FILENAME as SIGNATURE_FILENAME
from .report import Problem

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey, EllipticCurvePublicKey


log = logging.getLogger("integrity_fs")

INSTALL_HINT = "pip install 'integrity-fs[sign]'"

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"

#: Files model_signing's verifier must not hash: our manifest and the signature itself.
IGNORE_PATHS = (MANIFEST_FILENAME, SIGNATURE_FILENAME)
_CURVES = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}
_MAX_LISTED = 10

#: A PEM file path, PEM bytes, or a ``cryptography`` key object.
PrivateKey: TypeAlias = "str | os.PathLike[str] | bytes | EllipticCurvePrivateKey"
PublicKey: TypeAlias = "str | os.PathLike[str] | bytes | EllipticCurvePublicKey"


@dataclass(frozen=True)
class Signed:
    """What a verified signature covers: resource name -> hex digest, and how they were made.

    ``method`` is model_signing's serialization (``"files"`` or ``"shards"``); ``shard_size``
    is set for shards. Resource names are file names (files) or ``name:start:end`` (shards).
    """

    method: str
    shard_size: int | None
    resources: Mapping[str, str]
    model_name: str


# --- keys ----------------------------------------------------------------------------------------


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


def _key_hint(public: EllipticCurvePublicKey) -> str:
    """model_signing's key identifier: the SHA-256 of the public key's PEM (SubjectPublicKeyInfo)."""
    _hashes, serialization, _ec = _crypto()
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def _ecdsa(curve: str) -> Any:
    hashes, _serialization, ec = _crypto()
    return ec.ECDSA(getattr(hashes, _CURVES[curve])())


def pae(payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding of an in-toto payload: the bytes actually signed."""
    return b"DSSEv1 %d %s %d " % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload)) + payload


# --- manifest -> resources -> bundle ------------------------------------------------------------


def check_signable(algorithm: str, granularity: str) -> None:
    """``ValueError`` unless model_signing has a serialization for manifests of this kind."""
    if algorithm != "sha256":
        raise ValueError(f"signing needs algorithm 'sha256' (what model_signing verifies), not {algorithm!r}")
    if granularity not in ("file", "chunk"):
        raise ValueError(f"signing supports granularity 'file' and 'chunk', not {granularity!r}")


def _shard_name(name: str, start: int, end: int) -> str:
    return f"{name}:{start}:{end}"


def check_shard_names(granularity: str, sizes: Mapping[str, int]) -> None:
    """``ValueError`` naming a file whose shard resource model_signing could not hold: with
    chunk granularity, a non-empty file whose name has ``':'`` (shards are ``name:start:end``).
    Called on the listing, so a seal that would fail to sign fails before reading anything."""
    if granularity != "chunk":
        return
    bad = sorted(name for name, size in sizes.items() if size and ":" in name)
    if bad:
        raise ValueError(
            f"{bad[0]!r}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}: model_signing's shard "
            "names cannot hold a file name with ':' (sign with granularity='file')"
        )


def resources(manifest: Manifest) -> dict[str, str]:
    """The resources model_signing would list for ``manifest``'s files: name -> hex digest."""
    check_signable(manifest.algorithm, manifest.granularity)
    if manifest.granularity == "file":
        return dict(manifest.files)
    assert manifest.chunks is not None and manifest.sizes is not None and manifest.chunk_size is not None
    out: dict[str, str] = {}
    for name, digests in manifest.chunks.items():
        size = manifest.sizes[name]
        if size == 0:
            continue  # model_signing gives an empty file no shard
        check_shard_names("chunk", {name: size})
        for i, digest in enumerate(digests):
            out[_shard_name(name, *chunk_range(size, manifest.chunk_size, i))] = digest
    return out


def _file_order(name: str) -> tuple[str, ...]:
    """model_signing's order of files: by path components, as ``PurePosixPath`` compares."""
    return tuple(name.split("/"))


def _shard_order(name: str) -> tuple[tuple[str, ...], int, int]:
    """model_signing's order of shards: by file, then offsets."""
    path, start, end = name.rsplit(":", 2)
    return _file_order(path), int(start), int(end)


def statement(manifest: Manifest, model_name: str) -> bytes:
    """The in-toto statement model_signing would sign for ``manifest`` (its JSON layout, too)."""
    by_name = resources(manifest)
    order = _file_order if manifest.granularity == "file" else _shard_order
    algorithm = "sha256" if manifest.granularity == "file" else f"sha256-sharded-{manifest.chunk_size}"
    listed = [{"name": n, "algorithm": algorithm, "digest": by_name[n]} for n in sorted(by_name, key=order)]
    serialization: dict[str, Any] = {"method": "files" if manifest.granularity == "file" else "shards"}
    if manifest.granularity == "chunk":
        serialization["shard_size"] = manifest.chunk_size
    serialization.update(hash_type="sha256", allow_symlinks=False, ignore_paths=list(IGNORE_PATHS))
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in listed)).hexdigest()
    document = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": root}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {"serialization": serialization, "resources": listed},
    }
    return json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")


def sign(manifest: Manifest, private_key: PrivateKey, model_name: str) -> bytes:
    """``model.sig`` bytes: ``manifest``'s digests signed with ``private_key``.

    ``model_name`` is informative (model_signing uses the directory's name).
    """
    key = load_private_key(private_key)
    payload = statement(manifest, model_name)
    signature = key.sign(pae(payload), _ecdsa(key.curve.name))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": _key_hint(key.public_key())}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode("ascii"),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode("ascii"), "keyid": ""}],
        },
    }
    return json.dumps(bundle, separators=(",", ":")).encode("utf-8")


# --- bundle -> statement -> resources: the one model_signing parser (formats reads bundles too) --


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


def read_statement(payload: bytes) -> Signed:
    """The resources an in-toto statement of model_signing lists, checked: its types, one
    subject whose digest is the SHA-256 of the resources' digests in order, the ``files`` or
    ``shards`` serialization of SHA-256, every name a manifest name (shards ``name:start:end``)
    listed once. Entries for this project's manifest and ``model.sig`` (model_signing run over a
    sealed directory without ignoring them) are left out. ``ManifestError`` says what is wrong."""
    doc = parse_json(payload, "the in-toto statement")
    if not isinstance(doc, dict) or doc.get("_type") != STATEMENT_TYPE:
        kind = doc.get("_type") if isinstance(doc, dict) else type(doc).__name__
        raise ManifestError(f"statement type {kind!r} is not supported (expected {STATEMENT_TYPE})")
    if doc.get("predicateType") != PREDICATE_TYPE:
        raise ManifestError(
            f"predicate type {doc.get('predicateType')!r} is not supported (this reader knows {PREDICATE_TYPE})"
        )
    subjects = doc.get("subject")
    if not isinstance(subjects, list) or len(subjects) != 1 or not isinstance(subjects[0], dict):
        raise ManifestError("the statement must have exactly one subject")
    digest = subjects[0].get("digest")
    root = digest.get("sha256") if isinstance(digest, dict) else None
    model_name = subjects[0].get("name")
    predicate = doc.get("predicate")
    serialization = predicate.get("serialization") if isinstance(predicate, dict) else None
    listed = predicate.get("resources") if isinstance(predicate, dict) else None
    if not isinstance(serialization, dict):
        raise ManifestError("the predicate has no 'serialization' object")
    if not isinstance(listed, list) or not all(isinstance(r, dict) for r in listed):
        raise ManifestError("'resources' is not a list of objects")
    method = serialization.get("method")
    if serialization.get("hash_type") != "sha256":
        raise ManifestError(f"hash type {serialization.get('hash_type')!r} is not supported (only sha256)")
    if method not in ("files", "shards"):
        raise ManifestError(f"serialization method {method!r} is not supported (files, shards)")
    shard_size = _shard_size(serialization.get("shard_size")) if method == "shards" else None
    hasher = hashlib.sha256()
    out: dict[str, str] = {}
    seen: set[str] = set()
    for item in listed:
        name, algorithm, value = item.get("name"), item.get("algorithm"), item.get("digest")
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            raise ManifestError(f"{name!r} has no SHA-256 digest (64 hex digits): {value!r}")
        hasher.update(bytes.fromhex(value))
        path = _resource_path(name, algorithm, shard_size)
        if name in seen:
            raise ManifestError(f"{name!r} is listed twice")
        seen.add(name)
        if path in IGNORE_PATHS:
            log.warning("the signed statement lists %s: left out (never content: not verified against it)", name)
            continue
        out[name] = value.lower()
    if not isinstance(root, str) or hasher.hexdigest() != root.lower():
        raise ManifestError(
            f"the statement is inconsistent: its resources do not hash to its root digest "
            f"(subject digest {root!r}, resources {hasher.hexdigest()!r})"
        )
    return Signed(method, shard_size, out, model_name if isinstance(model_name, str) else "")


_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
# ASCII digits only (``\d`` takes any script's, which ``int`` converts), and at most 20 of them: no
# byte offset has more, and ``int`` refuses strings of over 4300 digits with a plain ValueError.
_SHARD_ALGORITHM = re.compile(r"sha256-sharded-([0-9]{1,20})(?:\.0)?")
_SHARD_NAME = re.compile(r"(?P<path>.+):(?P<start>[0-9]{1,20}):(?P<end>[0-9]{1,20})", re.DOTALL)


def _is_shard(start: int, end: int, size: int, shard_size: int) -> bool:
    """Whether ``start:end`` is one of the fixed-size shards of a file of ``size`` bytes."""
    return start % shard_size == 0 and start < size and end == min(size, start + shard_size)


def _resource_path(name: object, algorithm: object, shard_size: int | None) -> str:
    """The file a resource is of (its name, or a shard's path), checked as a manifest name."""
    if shard_size is None:
        if algorithm != "sha256":
            raise ManifestError(f"{name!r}: digest algorithm {algorithm!r} is not supported (expected sha256)")
        path = name
    else:
        found = _SHARD_ALGORITHM.fullmatch(algorithm) if isinstance(algorithm, str) else None
        if found is None or int(found[1]) != shard_size:
            raise ManifestError(
                f"{name!r}: digest algorithm {algorithm!r} is not supported (expected sha256-sharded-{shard_size})"
            )
        parsed = _SHARD_NAME.fullmatch(name) if isinstance(name, str) else None
        if parsed is None or int(parsed["start"]) >= int(parsed["end"]):
            raise ManifestError(f"shard name {name!r} is not '<path>:<start>:<end>' with start < end")
        path = parsed["path"]
    if path in IGNORE_PATHS:
        return path
    return check_name(path)


def _shard_size(value: object) -> int:
    """model_signing 1.1.1 writes ``shard_size`` as a float (``1048576.0``): accept integral ones."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ManifestError(f"shard size {value!r} is not supported (a positive whole number of bytes)")
    return value


def _b64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise ManifestError(f"{what} is not a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ManifestError(f"{what} is not valid base64 ({exc})") from exc


def signed_manifest(signed: Signed) -> Manifest:
    """The manifest of what ``signed`` lists. Shards become a chunk manifest with ``chunk_size =
    shard_size``: each file's shards must be its consecutive chunks, and its size is the last
    shard's end. ``ManifestError`` otherwise."""
    if signed.method == "files":
        return Manifest(files=dict(signed.resources))
    assert signed.shard_size is not None
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for name, digest in signed.resources.items():
        path, start, end = name.rsplit(":", 2)
        by_file.setdefault(path, []).append((int(start), int(end), digest))
    size_of, chunks = {}, {}
    for path, shards in by_file.items():
        shards.sort()
        size = shards[-1][1]
        # Compared shard by shard, never by building the list of every shard the size calls for:
        # a statement's offsets (up to 20 digits) would make that list as long as a file has bytes.
        shard_size = signed.shard_size
        count = chunk_count(size, shard_size)
        got = [(start, end) for start, end, _ in shards]
        if len(got) != count or any(chunk_range(size, shard_size, i) != r for i, r in enumerate(got)):
            odd = next((f"unexpected {path}:{a}:{b}" for a, b in got if not _is_shard(a, b, size, shard_size)), "")
            twice = "a shard listed twice" if len(set(got)) < len(got) else ""
            unexpected = odd or twice or f"{count - len(got)} of its {count} shards missing"
            raise ManifestError(
                f"shards of {path!r} are not consecutive shards of {shard_size} bytes from 0 "
                f"({unexpected}); only a fixed shard size is supported"
            )
        size_of[path] = size
        chunks[path] = tuple(digest for _, _, digest in shards)
    files = {path: combine_chunk_digests("sha256", digests) for path, digests in chunks.items()}
    return Manifest(files=files, sizes=size_of, granularity="chunk", chunk_size=signed.shard_size, chunks=chunks)


# --- bundle -> verified resources ---------------------------------------------------------------


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
    if hint and hint != _key_hint(key):
        raise SignatureError(f"{where} was signed by another key (key hint {hint})", location=location)
    signatures = bundle["dsseEnvelope"].get("signatures")
    if not isinstance(signatures, list) or not signatures or not isinstance(signatures[0], dict):
        raise SignatureError(f"{where} holds no signature", location=location)
    raw = _b64(signatures[0].get("sig"), f"{where} signature")
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(raw, pae(payload), _ecdsa(key.curve.name))
    except InvalidSignature as exc:
        raise SignatureError(
            f"{where}: the signature does not verify with the given public key", location=location
        ) from exc
    return read_statement(payload)


# --- signed resources vs a manifest -------------------------------------------------------------


def to_manifest(signed: Signed, *, location: str = "") -> Manifest:
    """:func:`signed_manifest`, for a checkpoint whose signature stands in for its manifest:
    ``SignatureError`` when the signed shards are not a chunk manifest."""
    try:
        return signed_manifest(signed)
    except ManifestError as exc:
        raise SignatureError(f"the signed {exc}", location=location) from exc


def differences(manifest: Manifest, signed: Signed) -> tuple[list[str], list[Problem]]:
    """How the signed digests differ from ``manifest``'s: lines for a message, and problems.

    Problems name files: ``"extra"`` signed but not in the manifest, ``"missing"`` in the manifest
    but not signed, ``"mismatch"`` signed with other digests (``expected`` the signed digest,
    ``actual`` the manifest's; ``byte_ranges`` the chunks that differ).
    """
    method = "files" if manifest.granularity == "file" else "shards"
    if manifest.algorithm != "sha256" or signed.method != method or signed.shard_size != manifest.chunk_size:
        shape = f"{signed.method} of {signed.shard_size} bytes" if signed.shard_size else signed.method
        mine = (
            f"chunks of {manifest.chunk_size} bytes" if manifest.chunk_size else f"{manifest.granularity} granularity"
        )
        line = f"the signature covers {shape} but the manifest has {manifest.algorithm} {mine}"
        return [line], [Problem(SIGNATURE_FILENAME, "mismatch", expected=shape, actual=mine)]
    try:
        mine_res = resources(manifest)
    except ValueError as exc:  # a name model_signing cannot sign: no signature covers this manifest
        return [str(exc)], [Problem(SIGNATURE_FILENAME, "mismatch")]
    if signed.method == "files":
        ours: dict[str, dict[str, str]] = {n: {n: d} for n, d in mine_res.items()}
        theirs: dict[str, dict[str, str]] = {n: {n: d} for n, d in signed.resources.items()}
    else:
        ours, theirs = _group_shards(mine_res), _group_shards(signed.resources)
        for name in manifest.files:  # empty files are in the manifest, and rightly not signed
            if manifest.sizes is not None and manifest.sizes[name] == 0:
                ours.setdefault(name, {})
                theirs.setdefault(name, {})
    lines: list[str] = []
    problems: list[Problem] = []
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours:
            lines.append(f"{name}: signed but not in the manifest")
            problems.append(Problem(name, "extra"))
        elif name not in theirs:
            lines.append(f"{name}: in the manifest but not signed")
            problems.append(Problem(name, "missing", expected=manifest.files[name]))
        elif ours[name] != theirs[name]:
            ranges = (
                tuple(
                    _range(r)
                    for r in sorted(set(ours[name]) | set(theirs[name]), key=_shard_order)
                    if ours[name].get(r) != theirs[name].get(r)
                )
                if signed.method == "shards"
                else ()
            )
            signed_digest = _file_digest(signed, name, theirs[name])
            where = " in bytes " + ", ".join(f"{a}-{b - 1}" for a, b in ranges) if ranges else ""
            lines.append(f"{name}: signed digest differs from the manifest's{where}")
            problems.append(
                Problem(name, "mismatch", expected=signed_digest, actual=manifest.files[name], byte_ranges=ranges)
            )
    return lines, problems


def _group_shards(by_name: Mapping[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, digest in by_name.items():
        out.setdefault(name.rsplit(":", 2)[0], {})[name] = digest
    return out


def _range(shard: str) -> tuple[int, int]:
    _path, start, end = shard.rsplit(":", 2)
    return int(start), int(end)


def _file_digest(signed: Signed, name: str, shards: Mapping[str, str]) -> str | None:
    if signed.method == "files":
        return shards[name]
    ordered = [shards[s] for s in sorted(shards, key=_shard_order)]
    return combine_chunk_digests("sha256", ordered) if ordered else None


def describe_differences(lines: list[str]) -> str:
    shown = lines[:_MAX_LISTED]
    if len(lines) > _MAX_LISTED:
        shown.append(f"... and {len(lines) - _MAX_LISTED} more")
    return "the signed digests differ from the manifest's: " + "; ".join(shown)
