"""verify: check a checkpoint against its manifest (the pipeline is :mod:`integrity_fs.verification`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import signing, storage
from .manifest import Manifest
from .options import Attested, ManifestFormat, VerifyOptions, Work
from .report import Report
from .storage import URL
from .verification import check

if TYPE_CHECKING:
    import fsspec
    from fsspec.callbacks import Callback

__all__ = ["verify"]


def verify(  # noqa: PLR0913  # SPEC's signature
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: fsspec.AbstractFileSystem | None = None,
    max_workers: int | None = None,
    callback: Callback | None = None,
    strict: bool = False,
    quick: bool = False,
    manifest: Manifest | URL | None = None,
    attested: Attested = False,
    public_key: signing.PublicKey | None = None,
    expected_name: str | None = None,
    manifest_format: ManifestFormat = "auto",
) -> Report:
    """Check the checkpoint at ``url`` against its manifest; raise on any problem.

    Raises ``ManifestNotFoundError`` when there is no manifest, ``ManifestError`` when it is
    invalid, ``IntegrityError`` (with every problem in its report) when content differs,
    ``FileChangedError`` when a file changed while it was read, and ``OSError`` when storage
    fails. ``quick`` compares names and sizes from a listing only. ``strict`` makes files absent
    from the manifest problems too, and so does a manifest that lists no files (it verifies only a
    directory with no files). ``manifest``: a :class:`Manifest`, or the path or URL of a manifest
    file in any format :mod:`formats` reads (a relative name is inside the root); by default the
    root's ``_integrity_manifest.json``; ``manifest_format`` says how to read that file (one of
    ``formats.FORMATS``; by default detected). ``attested`` confirms files whose store-kept checksum
    equals the manifest's digest without reading them (the rest are hashed as usual). With
    ``public_key``, ``model.sig`` must verify and cover exactly the manifest's digests, and every
    file there (``SignatureError``, ``strict`` or not), before content is checked; without a
    manifest, the signed digests are the manifest. ``expected_name`` (with ``public_key``): the
    name the signature must give the checkpoint, so that one copied from another checkpoint is a
    ``SignatureError``. Caching layers in ``url`` are looked beneath: the store is verified, never a cache.
    """
    options = VerifyOptions(
        strict=strict,
        quick=quick,
        attested=attested,
        manifest=manifest,
        manifest_format=manifest_format,
        public_key=public_key,
        expected_name=expected_name,
    )
    return check(*storage.resolve(url, storage_options, fs), options, Work(max_workers, callback))
