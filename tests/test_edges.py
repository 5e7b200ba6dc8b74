"""Edges a user meets outside the main paths: a reader that stops early, a shared checkpoint."""

import contextlib
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import integrity_fs


def _sealed_tree(root: Path, files: int) -> None:
    root.mkdir()
    for i in range(files):
        (root / f"shard_{i:05d}.bin").write_bytes(i.to_bytes(4, "big"))
    integrity_fs.seal(root)


def test_cli_stops_quietly_when_its_reader_closes_early(tmp_path: Path) -> None:
    """`integrity-fs show URL --json | head -c 100`: no traceback, no 'Exception ignored' noise."""
    root = tmp_path / "ckpt"
    _sealed_tree(root, 3000)  # the JSON is far larger than a pipe's buffer
    proc = subprocess.Popen(
        [sys.executable, "-m", "integrity_fs", "show", str(root), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    head = proc.stdout.read(100)
    proc.stdout.close()  # what `head` does once it has its bytes
    stderr = proc.stderr.read().decode()
    code = proc.wait(timeout=60)
    assert head.startswith(b"{")
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert code == 4  # the output was cut short: not a success


def test_dcp_save_writes_a_manifest_others_can_read(tmp_path: Path) -> None:
    """Issue 10 item 14 through dcp.save: the manifest gets the umask's permissions, not 0600."""
    torch = pytest.importorskip("torch")
    from integrity_fs import dcp

    old = os.umask(0o022)
    try:
        dcp.save({"w": torch.arange(10.0)}, str(tmp_path / "step_1"))
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "step_1" / integrity_fs.MANIFEST_FILENAME).st_mode)
    assert mode == 0o644


