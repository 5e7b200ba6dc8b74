"""``integrity-fs ARGS`` as torchrun starts it on each rank, with test hooks: each rank records the
byte ranges it hashes and its exit code in ``$RECORD_DIR/rank<RANK>.json``, and
``BAD_ARG_RANK=<r>`` gives rank r alone one bad argument (``--workers 0``).

With ``COMMANDS=<file>`` (a JSON object: name -> ``{"argv": [...], "bad_arg_rank": r}``), one
launch runs several commands in turn. The process group is joined here, once, so that each
``main(argv)`` finds it ready (as a program that calls ``main`` inside its own job does) and
leaves it as it was; each rank records, for each command, its exit code, the ranges it hashed
and what the command printed on stdout and stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

from integrity_fs import storage
from integrity_fs.cli import main

rank = int(os.environ["RANK"])
hashed: list[tuple[str, int, int]] = []
real = storage.hash_range


def recording(span: storage.Span, *args: Any, **kwargs: Any) -> Any:
    hashed.append((span.path, span.offset, span.length))
    return real(span, *args, **kwargs)


def run(argv: list[str], bad_arg_rank: int | None) -> int:
    if bad_arg_rank == rank:
        argv = [*argv, "--workers", "0"]
    return main(argv)


storage.hash_range = recording  # type: ignore[assignment]
record = os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.json")
commands = os.environ.get("COMMANDS")
if commands is None:
    bad = os.environ.get("BAD_ARG_RANK")
    code = run(sys.argv[1:], None if bad is None else int(bad))
    with open(record, "w") as f:
        json.dump({"code": code, "hashed": hashed}, f)
    sys.exit(code)

import torch.distributed as dist  # noqa: E402 (only the several-commands launch joins the group here)

with open(commands) as f:
    todo: dict[str, dict[str, Any]] = json.load(f)
dist.init_process_group("gloo")  # from torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
outcomes: dict[str, dict[str, Any]] = {}
for name, command in todo.items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(command["argv"], command.get("bad_arg_rank"))
    outcomes[name] = {"code": code, "hashed": list(hashed), "stdout": out.getvalue(), "stderr": err.getvalue()}
    hashed.clear()
dist.destroy_process_group()
with open(record, "w") as f:
    json.dump(outcomes, f)
