"""The status and latest commands over a run's checkpoints, on local paths and S3 (moto)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from cli_run import (
    FILES,
    LARGE,
    Shifting,
    cli,
    error_lines,
    flip,
    manifest_of,
    put_tree,
    run_on_terminal,
    screen_lines,
    shifting_store,
    stderr_pair,
)
from conftest import Backend

from integrity_fs import MANIFEST_FILENAME


@pytest.fixture
def shifting() -> Iterator[type[Shifting]]:
    yield from shifting_store()


# --- status ------------------------------------------------------------------------------------------


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """step_4 unsealed, step_3 damaged (same size), step_2 truncated, step_1 good, step_0 invalid."""
    root = tmp_path / "run"
    for step in range(5):
        for name, data in FILES.items():
            (root / f"step_{step}" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / f"step_{step}" / name).write_bytes(data)
        if step != 4:
            assert cli("seal", str(root / f"step_{step}")).returncode == 0
    flip(root / "step_3" / "model.bin", 99)
    (root / "step_2" / "optim.bin").write_bytes(b"short")
    (root / "step_0" / MANIFEST_FILENAME).write_text("{not json")
    return root


def test_status_lists_every_checkpoint_with_its_verdict(run: Path) -> None:
    proc = cli("status", str(run))
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[:2] for line in lines] == [
        ["step_4", "unsealed"],
        ["step_3", "sealed"],
        ["step_2", "sealed"],
        ["step_1", "sealed"],
        ["step_0", "sealed"],
    ]
    verdicts = {line[0]: " ".join(line[6:]) for line in lines}
    assert verdicts["step_3"] == "sizes ok"  # quick: a flipped bit keeps the size, and it says what it checked
    assert verdicts["step_2"] == "damaged: optim.bin (size)"  # named as the error lines name files
    assert verdicts["step_4"] == "unsealed" and verdicts["step_1"] == "sizes ok"
    assert verdicts["step_0"].startswith("invalid: ") and "not valid JSON" in verdicts["step_0"]
    assert lines[1][2:6] == ["3", "files", "390.6", "KiB"]

    full = cli("status", str(run), "--full", "--json")
    assert full.returncode == 0, full.stderr
    found = json.loads(full.stdout)
    assert [c["name"] for c in found] == ["step_4", "step_3", "step_2", "step_1", "step_0"]
    assert [c["verdict"] for c in found] == ["unsealed", "damaged", "damaged", "ok", "invalid"]
    assert found[1]["problems"][0].startswith("model.bin: mismatch") and found[1]["url"] == str(run / "step_3")
    assert found[3] == {
        "name": "step_1",
        "url": str(run / "step_1"),
        "sealed": True,
        "files": 3,
        "bytes": sum(map(len, FILES.values())),
        "verdict": "ok",
        "problems": [],
    }
    quick = json.loads(cli("status", str(run), "--json").stdout)
    assert quick[1]["verdict"] == "sizes ok" and quick[2]["verdict"] == "damaged"
    assert [line.split()[-1] for line in cli("status", str(run), "--full").stdout.splitlines()][3] == "ok"


def test_status_lists_other_folders_and_staging_leftovers(run: Path) -> None:
    """Folders that are not the run's checkpoints are listed as such, never judged: another
    folder, the staging folder of a killed forced transfer (dead: no lock on its lease), and that
    of a live one (its lease locked, as the transfer holds it)."""
    (run / "logs").mkdir()
    dead, live = run / ".step_1.integrity-fs-staging-0badf00d", run / ".step_2.integrity-fs-staging-0c0ffee0"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.bin").write_bytes(b"half sent")
        (folder / "_integrity_lease.json").write_text("{}")
    with open(live / "_integrity_lease.json") as lease:
        fcntl.flock(lease, fcntl.LOCK_EX)
        proc = cli("status", str(run), "--json")
        human = cli("status", str(run)).stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["logs"]["verdict"] == "other" and rows["logs"]["sealed"] is None
    assert rows[dead.name]["verdict"] == "leftover" and rows[live.name]["verdict"] == "staging"
    assert human[-3].split() == ["logs", "other"]
    assert sorted(line.split() for line in human[-2:]) == [[dead.name, "leftover"], [live.name, "staging"]]


def test_status_lists_a_checkpoint_of_an_unsupported_algorithm_as_invalid(run: Path) -> None:
    manifest = manifest_of(run / "step_1")
    (run / "step_1" / MANIFEST_FILENAME).write_text(json.dumps({**manifest, "algorithm": "md5"}))
    proc = cli("status", str(run), "--json")
    assert proc.returncode == 0, proc.stderr  # exit 0 whatever the verdicts
    found = {c["name"]: c for c in json.loads(proc.stdout)}
    assert len(found) == 5 and found["step_1"]["verdict"] == "invalid" and found["step_1"]["sealed"]
    human = cli("status", str(run))
    rows = {line.split()[0]: " ".join(line.split()[6:]) for line in human.stdout.splitlines()}
    assert human.returncode == 0 and rows["step_1"].startswith("invalid: ") and "md5" in rows["step_1"]


def test_status_of_a_missing_root_is_a_storage_error(tmp_path: Path) -> None:
    proc = cli("status", str(tmp_path / "typo"), "--json")
    assert proc.returncode == 4
    assert json.loads(proc.stdout)["url"] == str(tmp_path / "typo")
    assert str(tmp_path / "typo") in stderr_pair(proc)[0] and "check the path" in stderr_pair(proc)[1]
    assert "run's directory" in stderr_pair(proc)[1]  # ROOT holds checkpoints; it is not one
    (tmp_path / "file").write_bytes(b"x")
    for command in ("status", "latest"):
        on_a_file = cli(command, str(tmp_path / "file"))
        assert on_a_file.returncode == 4 and "run's directory" in stderr_pair(on_a_file)[1]
    (tmp_path / "empty").mkdir()
    empty = cli("status", str(tmp_path / "empty"), "--json")
    assert empty.returncode == 0 and json.loads(empty.stdout) == []


def test_status_on_s3_and_an_unreachable_store(s3: tuple[Backend, list[str]]) -> None:
    backend, options = s3
    for step in (1, 2):
        assert cli("upload", str(Path(__file__).parent), f"{backend.url}/run/step_{step}", *options).returncode == 0
    proc = cli("status", f"{backend.url}/run", "--full", *options)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["step_2", "step_1"]
    unreachable = ["-o", "client_kwargs.endpoint_url=http://127.0.0.1:1", "-o", "config_kwargs.retries.max_attempts=1"]
    down = cli("status", "s3://bucket/run", *unreachable)
    assert down.returncode == 4 and down.stdout == "" and stderr_pair(down)


def test_progress_bar_for_status_full(run: Path) -> None:
    pytest.importorskip("tqdm")
    code, terminal = run_on_terminal("status", str(run), "--full")
    assert code == 0 and "\r" in terminal and "status" in terminal


# --- latest ------------------------------------------------------------------------------------------


def test_latest_prints_the_newest_checkpoint_that_verifies(run: Path) -> None:
    proc = cli("latest", str(run))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{run / 'step_1'}\n"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("integrity-fs: WARNING: skipping")]
    assert [w.split()[3] for w in warnings] == [str(run / f"step_{n}") for n in (4, 3, 2)]
    assert "(unsealed)" in warnings[0] and "(damaged)" in warnings[1] and "model.bin" in warnings[1]  # named
    assert not re.search("[0-9a-f]{64}", warnings[1])  # digests shortened
    assert not error_lines(proc)
    quick = cli("latest", str(run), "--quick")
    assert quick.returncode == 0 and quick.stdout == f"{run / 'step_3'}\n"  # names and sizes only

    flip(run / "step_1" / "sub" / "meta.json", 0)
    none = cli("latest", str(run))
    assert none.returncode == 1 and none.stdout == ""
    last = none.stderr.splitlines()[-2:]  # after the WARNING lines, the usual two
    assert last[0] == f"integrity-fs: error: no checkpoint under {run} verifies"
    assert last[1].startswith("integrity-fs: hint: ") and "WARNING" in last[1]
    assert "(invalid)" in none.stderr


def test_latest_json_gives_the_url_and_its_report(run: Path) -> None:
    proc = cli("latest", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["url"] == str(run / "step_1") and found["ok"] and found["root"] == str(run) and not found["quick"]
    assert found["report"]["ok"] and found["report"]["files_checked"] == 3
    warnings = [line for line in proc.stderr.splitlines() if "WARNING: skipping" in line]  # for a person: stderr
    assert len(warnings) == 3 and "model.bin: mismatch" in warnings[1] and "optim.bin: size" in warnings[2]

    flip(run / "step_1" / "model.bin", 0)
    none = cli("latest", str(run), "--json")
    assert none.returncode == 1
    failed = json.loads(none.stdout)  # one object: the failure
    assert failed["url"] is None and not failed["ok"] and failed["exit_code"] == 1
    assert failed["error"] == f"no checkpoint under {run} verifies"
    assert none.stderr.splitlines()[-2] == f"integrity-fs: error: no checkpoint under {run} verifies"


def test_latest_of_a_root_that_is_not_there_is_a_path_problem(run: Path) -> None:
    """A mistyped ROOT is exit 4 with a path hint, told apart from "none verifies" (exit 1)."""
    typo = cli("latest", str(run) + "x")
    assert typo.returncode == 4 and typo.stdout == ""
    what, hint = stderr_pair(typo)
    assert str(run) + "x" in what and "check the path" in hint and "create ROOT first" in hint
    assert "ROOT must be the run's directory (the one that holds its checkpoints), and it must exist" in hint, hint
    assert "WARNING" not in typo.stderr
    for step in range(5):
        shutil.rmtree(run / f"step_{step}")
    empty = cli("latest", str(run))
    assert empty.returncode == 1 and "holds no checkpoint directory" in stderr_pair(empty)[0]


def test_warning_lines_are_written_through_the_progress_bar(run: Path) -> None:
    """A WARNING while a bar is drawn clears the bar first and starts its own line (the bar is
    drawn again below it): never ``latest:  89%|…]integrity-fs: WARNING: skipping …`` on one line."""
    pytest.importorskip("tqdm")
    proc = cli("latest", str(run), terminal=True)  # the bar forced on, in this process
    assert proc.returncode == 0 and proc.stdout == f"{run / 'step_1'}\n"
    assert "latest: " in proc.stderr and "%|" in proc.stderr  # a bar was drawn
    warnings = [line for line in screen_lines(proc.stderr) if "WARNING" in line]
    assert len(warnings) == 3, proc.stderr  # step_4 unsealed, step_3 damaged, step_2 truncated
    assert all(line.startswith("integrity-fs: WARNING: skipping ") for line in warnings), warnings


def test_latest_shows_a_progress_bar_while_it_hashes(run: Path) -> None:
    pytest.importorskip("tqdm")
    code, terminal = run_on_terminal("latest", str(run))
    assert code == 0 and "\r" in terminal and "latest" in terminal
    code, terminal = run_on_terminal("latest", str(run), "--no-progress")
    assert code == 0 and not re.search("\r(?!\n)", terminal)  # the WARNING lines end in a terminal's \r\n


# --- status and latest -------------------------------------------------------------------------------


def test_status_and_latest_given_a_checkpoint_instead_of_its_run_say_so(sealed: Path) -> None:
    """ROOT is the run's directory; a checkpoint given by mistake (its sub/ is no checkpoint) gets a hint."""
    none = cli("latest", str(sealed))
    assert none.returncode == 1 and none.stdout == ""
    what, hint = stderr_pair(none)  # sub/ is not a checkpoint (no step in its name): none skipped
    assert what == f"integrity-fs: error: no checkpoint under {sealed} verifies: it holds no checkpoint directory"
    assert f"{sealed} is itself a sealed checkpoint" in hint and f"integrity-fs verify {sealed}" in hint
    status = cli("status", str(sealed), "--json")
    assert status.returncode == 0 and [(c["name"], c["verdict"]) for c in json.loads(status.stdout)] == [
        ("sub", "other")
    ]
    assert f"{sealed} is itself a sealed checkpoint" in status.stderr

    empty = sealed.parent / "empty"
    empty.mkdir()
    nothing = cli("latest", str(empty))
    assert nothing.returncode == 1 and nothing.stdout == "" and "skipping" not in nothing.stderr  # none skipped
    what, hint = stderr_pair(nothing)
    assert what == f"integrity-fs: error: no checkpoint under {empty} verifies: it holds no checkpoint directory"
    assert "WARNING" not in hint and "one directory per checkpoint" in hint