def test_entries_that_vanish_while_the_tree_is_listed_are_not_a_storage_error(tmp_path: Path, monkeypatch) -> None:
    """Another process creating and removing temporary files beside an intact checkpoint: a file or
    directory removed between the directory read and its stat is simply not there (a listed one
    would be "missing"), never a raw FileNotFoundError that reads as "no checkpoint"."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "w.bin").write_bytes(b"weights")
    integrity_fs.seal(root)
    real_scandir = os.scandir

    class Listed:
        def __init__(self, path: str) -> None:
            with real_scandir(path) as entries:
                self.entries = list(entries)  # read, then the other process removes its files

        def __enter__(self) -> list[os.DirEntry[str]]:
            for victim in (root / "scratch.tmp", root / "scratch" / "x", root / "scratch", root / "link"):
                if victim.is_symlink() or victim.is_file():
                    victim.unlink()
                elif victim.is_dir():
                    victim.rmdir()
            return self.entries

        def __exit__(self, *exc: object) -> None:
            pass

    for call in (lambda: integrity_fs.verify(root, strict=True), lambda: integrity_fs.seal(root, overwrite=True)):
        (root / "scratch").mkdir()
        (root / "scratch" / "x").write_bytes(b"")
        (root / "scratch.tmp").write_bytes(b"partial")
        (root / "link").symlink_to(root / "scratch.tmp")
        monkeypatch.setattr(os, "scandir", Listed)
        result = call()
        monkeypatch.setattr(os, "scandir", real_scandir)
        if isinstance(result, integrity_fs.Manifest):
            assert list(result.files) == ["sub/w.bin"]
        else:
            assert result.ok and result.extra == ()


def test_a_temporary_manifest_left_by_a_killed_seal_is_not_content(tmp_path: Path, caplog) -> None:
    """A seal killed between writing its temporary manifest and renaming it (OOM, preemption)
    leaves `._integrity_manifest.json.<random>.tmp` beside the files. The next seal must not
    list it as content: deleting it later would fail the checkpoint, and `--strict` would call it
    an extra file."""
    (tmp_path / "w.bin").write_bytes(b"weights")
    leftovers = [tmp_path / "._integrity_manifest.json.k3_x9q0z.tmp", tmp_path / ".model.sig.a1b2c3d4.tmp"]
    for leftover in leftovers:
        leftover.write_bytes(b'{"half": ')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "._integrity_manifest.json.k3_x9q0z.tmp").write_bytes(b"user data, not at the root")
    manifest = integrity_fs.seal(tmp_path)
    assert sorted(manifest.files) == ["sub/._integrity_manifest.json.k3_x9q0z.tmp", "w.bin"]
    assert "interrupted" in caplog.text
    report = integrity_fs.verify(tmp_path)  # there, and not content: extra, and named
    assert report.ok and report.extra == ("._integrity_manifest.json.k3_x9q0z.tmp", ".model.sig.a1b2c3d4.tmp")
    for leftover in leftovers:
        leftover.unlink()
    assert integrity_fs.verify(tmp_path, strict=True).ok


# --------------------------------------------------------------------------- trust at the edges, round 3

FAKE = "x\nintegrity-fs: verified ckpt: 3 files"


def test_every_warning_that_names_a_file_or_checkpoint_escapes_it(tmp_path: Path, caplog) -> None:
    """Item 20, through the library (whatever handler a program gives its logging): a name with a
    newline cannot add a line to a WARNING, whichever warning it is."""
    run = tmp_path / f"run{FAKE}"
    good, bad = run / "step_1", run / f"step_2{FAKE}"
    good.mkdir(parents=True)
    (good / "w.bin").write_bytes(b"weights")
    integrity_fs.seal(good)
    import shutil

    shutil.copytree(good, bad)
    (bad / "w.bin").write_bytes(b"damaged")
    os.mkfifo(good / f"fifo{FAKE}")
    (tmp_path / "outside.bin").write_bytes(b"o")
    (good / f"link{FAKE}").symlink_to(tmp_path / "outside.bin")
    (good / f"extra{FAKE}").write_bytes(b"e")

    checks = {
        "a FIFO": (lambda: integrity_fs.verify(good), "not a regular file"),
        "a symlink out of the root": (lambda: integrity_fs.verify(good), "leaves the checkpoint root"),
        "a skipped checkpoint": (lambda: integrity_fs.latest_verified(run), "skipping"),
        "a root not there": (lambda: integrity_fs.latest_verified(tmp_path / f"none{FAKE}"), "no checkpoints under"),
        "files left behind by upload": (lambda: integrity_fs.upload(good, str(tmp_path / "up")), "not uploading"),
    }
    sums = good / f"SUMS{FAKE}"
    sums.write_text(f"{'0' * 64}  {integrity_fs.MANIFEST_FILENAME}\n")
    checks["a manifest file that lists ours"] = (
        lambda: integrity_fs.verify(good, manifest=str(sums)),
        "left out",
    )
    unescaped = []
    for what, (call, phrase) in checks.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="integrity_fs"), contextlib.suppress(Exception):
            call()
        lines = [m for m in caplog.messages if phrase in m]
        assert lines, (what, caplog.text)
        unescaped += [(what, m) for m in lines if not m.isprintable()]
    assert not unescaped


def test_importing_and_verifying_without_the_posix_only_calls(tmp_path: Path) -> None:
    """Item 28: macOS and Windows lack some of os.readv, os.preadv, os.O_NONBLOCK, os.fchmod (and
    /proc): with them gone before `import integrity_fs`, sealing, verifying (a flipped bit caught),
    downloading and the manifest's permissions still work."""
    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    (tmp_path / "ckpt" / "small.bin").write_bytes(b"s" * 100)
    (tmp_path / "ckpt" / "sub" / "large.bin").write_bytes(os.urandom(3 << 20))
    script = f"""
import os
for name in ("readv", "preadv", "O_NONBLOCK", "fchmod"):
    if hasattr(os, name):
        delattr(os, name)
real_open = open
def no_proc(file, *args, **kwargs):
    if str(file).startswith("/proc/"):
        raise FileNotFoundError(file)
    return real_open(file, *args, **kwargs)
import builtins
builtins.open = no_proc
os.umask(0o022)
import integrity_fs
root = {str(tmp_path / "ckpt")!r}
integrity_fs.seal(root, granularity="chunk", chunk_size=1 << 20)
assert oct(os.stat(os.path.join(root, integrity_fs.MANIFEST_FILENAME)).st_mode & 0o777) == "0o644"
assert integrity_fs.verify(root).files_checked == 2
integrity_fs.download(root, {str(tmp_path / "copy")!r})
with open(os.path.join(root, "sub", "large.bin"), "r+b") as f:
    f.seek(1 << 20)
    byte = f.read(1)
    f.seek(1 << 20)
    f.write(bytes([byte[0] ^ 1]))
try:
    integrity_fs.verify(root)
except integrity_fs.IntegrityError as exc:
    assert [p.path for p in exc.report.problems] == ["sub/large.bin"], exc
else:
    raise AssertionError("the flipped bit went unseen")
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
    assert integrity_fs.verify(tmp_path / "copy").files_checked == 2


def test_the_demo_leaves_the_environment_as_it_was(monkeypatch) -> None:
    """Item 28: the demo set AWS credentials in os.environ for good (a program that runs it, then
    reaches its own bucket, used "testing")."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    import io

    from integrity_fs.cli import demo

    monkeypatch.setitem(sys.modules, "torch", None)  # random shards instead of a state dict: sooner
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mine")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "my-token")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    before = dict(os.environ)
    assert demo.run(out=io.StringIO())
    assert dict(os.environ) == before


