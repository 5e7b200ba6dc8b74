"""The in-toto statement inside model.sig: what model_signing signs, built from a manifest and
read back into what it covers.

The predicate (``https://model_signing/signature/v1.0``) lists every signed resource with its
digest; the subject's digest is the SHA-256 of the resources' raw digests, in order. File
granularity is model_signing's ``files`` serialization (one resource per file). Chunk granularity
is its ``shards`` serialization with ``shard_size = chunk_size`` (one resource ``name:start:end``
per chunk). That serialization gives an empty file no shard, so this project's statements also
name the empty files, in a predicate field of their own (``integrity_fs.empty_files``) that
model_signing's verifier ignores, as its v1.0 predicate says verifiers must: with it, every file
is covered in both granularities.

Pure: bytes in, bytes out. The one parser of statements (``formats`` reads them too).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestError
from ..hashing import chunk_count, chunk_range, combine_chunk_digests
from ..manifest import MANIFEST_FILENAME, Manifest, check_name, parse_json, whole_number
from ..recorded import CHECKSUMS_FILENAME
from ..report import SIGNATURE_FILENAME, printable, shortened

__all__ = [
    "EMPTY_SHA256",
    "EXTENSION",
    "IGNORE_PATHS",
    "PREDICATE_TYPE",
    "PREDICATE_TYPE_COMPAT",
    "STATEMENT_TYPE",
    "Signed",
    "check_shard_names",
    "check_signable",
    "empty_files",
    "read_statement",
    "resources",
    "shard_order",
    "signed_manifest",
    "statement",
]

log = logging.getLogger("integrity_fs")

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"

PREDICATE_TYPE = "https://model_signing/signature/v1.0"

#: model_signing before 1.0 (``Digests/v0.1``): one subject per file, no predicate; its 1.1.1
#: verifier still accepts it.
PREDICATE_TYPE_COMPAT = "https://model_signing/Digests/v0.1"

#: The predicate field this project adds (model_signing's verifier ignores it).
EXTENSION = "integrity_fs"

#: Files model_signing's verifier must not hash: our manifest, the signature itself, and the
#: sidecar of recorded store checksums (never content).
IGNORE_PATHS = (MANIFEST_FILENAME, SIGNATURE_FILENAME, CHECKSUMS_FILENAME)

#: The SHA-256 of no bytes: the one chunk of an empty file.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Signed:
    """What a verified signature covers: resource name -> hex digest, and how they were made.

    ``method`` is model_signing's serialization (``"files"`` or ``"shards"``); ``shard_size``
    is set for shards. Resource names are file names (files) or ``name:start:end`` (shards).
    ``empty_files``: with shards, the empty files the statement names (``None``: it names none
    either way, as model_signing's own shard statements, so empty files are not covered).
    ``model_name``: the checkpoint the statement names (``""``: none, a pre-1.0 statement).
    """

    method: str
    shard_size: int | None
    resources: Mapping[str, str]
    model_name: str
    empty_files: tuple[str, ...] | None = None


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
            f"{shortened([repr(name) for name in bad], 1)}: model_signing's shard "
            "names cannot hold a file name with ':' (sign with granularity='file')"
        )


def resources(manifest: Manifest) -> dict[str, str]:
    """The resources model_signing would list for ``manifest``'s files: name -> hex digest
    (with chunks, empty files have none: see :func:`empty_files`)."""
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


def empty_files(manifest: Manifest) -> list[str]:
    """The empty files of a chunk manifest, in model_signing's order of files."""
    sizes = manifest.sizes or {}
    return sorted((name for name, size in sizes.items() if size == 0), key=_file_order)


def _file_order(name: str) -> tuple[str, ...]:
    """model_signing's order of files: by path components, as ``PurePosixPath`` compares."""
    return tuple(name.split("/"))


def shard_order(name: str) -> tuple[tuple[str, ...], int, int]:
    """model_signing's order of shards: by file, then offsets."""
    path, start, end = name.rsplit(":", 2)
    return _file_order(path), int(start), int(end)


def statement(manifest: Manifest, model_name: str) -> bytes:
    """The in-toto statement model_signing would sign for ``manifest`` (its JSON layout, too),
    naming the empty files as well with chunk granularity (see the module docstring).

    ``allow_symlinks`` is declared true: symlinks inside the root are content here (their
    targets' bytes), as model_signing hashes them with that flag.
    """
    by_name = resources(manifest)
    order = _file_order if manifest.granularity == "file" else shard_order
    algorithm = "sha256" if manifest.granularity == "file" else f"sha256-sharded-{manifest.chunk_size}"
    listed = [{"name": n, "algorithm": algorithm, "digest": by_name[n]} for n in sorted(by_name, key=order)]
    serialization: dict[str, Any] = {"method": "files" if manifest.granularity == "file" else "shards"}
    if manifest.granularity == "chunk":
        serialization["shard_size"] = manifest.chunk_size
    serialization.update(hash_type="sha256", allow_symlinks=True, ignore_paths=list(IGNORE_PATHS))
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in listed)).hexdigest()
    predicate: dict[str, Any] = {"serialization": serialization, "resources": listed}
    if manifest.granularity == "chunk":
        predicate[EXTENSION] = {"empty_files": empty_files(manifest)}
    document = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": root}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }
    return json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")