def test_status_and_latest_show_a_checkpoint_changing_while_read(shifting: type[Shifting]) -> None:
    """status --full shows the verdict "changing"; latest skips it, saying so, and goes on."""
    for step in (1, 2):
        put_tree(shifting, f"/run/step_{step}", LARGE)
        assert cli("seal", f"shifting://run/step_{step}").returncode == 0
    shifting.change = ("/run/step_2/",)  # another writer at work in step_2 while it is read
    status = cli("status", "shifting://run", "--full", "--workers", "1")
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: " ".join(line.split()[6:]) for line in status.stdout.splitlines()}
    assert rows["step_2"].startswith("changing: ") and "run again once writers are done" in rows["step_2"]
    assert rows["step_1"] == "ok"

    latest = cli("latest", "shifting://run", "--workers", "1")
    assert latest.returncode == 0 and latest.stdout == "shifting:///run/step_1\n", latest.stderr
    assert "skipping shifting:///run/step_2 (changing): changed while it was read" in latest.stderr


# --- prune -------------------------------------------------------------------------------------------


def _run_of(root: Path, steps: range) -> Path:
    for step in steps:
        for name, data in FILES.items():
            (root / f"step_{step}" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / f"step_{step}" / name).write_bytes(data)
        assert cli("seal", str(root / f"step_{step}")).returncode == 0
    return root


