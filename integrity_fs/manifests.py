"""A checkpoint's own files on storage: its manifest (or another one named by path or URL) and
its signature, read and checked, or written after the content they describe.

Internal: the verbs call these.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from . import formats, signing, storage
from .errors import ManifestError, ManifestNotFoundError, SignatureError
from .manifest import MANIFEST_FILENAME, Manifest, check_name
from .options import VerifyOptions
from .report import Problem, Report, printable
from .storage import URL

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "InUse",
    "check_signature",
    "load_manifest",
    "load_manifest_if_any",
    "manifest_in_use",
    "model_name",
    "read_manifest",
    "read_manifest_file",
    "write_sealed",
]

log = logging.getLogger("integrity_fs")
T = TypeVar("T")


def read_manifest(
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``url``; nothing else is read."""
    fs_, root = storage.resolve(url, storage_options, fs)
    return load_manifest(fs_, root)


def load_manifest(fs: fsspec.AbstractFileSystem, root: str) -> Manifest:
    path = storage.join(root, MANIFEST_FILENAME)
    try:
        raw = storage.read_file(fs, path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        storage.check_root(fs, root)  # a root that is not there, or is a file, is not "never sealed"
        raise ManifestNotFoundError(
            f"no {MANIFEST_FILENAME} at {storage.describe(fs, root)}: the checkpoint was never sealed"
        ) from exc
    except IsADirectoryError as exc:
        raise ManifestError(f"{path} is a directory, not a manifest") from exc
    except storage.NotARegularFileError as exc:  # a FIFO, socket or device: never opened for reading
        raise ManifestError(f"{exc}: not a manifest") from exc
    try:
        return Manifest.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"{storage.describe(fs, root)}/{MANIFEST_FILENAME}: {exc}") from exc


def model_name(root: str) -> str:
    """The checkpoint's name as model_signing records it: the root's last component."""
    return root.rstrip("/").rsplit("/", 1)[-1] or "/"


def write_signature(fs: fsspec.AbstractFileSystem, root: str, signature: bytes) -> None:
    storage.write_atomic(fs, storage.join(root, signing.SIGNATURE_FILENAME), signature)


def load_manifest_if_any(fs: fsspec.AbstractFileSystem, root: str) -> Manifest | None:
    """The root's manifest, or ``None`` when it has none (a signature can stand in for it)."""
    try:
        return load_manifest(fs, root)
    except ManifestNotFoundError:
        return None


def check_signature(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest | None,
    public_key: signing.PublicKey,
    *,
    expected_name: str | None = None,
) -> tuple[Manifest, bool]:
    """Check the root's ``model.sig`` with ``public_key`` and against ``manifest``; the manifest
    to verify content against (the signed digests when ``manifest`` is ``None``), and whether the
    signature names every empty file it vouches for (:func:`signing.covers_empty_files`).

    ``SignatureError`` when the signature is missing (or not a regular file), invalid, covers
    other digests, or (``expected_name``) names another checkpoint than ``expected_name``.
    """
    location = storage.describe(fs, root)
    path = storage.join(root, signing.SIGNATURE_FILENAME)
    try:
        data = storage.read_file(fs, path)
    except (FileNotFoundError, IsADirectoryError, storage.NotARegularFileError) as exc:
        # With no manifest either, the report says so: the checkpoint was never sealed (unsealed,
        # not damaged, for latest_verified and prune), whichever rank reports it.
        unsealed = (Problem(MANIFEST_FILENAME, "missing"),) if manifest is None else ()
        missing = Report(problems=(*unsealed, Problem(signing.SIGNATURE_FILENAME, "missing")))
        what = "no" if isinstance(exc, FileNotFoundError) else "no readable"
        why = "" if isinstance(exc, FileNotFoundError) else f" ({printable(str(exc))})"
        nor = f" (nor sealed: no {MANIFEST_FILENAME})" if unsealed else ""
        raise SignatureError(
            f"{what} {signing.SIGNATURE_FILENAME}{why}: the checkpoint is not signed{nor}", missing, location
        ) from exc
    signed = signing.open_bundle(data, public_key, location=location)
    if expected_name is not None:
        signing.check_model_name(signed, expected_name, location=location)
    covers = signing.covers_empty_files(signed)
    if manifest is None:
        return signing.to_manifest(signed, location=location), covers
    lines, problems = signing.differences(manifest, signed)
    if problems:
        report = Report(problems=tuple(problems))
        raise SignatureError(signing.describe_differences(lines), report, location)
    return manifest, covers


class InUse(NamedTuple):
    """The manifest a verification checks against (see :func:`manifest_in_use`)."""

    manifest: Manifest
    file: str | None  # the name of its file when that lies inside the root (never content)
    kind: str | None  # the format of the manifest file read (None: none was)
    #: Signed by model_signing's own shards, which cover no empty file: the root's empty files
    #: pass while they are empty (:func:`signing.with_empty_files` adds them once listed).
    empty_unsigned: bool = False


def manifest_in_use(fs: fsspec.AbstractFileSystem, root: str, options: VerifyOptions) -> InUse:
    """The manifest ``options`` name (the root's by default; a file in any format), its signature
    checked with ``options.public_key`` (and ``options.expected_name``); the name of its file when that
    lies inside the root (never content), the format of the file read (``None``: none was), and
    whether the signature leaves empty files to the listing (see :class:`InUse`).

    The one place verify, ``open`` and ``dcp.load`` learn what they check against.
    """
    wanted, in_use, kind = options.manifest, None, None
    if wanted is None:
        found = load_manifest(fs, root) if options.public_key is None else load_manifest_if_any(fs, root)
    elif isinstance(wanted, Manifest):
        found = wanted
    else:
        found, in_use, kind = read_manifest_file(fs, root, wanted, format=options.manifest_format)
        if kind == "model_signing" and options.public_key is None:
            log.warning(
                "%s is a model_signing bundle: its digests are used, its signature is NOT checked "
                "(pass public_key= to check the root's %s)",
                printable(os.fspath(wanted)),
                signing.SIGNATURE_FILENAME,
            )
    covers = True
    if options.public_key is not None:
        found, covers = check_signature(fs, root, found, options.public_key, expected_name=options.expected_name)
    assert found is not None
    return InUse(found, in_use, kind, not covers)


