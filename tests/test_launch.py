"""The command line under torchrun (WORLD_SIZE > 1): seal, verify, latest, status and prune as collectives over a
real gloo group of two ranks, on local disk and S3 (moto). A launch costs seconds: two in all, the
second running every command after ``seal`` in one process group (tests/launch_cli.py)."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import BUCKET

import integrity_fs

pytest.importorskip("torch")
TESTS = Path(__file__).resolve().parent
TORCHRUN = shutil.which("torchrun") or ""
pytestmark = pytest.mark.skipif(not TORCHRUN, reason="torchrun is installed with torch")
CHUNK = 1 << 20


def _launch(record: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir(parents=True)
    env = {
        **os.environ,
        **env,
        "RECORD_DIR": str(record),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(TESTS / "launch_cli.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,  # a hang fails the test
        env=env,
        stdin=subprocess.DEVNULL,
    )


def launch(record: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``torchrun --nproc-per-node 2 -m integrity_fs ARGS`` (through tests/launch_cli.py): the command
    joins the process group itself; returns torchrun's output and what each rank recorded."""
    proc = _launch(record, list(args), {})
    ranks = [json.loads((record / f"rank{rank}.json").read_text()) for rank in range(2)]
    return proc, ranks


@dataclass
class Outcome:
    """One command of a launch: what both ranks printed, and what each rank recorded."""

    stdout: str
    stderr: str
    ranks: list[dict[str, Any]]


