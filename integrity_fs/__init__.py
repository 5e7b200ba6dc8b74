"""integrity_fs: seal checkpoint directories with manifests and verify them before loading, on any
fsspec filesystem (local, S3, GCS, ...)."""

from . import formats  # noqa: F401  # SPEC's integrity_fs.formats, as an attribute
from .errors import (
    CheckpointingException,
    FileChangedError,
    IntegrityError,
    ManifestError,
    ManifestNotFoundError,
    PartialLoadError,
    SignatureError,
)
from .manifest import MANIFEST_FILENAME, Manifest
from .options import SealOptions, VerifyOptions
from .read import open
from .report import Problem, PruneResult, Report
from .runs import find_checkpoints, latest_verified, prune
from .transfer import copy, download, upload
from .verify import read_manifest, seal, sign, verify

__all__ = [
    "MANIFEST_FILENAME",
    "CheckpointingException",
    "FileChangedError",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "PartialLoadError",
    "Problem",
    "PruneResult",
    "Report",
    "SealOptions",
    "SignatureError",
    "VerifyOptions",
    "copy",
    "download",
    "find_checkpoints",
    "latest_verified",
    "open",
    "prune",
    "read_manifest",
    "seal",
    "sign",
    "upload",
    "verify",
]

__version__ = "0.1.0"