def write_sealed(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest,
    *,
    key: Any = None,
    raw: bytes | None = None,
    signature: bytes | None = None,
) -> None:
    """Write the manifest at ``root``, after the content it describes, atomically; then its
    signature: made with ``key`` (a loaded private key) from the same digests, or ``signature``
    (bytes carried along unchanged, a sealed source's). ``raw``: the manifest's exact bytes when
    they are kept from elsewhere, else its canonical JSON.

    A manifest replaced without a new signature leaves a signature that signed what was there
    before: it is removed first (with a WARNING), so that a checkpoint never sits beside a
    signature of other content. A signature beside a root sealed for the first time (model_signing
    run over it) is left alone. Every entry point that seals (``seal``, ``distributed.seal``,
    ``upload``, ``copy``, ``dcp.save``) ends here.
    """
    if key is not None:
        signature = signing.sign(manifest, key, model_name(root))
    path = storage.join(root, MANIFEST_FILENAME)
    old = storage.join(root, signing.SIGNATURE_FILENAME)
    if signature is None and storage.exists(fs, path) and storage.exists(fs, old):
        storage.remove_file(fs, old)
        log.warning("removed %s: it signed what the checkpoint held before", printable(storage.describe(fs, old)))
    storage.write_atomic(fs, path, manifest.to_json() if raw is None else raw)
    if signature is not None:
        write_signature(fs, root, signature)


def read_manifest_file(
    fs: fsspec.AbstractFileSystem,
    root: str,
    source: str | os.PathLike[str],
    *,
    format: str = "auto",
) -> tuple[Manifest, str | None, str]:
    """The manifest in the file ``source`` for the checkpoint at ``root`` on ``fs``; the name
    relative to ``root`` of that file when it lies inside the root (``None`` otherwise), so that
    the caller neither hashes it nor counts it as extra; and the format it was read as.

    A bare relative name resolves inside the root (``"integrity.json"``, ``"meta/SUMS"``). A path
    that starts with ``./`` or ``../`` is relative to the working directory, as a shell means it.
    A URL is read as is, through ``fs`` when it has ``fs``'s protocol (same store, same options);
    an absolute path without a protocol is a local path. ``ManifestNotFoundError`` when the file
    is not there, ``ManifestError`` when it is a directory or a special file (never opened).
    """
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"manifest must be a Manifest, a path or a URL, not {type(source).__name__}")
    text = os.fspath(source)
    if not text:
        raise ValueError("manifest path is empty")
    name: str | None
    if _URL.match(text) or os.path.isabs(text) or _EXPLICIT_RELATIVE.match(text):
        same_store = _URL.match(text) is not None and text.split("://", 1)[0] in _protocols(fs)
        if same_store:
            mfs, path = storage.resolve(text, fs=fs)
        else:
            mfs, path = storage.resolve(text if _URL.match(text) else os.path.abspath(text))
        prefix = root.rstrip("/") + "/"
        same_fs = mfs is fs or (storage.is_local(mfs) and storage.is_local(fs))
        name = path[len(prefix) :] if same_fs and path.startswith(prefix) else None
        where = storage.describe(mfs, path)
    else:
        name = text
        if name != MANIFEST_FILENAME:
            try:
                check_name(name)
            except ManifestError as exc:
                raise ValueError(
                    f"manifest {text!r} is not a name inside the checkpoint ({exc}); pass a path "
                    "(./NAME, ../NAME or absolute) or a URL"
                ) from None
        mfs, path = fs, storage.join(root, name)
        where = f"{storage.describe(fs, root)}/{name}"
    try:
        raw = storage.read_file(mfs, path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        if name is not None:
            storage.list_files(fs, root)  # a root that is not there is "no checkpoint", not "no manifest"
        raise ManifestNotFoundError(f"no manifest file at {where}") from exc
    except IsADirectoryError as exc:
        raise ManifestError(f"{where} is a directory, not a manifest") from exc
    except storage.NotARegularFileError as exc:  # a FIFO, socket or device: never opened for reading
        raise ManifestError(f"{exc}: not a manifest") from exc
    try:
        kind = formats.detect(raw, name=path.rsplit("/", 1)[-1]) if format == "auto" else format
        manifest = formats.load(raw, kind)
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from exc
    if name is not None and name in manifest.files:
        # `sha256sum * > SUMS` run twice, model_signing's Python API re-signing into the model.
        log.warning("%s lists itself: that entry is left out (no file holds its own digest)", printable(where))
        manifest = _without(manifest, name)
    return manifest, name, kind


def _without(manifest: Manifest, name: str) -> Manifest:
    def drop(mapping: Mapping[str, T] | None) -> dict[str, T] | None:
        return None if mapping is None else {k: v for k, v in mapping.items() if k != name}

    return dataclasses.replace(
        manifest, files=drop(manifest.files) or {}, sizes=drop(manifest.sizes), chunks=drop(manifest.chunks)
    )


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return tuple(protocol) if isinstance(protocol, (tuple, list)) else (protocol,)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: ``./x``, ``../x`` (and ``.\x`` on Windows): a path the user means from the working directory.
_EXPLICIT_RELATIVE = re.compile(r"\.\.?(?:/|\\)" if os.sep == "\\" else r"\.\.?/")
