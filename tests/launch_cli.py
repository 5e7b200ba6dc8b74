"""``integrity-fs ARGS`` as torchrun starts it on each rank, with two test hooks: each rank records
the byte ranges it hashes and its exit code in ``$RECORD_DIR/rank<RANK>.json``, and
``BAD_ARG_RANK=<r>`` gives rank r alone one bad argument (``--workers 0``)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from integrity_fs import storage
from integrity_fs.cli import main

rank = int(os.environ["RANK"])
hashed: list[tuple[str, int, int]] = []
real = storage.hash_range


def recording(fs: Any, path: str, algorithm: str, offset: int, length: int, *args: Any, **kwargs: Any) -> Any:
    hashed.append((path, offset, length))
    return real(fs, path, algorithm, offset, length, *args, **kwargs)


storage.hash_range = recording  # type: ignore[assignment]
argv = sys.argv[1:]
if os.environ.get("BAD_ARG_RANK") == str(rank):
    argv += ["--workers", "0"]
code = main(argv)
with open(os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"code": code, "hashed": hashed}, f)
sys.exit(code)
