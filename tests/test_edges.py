"""Edges a user meets outside the main paths: a reader that stops early, a shared checkpoint."""

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
