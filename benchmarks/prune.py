"""``python -m benchmarks.prune [--checkpoints 50] [--files 4] [--kib 256] [--keep-last 2] [--json]``

Retention on S3 (a moto server in this process): a run of ``--checkpoints`` checkpoints, each of
``--files`` random files written with ``integrity_fs.upload`` (so they carry S3's SHA-256
checksums), pruned to ``--keep-last`` with ``integrity_fs.prune``:

- ``attested``: ``prune(attested=True)``, what ``integrity-fs prune --attested`` runs: the kept
  checkpoints are confirmed from the store's checksums (GetObjectAttributes), the older ones by
  their manifest and listing; no content should be read;
- ``hashed``: ``prune()``, the default: the kept checkpoints are read and hashed.

Each prune runs once on a run of its own, with every request the server answered under the run
counted by a WSGI middleware in front of moto: listings, GETs of manifests and sidecars, GETs of
object content (and their bytes), GetObjectAttributes, DeleteObjects (batched deletes, up to
1,000 keys each) and single-object DELETEs. ``--json`` prints the rows as JSON (``python -m
benchmarks`` runs it that way, in a child process, section ``prune``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

KiB = 1024
#: The root files that are metadata, not content.
METADATA = ("_integrity_manifest.json", "_integrity_store_checksums.json", "model.sig")


@dataclass
class Counts:
    """What the moto server answered under one run's prefix."""

    total: int = 0
    listings: int = 0
    metadata_gets: int = 0  # GETs of manifests, sidecars, signatures
    content_gets: int = 0  # GETs of a data file's content (any range)
    content_bytes: int = 0
    attributes: int = 0  # GetObjectAttributes
    delete_batches: int = 0  # DeleteObjects (POST ?delete)
    single_deletes: int = 0  # DELETE of one object
    other: int = 0


@dataclass
class Counter:
    """WSGI middleware in front of moto: counts the requests whose path (path style) is under
    ``prefix``, or that list or batch-delete in its bucket."""

    prefix: str = ""
    counts: Counts = field(default_factory=Counts)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _app: Any = None

    def wrap(self, app: Any) -> Counter:
        self._app = app
        return self

    def reset(self, prefix: str) -> None:
        with self._lock:
            self.prefix, self.counts = prefix, Counts()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path, query, method = environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", ""), environ["REQUEST_METHOD"]
        bucket = "/" + self.prefix.strip("/").split("/", 1)[0] if self.prefix else ""
        in_run = bool(self.prefix) and path.startswith(self.prefix)
        on_bucket = bool(self.prefix) and path.rstrip("/") == bucket
        listing = on_bucket and method == "GET" and self.prefix.strip("/").split("/", 1)[-1] in _unquote(query)
        batch = on_bucket and method == "POST" and "delete" in query.split("&")
        content = in_run and method == "GET" and not query and not path.endswith(METADATA)
        if in_run or listing or batch:
            with self._lock:
                c = self.counts
                c.total += 1
                if listing:
                    c.listings += 1
                elif batch:
                    c.delete_batches += 1
                elif method == "DELETE":
                    c.single_deletes += 1
                elif method == "GET" and "attributes" in query.split("&"):
                    c.attributes += 1
                elif method == "GET" and path.endswith(METADATA):
                    c.metadata_gets += 1
                elif content:
                    c.content_gets += 1
                else:
                    c.other += 1
        body = self._app(environ, start_response)
        return self._counted(body) if content else body

    def _counted(self, body: Iterable[bytes]) -> Iterable[bytes]:
        try:
            for piece in body:
                with self._lock:
                    self.counts.content_bytes += len(piece)
                yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


def _unquote(query: str) -> str:
    from urllib.parse import unquote

    return unquote(query)


@dataclass(frozen=True)
class Row:
    how: str
    checkpoints: int
    keep_last: int
    seconds: float
    kept: int
    deleted: int
    objects_before: int
    objects_after: int
    bytes_freed: int
    files_attested: int
    counts: dict[str, int]


def _write_run(options: dict[str, Any], url: str, source: str, checkpoints: int) -> None:
    import integrity_fs

    for step in range(1, checkpoints + 1):
        integrity_fs.upload(source, f"{url}/step_{step}", storage_options=options)


def _objects(options: dict[str, Any], url: str) -> int:
    import fsspec

    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()
    return len(fs.find(url.removeprefix("s3://")))


