"""Writing: a manifest atomically; a file while it is hashed (on S3 with the store's own
checksums); local destinations beneath one folder opened without following links.

A local destination is opened once with ``O_NOFOLLOW`` and every path beneath it is walked
relative to that descriptor, each folder again with ``O_NOFOLLOW``, each file created new
(``O_EXCL``): a link planted at or under the destination, before or during a write, is refused
(``ValueError`` naming it), never written through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsspec.asyn import sync

from ..hashing import StreamDigest
from . import s3
from .errors import storage_errors
from .listing import TEMP_PREFIX, forget
from .urls import describe, is_gcs, is_local, is_s3, parent

__all__ = ["LocalTree", "Writer", "fsync_dir", "remove", "write_atomic"]

_SIDE_BY_SIDE = 1024 * 1024  # writes at least this large are hashed beside the write
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(fs: Any, path: str, data: bytes) -> None:
    """``data`` at ``path``, all or nothing: locally a temporary file beside it (permissions from
    the umask), fsynced and renamed over; on object stores one PUT."""
    if not is_local(fs):
        with storage_errors(f"writing {describe(fs, path)}"):
            fs.pipe_file(path, data)
            forget(fs, path)
        return
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX + name + ".")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o666 & ~_umask())
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_refused(path: str, exc: OSError) -> ValueError:
    return ValueError(f"{path} is a symbolic link (or not a folder): refused, nothing is written through a link")


class LocalTree:
    """A local folder written beneath one descriptor (see the module docstring). ``create``: make
    the folder (its parents too) when it is not there."""

    def __init__(self, root: str, *, create: bool = False) -> None:
        self.root = root
        above, name = os.path.split(root.rstrip("/"))
        if create:
            os.makedirs(above, exist_ok=True)
        self._above = os.open(above, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=self._above)
            try:
                self.fd = os.open(name, _DIR, dir_fd=self._above)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_refused(root, exc) from exc
                raise
        except BaseException:
            os.close(self._above)
            raise
        self.made: list[str] = []  # folders made here, beneath the root, in order

    def _folder(self, rel: str, *, make: bool) -> int:
        """A descriptor of the folder ``rel`` (``""``: the root), walked without following links."""
        fd = os.dup(self.fd)
        done = ""
        for part in [p for p in rel.split("/") if p]:
            done = f"{done}/{part}" if done else part
            if make:
                try:
                    os.mkdir(part, dir_fd=fd)
                    self.made.append(done)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_refused(os.path.join(self.root, done), exc) from exc
                raise
            os.close(fd)
            fd = nxt
        return fd

    def create(self, rel: str) -> int:
        """A new file at ``rel`` for writing; whatever was at that name is unlinked first (a link
        is removed, never followed)."""
        folder, name = os.path.split(rel)
        fd = self._folder(folder, make=True)
        try:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                os.unlink(name, dir_fd=fd)
            return os.open(name, _NEW, 0o666, dir_fd=fd)
        finally:
            os.close(fd)

    def unlink(self, rel: str) -> None:
        folder, name = os.path.split(rel)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, ValueError):
            fd = self._folder(folder, make=False)
            try:
                os.unlink(name, dir_fd=fd)
            finally:
                os.close(fd)

    def rmdir(self, rel: str) -> None:
        folder, name = os.path.split(rel)
        fd = self._folder(folder, make=False)
        try:
            os.rmdir(name, dir_fd=fd)
        finally:
            os.close(fd)

    def rename(self, rel: str, new_rel: str) -> None:
        """``rel`` to ``new_rel`` inside the tree (no link followed on either side)."""
        a, b = self._folder(os.path.dirname(rel), make=False), self._folder(os.path.dirname(new_rel), make=True)
        try:
            os.rename(os.path.basename(rel), os.path.basename(new_rel), src_dir_fd=a, dst_dir_fd=b)
        finally:
            os.close(a)
            os.close(b)

    def sync(self) -> None:
        """fsync the root and every folder made here (files are fsynced as they are closed)."""
        for rel in ["", *self.made]:
            with contextlib.suppress(FileNotFoundError, ValueError):
                fd = self._folder(rel, make=False)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def close(self) -> None:
        for fd in (self.fd, self._above):
            with contextlib.suppress(OSError):
                os.close(fd)


class Writer:
    """One file written while it is hashed (``digest``: one digest, or one per chunk). On S3 with a
    checksum S3 keeps, the bytes go up with it in an attestable layout (held in memory one part at a
    time); otherwise as a plain stream. Local files are created in ``tree`` (at ``rel``) and fsynced
    on close. ``size``: the file's size when known (it picks S3's layout). ``beside``: a lone writer
    (DCP's) whose large SHA-256 writes are hashed on a helper thread beside the write."""

    def __init__(
        self,
        fs: Any,
        path: str,
        algorithm: str,
        chunk_size: int | None,
        *,
        tree: LocalTree | None = None,
        rel: str = "",
        size: int | None = None,
        beside: bool = False,
    ) -> None:
        self.fs, self.path, self._tree, self._rel, self._beside = fs, path, tree, rel, beside
        self.size = 0
        self.digest = StreamDigest(algorithm, chunk_size)
        self._part = s3.layout(fs, algorithm, chunk_size, size) if is_s3(fs) else None
        self._upload = s3.Upload(fs, path, algorithm) if self._part is not None else None
        self._buffer = bytearray()
        self._stream: Any = None
        self._hasher: ThreadPoolExecutor | None = None
        if self._upload is None:
            self._open()

    def _open(self) -> None:
        if is_local(self.fs):
            tree = self._tree or LocalTree(parent(self.path), create=True)
            self._stream = os.fdopen(tree.create(self._rel or os.path.basename(self.path)), "wb")
            if self._tree is None:
                tree.close()
        else:
            with storage_errors(f"writing {describe(self.fs, self.path)}"):
                self._stream = self.fs.open(self.path, "wb")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        size = len(memoryview(data).cast("B"))
        if self._beside and self._stream is not None and size >= _SIDE_BY_SIDE and self.digest.algorithm == "sha256":
            if self._hasher is None:  # SHA-256 costs more than the write: both at once, on the caller's bytes
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="integrity_fs-hash")
            hashed = self._hasher.submit(self.digest.update, data)
        else:
            self.digest.update(data)
            hashed = None
        self.size += size
        if self._stream is not None:
            try:
                with storage_errors(f"writing {describe(self.fs, self.path)}"):
                    self._stream.write(data)
            finally:
                if hashed is not None:
                    hashed.result()  # the caller's bytes are theirs again only once both are done
            return
        assert self._upload is not None
        self._buffer += data
        if self._part == 0 and len(self._buffer) > (self.digest.chunk_size or s3.SINGLE_PUT):
            self._upload, self._stream = None, None  # grew past one PUT's attestable size: a plain stream
            self._open()
            self._stream.write(self._buffer)
            self._buffer = bytearray()
            return
        aligned = self._part == self.digest.chunk_size  # a part is a whole chunk: its digest is done
        while self._part and len(self._buffer) > self._part:  # a file of one part goes in one PUT
            digest = self.digest.done[len(self._upload._parts)] if aligned else None  # None: a CRC part, computed there
            self._upload.part(bytes(memoryview(self._buffer)[: self._part]), digest)
            del self._buffer[: self._part]

    def close(self) -> tuple[str, ...]:
        """Commit the file; its unit digests."""
        self._let_go()
        digest = self.digest
        digests = digest.digests()
        if self._stream is not None:
            with storage_errors(f"writing {describe(self.fs, self.path)}"):
                if is_local(self.fs):
                    self._stream.flush()
                    os.fsync(self._stream.fileno())
                self._stream.close()
        else:
            assert self._upload is not None
            last = digests[-1] if digest.algorithm == "sha256" else digest.file_digest()
            self._upload.finish(bytes(self._buffer), last)
            self._buffer = bytearray()
        return digests

    def abort(self) -> None:
        """Drop what was written: a multipart upload aborted, a local file removed."""
        self._let_go()
        if self._upload is not None:
            self._upload.abort()
        if self._stream is not None:
            with contextlib.suppress(Exception):
                discard = getattr(self._stream, "discard", None)
                if discard is None:
                    self._stream.close()
                else:  # fsspec's buffered file: dropped, and marked closed so that no __del__ commits it
                    discard()  # (gcsfs's leaves a file whose upload has not begun open)
                    self._stream.closed = True
            if is_local(self.fs) and self._tree is not None:
                self._tree.unlink(self._rel)

    def _let_go(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None


def _already_gone(exc: Exception) -> bool:
    return isinstance(exc, FileNotFoundError) or "No such object" in str(exc)


def remove(fs: Any, paths: list[str]) -> None:
    """Delete files (those already gone are fine): locally one by one, elsewhere in the store's own batches."""
    if not paths:
        return
    if is_local(fs):
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return
    with storage_errors(f"deleting {len(paths)} objects under {describe(fs, parent(paths[0]))}"):
        try:
            fs.rm(paths)
        except FileNotFoundError:  # some backends stop a batch at the first path already gone
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(path)
        except TypeError as exc:  # gcsfs before 2026.3 on Google sums a batch that failed whole into a TypeError:
            if not (is_gcs(fs) and "concatenate list" in str(exc)):  # ask again, batch by batch, for the store's answer
                raise
            for i in range(0, len(paths), 20):
                for outcome in sync(fs.loop, fs._rm_files, paths[i : i + 20]):
                    if isinstance(outcome, Exception) and not _already_gone(outcome):
                        raise outcome from exc
        for path in paths:
            forget(fs, path)
