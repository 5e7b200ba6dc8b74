"""distributed.verify(attested=True) on 2 gloo ranks against the moto server: the checksum requests
are shared like the reads, and every rank reaches the same verdict."""

from __future__ import annotations

import logging
import os
import re
import uuid
from typing import Any

import fsspec
import pytest

pytest.importorskip("torch.distributed")

from dist_launch import run_ranks

import integrity_fs as ifs
from integrity_fs import storage
from integrity_fs.options import Hashing

CHUNK = 5 * 1024 * 1024  # S3's smallest part size
FILES = {
    "big.bin": os.urandom(2 * CHUNK + 123),  # a 3-part upload: a composite checksum
    **{f"shard_{i}.bin": os.urandom(1000 + i) for i in range(5)},  # one PUT each: a full-object checksum
}
BIG = len(FILES["big.bin"])
NOT_CONTENT = (ifs.MANIFEST_FILENAME, "_integrity_store_checksums.json")
Results = dict[str, list[dict[str, Any]]]


class ServerLog(logging.Handler):
    """The requests the moto server (werkzeug, in this process) logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def gets(self, prefix: str) -> list[str]:
        """Paths of the GETs under ``prefix`` (other than the manifest's and the sidecar's),
        ``?attributes`` included."""
        paths = (m.group(1) for line in self.lines if (m := re.search(r"GET (\S+) HTTP", line)))
        return [p for p in paths if p.startswith(prefix) and not p.endswith(NOT_CONTENT)]


def _write_sealed(fs: fsspec.AbstractFileSystem, root: str, options: dict[str, Any]) -> None:
    """Upload the files as integrity_fs does (S3 checksums from our digests, parts of CHUNK), then seal."""
    for name, data in FILES.items():
        writer = storage.SealingWriter(fs, f"{root}/{name}", Hashing("sha256", "chunk", CHUNK), size=len(data))
        writer.write(data)
        writer.close()
    fs.invalidate_cache()
    ifs.seal(f"s3://{root}", storage_options=options, granularity="chunk", chunk_size=CHUNK)


@pytest.fixture(scope="module")
def attested(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> tuple[dict[str, str], Results, ServerLog]:
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = fsspec.filesystem("s3", **options)
    base = f"integrity-test/attested-{uuid.uuid4().hex}"
    roots = {name: f"{base}/{name}" for name in ("good", "replaced", "faults", "plain")}
    for name, root in roots.items():
        if name != "plain":
            _write_sealed(fs, root, options)
    for name, data in FILES.items():  # another tool's writes (plain s3fs), sealed: S3's MD5s recorded
        with fs.open(f"{roots['plain']}/{name}", "wb", block_size=CHUNK) as f:
            f.write(data)
    fs.invalidate_cache()
    ifs.seal(f"s3://{roots['plain']}", storage_options=options)
    damaged = bytearray(FILES["big.bin"])
    damaged[CHUNK + 7] ^= 1
    fs.pipe_file(f"{roots['replaced']}/big.bin", bytes(damaged))  # another tool's PUT: no SHA-256 of ours
    fs.invalidate_cache()

    def sc(id_: str, mode: str, ckpt: str, attested: bool = True, **extra: Any) -> dict[str, Any]:
        kwargs = {"storage_options": options, "attested": attested}
        return {"id": id_, "op": "verify", "mode": mode, "url": f"s3://{roots[ckpt]}", "kwargs": kwargs, **extra}

    scenarios = [
        sc("sharded", "sharded", "good"),
        sc("rank0", "rank0", "good"),
        sc("replaced", "sharded", "replaced"),
        sc("denied", "sharded", "faults", checksum_fault_rank=1, checksum_fault="permission"),
        sc("interrupted", "sharded", "faults", checksum_fault_rank=1, checksum_fault="KeyboardInterrupt"),
        sc("after", "sharded", "good"),  # the group is still in step
        sc("hashed", "sharded", "faults", attested=False),
        sc("plain", "sharded", "plain"),
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
    shared = [{k: v for k, v in o.items() if k not in ("hashed", "notes", "checksums_asked")} for o in outcomes]
    assert shared[0] == shared[1], shared
    return shared[0]


def test_sharded_attested_verify_reads_nothing_and_splits_the_requests(attested: Any) -> None:
    prefixes, results, log = attested
    for name in ("sharded", "after"):
        report = _shared(results[name])["report"]
        assert report["ok"] and report["files_attested"] == len(FILES) == report["files_checked"], name
        assert report["bytes_checked"] == 0
        assert [o["hashed"] for o in results[name]] == [0, 0]
        assert [o["checksums_asked"] for o in results[name]] == [3, 3], name  # 6 files, half each
    # rank0 mode: the local attested verify, on rank 0 alone, and the same report.
    assert _shared(results["rank0"])["report"] == _shared(results["sharded"])["report"]
    assert [o["checksums_asked"] for o in results["rank0"]] == [len(FILES), 0]
    # On the server: one attributes request per file and call, no GET of any object's content.
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


def test_a_checksum_request_failing_on_one_rank_is_raised_on_every_rank(attested: Any) -> None:
    _prefixes, results, _log = attested
    denied = _shared(results["denied"])
    assert denied["type"] == "PermissionError" and "injected" in denied["message"]
    assert [o["hashed"] for o in results["denied"]] == [0, 0]  # nothing hashed once a share failed
    assert results["denied"][0]["notes"] == ["(raised on rank 1)"]
    rank0, rank1 = results["interrupted"]
    assert rank1["type"] == "KeyboardInterrupt"
    assert {k: rank0[k] for k in ("type", "message")} == {"type": "RuntimeError", "message": "KeyboardInterrupt"}
    hashed = _shared(results["hashed"])["report"]  # without attested: every byte read, as before
    assert hashed["files_attested"] == 0 and hashed["bytes_checked"] == sum(map(len, FILES.values()))


def test_sharded_attested_verify_attests_from_recorded_store_checksums(attested: Any) -> None:
    """A checkpoint another tool wrote, sealed once: every rank attests each file from the MD5 the
    seal recorded (S3's ETag), the same on every rank, and no rank reads any content."""
    prefixes, results, log = attested
    report = _shared(results["plain"])["report"]
    assert report["ok"] and report["files_attested"] == len(FILES) and report["bytes_checked"] == 0
    assert report["attested_by"] == dict.fromkeys(sorted(FILES), "md5")
    assert [o["hashed"] for o in results["plain"]] == [0, 0]
    assert [g for g in log.gets(prefixes["plain"]) if not g.endswith("?attributes")] == []
