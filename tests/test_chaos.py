"""The crash-and-damage harness (benchmarks/chaos.py), short: a real training loop in
forked children (one or two gloo ranks) SIGKILLed at random moments, damage injected, and the
invariants checked by a fresh process after each kill. The full runs are
``python -m benchmarks --only chaos --trials 1000`` and ``--backend s3``. Here one run of five
trials (one harness start: its imports are most of the time), seeds 43 to 47: two with 2 ranks,
damage before one kill and after another; in trial 44 the harness plants a lie in its own record
of a saved step, which its checks must catch while the other trials stay clean; trial 47 is killed
at a chosen point, not a random moment: between the two renames of a forced upload's swap, where
the destination is gone and only the two staged copies are whole (the next prune must keep them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import fork_server
import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parent.parent
SEEDS = range(43, 48)
LIE = 44  # one rank, three steps before the kill, no damage: the record of step 3 is altered
SWAP = 47  # one rank, two steps (and a sealed mirror) before the kill, no damage
# Fixed kill times (seconds into the loop per world size): no calibration, the same kill times on every run.
DURATIONS = "1=0.4,2=0.6"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.chaos ARGS``, forked from a warm interpreter (tests/fork_server.py)."""
    argv = ["--trials", str(len(SEEDS)), "--seed", str(SEEDS[0]), "--durations", DURATIONS, "--verbose"]
    argv += ["--sabotage", str(LIE), "--kill-before", f"{SWAP}=swap:2", "--dir", str(tmp_path_factory.mktemp("chaos"))]
    script = tmp_path_factory.mktemp("chaos-main") / "chaos_main.py"
    main = "runpy.run_module('benchmarks.chaos', run_name='__main__')"
    script.write_text(f"import runpy, sys\nsys.path.insert(0, {str(REPO)!r})\n{main}\n")
    return fork_server.run([script, *argv], cwd=REPO, timeout=120)


def violations(run: subprocess.CompletedProcess[str]) -> dict[int, list[str]]:
    """The report's violations by seed."""
    found: dict[int, list[str]] = {}
    seed = None
    for line in run.stdout.splitlines():
        if m := re.match(r"- seed (\d+):", line):
            seed = int(m[1])
        elif seed is not None and line.startswith("  ["):
            found.setdefault(seed, []).append(line.strip())
    return found


def test_killed_and_damaged_training_runs_keep_every_invariant(run: subprocess.CompletedProcess[str]) -> None:
    assert re.search(r"^chaos: 5 trials, \d+ kills, [1-9]\d* damaged, [1-9]\d* violations$", run.stdout, re.M), (
        run.stdout[-3000:] + run.stderr[-3000:]
    )
    assert set(violations(run)) == {LIE}, run.stdout[-3000:]  # every trial but the one with the lie is clean
    assert "| 5. nothing hangs | 0 |" in run.stdout


def test_a_kill_inside_a_forced_uploads_swap_loses_no_copy(run: subprocess.CompletedProcess[str]) -> None:
    line = next(line for line in run.stderr.splitlines() if f" seed {SWAP}: " in line)
    assert f"seed {SWAP}: 1r, transfer/swap at " in line and ".integrity-fs-staging-" in line, line
    assert SWAP not in violations(run)


def test_the_checks_catch_tensors_other_than_those_saved(run: subprocess.CompletedProcess[str]) -> None:
    found = violations(run)[LIE]
    assert any(v.startswith("[2]") and "step 3" in v and "tensors other than those saved at" in v for v in found), found
    assert run.returncode == 1
