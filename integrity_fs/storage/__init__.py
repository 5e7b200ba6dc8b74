"""The only door to fsspec: where a checkpoint is, what it holds, reading it (one guarded,
pinned, retried reader) and writing (atomic, checksummed, never half-committed).

Internal: the verbs of integrity_fs call these; users call the verbs.
"""

from .calls import check_stop, on_loop
from .checksums import StoreHasher, computed_values, keeps_checksums, listed_states, object_states
from .copying import copy_file, copy_within
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
from .local import create_beneath, unlink_beneath
from .read import BLOCK_SIZE, ProgressFn, Range, Sink, fresh_size, hash_range, open_range, read_file
from .recording import Recording, WriteRecording, plan_recording, read_records, record_checksums, record_written
from .removing import METADATA_ORDER, Folder, folder_of, remove_folders
from .urls import Place, beneath_caches, describe, is_local, join, local_filesystem, overlap, parent, place, resolve
from .write import (
    SealingWriter,
    Written,
    make_local_parent,
    makedirs,
    object_checksums,
    remove_file,
    remove_files,
    store_checksums,
    sync_dirs,
    write_atomic,
)

__all__ = [
    "BLOCK_SIZE",
    "METADATA_ORDER",
    "NOT_CONTENT",
    "Cancelled",
    "FileGrewError",
    "Folder",
    "NotARegularFileError",
    "Place",
    "ProgressFn",
    "Range",
    "Recording",
    "SealingWriter",
    "ShortReadError",
    "Sink",
    "SizeChangedError",
    "StoreHasher",
    "Version",
    "WriteRecording",
    "Written",
    "beneath_caches",
    "check_no_clashes",
    "check_root",
    "check_stop",
    "computed_values",
    "copy_file",
    "copy_within",
    "create_beneath",
    "describe",
    "exists",
    "file_folder_clashes",
    "folder_of",
    "forget_cached",
    "fresh_size",
    "hash_range",
    "is_local",
    "join",
    "keeps_checksums",
    "list_dirs",
    "list_files",
    "listed_states",
    "local_filesystem",
    "make_local_parent",
    "makedirs",
    "object_checksums",
    "object_states",
    "on_loop",
    "open_range",
    "overlap",
    "parent",
    "place",
    "plan_recording",
    "read_file",
    "read_records",
    "record_checksums",
    "record_written",
    "remove_file",
    "remove_files",
    "remove_folders",
    "resolve",
    "stamp_of",
    "stat_file",
    "storage_errors",
    "store_checksums",
    "sync_dirs",
    "unlink_beneath",
    "write_atomic",
]
