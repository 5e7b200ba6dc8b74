"""integrity_fs: seal checkpoint directories with SHA-256 manifests and verify them before loading,
on any fsspec filesystem (local, S3, GCS, ...)."""

from . import formats
from .checkpoints import find_checkpoints, latest_verified
from .core import read_manifest, seal, sign, verify
from .errors import CheckpointingException, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .manifest import MANIFEST_FILENAME, Manifest
from .report import Problem, Report
from .signing import SIGNATURE_FILENAME
from .transfer import copy, download, upload

__all__ = [
    "MANIFEST_FILENAME",
    "SIGNATURE_FILENAME",
    "CheckpointingException",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "Problem",
    "Report",
    "SignatureError",
    "copy",
    "download",
    "find_checkpoints",
    "formats",
    "latest_verified",
    "read_manifest",
    "seal",
    "sign",
    "upload",
    "verify",
]

__version__ = "0.1.0"
