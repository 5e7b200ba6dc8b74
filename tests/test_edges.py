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
