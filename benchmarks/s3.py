"""A local S3: moto's ThreadedMotoServer on 127.0.0.1, in this process, counting the bytes of
object content its GETs send (what a verified transfer must read once, and only once)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

BUCKET = "integrity-fs-bench"


class Served:
    """WSGI middleware in front of moto: bytes sent in answer to GETs of data files (not listings,
    attributes, manifests or signatures: names starting with ``_`` or ``.``, ``model.sig``)."""

    def __init__(self, app: Any) -> None:
        self.app, self.total, self._lock = app, 0, threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        body = self.app(environ, start_response)
        query = environ.get("QUERY_STRING", "")
        name = environ.get("PATH_INFO", "").rsplit("/", 1)[-1]
        metadata = name.startswith(("_", ".")) or name == "model.sig" or "list-type" in query or "attributes" in query
        if environ.get("REQUEST_METHOD") != "GET" or metadata:
            return body
        return self._count(body)

    def _count(self, body: Any) -> Iterator[bytes]:
        try:
            for piece in body:
                with self._lock:
                    self.total += len(piece)
                yield piece
        finally:
            if hasattr(body, "close"):
                body.close()


@contextmanager
def moto_server() -> Iterator[tuple[dict[str, Any], Served]]:
    """Yield the storage options that reach the server (bucket ``BUCKET`` made) and its counter."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    wsgi: Any = server._server  # werkzeug's server, which calls its ``app`` per request
    served = wsgi.app = Served(wsgi.app)
    try:
        # No region_name in client_kwargs: with one, bucket creation fails against moto.
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
        with suppress(FileExistsError):
            fsspec.filesystem("s3", **options).mkdir(BUCKET)
        yield options, served
    finally:
        server.stop()


def upload(options: dict[str, Any], data: str, algorithm: str) -> str:
    """``integrity_fs.upload`` of the local directory ``data`` to ``s3://BUCKET/<algorithm>``."""
    import integrity_fs

    url = f"s3://{BUCKET}/{algorithm}"
    integrity_fs.upload(data, url, storage_options=options, algorithm=algorithm)
    return url
