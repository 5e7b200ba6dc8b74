"""integrity_fs: seal checkpoint directories with SHA-256 manifests and verify them before loading,
on any fsspec filesystem (local, S3, GCS, ...)."""

from . import formats
from .core import Problem, Report, read_manifest, seal, verify
from .errors import CheckpointingException, IntegrityError, ManifestError, ManifestNotFoundError
from .manifest import MANIFEST_FILENAME, Manifest

__all__ = [
    "MANIFEST_FILENAME",
    "CheckpointingException",
    "IntegrityError",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "Problem",
    "Report",
    "formats",
    "read_manifest",
    "seal",
    "verify",
]

__version__ = "0.1.0"
