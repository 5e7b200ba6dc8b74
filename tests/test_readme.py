"""Every ```python block of README.md runs as written (README "Development" says how to mark one)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
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
#: What a rank prints once its group is destroyed: every line of the block has run.
DONE = "readme-test: process group destroyed"
RANK_EPILOGUE = f"\ndist.barrier()\ndist.destroy_process_group()\nprint({DONE!r}, flush=True)\n"
#: How torch 2.13 (rarely) aborts a gloo process on its way out after ``destroy_process_group``:
#: seen once in CI, on a rank that had passed the closing barrier; not reproduced in local runs.
#: That abort, and only after ``DONE``, is reported as a warning rather than a failure.
TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_WARNING = "torch aborted a rank at exit, after the block had run"


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
        tokens = r"(s3|ranks=[\d,]+)( (s3|ranks=[\d,]+))*"
        assert block.directive == "" or re.fullmatch(rf"{tokens}|skip: .+", block.directive), block


def start(code: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", code],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_all(procs: dict[str, subprocess.Popen[str]]) -> None:
    """Wait for every process (they run at once); each must exit 0."""
    try:
        outputs = {name: proc.communicate(timeout=TIMEOUT_S)[0] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for name, proc in procs.items():
        if proc.returncode == -signal.SIGABRT and DONE in outputs[name] and TEARDOWN_ABORT in outputs[name]:
            warnings.warn(f"{TEARDOWN_WARNING} ({name}):\n{outputs[name]}", RuntimeWarning, stacklevel=2)
            continue
        assert proc.returncode == 0, f"{name}:\n{outputs[name]}"


def needs(block: Block) -> tuple[bool, list[int]]:
    """``(s3, rank counts)`` from a directive such as ``s3 ranks=1,2`` (no ranks: ``[0]``, a plain run)."""
    s3, ranks = False, [0]
    for token in block.directive.split():
        if token == "s3":
            s3 = True
        elif token.startswith("ranks="):
            ranks = [int(x) for x in token[len("ranks=") :].split(",")]
    return s3, ranks


def launch(code: str, cwd: Path, env: dict[str, str], n: int) -> dict[str, subprocess.Popen[str]]:
    """``code`` as one process (``n`` 0 or 1), or as the ``n`` ranks of a gloo group (file:// rendezvous)."""
    if n <= 1:
        return {"alone": start(code, cwd, env)}
    init = f"file://{cwd / 'init'}"
    return {
        f"rank {rank} of {n}": start(
            RANK_PRELUDE + code + RANK_EPILOGUE,
            cwd,
            {**env, "README_INIT": init, "RANK": str(rank), "WORLD_SIZE": str(n)},
        )
        for rank in range(n)
    }


def fresh_bucket(endpoint: str) -> None:
    """An empty ``bucket`` holding one unsealed checkpoint, for ``s3`` blocks."""
    fs = fsspec.filesystem("s3", key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})
    if fs.exists("bucket"):
        fs.rm("bucket", recursive=True)
    fs.mkdir("bucket")
    for name, data in {"model.pt": os.urandom(100_000), "sub/meta.json": b"{}"}.items():
        fs.pipe_file(f"{S3_CHECKPOINT}/{name}", data)
    fs.invalidate_cache()


@pytest.mark.filterwarnings(f"default:{TEARDOWN_WARNING}:RuntimeWarning")  # shown, not raised
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_snippet_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.directive.startswith("skip:"):
        pytest.skip(block.directive)
    s3, ranks = needs(block)
    if ranks != [0]:
        pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    endpoint = request.getfixturevalue("s3_endpoint") if s3 else ""
    if s3:
        env["AWS_ENDPOINT_URL"] = endpoint
    procs: dict[str, subprocess.Popen[str]] = {}
    for n in ranks:
        cwd = tmp_path / f"ranks{n}"
        cwd.mkdir()
        if s3:  # one bucket: each run in turn, on a fresh one
            fresh_bucket(endpoint)
            wait_all(launch(block.code, cwd, env, n))
        else:  # separate directories: all at once
            procs.update({f"{name}, ranks={n}": p for name, p in launch(block.code, cwd, env, n).items()})
    wait_all(procs)


@pytest.mark.parametrize(
    ("printed", "how", "passes"),
    [
        (f"{DONE}\n{TEARDOWN_ABORT}", "abort", True),  # the known teardown abort: a warning
        (TEARDOWN_ABORT, "abort", False),  # an abort before the block ended
        (DONE, "abort", False),  # another abort
        (DONE, "exit 1", False),
    ],
)
def test_only_a_teardown_abort_after_the_block_is_forgiven(printed: str, how: str, passes: bool) -> None:
    end = "os.abort()" if how == "abort" else "sys.exit(1)"
    code = f"import os, sys\nprint({printed!r}, flush=True)\n{end}\n"
    procs = {"rank 0 of 2": start(code, Path.cwd(), dict(os.environ))}
    if passes:
        with pytest.warns(RuntimeWarning, match=TEARDOWN_WARNING):
            wait_all(procs)
    else:
        with pytest.raises(AssertionError):
            wait_all(procs)