def launch_commands(record: Path, commands: dict[str, dict[str, Any]]) -> dict[str, Outcome]:
    """One torchrun launch of 2 ranks that runs each command in turn in a process group joined
    once (a launch costs seconds: the commands share one); name -> its outcome."""
    record.mkdir(parents=True, exist_ok=True)
    todo = record.parent / f"{record.name}.json"
    todo.write_text(json.dumps(commands))
    proc = _launch(record, [], {"COMMANDS": str(todo)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_rank = [json.loads((record / f"rank{rank}.json").read_text()) for rank in range(2)]
    return {
        name: Outcome(
            "".join(r[name]["stdout"] for r in by_rank),
            "".join(r[name]["stderr"] for r in by_rank),
            [r[name] for r in by_rank],
        )
        for name in commands
    }


def assert_split(ranks: list[dict[str, Any]], sizes: dict[str, int]) -> None:
    """Every byte of every file hashed by exactly one rank, and both ranks hashed some."""
    assert all(rank["hashed"] for rank in ranks), ranks
    by_file: dict[str, list[tuple[int, int]]] = {}
    for rank in ranks:
        for path, offset, length in rank["hashed"]:
            by_file.setdefault(path.rsplit("/", 1)[-1], []).append((offset, length))
    assert set(by_file) == set(sizes)
    for name, ranges in by_file.items():
        covered = sorted(ranges)
        assert covered[0][0] == 0 and sum(length for _, length in covered) == sizes[name], (name, covered)
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(covered)), (name, covered)  # no overlap


def files(n: int = 4) -> dict[str, bytes]:
    return {f"shard_{i}.bin": random.Random(i).randbytes(2 * CHUNK + 1000 * i) for i in range(n)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> dict[str, Any]:
    """Two launches in all: ``seal`` alone (the command joins and leaves the group itself), then
    every other command of the tests below in one launch."""
    root = tmp_path_factory.mktemp("launch")
    run = root / "run"
    data = files()
    for step in (1, 2):
        (run / f"step_{step}").mkdir(parents=True)
        for name, content in data.items():
            (run / f"step_{step}" / name).write_bytes(content)
    seal = launch(root / "rec-seal", "seal", str(run / "step_2"), "--chunk-size", "1MiB")
    damaged = root / "damaged"  # the run as sealed above, then step_2 damaged: latest skips it
    shutil.copytree(run, damaged)
    (damaged / "step_2" / "shard_1.bin").write_bytes(b"x" + data["shard_1.bin"][1:])
    pruned = root / "pruned"  # step_3 damaged: prune --keep-last 1 keeps step_2, deletes step_1
    for step in (1, 2, 3):
        (pruned / f"step_{step}").mkdir(parents=True)
        for name, content in data.items():
            (pruned / f"step_{step}" / name).write_bytes(content)
        integrity_fs.seal(pruned / f"step_{step}", granularity="chunk", chunk_size=CHUNK)
    (pruned / "step_3" / "shard_2.bin").write_bytes(b"x" + data["shard_2.bin"][1:])
    shutil.copytree(pruned / "step_1", pruned / "export_1")  # sealed, but not one of --match's
    (root / "unsealed" / "ckpt").mkdir(parents=True)
    (root / "unsealed" / "ckpt" / "w.bin").write_bytes(b"weights")

    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    s3_root = f"{BUCKET}/launch-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("s3", **options)
    s3_data = files(3)
    for name, content in s3_data.items():
        fs.pipe_file(f"{s3_root}/step_1/{name}", content)
    fs.invalidate_cache()
    s3_url = f"s3://{s3_root}/step_1"
    integrity_fs.seal(s3_url, storage_options=options, granularity="chunk", chunk_size=CHUNK)
    o = ["-o", "key=testing", "-o", "secret=testing", "-o", f"client_kwargs.endpoint_url={s3_endpoint}"]

    commands = {
        "verify": {"argv": ["verify", str(run / "step_2"), "--json"]},
        "latest": {"argv": ["latest", str(damaged)]},
        "latest-json": {"argv": ["latest", str(damaged), "--json"]},
        "verify-rank0": {"argv": ["verify", str(damaged / "step_2"), "--mode", "rank0"]},
        "bad-argument": {"argv": ["verify", str(root / "unsealed" / "ckpt")], "bad_arg_rank": 1},
        "s3-verify": {"argv": ["verify", s3_url, *o]},
        "s3-latest": {"argv": ["latest", f"s3://{s3_root}", *o]},
        "status": {"argv": ["status", str(damaged), "--full", "--json"]},
        "status-table": {"argv": ["status", str(run), "--full"]},
        "prune": {"argv": ["prune", str(pruned), "--keep-last", "1", "--match", "step_[0-9]+", "--json"]},
        "prune-missing": {"argv": ["prune", str(root / "typo"), "--keep-last", "1"]},
    }
    outcomes = launch_commands(root / "rec", commands)
    return {
        "run": run,
        "damaged": damaged,
        "pruned": pruned,
        "seal": seal,
        "sizes": {name: len(content) for name, content in data.items()},
        "s3_url": s3_url,
        "s3_sizes": {name: len(content) for name, content in s3_data.items()},
        **outcomes,
    }


def test_seal_verify_and_latest_under_torchrun_split_the_bytes_and_print_once(launched: dict[str, Any]) -> None:
    run, sizes = launched["run"], launched["sizes"]
    proc, ranks = launched["seal"]
    assert [r["code"] for r in ranks] == [0, 0], proc.stdout + proc.stderr
    assert proc.stdout.count(f"sealed {run / 'step_2'}") == 1, proc.stdout
    assert_split(ranks, sizes)

    verify: Outcome = launched["verify"]
    assert [r["code"] for r in verify.ranks] == [0, 0], verify.stdout + verify.stderr
    report = json.loads(verify.stdout[verify.stdout.index("{") : verify.stdout.rindex("}") + 1])  # one object
    assert report["ok"] and report["bytes_checked"] == sum(sizes.values())
    assert_split(verify.ranks, sizes)

    latest: Outcome = launched["latest"]  # step_2 damaged, step_1 never sealed
    assert [r["code"] for r in latest.ranks] == [1, 1], latest.stdout + latest.stderr
    assert latest.stderr.count("skipping") == 2, latest.stderr  # step_2 damaged, step_1 unsealed: once each
    assert latest.stderr.count("integrity-fs: error: no checkpoint under") == 1
    as_json: Outcome = launched["latest-json"]  # rank 0's one object, with what was skipped and why
    assert [r["code"] for r in as_json.ranks] == [1, 1], as_json.stdout + as_json.stderr
    found = json.loads(as_json.stdout)
    assert found["url"] is None and [s["reason"] for s in found["skipped"]] == ["damaged", "unsealed"], found

    rank0: Outcome = launched["verify-rank0"]
    assert [r["code"] for r in rank0.ranks] == [1, 1] and rank0.stdout.count("FAILED") == 1, rank0.stdout
    assert rank0.ranks[0]["hashed"] and not rank0.ranks[1]["hashed"]  # rank 0 alone read


def test_a_bad_argument_on_one_rank_fails_every_rank_with_exit_2(launched: dict[str, Any]) -> None:
    bad: Outcome = launched["bad-argument"]
    assert [r["code"] for r in bad.ranks] == [2, 2], bad.stdout + bad.stderr
    errors = [line for line in bad.stderr.splitlines() if line.startswith("integrity-fs: error:")]
    assert len(errors) == 1 and "(rank 1)" in errors[0] and "--workers" in errors[0], bad.stderr
    assert not any(r["hashed"] for r in bad.ranks)


def test_verify_under_torchrun_on_s3(launched: dict[str, Any]) -> None:
    url = launched["s3_url"]
    verify: Outcome = launched["s3-verify"]
    assert [r["code"] for r in verify.ranks] == [0, 0], verify.stdout + verify.stderr
    assert verify.stdout.count(f"verified {url}") == 1
    assert_split(verify.ranks, launched["s3_sizes"])
    latest: Outcome = launched["s3-latest"]
    assert [r["code"] for r in latest.ranks] == [0, 0] and latest.stdout.splitlines() == [url], latest.stdout


def test_prune_under_torchrun_agrees_on_the_verdicts_and_deletes_once(launched: dict[str, Any]) -> None:
    pruned = launched["pruned"]
    prune: Outcome = launched["prune"]
    assert [r["code"] for r in prune.ranks] == [0, 0], prune.stdout + prune.stderr
    result = json.loads(prune.stdout)  # printed once, by rank 0
    assert result["kept"] == [str(pruned / "step_2")] and result["deleted"] == [str(pruned / "step_1")]
    assert result["left"] == [str(pruned / "step_3")] and result["verdicts"][str(pruned / "step_3")] == "damaged"
    assert sorted(p.name for p in pruned.iterdir()) == ["export_1", "step_2", "step_3"]
    assert str(pruned / "export_1") not in result["verdicts"]  # --match reached every rank's prune
    assert all(r["hashed"] for r in prune.ranks)  # the hashing of step_3 and step_2 is shared
    missing: Outcome = launched["prune-missing"]
    assert [r["code"] for r in missing.ranks] == [4, 4] and missing.stderr.count("integrity-fs: error:") == 1


def test_status_full_under_torchrun_shares_the_hashing_and_prints_once(launched: dict[str, Any]) -> None:
    damaged = launched["damaged"]
    status: Outcome = launched["status"]  # step_2 damaged, step_1 never sealed
    assert [r["code"] for r in status.ranks] == [0, 0], status.stdout + status.stderr
    found = json.loads(status.stdout)  # one list: printed by rank 0 alone
    assert [(c["url"], c["verdict"]) for c in found] == [
        (str(damaged / "step_2"), "damaged"),
        (str(damaged / "step_1"), "unsealed"),
    ]
    assert [p["path"] for p in found[0]["problems"]] == ["shard_1.bin"]
    assert all(r["hashed"] for r in status.ranks)  # the hashing of step_2 is shared
    assert status.ranks[1]["stdout"] == ""

    table: Outcome = launched["status-table"]  # step_2 sealed above, step_1 never sealed
    assert [r["code"] for r in table.ranks] == [0, 0], table.stdout + table.stderr
    lines = table.stdout.splitlines()  # one table: one line per checkpoint
    assert [line.split()[:2] for line in lines] == [["step_2", "sealed"], ["step_1", "unsealed"]], table.stdout
    assert "ok" in lines[0] and table.ranks[1]["stdout"] == ""
    assert_split(table.ranks, launched["sizes"])  # each byte hashed once, by one of the ranks
