"""``python -m benchmarks.safetensors [--mib 512] [--tensors 64] [--shards 1,2] [--repeats 5] [--dir DIR] [--json]``

Times loading a ``save_pretrained`` directory of float32 tensors (one ``model.safetensors``, and
2 shards with their ``model.safetensors.index.json``; ``--shards`` says which), written by
``safetensors.torch.save_file``) into a state dict on the CPU, hot page cache, single process:

- ``load_file``: ``safetensors.torch.load_file`` of each file as it is (its default ``mmap`` backend:
  the tensors are views of the mapped file, so no byte is read until the tensors are used);
- ``load_file + copy``: the same, each tensor then copied into memory of its own (every byte read
  once, as a load that uses the tensors does);
- ``load_file, pread``: ``load_file(backend="pread")``: every byte read into the tensors;
- ``load_state_dict, chunk``: ``integrity_fs.integrations.safetensors.load_state_dict`` on the same
  files (hard links) sealed in chunk granularity (64 MiB chunks): every byte read once and hashed
  before it reaches a tensor;
- ``load_state_dict, file``: the same, sealed in file granularity: a file over 64 MiB is hashed whole
  first, then read again into the tensors.

Before each call, glibc's ``malloc_trim(0)`` hands freed memory back, so that each contender
allocates fresh memory whatever the one before it freed. The contenders run round-robin,
``--repeats`` rounds after one warm-up round, so that drift of a shared machine weighs on all of
them alike; a round during which other processes used more than a tenth of a core is run again
(at most ``4 * repeats`` rounds; after ``3 * repeats`` tries any round counts). The table gives
each contender's median wall and CPU seconds, and the median over rounds of its time divided by
``load_file + copy``'s and by ``load_file, pread``'s in the same round. The floor of a verified
load follows: the larger of ``load_file + copy`` and the SHA-256 of the same bytes in memory
spread over every core (measured on one core); the target is ``load_state_dict`` (chunk) within
1.15x of it.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.distributed import others_cpu_s

MiB = 1024 * 1024
#: A round counts when other processes used less than this fraction of one core meanwhile.
QUIET = 0.1
BASES = ("load_file + copy", "load_file, pread")


#: The target: a verified load within this factor of its floor.
TARGET = 1.15


def shard_names(shards: int) -> list[str]:
    """The file names ``save_pretrained`` gives: one ``model.safetensors``, or numbered shards."""
    if shards == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]


def _write(root: Path, total_mib: int, tensors: int, shards: int) -> list[Path]:
    """The files of a ``save_pretrained`` directory in ``root/data`` (shards and their index when
    ``shards`` > 1), hard-linked into ``root/chunk`` and ``root/file``, each sealed in its granularity."""
    import torch
    from safetensors.torch import save_file

    import integrity_fs

    per = total_mib * MiB // tensors // 4
    gen = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}
    (root / "data").mkdir()
    names = shard_names(shards)
    weight_map: dict[str, str] = {}
    for index, name in enumerate(names):
        part = {k: v for i, (k, v) in enumerate(state.items()) if i * shards // tensors == index}
        save_file(part, root / "data" / name)
        weight_map.update(dict.fromkeys(part, name))
    files = list(names)
    if shards > 1:
        index = {"metadata": {"total_size": total_mib * MiB}, "weight_map": weight_map}
        (root / "data" / "model.safetensors.index.json").write_text(json.dumps(index))
        files.append("model.safetensors.index.json")
    for granularity in ("chunk", "file"):
        (root / granularity).mkdir()
        for name in files:
            os.link(root / "data" / name, root / granularity / name)
        integrity_fs.seal(root / granularity, granularity=granularity)
    return [root / "data" / name for name in names]


def _contenders(root: Path, paths: list[Path]) -> dict[str, Callable[[], object]]:
    from safetensors.torch import load_file

    from integrity_fs.integrations.safetensors import load_state_dict

    return {
        "load_file": lambda: [load_file(path) for path in paths],
        "load_file + copy": lambda: [{k: v.clone() for k, v in load_file(path).items()} for path in paths],
        "load_file, pread": lambda: [load_file(path, backend="pread") for path in paths],
        "load_state_dict, chunk": lambda: load_state_dict(root / "chunk"),
        "load_state_dict, file": lambda: load_state_dict(root / "file"),
    }


def _trim() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)``: freed memory goes back to the system, so that every call
    allocates (and faults in) fresh memory, as a load into a training process does, whatever the
    call before it freed; a no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return lambda: libc.malloc_trim(0)
    except (OSError, AttributeError):
        return lambda: None


def _round(contenders: dict[str, Callable[[], object]]) -> tuple[dict[str, tuple[float, float]], float]:
    """One call of each contender: its (wall, CPU) seconds, and the CPU seconds others used meanwhile."""
    me = {os.getpid()}
    times: dict[str, tuple[float, float]] = {}
    trim = _trim()
    others = others_cpu_s(me)
    for name, load in contenders.items():
        trim()
        start, cpu = time.perf_counter(), time.process_time()
        state = load()
        times[name] = (time.perf_counter() - start, time.process_time() - cpu)
        del state
    return times, others_cpu_s(me) - others


def run(total_mib: int, tensors: int, repeats: int, workdir: Path, shards: int = 1) -> dict[str, Any]:
    paths = _write(workdir, total_mib, tensors, shards)
    for path in paths:
        path.read_bytes()  # into the page cache
    contenders = _contenders(workdir, paths)
    _round(contenders)  # warm-up
    rounds: list[dict[str, tuple[float, float]]] = []
    tried = 0
    while len(rounds) < repeats and tried < 4 * repeats:
        tried += 1
        times, others = _round(contenders)
        if others < QUIET * sum(wall for wall, _cpu in times.values()) or tried > 3 * repeats:
            rounds.append(times)
    data = [memoryview(path.read_bytes()) for path in paths]
    start = time.perf_counter()
    for piece in data:
        hashlib.sha256(piece).digest()
    hash_s = time.perf_counter() - start
    rows = []
    for name in contenders:
        ratios = {base: statistics.median(r[name][0] / r[base][0] for r in rounds) for base in BASES}
        median_s = statistics.median(r[name][0] for r in rounds)
        cpu_s = statistics.median(r[name][1] for r in rounds)
        rows.append({"contender": name, "median_s": median_s, "cpu_s": cpu_s, "ratios": ratios})
    total = sum(len(piece) for piece in data)
    return {"rows": rows, "rounds": len(rounds), "tried": tried, "hash_s": hash_s, "bytes": total, "shards": shards}


def floor_s(result: dict[str, Any]) -> float:
    """The least a verified load can take here: every byte read into the tensors (what
    ``load_file`` + copy costs) and hashed, the hashing spread over every core."""
    rows = {row["contender"]: row for row in result["rows"]}
    return max(rows[BASES[0]]["median_s"], result["hash_s"] / (os.cpu_count() or 1))


def table(result: dict[str, Any]) -> str:
    lines = [
        "| load | median s | CPU s | vs load_file + copy | vs load_file, pread |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        ratios = row["ratios"]
        lines.append(
            f"| {row['contender']} | {row['median_s']:.3f} | {row['cpu_s']:.3f} | {ratios[BASES[0]]:.2f}x "
            f"| {ratios[BASES[1]]:.2f}x |"
        )
    return "\n".join(lines)


def cpu_floor_s(result: dict[str, Any]) -> float:
    """The least a verified load can take when the copy and the hashing both need the cores: their
    CPU seconds together (``load_file`` + copy's, SHA-256's on one core), spread over every core."""
    rows = {row["contender"]: row for row in result["rows"]}
    return (rows[BASES[0]]["cpu_s"] + result["hash_s"]) / (os.cpu_count() or 1)


def floor_line(result: dict[str, Any]) -> str:
    cores = os.cpu_count() or 1
    gb, hash_s = result["bytes"] / 1e9, result["hash_s"]
    return (
        f"sha256 of the same bytes in memory: {hash_s:.3f} s on one core ({gb / hash_s:.2f} GB/s), "
        f"{hash_s / cores:.3f} s spread over {cores} cores; the floor of a verified load (the larger of "
        f"that and load_file + copy): {floor_s(result):.3f} s; with the copy's CPU and the hashing's spread "
        f"over {cores} cores together: {cpu_floor_s(result):.3f} s"
    )


def what(result: dict[str, Any]) -> str:
    shards = result.get("shards", 1)
    return "one file" if shards == 1 else f"{shards} shards and their index"


def target_lines(result: dict[str, Any]) -> list[str]:
    """The target of a verified safetensors load: within ``TARGET`` of its floor."""
    rows = {row["contender"]: row for row in result["rows"]}
    chunk = rows["load_state_dict, chunk"]
    ratio = chunk["median_s"] / floor_s(result)
    return [
        f"- {'PASS' if ratio <= TARGET else 'MISS'}: `integrity_fs.integrations.safetensors.load_state_dict` "
        f"(chunk granularity, {what(result)}) {ratio:.2f}x its floor here ({chunk['median_s']:.3f} s vs "
        f"{floor_s(result):.3f} s, the larger of `load_file` + copy and SHA-256 of every byte over every "
        f"core; target ≤ {TARGET}x); {chunk['median_s'] / cpu_floor_s(result):.2f}x the copy's and the hashing's "
        f"CPU spread over every core; {chunk['ratios'][BASES[0]]:.2f}x `load_file` + copy"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="size of all the files together in MiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--shards", default="1,2", help="file counts to measure, comma-separated (1: one file)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    results = []
    for shards in (int(n) for n in args.shards.split(",")):
        with tempfile.TemporaryDirectory(prefix="ifs-bench-safetensors-", dir=args.dir) as tmp:
            try:
                results.append(run(args.mib, args.tensors, args.repeats, Path(tmp), shards))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"results": results, "mib": args.mib, "tensors": args.tensors}))
        return
    for result in results:
        print(f"safetensors, {what(result)}: {args.tensors} tensors, {args.mib} MiB; {result['rounds']} rounds\n")
        print(table(result))
        print("\n".join(["", floor_line(result), "", *target_lines(result), ""]))


if __name__ == "__main__":
    main()
