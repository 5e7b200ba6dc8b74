"""One rank of a distributed seal/verify test: ``python dist_worker.py SPEC.json RANK``.

Runs every scenario of the spec in one gloo process group and writes this rank's outcomes (result
type, message, report or manifest, bytes this rank hashed) to ``rank<RANK>.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dist_rank import run_rank
from fsspec.callbacks import Callback
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from integrity_fs import IntegrityError, Manifest, Report, distributed


class Unprintable(Exception):
    """An exception whose ``str()`` raises (as a backend's can, formatting fields it never set)."""

    def __str__(self) -> str:
        raise KeyError("message")


FAULTS: dict[str, Exception] = {
    "permission": PermissionError(13, "Permission denied (injected)"),
    "unexpected": ZeroDivisionError("injected"),
    "unprintable": Unprintable(),
}


class FaultyLocalFS(AbstractFileSystem):
    """Local files behind a non-local fsspec class whose reads of file content fail (with ``fault``).

    (integrity_fs opens files of a real LocalFileSystem with the built-in open(), so a
    LocalFileSystem subclass could not inject anything.)
    """

    protocol = "faultylocal"
    root_marker = "/"

    def __init__(self, fault: str | None) -> None:
        super().__init__(skip_instance_cache=True)
        self.local = LocalFileSystem()
        self.fault = fault

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.local.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.local.info(path, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if self.fault is not None and "r" in mode and not path.endswith("_integrity_manifest.json"):
            error = FAULTS[self.fault]
            if isinstance(error, OSError):
                raise type(error)(error.errno, error.strerror, path)
            raise type(error)(*error.args)
        return self.local._open(path, mode, **kwargs)


INTERRUPTS: dict[str, BaseException] = {
    "KeyboardInterrupt": KeyboardInterrupt(),
    "UnicodeEncodeError": UnicodeEncodeError("utf-8", "a\udcff", 1, 2, "surrogates not allowed"),
}


class ByteCounter(Callback):  # type: ignore[misc]
    """Counts the bytes this rank hashes; raises ``interrupt`` at the first one (a Ctrl-C in a callback)."""

    def __init__(self, interrupt: BaseException | None = None, rewrite: str | None = None) -> None:
        super().__init__()
        self.hashed = 0
        self.interrupt = interrupt
        self.rewrite = rewrite

    def relative_update(self, inc: int = 1) -> None:
        if self.interrupt is not None:
            raise self.interrupt
        if self.rewrite is not None and inc > 0:  # after this rank's first block: a writer steps in
            for path in sorted(Path(self.rewrite).rglob("*.bin")):
                data = path.read_bytes()
                with open(path, "r+b") as f:  # in place, the same bytes: only the file's identity changes
                    f.write(data)
            self.rewrite = None
        self.hashed += inc


def outcome(value: object) -> dict[str, Any]:
    if isinstance(value, Report):
        return {"type": "Report", "report": value.to_dict()}
    if isinstance(value, Manifest):
        return {"type": "Manifest", "manifest": value.to_json().decode()}
    raise TypeError(f"unexpected result {value!r}")


def failure(exc: BaseException) -> dict[str, Any]:
    report = exc.report.to_dict() if isinstance(exc, IntegrityError) else None
    try:
        message = str(exc)
    except Exception:  # an Unprintable raised again on its own rank
        message = "<exception str() failed>"
    return {"type": type(exc).__name__, "message": message, "report": report, "notes": getattr(exc, "__notes__", [])}


def run(scenario: dict[str, Any], rank: int, group: Any) -> dict[str, Any]:
    kwargs = dict(scenario.get("kwargs", {}))
    kwargs.update(scenario.get("rank_kwargs", {}).get(str(rank), {}))
    mode = kwargs.pop("mode", scenario["mode"])  # a rank may pass its own (a bad or different) mode
    if "faulty_rank" in scenario:  # every rank sees the files through one filesystem; one rank's reads fail
        kwargs["fs"] = FaultyLocalFS(scenario["fault"] if scenario["faulty_rank"] == rank else None)
    interrupt = INTERRUPTS[scenario.get("interrupt", "KeyboardInterrupt")]
    rewrite = scenario.get("rewrite_dir") if scenario.get("rewrite_rank") == rank else None
    counter = ByteCounter(interrupt if scenario.get("interrupt_rank") == rank else None, rewrite)
    kwargs["callback"] = counter
    function = distributed.verify if scenario["op"] == "verify" else distributed.seal
    cwd = os.getcwd()
    if "rank_cwd" in scenario:  # the same relative URL names a different directory on each rank
        os.chdir(scenario["rank_cwd"][rank])
    try:
        result = outcome(function(scenario["url"], group=group, mode=mode, **kwargs))
    except BaseException as exc:  # KeyboardInterrupt included: the outcome of this rank
        result = failure(exc)
    finally:
        os.chdir(cwd)
    return {**result, "hashed": counter.hashed}


def run_all(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for scenario in spec["scenarios"]:
        members = scenario.get("group")
        group = dist.new_group(members) if members is not None else None  # every rank creates it
        if members is not None and rank not in members:
            results[scenario["id"]] = {"type": "not a member"}
            continue
        results[scenario["id"]] = run(scenario, rank, group)
    return results


if __name__ == "__main__":
    run_rank(run_all)
