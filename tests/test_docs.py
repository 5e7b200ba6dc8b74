"""Every ```python block of README.md and of docs/**/*.md runs as written, in the order a reader
runs them, and the docs site builds (docs/development.md, "Snippets are tests", says how to mark
a block)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import fork_server
import fsspec
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 180
DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
TOKENS = r"(s3|ranks=[\d,]+)( (s3|ranks=[\d,]+))*"
#: What an ``s3`` block finds in the bucket: an unsealed checkpoint.
S3_CHECKPOINT = "bucket/run/step_1000"
#: What torchrun sets on each rank; cleared for runs alone, so that they run as one process.
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Runs before a ``ranks=N`` block (N > 1) that does not initialise a process group itself.
RANK_PRELUDE = 'import torch.distributed as _test_dist\n_test_dist.init_process_group("gloo")\n'
#: What a rank prints once its group is destroyed: every line of the block has run.
DONE = "readme-test: process group destroyed"
RANK_EPILOGUE = f"""
import torch.distributed as _test_dist
if _test_dist.is_initialized():
    _test_dist.barrier()
    _test_dist.destroy_process_group()
print({DONE!r}, flush=True)
"""
#: How torch 2.13 (rarely) aborts a gloo process on its way out after ``destroy_process_group``:
#: seen once in CI, on a rank that had passed the closing barrier; not reproduced in local runs.
#: That abort, and only after ``DONE``, is reported as a warning rather than a failure.
TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_WARNING = "torch aborted a rank at exit, after the block had run"


@dataclass(frozen=True)
class Block:
    page: str  # the file, relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    directive: str  # "" when none

    @property
    def id(self) -> str:
        first = next((line for line in self.code.splitlines() if line.strip()), "")
        return f"{self.page}:L{self.line}:{re.sub(r'[^A-Za-z0-9_]+', '_', first)[:40]}"

    @property
    def skipped(self) -> bool:
        return self.directive.startswith("skip:")

    @property
    def s3(self) -> bool:
        return not self.skipped and "s3" in self.directive.split()

    @property
    def ranks(self) -> list[int]:
        """The rank counts of a ``ranks=1,2`` directive; ``[0]`` (one plain run) without one."""
        for token in [] if self.skipped else self.directive.split():
            if token.startswith("ranks="):
                return [int(x) for x in token[len("ranks=") :].split(",")]
        return [0]

    @property
    def in_sequence(self) -> bool:
        """Whether the block is one of its page's steps, run in order: not skipped, no ranks."""
        return not self.skipped and self.ranks == [0]


def python_blocks(text: str, page: str) -> list[Block]:
    """The ```python blocks, each with the readme-test directive on the line before it (if any)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            before = lines[i - 1] if i else ""
            match = DIRECTIVE.fullmatch(before.strip())
            code = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(page, i + 1, code, match.group(1) if match else ""))
            i = end
        i += 1
    return blocks


def stray_directives(text: str) -> list[int]:
    """Lines that are a readme-test directive but do not stand right before a ```python block."""
    lines = text.splitlines()
    return [
        n + 1
        for n, line in enumerate(lines)
        if DIRECTIVE.fullmatch(line.strip()) and (n + 1 >= len(lines) or lines[n + 1].strip() != "```python")
    ]


def _relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


BLOCKS = [block for page in PAGES for block in python_blocks(page.read_text(encoding="utf-8"), _relative(page))]


def steps_before(block: Block) -> list[Block]:
    """The blocks a reader has run before ``block``: the earlier steps of its page."""
    return [b for b in BLOCKS if b.page == block.page and b.line < block.line and b.in_sequence]


def test_the_pages_have_the_snippets_they_should() -> None:
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert len(readme) >= 3
    assert len(BLOCKS) - len(readme) >= 10
    for block in BLOCKS:
        assert block.directive == "" or re.fullmatch(rf"{TOKENS}|skip: .+", block.directive), block
    for page in PAGES:
        stray = stray_directives(page.read_text(encoding="utf-8"))
        assert stray == [], f"{_relative(page)}, lines {stray}: a directive that stands before no ```python block"


def test_blocks_and_directives_are_found_where_they_stand() -> None:
    text = (
        "intro\n<!-- readme-test: s3 -->\n```python\na = 1\n```\n```python\nb = 2\n```\n"
        "<!-- readme-test: s3 -->\n```bash\n```\n"
    )
    blocks = python_blocks(text, "page.md")
    assert [(b.line, b.code, b.directive) for b in blocks] == [(3, "a = 1\n", "s3"), (6, "b = 2\n", "")]
    assert stray_directives(text) == [9]
    ranks = Block("p.md", 1, "", "s3 ranks=1,2")
    assert (ranks.s3, ranks.ranks, ranks.in_sequence) == (True, [1, 2], False)
    assert not Block("p.md", 1, "", "skip: s3 is not here").s3


def test_the_readme_stays_short() -> None:
    """The README is the short tour (what ``wc -w`` counts); the reference lives in docs/."""
    assert len(README.read_text(encoding="utf-8").split()) <= 3000


#: A checkpoint (or run) a block names in the test's bucket: ``s3://bucket/run/step_1000`` -> ``run/step_1000``.
BUCKET_NAME = re.compile(r"\bbucket/([\w.-]+(?:/[\w.-]+)?)")


