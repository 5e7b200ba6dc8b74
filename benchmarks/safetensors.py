"""``python -m benchmarks.safetensors [--mib 512] [--tensors 64] [--repeats 5] [--dir DIR] [--json]``

Times loading one ``model.safetensors`` (float32 tensors, written by ``safetensors.torch.save_file``)
into a state dict on the CPU, hot page cache, single process:

- ``load_file``: ``safetensors.torch.load_file`` as it is (its default ``mmap`` backend: the tensors
  are views of the mapped file, so no byte is read until the tensors are used);
- ``load_file + copy``: the same, each tensor then copied into memory of its own (every byte read
  once, as a load that uses the tensors does);
- ``load_file, pread``: ``load_file(backend="pread")``: every byte read into the tensors;
- ``load_state_dict, chunk``: ``integrity_fs.integrations.safetensors.load_state_dict`` on the same
  file (a hard link) sealed in chunk granularity (64 MiB chunks): every byte read once and hashed
  before it reaches a tensor;
- ``load_state_dict, file``: the same, sealed in file granularity: a file over 64 MiB is hashed whole
  first, then read again into the tensors.

Before each call, glibc's ``malloc_trim(0)`` hands freed memory back, so that each contender
allocates fresh memory whatever the one before it freed. The contenders run round-robin,
``--repeats`` rounds after one warm-up round, so that drift of a shared machine weighs on all of
them alike; a round during which other processes used more than a tenth of a core is run again
(at most ``4 * repeats`` rounds; after ``3 * repeats`` tries any round counts). The table gives
each contender's median wall and CPU seconds, and the median over rounds of its time divided by
``load_file + copy``'s and by ``load_file, pread``'s in the same round. A last line gives the
floor of any verified load: the SHA-256 of the same bytes in memory, on one core and spread over
every core.
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


def _write(root: Path, total_mib: int, tensors: int) -> Path:
    """``model.safetensors`` in ``root/data``, hard-linked into ``root/chunk`` and ``root/file``,
    each sealed in its granularity."""
    import torch
    from safetensors.torch import save_file

    import integrity_fs

    per = total_mib * MiB // tensors // 4
    gen = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}
    (root / "data").mkdir()
    save_file(state, root / "data" / "model.safetensors")
    for granularity in ("chunk", "file"):
        (root / granularity).mkdir()
        os.link(root / "data" / "model.safetensors", root / granularity / "model.safetensors")
        integrity_fs.seal(root / granularity, granularity=granularity)
    return root / "data" / "model.safetensors"


def _contenders(root: Path) -> dict[str, Callable[[], object]]:
    from safetensors.torch import load_file

    from integrity_fs.integrations.safetensors import load_state_dict

    path = root / "data" / "model.safetensors"
    return {
        "load_file": lambda: load_file(path),
        "load_file + copy": lambda: {k: v.clone() for k, v in load_file(path).items()},
        "load_file, pread": lambda: load_file(path, backend="pread"),
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


def run(total_mib: int, tensors: int, repeats: int, workdir: Path) -> dict[str, Any]:
    path = _write(workdir, total_mib, tensors)
    path.read_bytes()  # into the page cache
    contenders = _contenders(workdir)
    _round(contenders)  # warm-up
    rounds: list[dict[str, tuple[float, float]]] = []
    tried = 0
    while len(rounds) < repeats and tried < 4 * repeats:
        tried += 1
        times, others = _round(contenders)
        if others < QUIET * sum(wall for wall, _cpu in times.values()) or tried > 3 * repeats:
            rounds.append(times)
    data = memoryview(path.read_bytes())
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    hash_s = time.perf_counter() - start
    rows = []
    for name in contenders:
        ratios = {base: statistics.median(r[name][0] / r[base][0] for r in rounds) for base in BASES}
        median_s = statistics.median(r[name][0] for r in rounds)
        cpu_s = statistics.median(r[name][1] for r in rounds)
        rows.append({"contender": name, "median_s": median_s, "cpu_s": cpu_s, "ratios": ratios})
    return {"rows": rows, "rounds": len(rounds), "tried": tried, "hash_s": hash_s, "bytes": len(data)}


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


def floor_line(result: dict[str, Any]) -> str:
    cores = os.cpu_count() or 1
    gb, hash_s = result["bytes"] / 1e9, result["hash_s"]
    return (
        f"sha256 of the same bytes in memory: {hash_s:.3f} s on one core ({gb / hash_s:.2f} GB/s), "
        f"{hash_s / cores:.3f} s spread over {cores} cores"
    )


def target_lines(result: dict[str, Any]) -> list[str]:
    """The target of a verified safetensors load, and the floor it cannot go under."""
    rows = {row["contender"]: row for row in result["rows"]}
    chunk, copy = rows["load_state_dict, chunk"], rows[BASES[0]]
    ratio = chunk["ratios"][BASES[0]]
    # A verified load reads every byte into the tensors (what load_file + copy costs) and hashes
    # it, on every core at best: no load that checks every byte can be faster than this.
    floor = (copy["median_s"] + result["hash_s"] / (os.cpu_count() or 1)) / copy["median_s"]
    return [
        f"- {'PASS' if ratio <= 1.3 else 'MISS'}: `integrity_fs.integrations.safetensors.load_state_dict` "
        f"(chunk granularity) {ratio:.2f}x `load_file` + copy (target ≤ 1.3x; the floor here, that copy "
        f"plus SHA-256 of every byte spread over every core, is {floor:.2f}x)"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="file size in MiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ifs-bench-safetensors-", dir=args.dir) as tmp:
        try:
            result = run(args.mib, args.tensors, args.repeats, Path(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({**result, "mib": args.mib, "tensors": args.tensors}))
        return
    print(f"model.safetensors of {args.tensors} tensors, {args.mib} MiB; {result['rounds']} rounds\n")
    print(table(result))
    print("\n".join(["", floor_line(result), "", *target_lines(result)]))


if __name__ == "__main__":
    main()
