"""``integrity-fs demo``: an end-to-end run on a private S3 server (moto) in this process: upload
and seal a checkpoint, verify it, flip one bit in the bucket, watch verification and download
refuse it, then download a verified copy. Needs ``pip install 'integrity-fs[demo]'``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import integrity_fs

from .output import format_work, running, tidy

URL = "s3://demo-bucket/run/step_1000"
CHUNK = 1024 * 1024


def run(args: Any) -> bool:
    """Run the demo, narrating on stdout; True when every step behaved as it should."""
    try:
        import fsspec
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise ImportError(f"the demo needs moto and s3fs, and {exc.name} is missing", name="moto") from exc
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    # The server takes any credentials: these keep real ones out of the demo, for its duration.
    with _environment(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_SESSION_TOKEN=None):
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
            fs.mkdir("demo-bucket")
            with tempfile.TemporaryDirectory(prefix="integrity-fs-demo-") as workdir:
                return _Demo(args, options, fs, workdir).run(f"http://{host}:{port}")
        finally:
            server.stop()


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (``None``: unset) inside, and as it was afterwards."""
    before = {name: os.environ.get(name) for name in values}

    def put(settings: dict[str, str | None]) -> None:
        for name, value in settings.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)

    put(values)
    try:
        yield
    finally:
        put(before)


class _Demo:
    def __init__(self, args: Any, options: dict[str, Any], fs: Any, workdir: str) -> None:
        self.args, self.options, self.fs, self.workdir, self.step = args, options, fs, workdir, 0

    def say(self, text: str) -> None:
        self.step += 1
        print(f"{self.step}. {text}", flush=True)

    def run(self, endpoint: str) -> bool:
        where, workers = {"storage_options": self.options}, {"max_workers": self.args.workers}
        self.say(f"Started a private S3 server (moto) at {endpoint}; nothing leaves this machine.")
        src = os.path.join(self.workdir, "step_1000")
        self.say(f"Wrote a small checkpoint to {src}: {_write_checkpoint(src)}.")
        with running(self.args, "upload") as bar:
            manifest = integrity_fs.upload(src, URL, granularity="chunk", chunk_size=CHUNK, callback=bar.callback, **where, **workers)
        work = format_work(len(manifest.files), manifest.total_bytes or 0, bar.elapsed())
        self.say(f"Uploaded it to {URL}, hashing each 1 MiB chunk as it streamed; the manifest went last: {work}.")
        with running(self.args, "verify") as bar:
            report = integrity_fs.verify(URL, callback=bar.callback, **where, **workers)
        self.say(f"Verified {URL}: every byte matches the manifest; {format_work(report.files_checked, report.bytes_checked, bar.elapsed())}.")

        victim = max(manifest.files, key=lambda name: (manifest.sizes or {})[name])
        path = f"{URL.removeprefix('s3://')}/{victim}"
        original = self.fs.cat_file(path)
        offset = (CHUNK + 12345) % len(original)
        self.fs.pipe_file(path, original[:offset] + bytes([original[offset] ^ 1]) + original[offset + 1 :])
        self.say(f"Flipped one bit of byte {offset} of {victim} in the bucket, the kind of silent corruption a bad disk, a buggy copy or a flaky network leaves behind.")
        try:
            integrity_fs.verify(URL, **where, **workers)
        except integrity_fs.IntegrityError as err:
            self.say(f"Verification now rejects the checkpoint and names the file; {len(err.report.problems)} problem:")
            for problem in err.report.problems:
                print(f"  {tidy(problem)}")
            if not any(p.path == victim for p in err.report.problems):
                return False
        else:
            self.say("Verification did NOT catch the flipped bit. This is a bug; please report it.")
            return False
        dest = os.path.join(self.workdir, "downloaded", "step_1000")
        try:
            integrity_fs.download(URL, dest, **where, **workers)
            self.say("The download of the corrupt checkpoint was NOT refused; please report this bug.")
            return False
        except integrity_fs.IntegrityError:
            pass
        if os.path.lexists(dest):
            self.say(f"The refused download left {dest} behind; please report this bug.")
            return False
        self.say(f"A download of the corrupt checkpoint is refused as well: {dest} was not created.")

        self.fs.pipe_file(path, original)
        with running(self.args, "download") as bar:
            down = integrity_fs.download(URL, dest, callback=bar.callback, **where, **workers)
        work = format_work(down.files_checked, down.bytes_checked, bar.elapsed())
        self.say(f"Restored the bit and downloaded the checkpoint to {dest}, verifying it in the same read: {work}.")
        self.say(f"The local copy verifies on its own too: {integrity_fs.verify(dest).files_checked} files.")
        print("Demo complete: the corruption was caught before anything could load it.")
        print("The demo's files were in a temporary directory and are gone; try it on yours:")
        print("  integrity-fs seal ./step_1000 && integrity-fs verify ./step_1000")
        return True


def _write_checkpoint(directory: str) -> str:
    """A torch state dict if torch is installed, else random shards; says which."""
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
                f.write(os.urandom(3 * CHUNK))
        return "two random 3 MiB shards and metadata.json (install torch for a real state dict)"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 512)).square().mean().backward()
    optimizer.step()
    torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
    return "a torch model state dict in model.pt, its Adam optimizer state in optimizer.pt, and metadata.json"