def read_statement(payload: bytes) -> Signed:
    """The resources an in-toto statement of model_signing lists, checked: its types, one
    subject whose digest is the SHA-256 of the resources' digests in order, the ``files`` or
    ``shards`` serialization of SHA-256, every name a manifest name (shards ``name:start:end``)
    listed once. A pre-1.0 statement (``Digests/v0.1``: one subject per file) is read as files.
    Entries for this project's manifest and ``model.sig`` (model_signing run over a sealed
    directory without ignoring them) are left out. ``ManifestError`` says what is wrong."""
    doc = parse_json(payload, "the in-toto statement")
    if not isinstance(doc, dict) or doc.get("_type") != STATEMENT_TYPE:
        kind = doc.get("_type") if isinstance(doc, dict) else type(doc).__name__
        raise ManifestError(f"statement type {kind!r} is not supported (expected {STATEMENT_TYPE})")
    if doc.get("predicateType") == PREDICATE_TYPE_COMPAT:
        return _read_compat(doc)
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
        if _is_ours(path, name):
            continue
        out[name] = value.lower()
    if not isinstance(root, str) or hasher.hexdigest() != root.lower():
        raise ManifestError(
            f"the statement is inconsistent: its resources do not hash to its root digest "
            f"(subject digest {root!r}, resources {hasher.hexdigest()!r})"
        )
    empty = _empty_files(predicate, out) if method == "shards" and isinstance(predicate, dict) else None
    return Signed(method, shard_size, out, model_name if isinstance(model_name, str) else "", empty)


def _is_ours(path: str, name: object) -> bool:
    if path not in IGNORE_PATHS:
        return False
    log.warning(
        "the signed statement lists %s: left out (never content: not verified against it)", printable(str(name))
    )
    return True


def _read_compat(doc: dict[str, Any]) -> Signed:
    """A ``Digests/v0.1`` statement: each subject a file and its SHA-256 (model_signing's
    verifier builds the same list, with no root digest and no model name)."""
    subjects = doc.get("subject")
    if not isinstance(subjects, list) or not all(isinstance(s, dict) for s in subjects):
        raise ManifestError("'subject' is not a list of objects")
    out: dict[str, str] = {}
    for subject in subjects:
        name, digest = subject.get("name"), subject.get("digest")
        value = digest.get("sha256") if isinstance(digest, dict) else None
        if not isinstance(value, str) or not _SHA256.fullmatch(value):
            raise ManifestError(f"{name!r} has no SHA-256 digest (64 hex digits): {value!r}")
        path = _resource_path(name, "sha256", None)
        if path in out:
            raise ManifestError(f"{name!r} is listed twice")
        if not _is_ours(path, name):
            out[path] = value.lower()
    return Signed("files", None, out, "")


def _empty_files(predicate: dict[str, Any], shards: Mapping[str, str]) -> tuple[str, ...] | None:
    """The empty files a shard statement names (``None`` when it has no such field)."""
    extension = predicate.get(EXTENSION)
    if extension is None:
        return None
    names = extension.get("empty_files") if isinstance(extension, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ManifestError(f"'{EXTENSION}.empty_files' is not a list of names")
    sharded = {name.rsplit(":", 2)[0] for name in shards}
    out: list[str] = []
    for name in names:
        check_name(name)
        if name in sharded or name in out:
            raise ManifestError(f"{name!r} is named as an empty file twice, or also has shards")
        if name not in IGNORE_PATHS:
            out.append(name)
    return tuple(out)


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
    if not whole_number(value) or value <= 0:
        raise ManifestError(f"shard size {value!r} is not supported (a positive whole number of bytes)")
    return value


def signed_manifest(signed: Signed) -> Manifest:
    """The manifest of what ``signed`` lists. Shards become a chunk manifest with ``chunk_size =
    shard_size``: each file's shards must be its consecutive chunks, and its size is the last
    shard's end; the empty files it names are files of no bytes. ``ManifestError`` otherwise."""
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
    for path in signed.empty_files or ():
        size_of[path] = 0
        chunks[path] = (EMPTY_SHA256,)
    files = {path: combine_chunk_digests("sha256", digests) for path, digests in chunks.items()}
    return Manifest(files=files, sizes=size_of, granularity="chunk", chunk_size=signed.shard_size, chunks=chunks)
