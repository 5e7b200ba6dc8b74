"""``integrity-fs`` as torchrun starts it on each rank, each rank with its OWN command line (what a
job script that builds the arguments per rank, or a typo on one node, gives).

``ARGV_FILE`` names a JSON list with one argv per rank; this rank runs ``main(argv[RANK])`` (the
command joins the process group itself, as ``python -m integrity_fs`` under torchrun does) and
writes ``$RECORD_DIR/rank<RANK>.json``: the exit code ``main`` returned (or ``"raised"`` with the
traceback in ``stderr``), what it printed on stdout and stderr, and how long it took. The process
then exits 0, so that torchrun does not stop the other rank while it is still finishing: the
recorded code is what ``integrity-fs`` would have exited with. Only the public CLI is used.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback

from integrity_fs.cli import main

rank = int(os.environ["RANK"])
with open(os.path.join(os.environ["RECORD_DIR"], f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))  # torchrun starts each rank in a session of its own: the test kills a hung one by this id
with open(os.environ["ARGV_FILE"]) as f:
    argv: list[str] = json.load(f)[rank]
out, err = io.StringIO(), io.StringIO()
started = time.monotonic()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code: int | str = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # a crash is an outcome to record, not to hide
        traceback.print_exc()
        code = "raised"
record = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "seconds": time.monotonic() - started}
with open(os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
os.remove(os.path.join(os.environ["RECORD_DIR"], f"pid{rank}"))  # done: never killed by that id later
sys.stdout.flush()
os._exit(0)  # no teardown that could wait on the other rank: the record is written
