"""An end-to-end run on a private S3 server (moto) in this process: upload and seal a checkpoint,
verify it, flip one bit in the bucket, watch verification and download refuse it, then download
a verified copy. ``integrity-fs demo`` runs it; it needs ``pip install 'integrity-fs[demo]'``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import IO, Any

from .. import storage
from ..errors import IntegrityError
from ..storage import DEFAULT_CALLBACK, Callback
from ..text import describe_problem, format_work
from ..transfer import download, upload
from ..verify import verify

__all__ = [
    "DEMO_CHUNK_SIZE",
    "DEMO_URL",
    "ProgressFactory",
    "no_progress",
    "run",
]

DEMO_URL = "s3://demo-bucket/run/step_1000"
DEMO_CHUNK_SIZE = 1024 * 1024

ProgressFactory = Callable[[str], AbstractContextManager[Callback]]


@contextlib.contextmanager
def no_progress(desc: str) -> Iterator[Callback]:
    yield DEFAULT_CALLBACK


def run(*, max_workers: int | None = None, progress: ProgressFactory = no_progress, out: IO[str] | None = None) -> bool:
    """Run the demo, narrating on ``out`` (stdout); True when every step behaved as it should.

    ``ImportError`` (with the install command) when moto or s3fs is missing.
    """
    try:
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise ImportError(
            f"the demo needs moto and s3fs, and {exc.name} is missing",
            name=exc.name,
        ) from exc
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    # The server accepts any credentials; these keep real ones out of the demo, for its duration.
    with _environment(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_SESSION_TOKEN=None):
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            with tempfile.TemporaryDirectory(prefix="integrity-fs-demo-") as workdir:
                return _Demo(f"http://{host}:{port}", workdir, max_workers, progress, out).run()
        finally:
            server.stop()


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (``None``: unset) inside, and as it was afterwards."""
    before = {name: os.environ.get(name) for name in values}

    def put(settings: dict[str, str | None]) -> None:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    put(values)
    try:
        yield
    finally:
        put(before)


class _Demo:
    def __init__(
        self, endpoint: str, workdir: str, max_workers: int | None, progress: ProgressFactory, out: IO[str] | None
    ) -> None:
        self.endpoint = endpoint
        self.workdir = workdir
        self.workers = max_workers
        self.progress = progress
        self.out = out
        self.step = 0
        self.options: dict[str, Any] = {"key": "testing", "secret": "testing"}
        self.options["client_kwargs"] = {"endpoint_url": endpoint}

    def say(self, text: str) -> None:
        self.step += 1
        print(f"{self.step}. {text}", file=self.out, flush=True)

    def run(self) -> bool:
        fs, bucket = storage.resolve("s3://demo-bucket", self.options)
        storage.makedirs(fs, bucket)
        self.say(f"Started a private S3 server (moto) at {self.endpoint}; nothing leaves this machine.")
        src = os.path.join(self.workdir, "step_1000")
        self.say(f"Wrote a small checkpoint to {src}: {_write_checkpoint(src)}.")

        started = time.perf_counter()
        with self.progress("upload") as callback:
            manifest = upload(
                src,
                DEMO_URL,
                storage_options=self.options,
                granularity="chunk",
                chunk_size=DEMO_CHUNK_SIZE,
                max_workers=self.workers,
                callback=callback,
            )
        work = format_work(len(manifest.files), manifest.total_bytes or 0, time.perf_counter() - started)
        self.say(f"Uploaded it to {DEMO_URL}, hashing each 1 MiB chunk as it streamed; the manifest went last: {work}.")

        started = time.perf_counter()
        report = verify(DEMO_URL, storage_options=self.options, max_workers=self.workers)
        work = format_work(report.files_checked, report.bytes_checked, time.perf_counter() - started)
        self.say(f"Verified {DEMO_URL}: every byte matches the manifest; {work}.")

        [(victim, _)] = manifest.largest(1)  # upload records sizes
        path = f"demo-bucket/run/step_1000/{victim}"
        original = storage.read_file(fs, path)
        offset = (DEMO_CHUNK_SIZE + 12345) % len(original)
        flipped = bytearray(original)
        flipped[offset] ^= 0x01
        storage.write_atomic(fs, path, bytes(flipped))
        self.say(
            f"Flipped one bit of byte {offset} of {victim} in the bucket, the kind of silent corruption "
            "a bad disk, a buggy copy or a flaky network leaves behind."
        )
        try:
            verify(DEMO_URL, storage_options=self.options, max_workers=self.workers)
        except IntegrityError as err:
            self.say(f"Verification now rejects the checkpoint and names the file; {len(err.report.problems)} problem:")
            for problem in err.report.problems:
                print(f"  {describe_problem(problem)}", file=self.out)
            if not any(p.path == victim for p in err.report.problems):
                return False
        else:
            self.say("Verification did NOT catch the flipped bit. This is a bug; please report it.")
            return False

        dest = os.path.join(self.workdir, "downloaded", "step_1000")
        try:
            download(DEMO_URL, dest, storage_options=self.options, max_workers=self.workers)
        except IntegrityError:
            pass
        else:
            self.say("The download of the corrupt checkpoint was NOT refused; please report this bug.")
            return False
        if os.path.lexists(dest):
            self.say(f"The refused download left {dest} behind; please report this bug.")
            return False
        self.say(f"A download of the corrupt checkpoint is refused as well: {dest} was not created.")

        storage.write_atomic(fs, path, original)
        started = time.perf_counter()
        with self.progress("download") as callback:
            down = download(DEMO_URL, dest, storage_options=self.options, max_workers=self.workers, callback=callback)
        work = format_work(down.files_checked, down.bytes_checked, time.perf_counter() - started)
        self.say(f"Restored the bit and downloaded the checkpoint to {dest}, verifying it in the same read: {work}.")
        local = verify(dest)
        self.say(f"The local copy verifies on its own too: {local.files_checked} files.")
        print("Demo complete: the corruption was caught before anything could load it.", file=self.out)
        print("The demo's files were in a temporary directory and are gone; try it on yours:", file=self.out)
        print("  integrity-fs seal ./step_1000 && integrity-fs verify ./step_1000", file=self.out)
        return True


def _write_checkpoint(directory: str) -> str:
    """A torch state dict in two files if torch is installed, else random shards; says which."""
    os.makedirs(directory)
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"step": 1000, "note": "integrity-fs demo"}, f)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
    except ImportError:
        for i in range(2):
            with open(os.path.join(directory, f"shard_{i:02d}.bin"), "wb") as f:
                f.write(os.urandom(3 * 1024 * 1024))
        return "two random 3 MiB shards and metadata.json (install torch for a real state dict)"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 512)).square().mean().backward()
    optimizer.step()
    torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
    return "a torch model state dict in model.pt, its Adam optimizer state in optimizer.pt, and metadata.json"
