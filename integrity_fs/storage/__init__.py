"""The only door to fsspec: where a checkpoint is, what it holds, pinned reads, writes. Internal."""

from . import gcs, s3, write
from .errors import Cancelled, NotARegularFileError, kind_of, precondition_failed, storage_errors
from .listing import (
    NOT_CONTENT,
    SIGNATURE_FILENAME,
    TEMP_PREFIX,
    Stat,
    check_root,
    exists,
    forget,
    list_dirs,
    list_files,
    stat_file,
)
from .read import hash_range, on_loop, read_blocks, read_file
from .urls import URL, describe, is_gcs, is_local, is_s3, join, overlap, parent, resolve, under_cache
from .write import LocalTree, Writer, fsync_dir, remove, write_atomic

__all__ = [
    "NOT_CONTENT",
    "SIGNATURE_FILENAME",
    "TEMP_PREFIX",
    "URL",
    "Cancelled",
    "LocalTree",
    "NotARegularFileError",
    "Stat",
    "Writer",
    "check_root",
    "describe",
    "exists",
    "forget",
    "fsync_dir",
    "gcs",
    "hash_range",
    "is_gcs",
    "is_local",
    "is_s3",
    "join",
    "kind_of",
    "list_dirs",
    "list_files",
    "on_loop",
    "overlap",
    "parent",
    "precondition_failed",
    "read_blocks",
    "read_file",
    "remove",
    "resolve",
    "s3",
    "stat_file",
    "storage_errors",
    "under_cache",
    "write",
    "write_atomic",
]