def test_the_readme_loop_resaves_a_skipped_checkpoint_without_dcps_overwrite_warning(tmp_path: Path) -> None:
    """Item 25: resuming past a damaged step_4 and saving step_4 again printed DCP's "Detected an
    existing checkpoint ... overwriting" warning (on every rank): the README's save starts fresh."""
    pytest.importorskip("torch")
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    loop = readme.split("<!-- readme-test: ranks=1,2 -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "train.py").write_text(loop)

    def train() -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    train()
    shard = next((tmp_path / "checkpoints" / "run" / "step_4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    again = train()
    assert "skipping" in again.stderr and "(damaged)" in again.stderr
    assert "overwriting" not in again.stderr, again.stderr
    assert integrity_fs.verify(tmp_path / "checkpoints" / "run" / "step_4").ok


def test_a_file_named_like_a_leftover_never_passes_strict(tmp_path: Path) -> None:
    """Only what our interrupted writes leave (empty, or the start of the JSON we write) is left
    out of a seal; any other file of that name is content. And whatever such a file holds, it is
    never passed over by `strict=True` or a signature: it is there, and not in the manifest."""
    (tmp_path / "w.bin").write_bytes(b"weights")
    payload = tmp_path / "._integrity_manifest.json.abcd1234.tmp"
    payload.write_bytes(b"\x80\x04import os; os.system('...')")  # not what we write: content
    leftover = tmp_path / ".model.sig.a1b2c3d4.tmp"
    leftover.write_bytes(b'{"mediaType":"appl')  # what a killed sign leaves
    manifest = integrity_fs.seal(tmp_path)
    assert sorted(manifest.files) == [payload.name, "w.bin"]
    payload.write_bytes(b"changed")
    with pytest.raises(integrity_fs.IntegrityError, match="abcd1234"):
        integrity_fs.verify(tmp_path)
    payload.unlink()
    (tmp_path / integrity_fs.MANIFEST_FILENAME).unlink()
    integrity_fs.seal(tmp_path)
    payload.write_bytes(b'{"evil": "anything at all, under a name we would skip"}')
    with pytest.raises(integrity_fs.IntegrityError) as err:
        integrity_fs.verify(tmp_path, strict=True)
    assert sorted((p.path, p.kind) for p in err.value.report.problems) == [
        (payload.name, "extra"),
        (leftover.name, "extra"),
    ]
