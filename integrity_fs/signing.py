"""``model.sig``: a manifest's digests signed as OpenSSF model_signing signs with a key, a Sigstore
bundle (v0.3) of a DSSE envelope over an in-toto statement listing each resource's SHA-256. File
granularity is its ``files`` serialization, chunk granularity its ``shards`` (``shard_size =
chunk_size``); an empty file has no shard, so our statements name empty files in a field it ignores
(``integrity_fs.empty_files``). Pure; ECDSA is ``cryptography``'s (extra ``sign``), imported on use."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ManifestError, SignatureError
from .hashing import check_signable, chunk_range, combine, is_crc
from .manifest import MANIFEST_FILENAME, Manifest, check_name, parse_json
from .report import Problem, Report, printable, shortened

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey, EllipticCurvePublicKey

__all__ = [
    "SIGNATURE_FILENAME",
    "check",
    "check_names",
    "check_signed_algorithm",
    "load_private_key",
    "load_public_key",
    "sign",
    "with_empty_files",
]

log = logging.getLogger("integrity_fs")

SIGNATURE_FILENAME = "model.sig"
_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
_PAYLOAD_TYPE = "application/vnd.in-toto+json"
_STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
_PREDICATE_TYPE = "https://model_signing/signature/v1.0"
_PREDICATE_V01 = "https://model_signing/Digests/v0.1"  # before 1.0: one subject per file; 1.1.1 accepts it
_IGNORE_PATHS = (MANIFEST_FILENAME, SIGNATURE_FILENAME)  # never content
_EMPTY = hashlib.sha256(b"").hexdigest()  # the one chunk of an empty file
_CURVES = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
# ASCII digits, at most 20: no offset has more, and int() takes any script's digits (and refuses 4300).
_SHARD_ALGORITHM = re.compile(r"sha256-sharded-([0-9]{1,20})(?:\.0)?")
_SHARD_NAME = re.compile(r"(.+):([0-9]{1,20}):([0-9]{1,20})", re.DOTALL)
#: What reading a bundle raises: a ManifestError, or a value of the wrong type ("malformed").
_MALFORMED = (AttributeError, TypeError, KeyError, IndexError, ValueError)


def _crypto() -> Any:
    try:
        from cryptography import exceptions
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as exc:
        hint = "signatures need the cryptography package: pip install 'integrity-fs[sign]'"
        raise ModuleNotFoundError(hint, name="cryptography") from exc
    return exceptions, hashes, serialization, ec


def _load_key(key: Any, kind: str) -> Any:
    exceptions, _hashes, serialization, ec = _crypto()
    wanted = ec.EllipticCurvePrivateKey if kind == "private" else ec.EllipticCurvePublicKey
    if not isinstance(key, (wanted, str, os.PathLike, bytes)):
        raise TypeError(f"{kind}_key must be a PEM path, PEM bytes or an EC {kind} key, not {type(key).__name__}")
    if not isinstance(key, wanted):
        what = "(PEM bytes)" if isinstance(key, bytes) else repr(os.fspath(key))
        try:
            pem = key if isinstance(key, bytes) else Path(key).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the key file {what}: {exc}") from exc
        load = serialization.load_pem_private_key if kind == "private" else serialization.load_pem_public_key
        try:
            key = load(pem, None)  # no password (private), no backend (public)
        except (ValueError, TypeError, exceptions.UnsupportedAlgorithm) as exc:
            raise ValueError(f"cannot load the {kind} key {what}: {exc}") from exc
        if not isinstance(key, wanted):
            raise ValueError(f"the {kind} key {what} is not an elliptic-curve key")
    if key.curve.name not in _CURVES:
        raise ValueError(f"unsupported curve {key.curve.name!r} (model_signing supports {', '.join(_CURVES)})")
    return key


def load_private_key(key: Any) -> EllipticCurvePrivateKey:
    """An unencrypted EC private key (P-256, P-384, P-521): a PEM path, PEM bytes, or a key object."""
    return _load_key(key, "private")  # type: ignore[no-any-return]


def load_public_key(key: Any) -> EllipticCurvePublicKey:
    """An EC public key: a PEM path, PEM bytes, or a ``cryptography`` key object (returned as is)."""
    return _load_key(key, "public")  # type: ignore[no-any-return]


def _ecdsa(key: Any) -> Any:
    _exceptions, hashes, _serialization, ec = _crypto()
    return ec.ECDSA(getattr(hashes, _CURVES[key.curve.name])())


def _key_hint(public: Any) -> str:  # model_signing's key identifier: the SHA-256 of the public key's PEM
    pem = public.public_bytes(_crypto()[2].Encoding.PEM, _crypto()[2].PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def _pae(payload: bytes, compat: bool = False) -> bytes:
    """DSSE's pre-authentication encoding (the bytes signed); ``compat``: model_signing's before 1.0."""
    if compat:
        return f"DSSEV1 {len(_PAYLOAD_TYPE)} {_PAYLOAD_TYPE} {len(payload)} {payload!r}".encode()
    return b"DSSEv1 %d %s %d " % (len(_PAYLOAD_TYPE), _PAYLOAD_TYPE.encode(), len(payload)) + payload


def check_names(sizes: Mapping[str, int], chunk_size: int | None) -> None:
    """``ValueError`` for a file that a signature of these chunks cannot name: model_signing's
    shards are ``name:start:end``, so a non-empty chunked file's name cannot hold ':'."""
    colon = [repr(n) for n, size in sizes.items() if size and ":" in n and chunk_size]
    if colon:
        raise ValueError(f"{shortened(colon, 1)}: model_signing's shards cannot hold ':' (sign granularity='file')")


