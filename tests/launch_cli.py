"""``integrity-fs ARGS`` as torchrun starts it on each rank, with test hooks: each rank records its
exit code and how many bytes it read (``rchar`` of ``/proc/self/io``: every read and pread of the
process, its threads included) in ``$RECORD_DIR/rank<RANK>.json``.

With ``COMMANDS=<file>`` (a JSON object: name -> ``{"argv": [...], "bad_arg_rank": r}``), one
launch runs several commands in turn; ``bad_arg_rank`` gives rank r alone one more argument
(``--workers 0``). The process group is joined here, once, so that each ``main(argv)`` finds it
ready (as a program that calls ``main`` inside its own job does) and leaves it as it was; each
rank records, for each command, its exit code, the bytes it read and what it printed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

import torch.distributed as dist

import integrity_fs.distributed  # noqa: F401  (imported before any count: an import reads files too)
from integrity_fs.cli import main

rank = int(os.environ["RANK"])


def read_so_far() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def run(argv: list[str], bad_arg_rank: int | None) -> tuple[int, int]:
    """The exit code of ``integrity-fs argv`` and the bytes this rank read meanwhile."""
    if bad_arg_rank == rank:
        argv = [*argv, "--workers", "0"]
    before = read_so_far()
    code = main(argv)
    return code, read_so_far() - before


record = os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.json")
commands = os.environ.get("COMMANDS")
if commands is None:
    code, read = run(sys.argv[1:], None)
    with open(record, "w") as f:
        json.dump({"code": code, "read": read}, f)
    sys.exit(code)

with open(commands) as f:
    todo: dict[str, dict[str, Any]] = json.load(f)
dist.init_process_group(
    "gloo"
)  # only the several-commands launch joins here; from torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
outcomes: dict[str, dict[str, Any]] = {}
for name, command in todo.items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code, read = run(command["argv"], command.get("bad_arg_rank"))
    outcomes[name] = {"code": code, "read": read, "stdout": out.getvalue(), "stderr": err.getvalue()}
dist.destroy_process_group()
with open(record, "w") as f:
    json.dump(outcomes, f)
