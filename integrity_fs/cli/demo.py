"""``integrity-fs demo``: an end-to-end run on a private S3 server (moto) in this process: upload
and seal a checkpoint, verify it, flip one bit in the bucket, watch verification and download
refuse it, then download a verified copy. Needs ``pip install 'integrity-fs[demo]'``."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import integrity_fs

from .output import format_work, running, tidy

URL = "s3://demo-bucket/run/step_1000"
MiB = 1024 * 1024


def run(args: Any) -> bool:
    """Run the demo, narrating on stdout; True when every step behaved as it should."""
    try:
        import fsspec
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise ImportError(f"the demo needs moto and s3fs, and {exc.name} is missing", name="moto") from exc
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    environment = dict(os.environ)  # the server takes any credentials: these keep real ones out, meanwhile
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = "http://{}:{}".format(*server.get_host_and_port())
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        fs.mkdir("demo-bucket")
        with tempfile.TemporaryDirectory(prefix="integrity-fs-demo-") as workdir:
            return _steps(args, options, fs, workdir, endpoint)
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(environment)


def _steps(args: Any, options: dict[str, Any], fs: Any, workdir: str, endpoint: str) -> bool:
    where, said = {"storage_options": options, "max_workers": args.workers}, iter(range(1, 100))

    def say(text: str, ok: bool = True) -> bool:
        print(f"{next(said)}. {text}" + ("" if ok else "; this is a bug, please report it."), flush=True)
        return ok

    say(f"Started a private S3 server (moto) at {endpoint}; nothing leaves this machine.")
    src = os.path.join(workdir, "step_1000")
    os.makedirs(src)
    for name, size in (("model.bin", 3 * MiB), ("optimizer.bin", 2 * MiB), ("metadata.json", 100)):
        with open(os.path.join(src, name), "wb") as f:
            f.write(os.urandom(size))
    say(f"Wrote a small checkpoint to {src}: model.bin, optimizer.bin and metadata.json, 5 MiB of random bytes.")
    with running(args, "upload", finishing="finalising 3 objects") as bar:
        manifest = integrity_fs.upload(src, URL, granularity="chunk", chunk_size=MiB, callback=bar.callback, **where)
    work = format_work(len(manifest.files), manifest.total_bytes or 0, bar.elapsed())
    say(f"Uploaded it to {URL}, hashing each 1 MiB chunk as it streamed; the manifest went last: {work}.")
    with running(args, "verify") as bar:
        report = integrity_fs.verify(URL, callback=bar.callback, **where)
    work = format_work(report.files_checked, report.bytes_checked, bar.elapsed())
    say(f"Verified {URL}: every byte matches the manifest; {work}.")

    path, offset = f"{URL.removeprefix('s3://')}/model.bin", MiB + 12345
    original = fs.cat_file(path)
    fs.pipe_file(path, original[:offset] + bytes([original[offset] ^ 1]) + original[offset + 1 :])
    say(f"Flipped one bit of byte {offset} of model.bin in the bucket, the kind of silent corruption a bad disk,")
    print("   a buggy copy or a flaky network leaves behind.")
    try:
        integrity_fs.verify(URL, **where)
        return say("Verification did NOT catch the flipped bit", ok=False)
    except integrity_fs.IntegrityError as err:
        say(f"Verification now rejects the checkpoint and names the file; {len(err.report.problems)} problem:")
        print("".join(f"  {tidy(problem)}\n" for problem in err.report.problems), end="")
    dest = os.path.join(workdir, "downloaded", "step_1000")
    try:
        integrity_fs.download(URL, dest, **where)
        return say("The download of the corrupt checkpoint was NOT refused", ok=False)
    except integrity_fs.IntegrityError:
        if os.path.lexists(dest):
            return say(f"The refused download left {dest} behind", ok=False)
        say(f"A download of the corrupt checkpoint is refused as well: {dest} was not created.")

    fs.pipe_file(path, original)
    with running(args, "download", finishing="finalising") as bar:
        down = integrity_fs.download(URL, dest, callback=bar.callback, **where)
    work = format_work(down.files_checked, down.bytes_checked, bar.elapsed())
    say(f"Restored the bit and downloaded the checkpoint to {dest}, verifying it in the same read: {work}.")
    say(f"The local copy verifies on its own too: {integrity_fs.verify(dest).files_checked} files.")
    print("Demo complete: the corruption was caught before anything could load it.")
    print("The demo's files were in a temporary directory and are gone; try it on yours:")
    print("  integrity-fs seal ./step_1000 && integrity-fs verify ./step_1000")
    return True
