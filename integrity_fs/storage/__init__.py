"""The only door to fsspec: where a checkpoint is, what it holds, reading it (one guarded,
pinned, retried reader) and writing (atomic, checksummed, never half-committed).

Internal: the verbs of integrity_fs call these; users call the verbs.
"""

from .checksums import StoreHasher, computed_values, keeps_checksums, object_states
from .copying import copy_file, copy_within, rename_object
from .errors import Cancelled, NotARegularFileError, SizeChangedError
from .listing import (
    NOT_CONTENT,
    Version,
    check_no_clashes,
    check_root,
    exists,
    list_dirs,
    list_files,
    stat_file,
)
from .local import create_beneath, unlink_beneath
from .progress import DEFAULT_CALLBACK, Callback, TqdmCallback, progress_fn
from .read import BLOCK_SIZE, ProgressFn, Sink, Span, hash_range, read_file
from .recording import Recording, WriteRecording, plan_recording, read_records, record_checksums, record_written
from .removing import METADATA_ORDER, folder_of, remove_folders
from .urls import (
    URL,
    beneath_caches,
    describe,
    is_local,
    join,
    local_filesystem,
    local_path,
    overlap,
    parent,
    resolve,
)
from .write import (
    SealingWriter,
    Written,
    makedirs,
    object_checksums,
    remove_file,
    remove_files,
    sync_dirs,
    write_atomic,
)

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_CALLBACK",
    "METADATA_ORDER",
    "NOT_CONTENT",
    "URL",
    "Callback",
    "Cancelled",
    "NotARegularFileError",
    "ProgressFn",
    "Recording",
    "SealingWriter",
    "Sink",
    "SizeChangedError",
    "Span",
    "StoreHasher",
    "TqdmCallback",
    "Version",
    "WriteRecording",
    "Written",
    "beneath_caches",
    "check_no_clashes",
    "check_root",
    "computed_values",
    "copy_file",
    "copy_within",
    "create_beneath",
    "describe",
    "exists",
    "folder_of",
    "hash_range",
    "is_local",
    "join",
    "keeps_checksums",
    "list_dirs",
    "list_files",
    "local_filesystem",
    "local_path",
    "makedirs",
    "object_checksums",
    "object_states",
    "overlap",
    "parent",
    "plan_recording",
    "progress_fn",
    "read_file",
    "read_records",
    "record_checksums",
    "record_written",
    "remove_file",
    "remove_files",
    "remove_folders",
    "rename_object",
    "resolve",
    "stat_file",
    "sync_dirs",
    "unlink_beneath",
    "write_atomic",
]
