"""What a verified signature covers, held against a manifest: the differences by file (signed
but not in the manifest, in the manifest but not signed, signed with other digests)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..errors import ManifestError, SignatureError
from ..hashing import combine_chunk_digests
from ..manifest import Manifest, check_name
from ..report import SIGNATURE_FILENAME, Problem, Report, shortened
from .statement import EMPTY_SHA256, Signed, resources, shard_order, signed_manifest

__all__ = [
    "check_model_name",
    "covers_empty_files",
    "describe_differences",
    "differences",
    "to_manifest",
    "with_empty_files",
]


_MAX_LISTED = 10


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
        # An empty file has no shard: it is covered by name, as one empty chunk at 0:0.
        assert manifest.sizes is not None and manifest.chunks is not None
        ours, theirs = _group_shards(mine_res), _group_shards(signed.resources)
        for name, size in manifest.sizes.items():
            if size == 0:
                ours[name] = {f"{name}:0:0": manifest.chunks[name][0]}
        for name in signed.empty_files or ():
            theirs[name] = {f"{name}:0:0": EMPTY_SHA256}
        if not covers_empty_files(signed):  # model_signing's own shards: an entry of no bytes passes
            theirs.update((name, shards) for name, shards in ours.items() if shards == {f"{name}:0:0": EMPTY_SHA256})
    lines: list[str] = []
    problems: list[Problem] = []
    for name in sorted(set(ours) | set(theirs)):
        if name not in ours:
            lines.append(f"{name}: signed but not in the manifest")
            problems.append(Problem(name, "extra"))
        elif name not in theirs:
            unnamed = not covers_empty_files(signed) and manifest.sizes is not None and manifest.sizes[name] == 0
            why = " (an empty file under model_signing's shards must have the empty file's digest)" if unnamed else ""
            lines.append(f"{name}: in the manifest but not signed{why}")
            problems.append(Problem(name, "missing", expected=manifest.files[name]))
        elif ours[name] != theirs[name]:
            ranges = (
                tuple(
                    _range(r)
                    for r in sorted(set(ours[name]) | set(theirs[name]), key=shard_order)
                    if ours[name].get(r) != theirs[name].get(r) and not r.endswith(":0:0")
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


def covers_empty_files(signed: Signed) -> bool:
    """Whether ``signed`` names every empty file it vouches for: a ``files`` statement lists them,
    and this project's shard statements name them. model_signing's own shard statements cannot (no
    shard covers an empty file, and its verifier accepts one): under those an empty file passes
    while it is empty (:func:`with_empty_files`), and nothing else uncovered does."""
    return signed.method == "files" or signed.empty_files is not None


def with_empty_files(manifest: Manifest, listing: Mapping[str, int]) -> Manifest:
    """``manifest`` (the chunk manifest a model_signing shard signature vouches for) with the files
    of ``listing`` that are empty and not in it, as files of no bytes: what that signature says of
    an empty file (see :func:`covers_empty_files`). A non-empty file is never added."""
    added = [name for name, size in listing.items() if size == 0 and name not in manifest.files and _valid(name)]
    if not added or manifest.granularity != "chunk":
        return manifest
    assert manifest.sizes is not None and manifest.chunks is not None
    empty = combine_chunk_digests("sha256", [EMPTY_SHA256])
    return dataclasses.replace(
        manifest,
        files={**manifest.files, **dict.fromkeys(added, empty)},
        sizes={**manifest.sizes, **dict.fromkeys(added, 0)},
        chunks={**manifest.chunks, **dict.fromkeys(added, (EMPTY_SHA256,))},
    )


def _valid(name: str) -> bool:
    try:
        check_name(name)
    except ManifestError:
        return False  # a name no manifest holds stays uncovered, and is refused
    return True


def check_model_name(signed: Signed, expected: str, *, location: str = "") -> None:
    """``SignatureError`` unless the statement names the checkpoint ``expected``: a signature
    copied from another checkpoint (``step_1000``'s beside ``step_9000``) verifies, and names
    the one it was made for."""
    if signed.model_name == expected:
        return
    problem = Problem(SIGNATURE_FILENAME, "mismatch", expected=expected, actual=signed.model_name or None)
    if signed.model_name:
        detail = (
            f"{SIGNATURE_FILENAME} was signed as {signed.model_name!r}, not {expected!r} "
            "(a signature copied from another checkpoint?)"
        )
    else:
        detail = f"{SIGNATURE_FILENAME} does not name the checkpoint it signed (a pre-1.0 model_signing statement)"
    raise SignatureError(detail, Report(problems=(problem,)), location)


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
    ordered = [shards[s] for s in sorted(shards, key=shard_order)]  # an empty file: its one chunk
    return combine_chunk_digests("sha256", ordered) if ordered else None


def describe_differences(lines: list[str]) -> str:
    return "the signed digests differ from the manifest's: " + shortened(lines, _MAX_LISTED, sep="; ")
