"""The only door to fsspec: where a checkpoint is, what it holds, reading it (one guarded,
pinned, retried reader) and writing (atomic, checksummed, never half-committed).

Internal: the verbs of integrity_fs call these; users call the verbs.
"""

from .copying import copy_file
from .errors import Cancelled, FileGrewError, NotARegularFileError, ShortReadError, SizeChangedError, storage_errors
from .listing import (
    NOT_CONTENT,
    Version,
    check_no_clashes,
    check_root,
    exists,
    file_folder_clashes,
    forget_cached,
    list_dirs,
    list_files,
    stamp_of,
    stat_file,
)
from .local import digest_small_file
from .read import (
    BLOCK_SIZE,
    ProgressFn,
    Range,
    check_stop,
    fresh_size,
    hash_range,
    on_loop,
    open_range,
    read_file,
)
from .urls import Place, beneath_caches, describe, is_local, join, local_filesystem, overlap, place, resolve
from .write import (
    SealingWriter,
    Written,
    make_local_parent,
    makedirs,
    remove_file,
    remove_files,
    store_checksums,
    sync_dirs,
    write_atomic,
)

__all__ = [
    "BLOCK_SIZE",
    "NOT_CONTENT",
    "Cancelled",
    "FileGrewError",
    "NotARegularFileError",
    "Place",
    "ProgressFn",
    "Range",
    "SealingWriter",
    "ShortReadError",
    "SizeChangedError",
    "Version",
    "Written",
    "beneath_caches",
    "check_no_clashes",
    "check_root",
    "check_stop",
    "copy_file",
    "describe",
    "digest_small_file",
    "exists",
    "file_folder_clashes",
    "forget_cached",
    "fresh_size",
    "hash_range",
    "is_local",
    "join",
    "list_dirs",
    "list_files",
    "local_filesystem",
    "make_local_parent",
    "makedirs",
    "on_loop",
    "open_range",
    "overlap",
    "place",
    "read_file",
    "remove_file",
    "remove_files",
    "resolve",
    "stamp_of",
    "stat_file",
    "storage_errors",
    "store_checksums",
    "sync_dirs",
    "write_atomic",
]