def test_prune_prints_what_it_kept_deleted_and_left(run: Path) -> None:
    """step_4 unsealed, step_3 damaged, step_2 truncated, step_1 good, step_0 invalid: one verifies."""
    nothing = cli("prune", str(run), "--keep-last", "1", "--dry-run")
    assert nothing.returncode == 0, nothing.stderr
    rows = [line.split() for line in nothing.stdout.splitlines()]
    assert rows[:-1] == [
        ["step_4", "unsealed", "left"],
        ["step_3", "damaged", "left"],
        ["step_2", "damaged", "left"],
        ["step_1", "ok", "kept"],
        ["step_0", "invalid", "left"],  # older, but a manifest this installation cannot read: left
    ]
    last = "kept 1, left 4; dry run: would delete 0 checkpoints, freeing 0 B; nothing deleted"
    assert nothing.stdout.splitlines()[-1] == last
    flip(run / "step_3" / "model.bin", 99)  # step_3 good again
    assert cli("seal", str(run / "step_0"), "--force").returncode == 0  # step_0: valid again, and sealed
    held = sum(p.stat().st_size for p in (run / "step_0").rglob("*") if p.is_file())
    sealed_at = (run / "step_1" / MANIFEST_FILENAME).stat().st_mtime - 60  # before step_1 (else it is kept: Retention)
    os.utime(run / "step_0" / MANIFEST_FILENAME, (sealed_at, sealed_at))
    proc = cli("prune", str(run), "--keep-last", "2")
    assert proc.returncode == 0, proc.stderr
    assert [re.split(r"\s{2,}", line)[1:] for line in proc.stdout.splitlines()[:-1]] == [
        ["unsealed", "left"],
        ["ok", "kept"],
        ["damaged", "left"],  # newer than the oldest kept: never deleted
        ["ok", "kept"],
        ["sizes ok", "deleted"],  # older than the oldest kept: judged by names and sizes only
    ]
    assert proc.stdout.splitlines()[-1] == f"kept 2, left 2; deleted 1 checkpoint, freed {held / 1024:.1f} KiB"
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2", "step_3", "step_4"]


