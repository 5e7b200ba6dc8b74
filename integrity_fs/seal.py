"""seal and sign: a checkpoint's manifest written last (the pipeline is :mod:`integrity_fs.sealing`),
and its signature after the content was verified."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import manifests, signing, storage
from .errors import FileChangedError
from .hashing import DEFAULT_ALGORITHM, DEFAULT_GRANULARITY
from .manifest import MANIFEST_FILENAME, Manifest
from .options import Algorithm, Granularity, Hashing, SealOptions, VerifyOptions, Work, signing_key
from .report import printable
from .sealing import seal_at
from .storage import URL
from .verification import check

if TYPE_CHECKING:
    import fsspec
    from fsspec.callbacks import Callback

__all__ = ["seal", "sign"]

log = logging.getLogger("integrity_fs")


def seal(  # noqa: PLR0913  # SPEC's signature
    url: URL,
    *,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    granularity: Granularity = DEFAULT_GRANULARITY,
    chunk_size: int | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    overwrite: bool = False,
    private_key: signing.PrivateKey | None = None,
) -> Manifest:
    """Hash every file under ``url`` and write the manifest beside them, last and atomically.

    A root that already holds a manifest raises ``FileExistsError`` before any content is read,
    unless ``overwrite=True``: sealing again accepts whatever the files hold now, damage included
    (a signature there is removed, since it signed the old content). A seal that fails part-way
    writes nothing: an earlier manifest stays as it was. A file written to or replaced while it
    is read raises ``FileChangedError``. With ``private_key`` (a PEM path or a ``cryptography``
    EC key), ``model.sig`` is written right after the manifest, from the same digests.
    """
    options = SealOptions(
        algorithm=algorithm,
        granularity=granularity,
        chunk_size=chunk_size,
        overwrite=overwrite,
        private_key=private_key,
    )
    return seal_at(*storage.resolve(url, storage_options, fs), options, Work(max_workers, callback))


def sign(
    url: URL,
    *,
    private_key: signing.PrivateKey,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
) -> Manifest:
    """Sign the sealed checkpoint at ``url``: verify its content first, then write ``model.sig``.

    A damaged checkpoint is never signed (``IntegrityError``); an unsealed one raises
    ``ManifestNotFoundError``; a manifest that changes while the content is verified raises
    ``FileChangedError``. An existing signature is replaced. Returns the signed manifest.
    """
    work = Work(max_workers, callback)
    fs_, root = storage.resolve(url, storage_options, fs)
    before = manifests.load_manifest(fs_, root)
    key = signing_key(private_key, Hashing.of(before))
    check(fs_, root, VerifyOptions(manifest=before), work)
    if manifests.load_manifest(fs_, root).to_json() != before.to_json():
        raise FileChangedError(
            f"{storage.describe(fs_, root)}/{MANIFEST_FILENAME} changed while the checkpoint was verified "
            "(sealed again meanwhile?); not signed",
            (MANIFEST_FILENAME,),
        )
    manifests.write_signature(fs_, root, signing.sign(before, key, manifests.model_name(root)))
    log.info("signed %s", printable(storage.describe(fs_, root)))
    return before