def sign(manifest: Manifest, private_key: Any, name: str) -> bytes:
    """``model.sig`` bytes: ``manifest``'s digests signed, the statement naming the checkpoint ``name``
    (as model_signing names the model). ``ValueError`` for a digest that is not SHA-256, or a chunked
    file name with ':'. ``allow_symlinks``: a symlink in the root is its target's bytes, as here."""
    check_signable(manifest.algorithm)
    key = load_private_key(private_key)
    chunk_size, sizes = manifest.chunk_size, manifest.sizes or {}
    check_names(sizes, chunk_size)
    listed = []  # (name, algorithm, digest) in model_signing's order: by path components
    for n in sorted(manifest.files, key=lambda n: n.split("/")):
        if chunk_size is None:
            listed.append((n, "sha256", manifest.files[n]))
        for i, digest in enumerate(manifest.chunks[n] if manifest.chunks and sizes[n] else ()):  # empty: no shard
            start, end = chunk_range(sizes[n], chunk_size, i)  # type: ignore[arg-type]
            listed.append((f"{n}:{start}:{end}", f"sha256-sharded-{chunk_size}", digest))
    shape = {"method": "shards", "shard_size": chunk_size} if chunk_size else {"method": "files"}
    form = {**shape, "hash_type": "sha256", "allow_symlinks": True, "ignore_paths": [*_IGNORE_PATHS]}
    predicate = {"serialization": form, "resources": [{"name": n, "algorithm": a, "digest": d} for n, a, d in listed]}
    if chunk_size is not None:
        empty = sorted((n for n, size in sizes.items() if not size), key=lambda n: n.split("/"))
        predicate["integrity_fs"] = {"empty_files": empty}
    root = hashlib.sha256(b"".join(bytes.fromhex(d) for *_, d in listed)).hexdigest()
    subject = [{"name": name, "digest": {"sha256": root}}]
    statement = {"_type": _STATEMENT_TYPE, "subject": subject, "predicateType": _PREDICATE_TYPE, "predicate": predicate}
    payload = json.dumps(statement, indent=2, ensure_ascii=False).encode("utf-8")
    signature = {"sig": base64.b64encode(key.sign(_pae(payload), _ecdsa(key))).decode(), "keyid": ""}
    envelope = {"payload": base64.b64encode(payload).decode(), "payloadType": _PAYLOAD_TYPE, "signatures": [signature]}
    material = {"publicKey": {"hint": _key_hint(key.public_key())}, "tlogEntries": []}
    bundle = {"mediaType": _MEDIA_TYPE, "verificationMaterial": material, "dsseEnvelope": envelope}
    return json.dumps(bundle, separators=(",", ":")).encode("utf-8")


