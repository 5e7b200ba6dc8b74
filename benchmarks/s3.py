"""A local S3 (moto's ThreadedMotoServer on 127.0.0.1) holding a sealed copy of a dataset."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

BUCKET = "integrity-fs-bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def storage_options(endpoint: str) -> dict[str, Any]:
    # No region_name in client_kwargs: with one, bucket creation fails against moto.
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


@contextmanager
def moto_server(middleware: Callable[[Any], Any] | None = None) -> Iterator[dict[str, Any]]:
    """Start moto in this process (it serves the child processes over HTTP); yield the
    storage options that reach it, with an empty bucket ``BUCKET``. ``middleware`` wraps
    moto's WSGI application (to count the requests it serves)."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    if middleware is not None:
        wsgi: Any = server._server  # werkzeug's server, which calls its ``app`` per request
        wsgi.app = middleware(wsgi.app)
    try:
        options = storage_options(f"http://127.0.0.1:{port}")
        with suppress(FileExistsError):  # moto's state is per process: an earlier server's bucket stays
            fsspec.filesystem("s3", **options).mkdir(BUCKET)
        yield options
    finally:
        server.stop()


def upload(options: dict[str, Any], local_dir: str, prefix: str) -> tuple[str, list[str]]:
    """Copy every file of ``local_dir`` (manifest included) to ``s3://BUCKET/prefix``.

    Returns the checkpoint URL and the object paths of the data files (not the manifest).
    """
    import fsspec

    import integrity_fs

    fs = fsspec.filesystem("s3", **options)
    root = f"{BUCKET}/{prefix}"
    data: list[str] = []
    for name in sorted(os.listdir(local_dir)):
        fs.put_file(os.path.join(local_dir, name), f"{root}/{name}")
        if name != integrity_fs.MANIFEST_FILENAME:
            data.append(f"{root}/{name}")
    fs.invalidate_cache()
    return f"s3://{root}", data