def test_pages_name_checkpoints_of_their_own_in_the_bucket() -> None:
    """Run one page's S3 snippets after another's against one bucket (a reader trying both) and
    neither may trip over what the other wrote: no two pages name the same checkpoint, nor one
    inside a run the other names."""
    names: dict[str, set[str]] = {}
    for block in BLOCKS:
        if block.s3:
            names.setdefault(block.page, set()).update(BUCKET_NAME.findall(block.code))

    def overlap(a: str, b: str) -> bool:
        return a == b or a.startswith(f"{b}/") or b.startswith(f"{a}/")

    shared = [
        (page, other, a, b)
        for page, other in itertools.combinations(sorted(names), 2)
        for a in names[page]
        for b in names[other]
        if overlap(a, b)
    ]
    assert not shared, shared


def test_no_page_speaks_of_how_the_project_was_run() -> None:
    history = re.compile(r"issue [0-9]|round [0-9]|round-[0-9]", re.IGNORECASE)
    files = [*PAGES, *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.md"))]
    found = [
        f"{_relative(f)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if history.search(line)
    ]
    assert found == []


def start(code: str, cwd: Path, env: dict[str, str]) -> fork_server.Forked:
    """``python -X faulthandler -c CODE`` in ``cwd`` with ``env``, forked from a warm interpreter
    (tests/fork_server.py): a fresh ``__main__``, as a new interpreter that imported the libraries."""
    warm = [*fork_server.BASE, *(fork_server.TRANSFORMERS if "transformers" in code else ())]
    return fork_server.start(["-c"], code=code, cwd=cwd, env=env, warm=warm, faulthandler=True)


def wait_all(procs: dict[str, fork_server.Forked]) -> None:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch(code: str, cwd: Path, env: dict[str, str], n: int) -> dict[str, fork_server.Forked]:
    """``code`` as one process (``n`` 0 or 1), or as the ``n`` ranks of a gloo group, each with the
    environment torchrun gives a rank (so the block's own ``init_process_group`` joins it)."""
    if n <= 1:
        return {"alone": start(code, cwd, env)}
    prelude = "" if "init_process_group(" in code else RANK_PRELUDE
    port = str(free_port())
    world = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return {
        f"rank {rank} of {n}": start(
            prelude + code + RANK_EPILOGUE, cwd, {**env, **world, "RANK": str(rank), "LOCAL_RANK": str(rank)}
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
    BUCKETS.append(endpoint)


#: Every bucket ``fresh_bucket`` made, in this process: a page's steps on S3 go on only in the same one.
BUCKETS: list[str] = []


@dataclass
class PageRun:
    """A page's steps run so far in this process, in order, each passed: where, and on which bucket."""

    cwd: Path
    done: list[Block]
    buckets: int


#: Per page: the tests of its steps run one after the other in one worker (one xdist group), each
#: going on where the test before it left the page's directory, rather than running every step
#: before it again (a test run alone runs them first).
SEQUENCES: dict[str, PageRun] = {}


def _params() -> list[object]:
    """The blocks, those of a page's sequence in the page's group when it has several."""
    pages = [block.page for block in BLOCKS if block.in_sequence]
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.xdist_group(f"docs:{b.page}")] if pages.count(b.page) > 1 else [])
        for b in BLOCKS
    ]


def run_in_sequence(block: Block, tmp_path_factory: pytest.TempPathFactory, env: dict[str, str], endpoint: str) -> None:
    """The page's steps up to ``block``, in order, in one directory: each must pass."""
    steps = [*steps_before(block), block]
    went = SEQUENCES.pop(block.page, None)
    if (
        went is None
        or len(went.done) >= len(steps)
        or went.done != steps[: len(went.done)]
        or (endpoint and went.buckets != len(BUCKETS))
    ):
        if endpoint:
            fresh_bucket(endpoint)
        went = PageRun(tmp_path_factory.mktemp("page"), [], len(BUCKETS) if endpoint else 0)
    if endpoint and went.buckets == 0:  # the page's first step on S3 comes after steps that needed none
        fresh_bucket(endpoint)
        went.buckets = len(BUCKETS)
    for step in steps[len(went.done) :]:
        name = step.id if step is block else f"{step.id} (run before {block.id})"
        wait_all({name: start(step.code, went.cwd, env)})
        went.done.append(step)
    SEQUENCES[block.page] = went


@pytest.mark.filterwarnings(f"default:{TEARDOWN_WARNING}:RuntimeWarning")  # shown, not raised
@pytest.mark.parametrize("block", _params())
def test_snippet_runs(
    block: Block, request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if block.skipped:
        pytest.skip(block.directive)
    if block.ranks != [0]:
        pytest.importorskip("torch")
    steps = steps_before(block) if block.in_sequence else []
    s3 = any(b.s3 for b in [*steps, block])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL") and k not in RANK_ENV}
    endpoint = request.getfixturevalue("s3_endpoint") if s3 else ""
    if s3:
        env["AWS_ENDPOINT_URL"] = endpoint
    if block.in_sequence:  # the page's earlier steps first, then this one, in one directory
        run_in_sequence(block, tmp_path_factory, env, endpoint)
        return
    procs: dict[str, fork_server.Forked] = {}
    for n in block.ranks:
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


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link, a missing anchor or a page left out of the nav fails."""
    missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install -e '.[docs]'): the site is not built")
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    done = subprocess.run(
        [*command, "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").is_file() and (site / "api" / "index.html").is_file()
    # A `|` escaped for a table inside a code span renders its backslash on this site: not a word of a page.
    shown = [page.relative_to(site).as_posix() for page in site.rglob("*.html") if "\\|" in page.read_text()]
    assert not shown, shown