def _left_out(name: object, where: str) -> bool:
    """Whether ``name`` is our manifest or signature (never content), listed by a tool: left out, warned."""
    if name not in _IGNORE_PATHS:
        return False
    log.warning("%s lists %s: left out (never content: not verified against it)", where, printable(str(name)))
    return True


def _read(data: bytes, key: Any = None) -> tuple[Manifest, str, bool]:
    """The manifest a bundle signs (shards: a chunk manifest), the checkpoint it names (``""``: none), if
    it names the empty files it vouches for; with ``key``, its signature checked first. Raises _MALFORMED."""
    bundle = parse_json(data, "the bundle")
    envelope = bundle.get("dsseEnvelope") if isinstance(bundle, dict) else None
    if not isinstance(envelope, dict):
        raise ManifestError("not a model_signing bundle: no 'dsseEnvelope' (only DSSE bundles are supported)")
    if envelope.get("payloadType") != _PAYLOAD_TYPE:
        raise ManifestError(f"payload type {envelope.get('payloadType')!r} is not supported (expected {_PAYLOAD_TYPE})")
    payload = base64.b64decode(envelope["payload"], validate=True)
    if key is not None:
        if bundle.get("mediaType") != _MEDIA_TYPE:
            raise ManifestError(f"not a Sigstore bundle of media type {_MEDIA_TYPE}")
        hint = bundle["verificationMaterial"].get("publicKey", {}).get("hint")  # none: the signature decides
        if hint and hint != _key_hint(key):
            raise ManifestError(f"signed by another key (key hint {hint})")
        if not envelope.get("signatures"):
            raise ManifestError("the bundle holds no signature")
        raw, invalid = base64.b64decode(envelope["signatures"][0]["sig"], validate=True), _crypto()[0].InvalidSignature
        for compat in (False, True):  # as model_signing 1.1.1 does: a signature made before 1.0 too
            with contextlib.suppress(invalid):
                key.verify(raw, _pae(payload, compat), _ecdsa(key))
                break
        else:
            raise ManifestError("the signature does not verify with the given public key")
    doc = parse_json(payload, "the in-toto statement")
    if not isinstance(doc, dict) or doc.get("_type") != _STATEMENT_TYPE:
        raise ManifestError(f"the payload is not an in-toto statement of type {_STATEMENT_TYPE}")
    predicate_type, model, shard_size = doc.get("predicateType"), "", 0  # 0: files
    if predicate_type == _PREDICATE_V01:  # no root digest, no model name
        listed = [{**s, "digest": s["digest"].get("sha256"), "algorithm": "sha256"} for s in doc["subject"]]
        method, extension, root = "files", None, None
    elif predicate_type == _PREDICATE_TYPE:
        (subject,), predicate = doc["subject"], doc["predicate"]
        model, root = subject.get("name") if isinstance(subject.get("name"), str) else "", subject["digest"]["sha256"]
        form, listed, extension = predicate["serialization"], predicate["resources"], predicate.get("integrity_fs")
        method = form.get("method")
        if form.get("hash_type") != "sha256":
            raise ManifestError(f"hash type {form.get('hash_type')!r} is not supported (only sha256)")
        if method not in ("files", "shards"):
            raise ManifestError(f"serialization method {method!r} is not supported (files, shards)")
        if method == "shards":  # model_signing 1.1.1 writes it as a float
            shard_size = form.get("shard_size")
            if type(shard_size) not in (int, float) or shard_size <= 0 or shard_size % 1:
                raise ManifestError(f"shard size {shard_size!r} is not supported (a positive whole number of bytes)")
            shard_size = int(shard_size)
    else:
        raise ManifestError(f"predicate type {predicate_type!r} is not supported (this reader knows {_PREDICATE_TYPE})")
    if not isinstance(listed, list):
        raise ManifestError("'resources' is not a list")
    expected = "sha256" if method == "files" else f"sha256-sharded-{shard_size}"
    hasher, seen, files = hashlib.sha256(), set(), {}
    shards: dict[str, list[tuple[int, int, str]]] = {}  # path -> [(start, end, digest)]
    for item in listed:
        name, algorithm, digest = item.get("name"), item.get("algorithm"), item.get("digest")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ManifestError(f"{name!r} has no SHA-256 digest (64 hex digits): {digest!r}")
        hasher.update(bytes.fromhex(digest))
        if name in seen:
            raise ManifestError(f"{name!r} is listed twice")
        seen.add(name)
        found = _SHARD_ALGORITHM.fullmatch(algorithm) if isinstance(algorithm, str) else None
        if algorithm != expected and not (shard_size and found and int(found[1]) == shard_size):
            raise ManifestError(f"{name!r}: digest algorithm {algorithm!r} is not supported (expected {expected})")
        if method == "files":
            if not _left_out(name, "the signed statement"):
                files[check_name(name)] = digest.lower()
            continue
        parsed = _SHARD_NAME.fullmatch(name) if isinstance(name, str) else None
        if parsed is None or int(parsed[2]) >= int(parsed[3]):
            raise ManifestError(f"shard name {name!r} is not '<path>:<start>:<end>' with start < end")
        if not _left_out(parsed[1], "the signed statement"):
            shards.setdefault(check_name(parsed[1]), []).append((int(parsed[2]), int(parsed[3]), digest.lower()))
    if predicate_type == _PREDICATE_TYPE and (not isinstance(root, str) or hasher.hexdigest() != root.lower()):
        raise ManifestError(f"the statement is inconsistent: its resources do not hash to its root digest {root!r}")
    if method == "files":
        return Manifest(files=files), model, True
    sizes, chunks = {}, {}
    for path, got in shards.items():
        got.sort()
        size = got[-1][1]
        # Shard by shard, never a list of every shard the size calls for (offsets have up to 20 digits).
        odd = next(((a, b) for i, (a, b, _) in enumerate(got) if (a, b) != chunk_range(size, shard_size, i)), None)
        if odd is not None:
            raise ManifestError(
                f"shards of {path!r} are not consecutive shards of {shard_size} bytes from 0 "
                f"(unexpected {path}:{odd[0]}:{odd[1]}); only a fixed shard size is supported"
            )
        sizes[path], chunks[path] = size, tuple(digest for _, _, digest in got)
    names = () if extension is None else extension["empty_files"]  # our statements name them
    if not isinstance(names, (list, tuple)):
        raise ManifestError("'integrity_fs.empty_files' is not a list of names")
    for name in names:
        if name in chunks:
            raise ManifestError(f"{name!r} is named as an empty file twice, or also has shards")
        if not _left_out(name, "the signed statement"):
            sizes[check_name(name)], chunks[name] = 0, (_EMPTY,)
    files = {path: combine("sha256", digests, sizes[path], shard_size) for path, digests in chunks.items()}
    manifest = Manifest(files, sizes, granularity="chunk", chunk_size=shard_size, chunks=chunks)
    return manifest, model, extension is not None


