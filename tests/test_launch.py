"""The command line under torchrun (WORLD_SIZE > 1): seal, verify and latest as collectives over a
real gloo group of two ranks, on local disk and S3 (moto). Each launch costs a few seconds: few."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend

pytest.importorskip("torch")
TESTS = Path(__file__).resolve().parent
TORCHRUN = shutil.which("torchrun") or ""
pytestmark = pytest.mark.skipif(not TORCHRUN, reason="torchrun is installed with torch")
CHUNK = 1 << 20


def launch(
    record: Path, *args: str, bad_arg_rank: int | None = None
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``torchrun --nproc-per-node 2 -m integrity_fs ARGS`` (through tests/launch_cli.py); returns
    torchrun's output and what each rank recorded."""
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir(parents=True)
    env = {
        **os.environ,
        "RECORD_DIR": str(record),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    if bad_arg_rank is not None:
        env["BAD_ARG_RANK"] = str(bad_arg_rank)
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(TESTS / "launch_cli.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,  # a hang fails the test
        env=env,
        stdin=subprocess.DEVNULL,
    )
    ranks = [json.loads((record / f"rank{rank}.json").read_text()) for rank in range(2)]
    return proc, ranks


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


def test_seal_verify_and_latest_under_torchrun_split_the_bytes_and_print_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = files()
    for step in (1, 2):
        (run / f"step_{step}").mkdir(parents=True)
        for name, content in data.items():
            (run / f"step_{step}" / name).write_bytes(content)
    sizes = {name: len(content) for name, content in data.items()}

    proc, ranks = launch(tmp_path / "rec", "seal", str(run / "step_2"), "--chunk-size", "1MiB")
    assert [r["code"] for r in ranks] == [0, 0], proc.stdout + proc.stderr
    assert proc.stdout.count(f"sealed {run / 'step_2'}") == 1, proc.stdout
    assert_split(ranks, sizes)

    proc, ranks = launch(tmp_path / "rec", "verify", str(run / "step_2"), "--json")
    assert [r["code"] for r in ranks] == [0, 0], proc.stdout + proc.stderr
    report = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])  # one object
    assert report["ok"] and report["bytes_checked"] == sum(sizes.values())
    assert_split(ranks, sizes)

    (run / "step_2" / "shard_1.bin").write_bytes(b"x" + data["shard_1.bin"][1:])  # damaged: latest skips it
    proc, ranks = launch(tmp_path / "rec", "latest", str(run))
    assert [r["code"] for r in ranks] == [1, 1], proc.stdout + proc.stderr  # step_1 was never sealed
    assert proc.stderr.count("skipping") == 2, proc.stderr  # step_2 damaged, step_1 unsealed: once each
    assert proc.stderr.count("integrity-fs: error: no checkpoint under") == 1

    proc, ranks = launch(tmp_path / "rec", "verify", str(run / "step_2"), "--mode", "rank0")
    assert [r["code"] for r in ranks] == [1, 1] and proc.stdout.count("FAILED") == 1, proc.stdout
    assert ranks[0]["hashed"] and not ranks[1]["hashed"]  # rank 0 alone read


def test_a_bad_argument_on_one_rank_fails_every_rank_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "w.bin").write_bytes(b"weights")
    proc, ranks = launch(tmp_path / "rec", "verify", str(tmp_path / "ckpt"), bad_arg_rank=1)
    assert [r["code"] for r in ranks] == [2, 2], proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("integrity-fs: error:")]
    assert len(errors) == 1 and "(rank 1)" in errors[0] and "--workers" in errors[0], proc.stderr
    assert not any(r["hashed"] for r in ranks)


def test_verify_under_torchrun_on_s3(s3_backend: Backend, s3_endpoint: str, tmp_path: Path) -> None:
    import integrity_fs

    data = files(3)
    for name, content in data.items():
        s3_backend.write(f"step_1/{name}", content)
    url = f"{s3_backend.url}/step_1"
    integrity_fs.seal(url, storage_options=s3_backend.storage_options, granularity="chunk", chunk_size=CHUNK)
    options = ["-o", "key=testing", "-o", "secret=testing", "-o", f"client_kwargs.endpoint_url={s3_endpoint}"]
    proc, ranks = launch(tmp_path / "rec", "verify", url, *options)
    assert [r["code"] for r in ranks] == [0, 0], proc.stdout + proc.stderr
    assert proc.stdout.count(f"verified {url}") == 1
    assert_split(ranks, {name: len(content) for name, content in data.items()})
    proc, ranks = launch(tmp_path / "rec", "latest", s3_backend.url, *options)
    assert [r["code"] for r in ranks] == [0, 0] and proc.stdout.splitlines() == [url], proc.stdout