def test_prune_json_and_fewer_verified_than_asked(tmp_path: Path) -> None:
    root = _run_of(tmp_path / "run", range(1, 5))
    flip(root / "step_4" / "model.bin", 7)
    dry = cli("prune", str(root), "--keep-last", "2", "--json", "--dry-run", "--unsealed")
    assert dry.returncode == 0, dry.stderr
    found = json.loads(dry.stdout)
    assert set(found) == {"root", "kept", "deleted", "left", "verdicts", "bytes_freed", "dry_run"}
    assert found["kept"] == [str(root / "step_3"), str(root / "step_2")]
    assert found["deleted"] == [str(root / "step_1")] and found["left"] == [str(root / "step_4")]
    assert found["verdicts"][str(root / "step_4")] == "damaged" and found["dry_run"] is True
    assert found["bytes_freed"] == sum(p.stat().st_size for p in (root / "step_1").rglob("*") if p.is_file())
    assert (root / "step_1").is_dir()

    many = cli("prune", str(root), "--keep-last", "9")
    assert many.returncode == 0, many.stderr
    assert many.stdout.splitlines()[-1] == "kept 3, left 1; 3 verify, fewer than --keep-last 9: nothing deleted"
    assert "fewer than --keep-last 9" in many.stderr
    assert sorted(p.name for p in root.iterdir()) == [f"step_{n}" for n in range(1, 5)]


