"""Edges a user meets outside the main paths: a reader that stops early, a shared checkpoint."""

import os
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


# --------------------------------------------------------------------------- trust at the edges, round 3


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
