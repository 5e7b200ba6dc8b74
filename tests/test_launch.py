"""The command line under torchrun (WORLD_SIZE > 1): seal, verify, latest, status and prune as collectives over a
real gloo group of two ranks, on local disk and S3 (moto). A launch costs seconds: two in all, the
second running every command after ``seal`` in one process group (tests/launch_cli.py). Which rank
read what is seen from outside: each rank's ``rchar`` (/proc/self/io) while its command ran."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fork_server
import fsspec
import pytest
from conftest import BUCKET, free_port

import integrity_fs
from integrity_fs import MANIFEST_FILENAME

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


def forked_ranks(script: str, n: int, env: dict[str, str], *, timeout: float = 60) -> list[fork_server.Forked]:
    """``n`` ranks of ``tests/<script>`` with the environment torchrun gives each rank (RANK,
    WORLD_SIZE, MASTER_ADDR, ...), forked from a warm interpreter rather than started by torchrun
    (a second each saved: the real torchrun launch of ``seal`` covers torchrun itself); each must
    exit 0 within ``timeout`` seconds, or the test fails (a hang)."""
    port = str(free_port())
    world = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    base = {
        **os.environ,
        **env,
        **world,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        fork_server.start([TESTS / script], cwd=os.getcwd(), env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(n)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except Exception:
        pytest.fail(f"the ranks did not finish within {timeout} s (a hang)")
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)
    return procs


def launch_commands(record: Path, commands: dict[str, dict[str, Any]]) -> dict[str, Outcome]:
    """One launch of 2 ranks that runs each command in turn in a process group joined once (a
    launch costs seconds: the commands share one); name -> its outcome."""
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir(parents=True)
    todo = record.parent / f"{record.name}.json"
    todo.write_text(json.dumps(commands))
    forked_ranks("launch_cli.py", 2, {"COMMANDS": str(todo), "RECORD_DIR": str(record)}, timeout=180)
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
    """The bytes were shared: together the ranks read each byte about once (a few KiB of manifests
    and the like aside), and each rank a good part of them."""
    total = sum(sizes.values())
    reads = [rank["read"] for rank in ranks]
    assert total <= sum(reads) <= total + total // 16 and all(read >= total // 4 for read in reads), (reads, total)


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
    shutil.copytree(pruned / "step_1", pruned / "export_1")  # sealed, but not one of --pattern's
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
        "prune": {"argv": ["prune", str(pruned), "--keep-last", "1", "--pattern", "step_{step}", "--json"]},
        "prune-missing": {"argv": ["prune", str(root / "typo"), "--keep-last", "1"]},
        "show": {"argv": ["show", str(run / "step_2")]},
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
    as_json: Outcome = launched["latest-json"]  # rank 0's one object
    assert [r["code"] for r in as_json.ranks] == [1, 1], as_json.stdout + as_json.stderr
    found = json.loads(as_json.stdout)
    assert found["url"] is None and found["exit_code"] == 1 and as_json.ranks[1]["stdout"] == "", found

    rank0: Outcome = launched["verify-rank0"]
    assert [r["code"] for r in rank0.ranks] == [1, 1] and rank0.stdout.count("FAILED") == 1, rank0.stdout
    total = sum(launched["sizes"].values())
    assert rank0.ranks[0]["read"] >= total and rank0.ranks[1]["read"] < total // 8  # rank 0 alone read


def test_a_command_that_is_not_a_collective_runs_once_on_rank_0(launched: dict[str, Any]) -> None:
    show: Outcome = launched["show"]
    assert [r["code"] for r in show.ranks] == [0, 0], show.stdout + show.stderr
    assert show.stdout.count("manifest of") == 1 and show.ranks[1]["stdout"] == "", show.stdout


def test_a_bad_argument_on_one_rank_fails_every_rank_with_exit_2(launched: dict[str, Any]) -> None:
    bad: Outcome = launched["bad-argument"]
    assert [r["code"] for r in bad.ranks] == [2, 2], bad.stdout + bad.stderr
    errors = [line for line in bad.stderr.splitlines() if line.startswith("integrity-fs: error:")]
    assert len(errors) == 1 and "the command line" in errors[0] and "rank 1" in errors[0], bad.stderr
    assert "--workers" in errors[0] and "same command line" in bad.stderr
    assert all(r["read"] < sum(launched["sizes"].values()) // 8 for r in bad.ranks)  # no checkpoint was read


def test_verify_under_torchrun_on_s3(launched: dict[str, Any]) -> None:
    url = launched["s3_url"]
    verify: Outcome = launched["s3-verify"]
    assert [r["code"] for r in verify.ranks] == [0, 0], verify.stdout + verify.stderr
    assert verify.stdout.count(f"verified {url}") == 1
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
    assert str(pruned / "export_1") not in result["verdicts"]  # --pattern reached every rank's prune
    assert all(r["read"] >= CHUNK for r in prune.ranks)  # the hashing of step_3 and step_2 is shared
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
    assert [p.split(":")[0] for p in found[0]["problems"]] == ["shard_1.bin"]
    assert all(r["read"] >= CHUNK for r in status.ranks)  # the hashing of step_2 is shared
    assert status.ranks[1]["stdout"] == ""

    table: Outcome = launched["status-table"]  # step_2 sealed above, step_1 never sealed
    assert [r["code"] for r in table.ranks] == [0, 0], table.stdout + table.stderr
    lines = table.stdout.splitlines()  # one table: one line per checkpoint
    assert [line.split()[:2] for line in lines] == [["step_2", "sealed"], ["step_1", "unsealed"]], table.stdout
    assert "ok" in lines[0] and table.ranks[1]["stdout"] == ""
    assert_split(table.ranks, launched["sizes"])  # each byte hashed once, by one of the ranks


# --- issue 36, finding 23: the ranks agree on the whole command line before anything else -------------


def launch_ranks(workdir: Path, argvs: list[list[str]]) -> list[dict[str, Any]]:
    """``integrity-fs`` on real gloo ranks, rank r running ``argvs[r]`` and joining the process
    group itself (tests/launch_cli_ranks.py); returns what each rank recorded (exit code, stdout,
    stderr). A hang fails the test after 30 s."""
    record = workdir / "record"
    record.mkdir(parents=True)
    (workdir / "argv.json").write_text(json.dumps(argvs))
    forked_ranks(
        "launch_cli_ranks.py",
        len(argvs),
        {"ARGV_FILE": str(workdir / "argv.json"), "RECORD_DIR": str(record)},
        timeout=30,
    )
    missing = [r for r in range(len(argvs)) if not (record / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} died without an exit code"
    return [json.loads((record / f"rank{r}.json").read_text()) for r in range(len(argvs))]


def assert_one_usage_error_everywhere(ranks: list[dict[str, Any]]) -> None:
    codes = [r["code"] for r in ranks]
    assert codes == [2] * len(ranks), f"exit codes {codes}; stderr: {[r['stderr'] for r in ranks]}"
    assert not any("Traceback" in r["stderr"] for r in ranks), [r["stderr"] for r in ranks]
    errors = {line for r in ranks for line in r["stderr"].splitlines() if line.startswith("integrity-fs: error:")}
    assert len(errors) == 1 and "the command line" in next(iter(errors)), errors
    assert not any(r["stdout"].strip() for r in ranks)  # nothing reported as verified or sealed


def checkpoint(folder: Path, *, sealed: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(bytes((i * 7) % 256 for i in range(4096)))
    (folder / "opt.bin").write_bytes(bytes((i * 13) % 256 for i in range(2048)))
    if sealed:
        integrity_fs.seal(folder)
    return folder


def test_under_torchrun_ranks_given_different_arguments_all_exit_2_with_one_message(tmp_path: Path) -> None:
    """``verify --quick`` on rank 0, ``verify`` on rank 1, of a checkpoint with a flipped bit: if
    the ranks ran what rank 0 was given, the damage would pass as exit 0 on both."""
    damaged = checkpoint(tmp_path / "ckpt", sealed=True)
    data = bytearray((damaged / "w.bin").read_bytes())
    data[3] ^= 1
    (damaged / "w.bin").write_bytes(bytes(data))
    ranks = launch_ranks(tmp_path / "launch", [["verify", str(damaged), "--quick"], ["verify", str(damaged)]])
    assert_one_usage_error_everywhere(ranks)


def test_under_torchrun_ranks_given_different_commands_all_exit_2_with_one_message_and_nothing_is_sealed(
    tmp_path: Path,
) -> None:
    """``verify`` on rank 0, ``seal`` (a collective) on rank 1, ``show`` (not one) on rank 2, of the
    same never-sealed folder: no rank runs its own command, and none waits forever for another."""
    fresh = checkpoint(tmp_path / "ckpt", sealed=False)
    ranks = launch_ranks(tmp_path / "launch", [["verify", str(fresh)], ["seal", str(fresh)], ["show", str(fresh)]])
    assert_one_usage_error_everywhere(ranks)
    assert not (fresh / MANIFEST_FILENAME).exists()
