"""integrity_fs: seal checkpoint directories with SHA-256 manifests and verify them before loading,
on any fsspec filesystem (local, S3, GCS, ...)."""

from . import formats, logs
from .checkpoints import find_checkpoints, latest_verified
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
from .manifests import read_manifest
from .options import SealOptions, VerifyOptions
from .read import VerifiedFile, open
from .report import SIGNATURE_FILENAME, Problem, Report
from .retention import PruneResult, prune
from .seal import seal, sign
from .transfer import copy, download, upload
from .verify import verify

__all__ = [
    "MANIFEST_FILENAME",
    "SIGNATURE_FILENAME",
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
    "VerifiedFile",
    "VerifyOptions",
    "copy",
    "download",
    "find_checkpoints",
    "formats",
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

logs.install()  # the library's records name their level and logger where the application configured no logging