def check_signed_algorithm(manifest: Manifest, location: str = "") -> None:
    """``SignatureError`` for a manifest no signature can vouch for: not SHA-256 (a CRC only
    detects accidental damage; model_signing signs SHA-256), whatever ``model.sig`` holds."""
    if manifest.algorithm != "sha256":
        why = "a CRC only detects accidental damage" if is_crc(manifest.algorithm) else "model_signing signs SHA-256"
        problem = Problem(SIGNATURE_FILENAME, "mismatch", expected="sha256", actual=manifest.algorithm)
        detail = f"a {manifest.algorithm} manifest cannot be signed ({why}); seal with algorithm='sha256' to sign"
        raise SignatureError(detail, Report(problems=(problem,)), location)


def check(
    data: bytes, public_key: Any, manifest: Manifest | None, *, expected_name: str | None = None, location: str = ""
) -> tuple[Manifest, bool]:
    """Check ``model.sig`` (``data``) with ``public_key`` and against ``manifest``: the manifest to verify
    content against (the signed one when ``manifest`` is None), and whether the signature names every
    empty file it vouches for (not model_signing's own shards: :func:`with_empty_files`). SignatureError
    when it is malformed, by another key, names another checkpoint, or covers other digests (each named)."""
    if manifest is not None:
        check_signed_algorithm(manifest, location)
    key = load_public_key(public_key)
    try:
        signed, name, covers = _read(data, key)
    except _MALFORMED as exc:  # a ManifestError, or a value of the wrong type
        what = str(exc) if isinstance(exc, ManifestError) else f"malformed ({exc!r})"
        raise SignatureError(f"{SIGNATURE_FILENAME}: {what}", location=location) from exc
    if expected_name is not None and name != expected_name:
        problem = Problem(SIGNATURE_FILENAME, "mismatch", expected=expected_name, actual=name or None)
        if name:
            detail = f"was signed as {name!r}, not {expected_name!r} (a signature copied from another checkpoint?)"
        else:
            detail = "does not name the checkpoint it signed (a pre-1.0 model_signing statement)"
        raise SignatureError(f"{SIGNATURE_FILENAME} {detail}", Report(problems=(problem,)), location)
    if manifest is None:
        return signed, covers
    if (signed.granularity, signed.chunk_size) != (manifest.granularity, manifest.chunk_size):
        theirs = f"shards of {signed.chunk_size} bytes" if signed.chunk_size else "files"
        mine = f"chunks of {manifest.chunk_size} bytes" if manifest.chunk_size else "file granularity"
        problem = Problem(SIGNATURE_FILENAME, "mismatch", expected=theirs, actual=mine)
        detail = f"the signature covers {theirs} but the manifest has sha256 {mine}"
        raise SignatureError(detail, Report(problems=(problem,)), location)
    sizes, chunks = manifest.sizes or {}, manifest.chunks or {}
    if not covers:  # model_signing's own shards: an empty file's entry passes when it is the empty digest
        signed = with_empty_files(signed, {n: 0 for n, size in sizes.items() if not size and chunks[n] == (_EMPTY,)})
    lines, problems = [], []
    for n in sorted({*manifest.files, *signed.files}):
        if n not in manifest.files:
            lines.append(f"{n}: signed but not in the manifest")
            problems.append(Problem(n, "extra"))
        elif n not in signed.files:
            why = "" if covers or sizes[n] else " (an empty file under model_signing's shards must have its digest)"
            lines.append(f"{n}: in the manifest but not signed{why}")
            problems.append(Problem(n, "missing", expected=manifest.files[n]))
        elif manifest.files[n] != signed.files[n] or (signed.sizes is not None and signed.sizes[n] != sizes[n]):
            ranges: tuple[tuple[int, int], ...] = ()
            if signed.chunks is not None and signed.sizes is not None and signed.chunk_size is not None:
                a, b, size = chunks[n], signed.chunks[n], max(sizes[n], signed.sizes[n])
                differ = [i for i in range(max(len(a), len(b)) if size else 0) if a[i : i + 1] != b[i : i + 1]]
                ranges = tuple(chunk_range(size, signed.chunk_size, i) for i in differ)
            where = " in bytes " + ", ".join(f"{a}-{b - 1}" for a, b in ranges) if ranges else ""
            lines.append(f"{n}: signed digest differs from the manifest's{where}")
            problems.append(Problem(n, "mismatch", signed.files[n], manifest.files[n], ranges))
    if problems:
        detail = "the signed digests differ from the manifest's: " + shortened(lines, 10, sep="; ")
        raise SignatureError(detail, Report(problems=tuple(problems)), location)
    return manifest, covers


def with_empty_files(manifest: Manifest, sizes: Mapping[str, int]) -> Manifest:
    """``manifest`` (the chunk manifest a model_signing shard signature vouches for) plus the empty files
    of ``sizes`` it lacks: such a signature passes an empty file while it is empty. No other is added."""
    added = []
    for n, size in sizes.items():
        with contextlib.suppress(ManifestError):  # a name no manifest holds stays uncovered
            if size == 0 and n not in manifest.files and check_name(n):
                added.append(n)
    if not added or manifest.chunks is None or manifest.sizes is None or manifest.chunk_size is None:
        return manifest
    files = {**manifest.files, **dict.fromkeys(added, combine("sha256", [_EMPTY], 0, manifest.chunk_size))}
    chunks = {**manifest.chunks, **dict.fromkeys(added, (_EMPTY,))}
    return dataclasses.replace(
        manifest, files=files, sizes={**manifest.sizes, **dict.fromkeys(added, 0)}, chunks=chunks
    )
