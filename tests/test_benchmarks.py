"""The benchmarks' contender runner (``python -m benchmarks.runner``), as a user without the
``bench`` extra meets it: a peer whose package or tool is missing is a skip with its install hint
(a skipped row in the report), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _runner(spec: dict[str, object], blocked: Path, **env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)]), **env}
    command = [sys.executable, "-m", "benchmarks.runner", json.dumps(spec)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, input="quit\n", timeout=60)


def test_a_peer_whose_package_is_missing_is_skipped_with_its_install_hint(tmp_path: Path) -> None:
    blocked = tmp_path / "site"
    (blocked / "model_signing").mkdir(parents=True)  # importing it fails as a missing package does
    (blocked / "model_signing" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'model_signing'\", name='model_signing')\n"
    )
    (tmp_path / "data").mkdir()
    spec = {"contender": "model_signing", "params": {"directory": str(tmp_path / "data")}}
    done = _runner(spec, blocked)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    (first,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert first == {"skipped": "model_signing is not installed: pip install -e '.[bench]'"}


def test_a_peer_tool_missing_from_path_is_skipped_with_how_to_install_it(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.bin").write_bytes(b"a")
    spec = {"contender": "b3sum", "params": {"directory": str(tmp_path / "data")}}
    done = _runner(spec, tmp_path, PATH=str(tmp_path))  # no b3sum there
    assert done.returncode == 0, done.stderr
    (first,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert "apt-get install b3sum" in first["skipped"], first