def test_prune_takes_the_run_named_by_pattern_and_refuses_to_guess(tmp_path: Path) -> None:
    """--pattern: one run's checkpoints among others in the same directory; without it, names that
    may be two runs are refused (exit 2, naming --pattern) and nothing is deleted."""
    root = _run_of(tmp_path / "run", range(1, 5))
    for name in ("other_step_1", "other_step_2"):
        shutil.copytree(root / "step_1", root / name)
    ambiguous = cli("prune", str(root), "--keep-last", "1")
    assert ambiguous.returncode == 2 and "--pattern" in stderr_pair(ambiguous)[0]
    assert len(list(root.iterdir())) == 6
    proc = cli("prune", str(root), "--keep-last", "2", "--pattern", "step_{step}", "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["kept"] == [str(root / "step_4"), str(root / "step_3")]
    assert found["deleted"] == [str(root / "step_2"), str(root / "step_1")]
    assert sorted(found["verdicts"]) == [str(root / f"step_{n}") for n in range(1, 5)]  # other_* not candidates
    assert sorted(p.name for p in root.iterdir()) == ["other_step_1", "other_step_2", "step_3", "step_4"]


@pytest.mark.parametrize(
    "args",
    [
        ["--keep-last", "0"],
        ["--keep-last", "two"],
        [],  # --keep-last is required
        ["--keep-last", "1", "--quick", "--attested"],
        ["--keep-last", "1", "--pattern", "step_"],  # no {step}
    ],
)
def test_prune_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str]) -> None:
    root = _run_of(tmp_path / "run", range(1, 3))
    proc = cli("prune", str(root), *args, "--json")
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["exit_code"] == 2 and len(stderr_pair(proc)) == 2
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]


def test_prune_storage_errors_exit_4_and_delete_nothing(tmp_path: Path, shifting: type[Shifting]) -> None:
    typo = cli("prune", str(tmp_path / "typo"), "--keep-last", "1")
    assert typo.returncode == 4 and typo.stdout == ""
    assert "check the path" in stderr_pair(typo)[1] and "run's directory" in stderr_pair(typo)[1]
    for step in (1, 2, 3):
        put_tree(shifting, f"/run/step_{step}", FILES)
        assert cli("seal", f"shifting://run/step_{step}").returncode == 0
    shifting.fail = ("/run/step_1/",)  # every read in step_1 fails: a disk error, not damage
    down = cli("prune", "shifting://run", "--keep-last", "1")
    assert down.returncode == 4 and down.stdout == ""
    assert "Input/output error" in stderr_pair(down)[0]
    fs = fsspec.filesystem("shifting")
    for step in (1, 2, 3):
        assert fs.exists(f"/run/step_{step}/{MANIFEST_FILENAME}") and fs.exists(f"/run/step_{step}/model.bin")


def test_prune_on_s3_attested(s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    local = _run_of(tmp_path / "local", range(1, 4))
    for step in (1, 2, 3):
        target = f"{backend.url}/run/step_{step}"
        assert cli("upload", str(local / f"step_{step}"), target, *options).returncode == 0
    proc = cli("prune", f"{backend.url}/run", "--keep-last", "1", "--attested", *options)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()[:-1]] == ["step_3", "step_2", "step_1"]
    assert proc.stdout.splitlines()[-1].startswith("kept 1, left 0; deleted 2 checkpoints, freed ")


def test_prune_shows_a_progress_bar_while_it_hashes(tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    root = _run_of(tmp_path / "run", range(1, 3))
    code, terminal = run_on_terminal("prune", str(root), "--keep-last", "1")
    assert code == 0 and "\r" in terminal and "prune" in terminal
