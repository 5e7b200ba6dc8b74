"""The child process that runs one contender: ``python -m benchmarks.runner SPEC_JSON``.

SPEC is ``{"contender": name, "params": {...}, "import_path": dir or null}``. The contender's
setup runs first (untimed); the child then prints one JSON line and answers each line it reads on
stdin: ``call`` runs the contender's ``reset`` (untimed, if it has one) and then the contender
once, timed, and prints ``{"wall": s, "extra": {...}}``; ``quit`` prints the peak RSS and exits.
The parent decides when each call runs, so that the calls of a group's contenders alternate, and
measures the child from outside (CPU and I/O in ``/proc/<pid>``): see ``harness.py``.

A contender whose package or tool is missing prints ``{"skipped": reason}`` and exits 0.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

#: The install line for each package a contender may lack.
HINTS = {
    "model_signing": "pip install -e '.[bench]'",
    "OpenSSL": "pip install -e '.[bench]'",
    "blake3": "pip install -e '.[blake3]'",
    "cryptography": "pip install -e '.[sign]'",
    "awscrt": "pip install -e '.[crc]'",
    "safetensors": "pip install -e '.[hf]'",
    "torch": "pip install -e '.[torch]' (or keep the torch you have: pip install numpy)",
    "numpy": "pip install numpy",
    "s3fs": "pip install -e '.[s3]'",
    "moto": "pip install -e '.[demo]'",
    "integrity_fs": "run from the repository root, or pip install -e .",
}


def skip_reason(error: BaseException) -> str | None:
    """Why a contender cannot run here (a missing package, tool or feature), or None for a failure."""
    if isinstance(error, ModuleNotFoundError):
        name = (error.name or "").split(".")[0]
        if name == "integrity_fs":
            return f"this integrity_fs has no {error.name}"
        return f"{name or error} is not installed: {HINTS.get(name, f'pip install {name}')}"
    if isinstance(error, ImportError):  # the package is there, without the name (another version)
        return str(error)
    if isinstance(error, NotImplementedError) and "install" in str(error):
        return str(error)
    from benchmarks.contenders import Skip

    return str(error) if isinstance(error, Skip) else None


def vm_kib(key: str) -> int:
    """``VmHWM`` (peak) or ``VmRSS`` of this process, in KiB."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1])


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("import_path"):
        sys.path.insert(0, spec["import_path"])
    try:
        from benchmarks.contenders import CONTENDERS

        made = CONTENDERS[spec["contender"]](**spec.get("params", {}))
    except Exception as error:
        reason = skip_reason(error)
        if reason is None:
            reply({"error": "".join(traceback.format_exception_only(error)).strip()[-1500:]})
            sys.exit(1)
        reply({"skipped": reason})
        return
    run, reset = made if isinstance(made, tuple) else (made, None)
    reply({"ready": True, "rss_kib": vm_kib("VmHWM:")})
    for line in sys.stdin:
        if line.strip() != "call":
            break
        try:
            if reset is not None:
                reset()
            started = time.perf_counter()
            out = run()
            wall = time.perf_counter() - started
        except Exception as error:  # a package missing only at the call (a cached copy sealed before) is a skip
            reason = skip_reason(error)
            if reason is not None:
                reply({"skipped": reason})
                return
            traceback.print_exc(file=sys.stderr)
            reply({"error": "".join(traceback.format_exception_only(error)).strip()[-1500:]})
            sys.exit(1)
        reply({"wall": wall, "extra": out if isinstance(out, dict) else {}})
        out = None  # the result of one call must not count in the next one's memory
    reply({"rss_peak_kib": vm_kib("VmHWM:")})


if __name__ == "__main__":
    main()
