"""distributed.verify(attested=True) on 2 gloo ranks against moto: the store's checksums confirm
the files without reading them, every rank reaches the same verdict, and a file whose checksum
does not confirm it (replaced by another tool, or refused) is read and decided by its bytes."""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

pytest.importorskip("torch.distributed")

from dist_launch import run_ranks

import integrity_fs as ifs

CHUNK = 5 * 1024 * 1024  # S3's smallest part size
FILES = {
    "big.bin": os.urandom(2 * CHUNK + 123),  # a 3-part upload: a composite checksum
    **{f"shard_{i}.bin": os.urandom(1000 + i) for i in range(5)},  # one PUT each: a full-object checksum
}
BIG = len(FILES["big.bin"])
Results = dict[str, list[dict[str, Any]]]


class ServerLog(logging.Handler):
    """The requests the moto server (werkzeug, in this process) logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def gets(self, prefix: str) -> list[str]:
        """Paths of the GETs under ``prefix`` (other than the manifest's), ``?attributes`` included."""
        paths = (m.group(1) for line in self.lines if (m := re.search(r"GET (\S+) HTTP", line)))
        return [p for p in paths if p.startswith(prefix) and not p.endswith(ifs.MANIFEST_FILENAME)]


class RefusingFront:
    """A second front to the session's moto S3 (moto's state is per process) that refuses every
    GetObjectAttributes (403, as a policy without ``s3:GetObjectAttributes`` does)."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self._moto = DomainDispatcherApplication(create_backend_app)
        self.refused = 0
        self._server = make_server("127.0.0.1", 0, self._app, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        if "attributes" in environ.get("QUERY_STRING", "").split("&"):
            self.refused += 1
            body = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>no</Message></Error>"
            )
            start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        return self._moto(environ, start_response)

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


@pytest.fixture(scope="module")
def refusing(s3_endpoint: str) -> Iterator[RefusingFront]:
    front = RefusingFront()
    yield front
    front.stop()


def _options(endpoint: str) -> dict[str, Any]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}


@pytest.fixture(scope="module")
def attested(
    tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str, refusing: RefusingFront
) -> tuple[dict[str, str], Results, ServerLog]:
    options = _options(s3_endpoint)
    fs = fsspec.filesystem("s3", **options)
    local = tmp_path_factory.mktemp("attested-src")
    for name, data in FILES.items():
        (local / name).write_bytes(data)
    base = f"integrity-test/attested-{uuid.uuid4().hex}"
    roots = {name: f"{base}/{name}" for name in ("good", "replaced", "refused", "hashed")}
    for root in roots.values():  # uploaded as integrity_fs does: S3 checksums from the digests, parts of CHUNK
        ifs.upload(local, f"s3://{root}", storage_options=options, granularity="chunk", chunk_size=CHUNK)
    damaged = bytearray(FILES["big.bin"])
    damaged[CHUNK + 7] ^= 1
    fs.pipe_file(f"{roots['replaced']}/big.bin", bytes(damaged))  # another tool's PUT: no SHA-256 of ours
    fs.invalidate_cache()

    def sc(id_: str, mode: str, ckpt: str, attested: bool = True, **extra: Any) -> dict[str, Any]:
        kwargs = {"storage_options": options, "attested": attested}
        return {"id": id_, "op": "verify", "mode": mode, "url": f"s3://{roots[ckpt]}", "kwargs": kwargs, **extra}

    refused = {str(rank): {"storage_options": _options(refusing.endpoint)} for rank in (0, 1)}
    scenarios = [
        sc("sharded", "sharded", "good"),
        sc("rank0", "rank0", "good"),
        sc("replaced", "sharded", "replaced"),
        sc("refused", "sharded", "refused", rank_kwargs=refused),
        sc("after", "sharded", "good"),  # the group is still in step
        sc("hashed", "sharded", "hashed", attested=False),
    ]
    log = ServerLog()
    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.INFO)
    werkzeug.addHandler(log)
    try:
        results = run_ranks("dist_worker.py", 2, {"scenarios": scenarios}, tmp_path_factory.mktemp("attested"))
    finally:
        werkzeug.removeHandler(log)
        werkzeug.setLevel(level)
    return {name: f"/{root}/" for name, root in roots.items()}, results, log


def _shared(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """The outcome every rank returned (apart from what each rank did to get it)."""
    shared = [{k: v for k, v in o.items() if k not in ("hashed", "notes")} for o in outcomes]
    assert shared[0] == shared[1], shared
    return shared[0]


def test_attested_verify_reads_nothing_on_any_rank(attested: Any) -> None:
    prefixes, results, log = attested
    for name in ("sharded", "after", "rank0"):
        report = _shared(results[name])["report"]
        assert report["ok"] and report["files_attested"] == len(FILES) == report["files_checked"], name
        assert report["bytes_checked"] == 0
        assert [o["hashed"] for o in results[name]] == [0, 0]
    assert _shared(results["rank0"])["report"] == _shared(results["sharded"])["report"]
    # On the server: attributes requests only (one per file and call), no GET of any object's content.
    gets = log.gets(prefixes["good"])
    assert [g for g in gets if not g.endswith("?attributes")] == []
    assert len(gets) == 3 * len(FILES)


def test_a_replaced_object_is_read_and_caught_on_every_rank(attested: Any) -> None:
    prefixes, results, log = attested
    shared = _shared(results["replaced"])
    assert shared["type"] == "IntegrityError"
    (problem,) = shared["report"]["problems"]
    assert problem["path"] == "big.bin" and problem["kind"] == "mismatch"
    assert problem["byte_ranges"] == [[CHUNK, 2 * CHUNK]]
    assert shared["report"]["files_attested"] == len(FILES) - 1
    hashed = [o["hashed"] for o in results["replaced"]]
    assert sum(hashed) == BIG and all(hashed), hashed  # only big.bin's chunks, shared by both ranks
    assert set(log.gets(prefixes["replaced"])) - {f"{prefixes['replaced']}{n}?attributes" for n in FILES} == {
        f"{prefixes['replaced']}big.bin"
    }


def test_refused_checksum_requests_make_the_ranks_read_and_agree(attested: Any, refusing: RefusingFront) -> None:
    """A store that will not say its checksums (403): nothing is attested, every byte is read,
    shared by the ranks, and the verdict is the same on every rank."""
    _prefixes, results, _log = attested
    report = _shared(results["refused"])["report"]
    assert report["ok"] and report["files_attested"] == 0
    assert report["bytes_checked"] == sum(map(len, FILES.values()))
    assert refusing.refused >= len(FILES)
    assert all(o["hashed"] > 0 for o in results["refused"])
    hashed = _shared(results["hashed"])["report"]  # without attested: every byte read, as before
    assert hashed["files_attested"] == 0 and hashed["bytes_checked"] == sum(map(len, FILES.values()))
