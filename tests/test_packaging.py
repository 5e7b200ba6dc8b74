"""What the built package holds: the wheel that ``pip wheel`` makes from this checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120


def test_the_wheel_holds_the_license(tmp_path: Path) -> None:
    """pyproject.toml says Apache-2.0: the wheel carries that license's text, the repository's own
    LICENSE. Built from a copy of what the wheel is made of (nothing written into the checkout),
    with the setuptools installed here (no download)."""
    pytest.importorskip("setuptools", minversion="77")  # license-files
    source = tmp_path / "src"
    shutil.copytree(ROOT / "integrity_fs", source / "integrity_fs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run(
        [*build, "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("integrity_fs-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        licenses = [name for name in archive.namelist() if name.endswith(".dist-info/licenses/LICENSE")]
        assert len(licenses) == 1, archive.namelist()
        text = archive.read(licenses[0]).decode()
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in archive.read(metadata).decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 integrity_fs authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
