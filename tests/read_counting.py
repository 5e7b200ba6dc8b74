"""Count reads where they really happen, whatever code path makes them.

- Local files: the kernel, through inotify on the checkpoint directory: a ``read(2)`` of a file
  (``IN_ACCESS``: builtin ``open``, ``os.read``, ``sendfile``, ...) or the close of a file opened
  without write access (``IN_CLOSE_NOWRITE``, which also catches an ``mmap`` of it). Linux only.
- S3: the server. :class:`CountingS3Server` is a moto server that records every GET of an object
  (listings, HEADs and GetObjectAttributes are not reads of content) and serves the record at ``/_reads``, so ranks in
  subprocesses can count too.

``reads_under(url, options)`` gives the counter for a checkpoint URL; its ``take()`` returns the
names (relative to the URL) read since the last call, one entry per event or request.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote

_IN_ACCESS = 0x1
_IN_CLOSE_NOWRITE = 0x10
_IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")
READS_PATH = "/_reads"


class Reads(Protocol):
    def take(self) -> list[str]: ...

    def close(self) -> None: ...


class LocalReads:
    """Files of one local directory read since the last :meth:`take`, as the kernel saw them."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not sys.platform.startswith("linux"):
            raise NotImplementedError("LocalReads uses inotify (Linux)")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = _IN_ACCESS | _IN_CLOSE_NOWRITE
        if self._libc.inotify_add_watch(self._fd, os.fsencode(directory), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")

    def take(self) -> list[str]:
        names = []
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return names
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                if name and not mask & _IN_ISDIR:  # a file inside the directory, not the directory
                    names.append(os.fsdecode(name))

    def close(self) -> None:
        os.close(self._fd)


class CountingS3Server:
    """A moto S3 server on 127.0.0.1 (a free port) that records the path of every object GET and
    counts the bytes of content it served (``bytes_served``: object path -> bytes)."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self._moto = DomainDispatcherApplication(create_backend_app)
        self._gets: list[str] = []
        self.bytes_served: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server = make_server("127.0.0.1", 0, self._app, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == READS_PATH:
            with self._lock:
                body = json.dumps(self._gets).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        bucket, _, key = path.lstrip("/").partition("/")
        attributes = "attributes" in environ.get("QUERY_STRING", "").split("&")  # GetObjectAttributes: no content
        if environ.get("REQUEST_METHOD") == "GET" and bucket and key and not attributes:
            name = unquote(path.lstrip("/"))
            with self._lock:
                self._gets.append(name)
            return self._counted(name, self._moto(environ, start_response))
        return self._moto(environ, start_response)

    def _counted(self, name: str, body: Any) -> Any:
        try:
            for piece in body:
                with self._lock:
                    self.bytes_served[name] = self.bytes_served.get(name, 0) + len(piece)
                yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def served_under(self, url: str) -> int:
        """Bytes of content served so far for objects under the S3 ``url``."""
        prefix = url.removeprefix("s3://").rstrip("/") + "/"
        with self._lock:
            return sum(n for name, n in self.bytes_served.items() if name.startswith(prefix))

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


class S3Reads:
    """Objects under one S3 prefix that a :class:`CountingS3Server` served since the last :meth:`take`."""

    def __init__(self, endpoint: str, url: str) -> None:
        self._endpoint = endpoint
        self._prefix = url.removeprefix("s3://").rstrip("/") + "/"
        self._seen = len(self._all())

    def _all(self) -> list[str]:
        with urllib.request.urlopen(self._endpoint + READS_PATH, timeout=30) as response:
            gets: list[str] = json.load(response)
        return gets

    def take(self) -> list[str]:
        gets = self._all()
        new, self._seen = gets[self._seen :], len(gets)
        return [path[len(self._prefix) :] for path in new if path.startswith(self._prefix)]

    def close(self) -> None:
        pass


def reads_under(url: str, options: dict[str, Any]) -> Reads:
    """The read counter for a checkpoint at ``url``: local directory or S3 (on a :class:`CountingS3Server`)."""
    if url.startswith("s3://"):
        return S3Reads(options["client_kwargs"]["endpoint_url"], url)
    return LocalReads(url)