def run(checkpoints: int, files: int, kib: int, keep_last: int, workdir: str) -> list[Row]:
    import integrity_fs
    from benchmarks import s3

    source = os.path.join(workdir, "checkpoint")
    os.makedirs(source, exist_ok=True)
    for i in range(files):
        with open(os.path.join(source, f"shard_{i}.bin"), "wb") as f:
            f.write(os.urandom(kib * KiB))
    counter = Counter()
    rows: list[Row] = []
    with s3.moto_server(counter.wrap) as options:
        for how in ("attested", "hashed"):
            url = f"s3://{s3.BUCKET}/prune-{how}-{os.getpid()}"
            _write_run(options, url, source, checkpoints)
            before = _objects(options, url)
            kept = integrity_fs.find_checkpoints(url, storage_options=options)[:keep_last]
            attested = sum(integrity_fs.verify(k, storage_options=options, attested=True).files_attested for k in kept)
            counter.reset("/" + url.removeprefix("s3://") + "/")
            started = time.perf_counter()
            result = integrity_fs.prune(url, keep_last=keep_last, attested=how == "attested", storage_options=options)
            seconds = time.perf_counter() - started
            counts = dataclasses.asdict(counter.counts)
            counter.reset("")
            rows.append(
                Row(
                    how,
                    checkpoints,
                    keep_last,
                    seconds,
                    len(result.kept),
                    len(result.deleted),
                    before,
                    _objects(options, url),
                    result.bytes_freed,
                    attested if how == "attested" else 0,
                    counts,
                )
            )
            import fsspec

            fsspec.filesystem("s3", **options).rm(url.removeprefix("s3://"), recursive=True)
    return rows


def table(rows: list[Row]) -> str:
    from benchmarks.report import table as md_table

    headers = ["prune", "time s", "requests", "listings", "manifest GETs", "GetObjectAttributes"]
    headers += ["content GETs", "content bytes", "DeleteObjects", "single DELETEs", "objects deleted"]
    body = []
    for r in rows:
        c = r.counts
        body.append(
            [
                f"{r.how}, keep_last={r.keep_last} of {r.checkpoints}",
                f"{r.seconds:.2f}",
                str(c["total"]),
                str(c["listings"]),
                str(c["metadata_gets"]),
                str(c["attributes"]),
                str(c["content_gets"]),
                f"{c['content_bytes']:,}",
                str(c["delete_batches"]),
                str(c["single_deletes"]),
                str(r.objects_before - r.objects_after),
            ]
        )
    return md_table(headers, body)


def target_lines(rows: list[Row]) -> list[str]:
    """PASS/MISS: attested reads no content; deletes go in batches (no request per object)."""
    from benchmarks.report import verdict

    out = []
    for r in rows:
        c = r.counts
        deleted = r.objects_before - r.objects_after
        batches = -(-deleted // 1000) + 1  # the manifests first, then the files (1,000 keys a request)
        if r.how == "attested":
            ok = c["content_gets"] == 0 and c["content_bytes"] == 0
            text = (
                f"prune --attested over {r.checkpoints} checkpoints on moto reads no content: "
                f"{c['content_gets']} GETs of object content ({c['content_bytes']} bytes), "
                f"{c['attributes']} GetObjectAttributes, {c['metadata_gets']} manifest GETs, {c['total']} requests "
                f"in all; {r.kept} kept, {r.deleted} deleted in {r.seconds:.2f} s"
            )
            out.append(verdict(ok, text))
        ok = c["single_deletes"] == 0 and c["delete_batches"] <= batches
        text = (
            f"prune ({r.how}) deletes in batches: {deleted} objects of {r.deleted} checkpoints in "
            f"{c['delete_batches']} DeleteObjects requests (target ≤ {batches}: manifests first, then up to "
            f"1,000 keys a request), {c['single_deletes']} single-object DELETEs"
        )
        out.append(verdict(ok, text))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=int, default=50)
    parser.add_argument("--files", type=int, default=4, help="files per checkpoint")
    parser.add_argument("--kib", type=int, default=256, help="size of each file in KiB")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the source files are written (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ifs-bench-prune-", dir=args.dir) as tmp:
        rows = run(args.checkpoints, args.files, args.kib, args.keep_last, tmp)
    if args.json:
        print(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "files": args.files, "kib": args.kib}))
        return
    print(f"{args.checkpoints} checkpoints of {args.files} x {args.kib} KiB on moto, keep_last={args.keep_last}\n")
    print(table(rows))
    print("\n".join(["", *target_lines(rows)]))


if __name__ == "__main__":
    main()
