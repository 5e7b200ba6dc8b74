"""Every ```python block of README.md runs as written (README "Development" says how to mark one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
TIMEOUT_S = 180
DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
#: What an ``s3`` block finds in the bucket: an unsealed checkpoint.
S3_CHECKPOINT = "bucket/run/step_1000"
#: Runs before a block on each rank of a ``ranks=N`` run (N > 1), and after it.
RANK_PRELUDE = """\
import os, torch.distributed as dist
dist.init_process_group("gloo", init_method=os.environ["README_INIT"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
"""
RANK_EPILOGUE = "\ndist.barrier()\ndist.destroy_process_group()\n"


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    code: str
    directive: str  # "" when none

    @property
    def id(self) -> str:
        first = next((line for line in self.code.splitlines() if line.strip()), "")
        return f"L{self.line}:{re.sub(r'[^A-Za-z0-9_]+', '_', first)[:40]}"


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks, each with the readme-test directive on the line before it (if any)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            before = lines[i - 1] if i else ""
            match = DIRECTIVE.fullmatch(before.strip())
            blocks.append(Block(i + 1, "\n".join(lines[i + 1 : end]) + "\n", match.group(1) if match else ""))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_the_snippets_it_should() -> None:
    assert len(BLOCKS) >= 5
    for block in BLOCKS:
        assert block.directive == "" or re.fullmatch(r"s3|ranks=[\d,]+|skip: .+", block.directive), block


def run_block(code: str, cwd: Path, env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def run_ranks(code: str, cwd: Path, env: dict[str, str], world_size: int) -> None:
    init = f"file://{tempfile.mktemp(dir=cwd, prefix='init-')}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_PRELUDE + code + RANK_EPILOGUE],
            cwd=cwd,
            env={**env, "README_INIT": init, "RANK": str(rank), "WORLD_SIZE": str(world_size)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    try:
        outputs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank}:\n{out}"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_snippet_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.directive.startswith("skip:"):
        pytest.skip(block.directive)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    if block.directive == "s3":
        endpoint: str = request.getfixturevalue("s3_endpoint")
        env["AWS_ENDPOINT_URL"] = endpoint
        fs = fsspec.filesystem("s3", key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})
        if fs.exists("bucket"):
            fs.rm("bucket", recursive=True)
        fs.mkdir("bucket")
        for name, data in {"model.pt": os.urandom(100_000), "sub/meta.json": b"{}"}.items():
            fs.pipe_file(f"{S3_CHECKPOINT}/{name}", data)
    if block.directive.startswith("ranks="):
        pytest.importorskip("torch")
        for n in (int(x) for x in block.directive[len("ranks=") :].split(",")):
            cwd = tmp_path / f"ranks{n}"
            cwd.mkdir()
            if n == 1:
                run_block(block.code, cwd, env)
            else:
                run_ranks(block.code, cwd, env, n)
        return
    run_block(block.code, tmp_path, env)
