"""Kill it anywhere: a real training loop, SIGKILLed at random moments, checked after each kill.

``python -m benchmarks --only chaos [--trials N] [--backend local|s3] [--seed S]`` (also
``python -m benchmarks.chaos``). A trial is decided by its seed (``--seed S --trials 1`` runs it
again; the report gives each violation's kill time, ``--kill-after T``, and locally the exact
kill point, ``--kill-at-op N``). ``--every-op --seed S`` kills the trial of seed S once before
each file operation of rank 0 in turn, the way SQLite's crash tests enumerate crash points.

1. prefix: a child trains 0 to 4 steps uninterrupted. The loop, every step: a few optimizer steps
   of a small torch MLP, ``integrity_fs.dcp.save(..., keep_last=2)`` to ``run/step_<n>``; every
   second step ``integrity_fs.upload(..., overwrite=True)`` (S3: ``copy``, the source being on S3)
   of that checkpoint to ``mirror/latest``, then ``integrity_fs.prune`` of ``run`` and ``mirror``.
2. damage, in a share of the trials, before or after the kill: a byte flipped in a random file of
   a random sealed checkpoint, a file truncated, or a manifest deleted; the harness keeps a ledger.
3. the loop again, 1 or 2 gloo ranks forked from this warm interpreter (torch on one thread),
   resumed with ``dcp.load_latest``, SIGKILLed at a moment uniform over the loop's duration
   (measured unkilled every few trials, the machine's load changing). Before each operation the
   child writes what it does to shared memory, and each file operation is noted there too
   (locally by an audit hook in the child, on S3 by the moto server), so the phase killed is known.
4. a fresh process checks the invariants; the leftovers are aged (S3: their leases expired, as
   if the killed transfer's time had run out); a process runs the next prunes, and a fresh one
   checks again; the loop resumes and runs two more steps (a forced transfer and both prunes at
   least); a fresh process checks again.

The invariants:
1. once a checkpoint was sealed, one of the run verifies (unless the harness damaged the
   candidates); once the mirror was sealed, a verifying copy of it exists (its destination, or a
   staged copy);
2. ``latest_verified`` and ``dcp.load_latest`` agree with ``status --full`` on the newest
   checkpoint that verifies, and every checkpoint that verifies holds exactly the tensors the
   harness recorded for its step (as does every resume of the loop);
3. damaged bytes are never loaded and never verify again (a new save of that step is fine);
4. every leftover of a killed operation (staging folder, folder being deleted, unsealed folder)
   is listed by ``status``; the staging and deleting ones are gone after the next prunes (but a
   staged copy sealed while its destination is not) and after the next forced transfer; nothing
   outside ``run`` and ``mirror`` changes;
5. nothing hangs: each process finishes within its timeout.
A child that fails with an unexpected exception is a violation too (``E``). The report: kills per
phase, damage injected, violations per invariant with each trial's seed, and last
``chaos: N trials, K kills, D damaged, V violations``; exit status 1 when V > 0.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread in every child
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the two ranks talk over loopback

import argparse
import contextlib
import hashlib
import io
import json
import logging
import mmap
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

STEPS = 6  # saves in the killed loop
ITERS = 2  # optimizer steps between saves
EVERY = 2  # a transfer and two prunes every EVERY saves
KEEP = 2  # dcp.save(keep_last=KEEP) and prune(run, keep_last=KEEP)
MORE = 2  # steps of the resumed loop after the check
TIMEOUT_S = 60.0  # any one process of a trial (invariant 5)
RECALIBRATE = 10  # trials between two measures of the loop's duration
BUCKET = "chaos"
S3_KEYS = {"key": "testing", "secret": "testing"}
# Names SPEC and the brief state (not imported: the harness judges the library from outside).
MANIFEST = "_integrity_manifest.json"
STAGING = ".integrity-fs-staging-"
LEASE = "_integrity_lease.json"
DELETING = "_integrity_deleting"
DAMAGES = ("flip", "truncate", "manifest")
INVARIANTS = {
    "1": "a sealed checkpoint verifies",
    "2": "only verified, exact tensors",
    "3": "damage never loaded or sealed",
    "4": "leftovers listed and removed",
    "5": "nothing hangs",
    "E": "unexpected error",
}


# ----------------------------------------------------------------------------- shared memory


class Track:
    """File operations seen, in shared memory: the last one (any kind), and a ring of the others
    than reads and listings, each with its time (``time.monotonic``: one clock for every process)."""

    HEAD = struct.Struct("=QQd12s100s")
    ENTRY = struct.Struct("=d12s")
    RING = 64
    SIZE = HEAD.size + RING * ENTRY.size

    def __init__(self, buf: Any, offset: int) -> None:
        self.buf, self.off = buf, offset
        self.lock = threading.Lock()

    def note(self, kind: str, name: str) -> int:
        """Note one operation; how many were noted so far, this one included."""
        with self.lock:
            t = time.monotonic()
            count, total = self.HEAD.unpack_from(self.buf, self.off)[:2]
            if kind not in ("read", "list"):
                at = self.off + self.HEAD.size + (count % self.RING) * self.ENTRY.size
                self.ENTRY.pack_into(self.buf, at, t, kind.encode())
                count += 1
            self.HEAD.pack_into(
                self.buf, self.off, count, total + 1, t, kind.encode(), name.encode("utf-8", "replace")[-100:]
            )
            return int(total + 1)

    def since(self, t0: float) -> tuple[str, str, list[str], int]:
        """The last operation at or after ``t0`` (kind, name), the significant ones since, in
        order, and how many operations were noted in all."""
        count, total, t, kind, name = self.HEAD.unpack_from(self.buf, self.off)
        last = (_text(kind), _text(name)) if total and t >= t0 else ("", "")
        ring = []
        for i in range(max(0, count - self.RING), count):
            et, ek = self.ENTRY.unpack_from(self.buf, self.off + self.HEAD.size + (i % self.RING) * self.ENTRY.size)
            if et >= t0:
                ring.append(_text(ek))
        return last[0], last[1], ring, int(total)


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


class Board:
    """One slot per rank, shared with the forked children: when it was ready, when its loop
    started and ended, its phase (and since when), and the file operations it made (a Track)."""

    PHASE = struct.Struct("=dddd40s")
    SLOT = PHASE.size + Track.SIZE

    def __init__(self, ranks: int = 2) -> None:
        self.mm = mmap.mmap(-1, self.SLOT * ranks)  # anonymous and shared: the children write, the parent reads
        self.ranks = ranks
        self.tracks = [Track(self.mm, r * self.SLOT + self.PHASE.size) for r in range(ranks)]

    def clear(self) -> None:
        self.mm[:] = bytes(len(self.mm))

    def _set(self, rank: int, index: int, value: float) -> None:
        struct.pack_into("=d", self.mm, rank * self.SLOT + 8 * index, value)

    def ready(self, rank: int) -> None:
        self._set(rank, 0, time.monotonic())

    def loop_started(self, rank: int) -> None:
        self._set(rank, 1, time.monotonic())

    def loop_ended(self, rank: int) -> None:
        self._set(rank, 2, time.monotonic())

    def phase(self, rank: int, name: str) -> None:
        struct.pack_into("=d40s", self.mm, rank * self.SLOT + 24, time.monotonic(), name.encode()[:40])

    def get(self, rank: int) -> dict[str, Any]:
        ready, start, end, t_phase, phase = self.PHASE.unpack_from(self.mm, rank * self.SLOT)
        return {"ready": ready, "start": start, "end": end, "t_phase": t_phase, "phase": _text(phase)}


def phase_label(coarse: str, last: str, ring: list[str], remote: bool = False) -> str:
    """What the child was doing: its own phase (``save:5``), refined by the file operations seen
    since that phase began (``last``: the last one; ``ring``: those other than reads, in order)."""
    what = coarse.split(":")[0]
    seals = ring.count("manifest")
    kind = last or (ring[-1] if ring else "")
    if what == "save":
        if kind == "manifest":
            return "save/manifest"
        if seals:
            return "save/prune"
        return "save/unseal" if kind == "unseal" else "save/write"
    if what == "transfer":
        if kind == "manifest":
            return "transfer/seal"
        if not seals:
            return "transfer/check" if kind in ("read", "list", "") else "transfer/write"
        # staged (a lease was written): locally two renames, on S3 the old objects deleted and the
        # staged ones copied, until the destination's manifest; then the staging folder goes
        if kind in ("unlease", "rename", "swap", "copy") or (remote and "lease" in ring and seals == 1):
            return "transfer/swap"
        return "transfer/cleanup"
    if what in ("prune-run", "prune-mirror"):
        if kind == "mark":
            return "prune/mark"
        return "prune/delete" if kind in ("delete", "unseal") else "prune/verify"
    return what or "start"


# ----------------------------------------------------------------------------- the harness's own storage


class Store:
    """The trial's files as the harness sees them, through its own means (``os``, or boto3 on
    S3), never through integrity_fs. Paths are relative to the trial's root (``run/step_3/x``)."""

    def __init__(self, backend: str, local_root: str, prefix: str, endpoint: str | None) -> None:
        self.backend, self.local_root, self.prefix, self.endpoint = backend, local_root, prefix, endpoint
        self._client: Any = None
        self._pid = 0

    # where things are
    def url(self, rel: str) -> str:
        if self.backend == "local":
            return os.path.join(self.local_root, rel)
        return f"s3://{BUCKET}/{self.prefix}/{rel}"

    def options(self) -> dict[str, Any] | None:
        if self.backend == "local":
            return None
        return {**S3_KEYS, "client_kwargs": {"endpoint_url": self.endpoint}}

    def cli_options(self) -> list[str]:
        if self.backend == "local":
            return []
        return ["-o", "key=testing", "-o", "secret=testing", "-o", f"client_kwargs.endpoint_url={self.endpoint}"]

    @property
    def s3(self) -> Any:
        if self._client is None or self._pid != os.getpid():  # one client per process, never shared over a fork
            import boto3

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
                region_name="us-east-1",
            )
            self._pid = os.getpid()
        return self._client

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}".rstrip("/")

    # what is there
    def entries(self, rel: str) -> tuple[list[str], list[str]]:
        """The folders and the files directly in ``rel`` (empty when it is not there)."""
        if self.backend == "local":
            path = self.url(rel)
            if not os.path.isdir(path):
                return [], []
            names = sorted(os.listdir(path))
            return [n for n in names if os.path.isdir(os.path.join(path, n))], [
                n for n in names if not os.path.isdir(os.path.join(path, n))
            ]
        dirs, files = [], []
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=self._key(rel) + "/", Delimiter="/"
        ):
            dirs += [p["Prefix"][len(self._key(rel)) + 1 :].rstrip("/") for p in page.get("CommonPrefixes", [])]
            files += [o["Key"][len(self._key(rel)) + 1 :] for o in page.get("Contents", [])]
        return sorted(dirs), sorted(files)

    def files(self, rel: str) -> dict[str, int]:
        """Every file under ``rel``, recursively: relative name → size."""
        out: dict[str, int] = {}
        if self.backend == "local":
            top = self.url(rel)
            for folder, _, names in os.walk(top):
                for n in names:
                    path = os.path.join(folder, n)
                    out[os.path.relpath(path, top)] = os.lstat(path).st_size
            return out
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=self._key(rel) + "/"):
            for o in page.get("Contents", []):
                out[o["Key"][len(self._key(rel)) + 1 :]] = o["Size"]
        return out

    def read(self, rel: str) -> bytes | None:
        if self.backend == "local":
            try:
                with open(self.url(rel), "rb") as f:
                    return f.read()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
        try:
            return bytes(self.s3.get_object(Bucket=BUCKET, Key=self._key(rel))["Body"].read())
        except self.s3.exceptions.NoSuchKey:
            return None

    def write(self, rel: str, data: bytes) -> None:
        """Replace the file's bytes (locally in place, its times kept: damage the way a disk does it)."""
        if self.backend == "local":
            path = self.url(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            st = os.stat(path) if os.path.exists(path) else None
            with open(path, "r+b" if st else "wb") as f:
                f.write(data)
                f.truncate(len(data))
            if st is not None:
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            return
        self.s3.put_object(Bucket=BUCKET, Key=self._key(rel), Body=data)

    def delete(self, rel: str) -> None:
        if self.backend == "local":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.url(rel))
            return
        self.s3.delete_object(Bucket=BUCKET, Key=self._key(rel))

    def age(self, rel: str) -> None:
        """Make the staging folder ``rel`` look as old as a dead transfer's: the time that its
        lease (or, with none, its age) stands for has passed (every child is dead by now)."""
        if self.backend == "local":
            old = time.time() - 3600
            os.utime(self.url(rel), (old, old))
            return
        self.s3.put_object(
            Bucket=BUCKET, Key=self._key(f"{rel}/{LEASE}"), Body=json.dumps({"expires": time.time() - 1}).encode()
        )

    def young(self, rel: str) -> bool:
        """A local staging folder that holds no more than its lease and changed less than a minute
        ago: a transfer may be making it (its lease not locked yet), so no one may remove it yet.
        Its ctime cannot be aged from outside, and the trial does not wait the minute."""
        if self.backend != "local":
            return False
        path = self.url(rel)
        try:
            return set(os.listdir(path)) <= {LEASE} and time.time() - os.lstat(path).st_ctime < 60
        except FileNotFoundError:
            return False

    def remove_all(self) -> None:
        if self.backend == "local":
            shutil.rmtree(self.local_root, ignore_errors=True)
            return
        keys = list(self.files(""))
        for i in range(0, len(keys), 1000):
            self.s3.delete_objects(
                Bucket=BUCKET, Delete={"Objects": [{"Key": self._key(k)} for k in keys[i : i + 1000]]}
            )
        shutil.rmtree(self.local_root, ignore_errors=True)


def _sha(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- the training loop (in children)

SHAPES = {"w1": (64, 96), "b1": (96,), "w2": (96, 16), "b2": (16,)}
BATCH = 32


def fresh_state() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    state = {f"model.{k}": torch.randn(s, generator=g) * 0.1 for k, s in SHAPES.items()}
    state.update({f"optim.{k}": torch.zeros(s) for k, s in SHAPES.items()})
    state["step"] = torch.tensor(0, dtype=torch.int64)
    return state


def blank_state() -> dict[str, Any]:
    """What a load fills: every tensor of the state, zeros."""
    import torch

    return {k: torch.zeros_like(v) for k, v in fresh_state().items()}


def train(state: dict[str, Any], step: int, rank: int, world: int) -> None:
    """ITERS steps of SGD with momentum on a two-layer MLP; the batch is split in two halves whose
    gradients add (one rank: here; two ranks: ``all_reduce``), so the result is bit for bit the
    same whatever the world size, and the same again when a step is trained a second time."""
    import torch

    teacher = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    names = list(SHAPES)
    for it in range(ITERS):
        g = torch.Generator().manual_seed(step * 1000 + it)
        x = torch.randn(BATCH, 64, generator=g)
        y = torch.tanh(x @ teacher)
        halves = [rank] if world > 1 else [0, 1]
        total: list[Any] | None = None
        for h in halves:
            params = [state[f"model.{k}"].detach().clone().requires_grad_(True) for k in names]
            xs, ys = x[h * BATCH // 2 : (h + 1) * BATCH // 2], y[h * BATCH // 2 : (h + 1) * BATCH // 2]
            out = torch.relu(xs @ params[0] + params[1]) @ params[2] + params[3]
            loss = ((out - ys) ** 2).mean()
            grads = torch.autograd.grad(loss, params)
            total = list(grads) if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        assert total is not None
        if world > 1:
            import torch.distributed as dist

            flat = torch.cat([t.reshape(-1) for t in total])
            dist.all_reduce(flat)
            total = list(torch.split(flat, [t.numel() for t in total]))
            total = [t.reshape(SHAPES[k]) for t, k in zip(total, names, strict=True)]
        with torch.no_grad():
            for k, grad in zip(names, total, strict=True):
                m = state[f"optim.{k}"]
                m.mul_(0.9).add_(grad)
                state[f"model.{k}"].sub_(0.05 * m)
    state["step"] = torch.tensor(step, dtype=torch.int64)


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit for bit."""
    if set(a) != set(b):
        return False
    return all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].numpy().tobytes() == b[k].numpy().tobytes()
        for k in a
    )


@dataclass
class Trial:
    """One trial: its seed, its storage, its folders (records, log and ledger are local always)."""

    seed: int
    store: Store
    local: str  # the trial's local folder (records/, log.jsonl, ledger.json, child output)
    board: Board

    @property
    def run(self) -> str:
        return self.store.url("run")

    @property
    def mirror(self) -> str:
        return self.store.url("mirror")

    @property
    def latest(self) -> str:
        return self.store.url("mirror/latest")

    def record_path(self, step: int) -> str:
        return os.path.join(self.local, "records", f"step_{step}.pt")

    def record(self, step: int) -> dict[str, Any] | None:
        import torch

        try:
            return torch.load(self.record_path(step))  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def log(self, **event: Any) -> None:
        line = json.dumps({"t": time.monotonic(), "pid": os.getpid(), **event}) + "\n"
        fd = os.open(os.path.join(self.local, "log.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write under PIPE_BUF with O_APPEND: whole lines, whoever writes
        finally:
            os.close(fd)

    def events(self) -> list[dict[str, Any]]:
        try:
            with open(os.path.join(self.local, "log.jsonl"), encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def ledger(self) -> list[dict[str, Any]]:
        try:
            with open(os.path.join(self.local, "ledger.json"), encoding="utf-8") as f:
                return list(json.load(f))
        except FileNotFoundError:
            return []

    def damaged_here(self, url: str) -> list[dict[str, Any]]:
        """The ledger's damage whose damaged bytes are still at the checkpoint ``url``."""
        out = []
        for d in self.ledger():
            if (
                d["sha"] is not None
                and self.store.url(d["ckpt"]) == url.rstrip("/")
                and _sha(self.store.read(f"{d['ckpt']}/{d['file']}")) == d["sha"]
            ):
                out.append(d)
        return out


_WATCHED = {"open", "os.remove", "os.rename", "os.mkdir", "os.rmdir", "shutil.rmtree"}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _file_kind(event: str, args: tuple[Any, ...]) -> str:
    """The kind of one audited file operation (``""``: not one of the checkpoint's)."""
    path = args[0]
    if isinstance(path, bytes):
        path = path.decode("utf-8", "replace")
    if not isinstance(path, str):
        return ""
    base = os.path.basename(path.rstrip("/"))
    if event == "open":
        flags = args[2] if isinstance(args[2], int) else 0
        if flags & os.O_DIRECTORY or (args[1] is not None and not isinstance(args[1], str)):
            return ""
        writing = bool(flags & _WRITE) or (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
        if not writing:
            return "read"
        if MANIFEST in base:
            return "manifest"
        return {DELETING: "mark", LEASE: "lease"}.get(base, "write")
    if event == "os.rename":
        dst = args[1].decode() if isinstance(args[1], bytes) else str(args[1])
        if os.path.basename(dst) == MANIFEST:
            return "manifest"  # an atomic write's last step
        return "swap" if STAGING in path or STAGING in dst else "rename"
    if event == "os.remove":
        return {MANIFEST: "unseal", LEASE: "unlease"}.get(base, "delete")
    if event == "os.mkdir":
        return "lease" if STAGING in base else "write"
    return "delete"  # os.rmdir, shutil.rmtree


Point = int | tuple[str, int]  # a kill point: rank 0's file operation number, or the Nth of a kind ("swap", 2)


def _audit(track: Track, root: str, kill_at: Point | None) -> None:
    """Note each file operation of this process on the trial's files (an audit hook: it sees what
    the library does from outside, the way ``strace`` would). ``kill_at``: SIGKILL this process
    just before that operation (a replay of a kill point, exactly)."""
    kinds: Counter[str] = Counter()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event not in _WATCHED or not args:
            return
        path = args[0]
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        if not isinstance(path, str) or (os.path.isabs(path) and not path.startswith(root)):
            return
        kind = _file_kind(event, args)
        if not kind:
            return
        kinds[kind] += 1
        if track.note(kind, path) == kill_at or (kind, kinds[kind]) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def loop(trial: Trial, rank: int, world: int, steps: int, *, last_sync: bool) -> None:
    """The training loop of one rank (see the module docstring); ``last_sync``: the last step
    transfers and prunes whatever its number."""
    import torch

    import integrity_fs
    from integrity_fs import dcp

    board = trial.board
    group = None
    if world > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    opts = trial.store.options()
    board.loop_started(rank)
    board.phase(rank, "resume")
    state = blank_state()
    url = dcp.load_latest(state, trial.run, storage_options=opts, group=group)
    if url is None:
        state, step = fresh_state(), 0
    else:
        step = int(state["step"])
        recorded = trial.record(step)
        damaged = trial.damaged_here(url)
        trial.log(
            ev="resumed",
            url=url,
            step=step,
            rank=rank,
            match=recorded is not None and same_state(recorded, state),
            named=url.rstrip("/").endswith(f"/step_{step}"),
            damaged=[d["file"] for d in damaged],
        )
    for i in range(steps):
        step += 1
        board.phase(rank, f"train:{step}")
        train(state, step, rank, world)
        if rank == 0:
            board.phase(rank, f"record:{step}")
            recorded = trial.record(step)
            if recorded is None:
                tmp = trial.record_path(step) + f".{os.getpid()}.tmp"
                torch.save({k: v.clone() for k, v in state.items()}, tmp)
                os.replace(tmp, trial.record_path(step))
            elif not same_state(recorded, state):
                trial.log(ev="nondeterministic", step=step)
            trial.log(ev="save-start", step=step)
        board.phase(rank, f"save:{step}")
        dcp.save(state, f"{trial.run}/step_{step}", storage_options=opts, keep_last=KEEP)
        if rank == 0:
            trial.log(ev="saved", step=step)
        if step % EVERY == 0 or (last_sync and i == steps - 1):
            if rank == 0:
                board.phase(rank, f"transfer:{step}")
                if trial.store.backend == "local":
                    integrity_fs.upload(f"{trial.run}/step_{step}", trial.latest, overwrite=True)
                else:
                    integrity_fs.copy(
                        f"{trial.run}/step_{step}", trial.latest, src_options=opts, dst_options=opts, overwrite=True
                    )
                trial.log(ev="uploaded", step=step)
                board.phase(rank, f"prune-run:{step}")
                integrity_fs.prune(trial.run, keep_last=KEEP, storage_options=opts)
                board.phase(rank, f"prune-mirror:{step}")
                integrity_fs.prune(trial.mirror, keep_last=1, storage_options=opts)
            if group is not None:
                import torch.distributed as dist

                board.phase(rank, f"barrier:{step}")
                dist.barrier()
    board.phase(rank, "done")
    board.loop_ended(rank)


def rank_main(
    trial: Trial, rank: int, world: int, port: int, steps: int, last_sync: bool, kill_at: Point | None
) -> None:
    """A forked rank: one torch thread, its own output file, a process group for two ranks."""
    import torch

    torch.set_num_threads(1)
    if trial.store.backend == "local":
        _audit(trial.board.tracks[rank], trial.store.local_root, kill_at)
    if world > 1:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
    if trial.store.backend == "s3":  # the client is made before the loop's timed part, as a training job's would be
        import fsspec

        fs = fsspec.filesystem("s3", **(trial.store.options() or {}))  # the instance the library gets for these options
        with contextlib.suppress(FileNotFoundError):
            fs.ls(f"{BUCKET}/{trial.store.prefix}", refresh=True)
        fs.invalidate_cache()
    trial.board.ready(rank)
    loop(trial, rank, world, steps, last_sync=last_sync)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


# ----------------------------------------------------------------------------- processes


def fork(out: str, fn: Any, *args: Any) -> int:
    """``fn(*args)`` in a forked child whose stdout and stderr go to ``out``; exit 0, or 3 with
    the traceback in ``out`` when it raised."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
        os.environ.pop("WORLD_SIZE", None)
        fn(*args)
    except BaseException:
        code = 3
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(code)


def reap(pids: list[int], deadline: float) -> dict[int, int | None]:
    """Wait for ``pids`` until ``deadline`` (monotonic); each one's exit code, ``None`` for one still
    running then (it is killed). When one fails, the others are given a second to end, then killed."""
    codes: dict[int, int | None] = {}
    failed_at: float | None = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
        now = time.monotonic()
        if len(codes) < len(pids) and (now > deadline or (failed_at is not None and now > failed_at + 1.0)):
            for pid in pids:
                if pid not in codes:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = None if now > deadline else -signal.SIGKILL
        time.sleep(0.002)
    return codes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    """How one run of the loop ended."""

    codes: list[int | None]
    killed: bool = False
    phase: str = ""
    detail: str = ""
    at: float = 0.0  # seconds into the loop when killed
    op: int = 0  # rank 0's file operations until then (local): --kill-at-op replays the kill exactly
    duration: float = 0.0  # the loop's own duration when it was not killed


def run_loop(
    trial: Trial,
    role: str,
    world: int,
    steps: int,
    *,
    kill_after: float | None = None,
    kill_at: Point | None = None,
    last_sync: bool = False,
    moto: Track | None = None,
) -> Run:
    """The loop in ``world`` forked ranks; SIGKILLed ``kill_after`` seconds after its loop began
    (or rank 0 just before its file operation ``kill_at``, the others with it)."""
    board = trial.board
    board.clear()
    port = free_port() if world > 1 else 0
    pids = [
        fork(
            os.path.join(trial.local, f"{role}-{r}.out"),
            rank_main,
            trial,
            r,
            world,
            port,
            steps,
            last_sync,
            kill_at if r == 0 else None,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    if kill_after is None and kill_at is None:
        codes = reap(pids, deadline)
        slot = board.get(0)
        return Run([codes[p] for p in pids], duration=slot["end"] - slot["start"] if slot["end"] else 0.0)
    if kill_after is not None:
        while board.get(0)["start"] == 0.0 and time.monotonic() < deadline and not _exited(pids):
            time.sleep(0.0005)
        at = board.get(0)["start"] + kill_after
        while board.get(0)["start"] and time.monotonic() < at and board.get(0)["end"] == 0.0 and not _exited(pids):
            time.sleep(0.0005)
    else:
        while time.monotonic() < deadline and board.get(0)["end"] == 0.0 and not _exited(pids[:1]):
            time.sleep(0.0005)
    slot = board.get(0)
    if kill_at is not None:  # rank 0 ended before its loop did: by its own SIGKILL (or a failure, its code tells)
        kill = slot["end"] == 0.0 and _exited(pids[:1])
    else:
        kill = slot["start"] != 0.0 and slot["end"] == 0.0 and not _exited(pids)
    if not kill:  # done before the kill, or a rank failed: as it ended
        codes = reap(pids, deadline)
        return Run([codes[p] for p in pids], duration=slot["end"] - slot["start"] if slot["end"] else 0.0)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    codes_ = reap_all(pids)
    slot = board.get(0)
    last, name, ring, ops = board.tracks[0].since(slot["t_phase"])
    if moto is not None:
        last, name, ring, _ = moto.since(slot["t_phase"])
    when = (
        kill_after
        if kill_after is not None
        else board.tracks[0].HEAD.unpack_from(board.mm, board.tracks[0].off)[2] - slot["start"]
    )
    detail = f"{slot['phase']} {last} {os.path.basename(name)}".strip()
    return Run(
        [codes_[p] for p in pids], True, phase_label(slot["phase"], last, ring, moto is not None), detail, when, ops
    )


def _exited(pids: list[int]) -> bool:
    """Whether one of ``pids`` has ended (it is left to be reaped)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
    return False


def reap_all(pids: list[int]) -> dict[int, int]:
    out = {}
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        out[pid] = os.waitstatus_to_exitcode(status)
    return out


# ----------------------------------------------------------------------------- damage


def inject(trial: Trial, rng: random.Random) -> dict[str, Any] | None:
    """One damage to a random sealed checkpoint (run's or the mirror's), recorded in the ledger."""
    store = trial.store
    sealed = [
        f"run/{n}"
        for n in store.entries("run")[0]
        if n.startswith("step_") and store.read(f"run/{n}/{MANIFEST}") is not None
    ]
    if store.read(f"mirror/latest/{MANIFEST}") is not None:
        sealed.append("mirror/latest")
    if not sealed:
        return None
    ckpt = rng.choice(sorted(sealed))
    kind = rng.choice(DAMAGES)
    manifest = json.loads(store.read(f"{ckpt}/{MANIFEST}") or b"{}")
    entry: dict[str, Any] = {"t": time.monotonic(), "kind": kind, "ckpt": ckpt, "file": MANIFEST, "sha": None}
    if kind == "manifest":
        store.delete(f"{ckpt}/{MANIFEST}")
    else:
        name = rng.choice(sorted(manifest["files"]))
        data = bytearray(store.read(f"{ckpt}/{name}") or b"")
        if not data:
            return None
        if kind == "flip":
            at = rng.randrange(len(data))
            data[at] ^= rng.randrange(1, 256)
            entry["at"] = at
        else:
            data = data[: rng.randrange(len(data))]
            entry["at"] = len(data)
        store.write(f"{ckpt}/{name}", bytes(data))
        entry.update(file=name, sha=_sha(bytes(data)))
    ledger = [*trial.ledger(), entry]
    with open(os.path.join(trial.local, "ledger.json"), "w", encoding="utf-8") as f:
        json.dump(ledger, f)
    return entry


# ----------------------------------------------------------------------------- the checks (in a fresh process)


def check(trial: Trial, stage: str, out: str) -> None:
    """The invariants, from a fresh process; the violations go to ``out`` as JSON."""
    import torch

    torch.set_num_threads(1)
    found: list[tuple[str, str]] = []
    try:
        found = _check(trial, stage)
    finally:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(found, f)


def _status(trial: Trial, area: str) -> list[dict[str, Any]] | None:
    """``python -m integrity_fs status ROOT --full --json`` (its ``main``), or None when the folder is not there."""
    from integrity_fs.cli import main

    if not any(trial.store.entries(area)):
        return None
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        code = main(["status", trial.store.url(area), "--full", "--json", *trial.store.cli_options()])
    if code != 0:
        raise RuntimeError(f"status {area} exited {code}: {err.getvalue().strip()[-500:]}")
    return list(json.loads(buf.getvalue()))


def _verifies(trial: Trial, url: str) -> bool:
    import integrity_fs

    try:
        return bool(integrity_fs.verify(url, storage_options=trial.store.options()).ok)
    except (
        integrity_fs.IntegrityError,
        integrity_fs.ManifestError,
        integrity_fs.ManifestNotFoundError,
        integrity_fs.FileChangedError,
    ):
        return False


def _tensors_ok(trial: Trial, url: str, state: dict[str, Any]) -> str:
    """Why the state loaded from ``url`` is not the one recorded for its step (``""``: it is)."""
    step = int(state["step"])
    recorded = trial.record(step)
    if recorded is None:
        return f"{url} holds step {step}, which the loop never saved"
    if not same_state(recorded, state):
        return f"{url} holds tensors other than those saved at step {step}"
    if not url.rstrip("/").endswith(("/latest", f"/step_{step}")):
        return f"{url} holds the state of step {step}"
    return ""


def _check(trial: Trial, stage: str) -> list[tuple[str, str]]:
    import integrity_fs
    from integrity_fs import dcp

    store, opts, bad = trial.store, trial.store.options(), []
    events, ledger = trial.events(), trial.ledger()
    damage_t: dict[str, float] = {}
    for d in ledger:
        damage_t[d["ckpt"]] = max(damage_t.get(d["ckpt"], 0.0), d["t"])
    rows = {area: _status(trial, area) for area in ("run", "mirror")}
    run_rows = [r for r in rows["run"] or [] if r["verdict"] not in ("other", "leftover", "staging")]
    ok_rows = [r for r in run_rows if r["verdict"] == "ok"]

    # 1. a sealed checkpoint verifies
    saved: dict[int, float] = {}
    for e in events:
        if e.get("ev") == "saved":
            saved[e["step"]] = e["t"]
    intact = [s for s, t in saved.items() if damage_t.get(f"run/step_{s}", 0.0) < t]
    hit = {c for c in damage_t if c.startswith("run/")}
    if saved and intact and len(hit) < KEEP and not ok_rows:
        bad.append(
            (
                "1",
                f"no checkpoint of the run verifies; step {max(intact)} was sealed and never damaged "
                f"({[(r['name'], r['verdict']) for r in run_rows]})",
            )
        )
    uploads = [e["t"] for e in events if e.get("ev") == "uploaded"]
    latest_ok = _verifies(trial, trial.latest) if store.read(f"mirror/latest/{MANIFEST}") is not None else False
    staged = [n for n in store.entries("mirror")[0] if STAGING in n]
    if uploads and max(uploads) > damage_t.get("mirror/latest", 0.0) and not latest_ok:  # noqa: SIM102 (cheap test first)
        if not any(_verifies(trial, store.url(f"mirror/{n}")) for n in staged):
            bad.append(
                (
                    "1",
                    f"the mirror was sealed (its last upload logged) and no copy verifies: latest, staging {staged}",
                )
            )

    # 2. latest_verified and load_latest agree; every verifying checkpoint holds its step's tensors
    found = integrity_fs.latest_verified(trial.run, storage_options=opts) if rows["run"] is not None else None
    newest = ok_rows[0]["url"] if ok_rows else None
    if (found[0] if found else None) != newest:
        bad.append(
            (
                "2",
                f"latest_verified returned {found[0] if found else None}, "
                f"status --full says the newest that verifies is {newest}",
            )
        )
    if found is not None:
        if not _verifies(trial, found[0]):
            bad.append(("2", f"latest_verified returned {found[0]}, which does not verify"))
        state = blank_state()
        loaded = dcp.load_latest(state, trial.run, storage_options=opts)
        if loaded != found[0]:
            bad.append(("2", f"dcp.load_latest loaded {loaded}, latest_verified returned {found[0]}"))
        if loaded is not None:
            why = _tensors_ok(trial, loaded, state)
            if why:
                bad.append(("2", f"dcp.load_latest: {why}"))
            for d in trial.damaged_here(loaded):
                bad.append(
                    (
                        "3",
                        f"dcp.load_latest loaded {loaded}, whose {d['file']} holds the harness's damage ({d['kind']})",
                    )
                )
    for r in ok_rows[1:] + ([{"url": trial.latest}] if latest_ok else []):
        state = blank_state()
        dcp.load(state, r["url"], storage_options=opts)
        why = _tensors_ok(trial, r["url"], state)
        if why:
            bad.append(("2", f"a checkpoint that verifies: {why}"))
    for e in events:
        if e.get("ev") == "resumed" and not (e["match"] and e["named"]):
            bad.append(
                (
                    "2",
                    f"rank {e['rank']} resumed from {e['url']} (step {e['step']}) "
                    "with tensors other than those saved at that step",
                )
            )
        if e.get("ev") == "resumed" and e["damaged"]:
            bad.append(
                ("3", f"rank {e['rank']} resumed from {e['url']}, whose {e['damaged']} holds the harness's damage")
            )
        if e.get("ev") == "nondeterministic":
            bad.append(("E", f"harness: step {e['step']} trained twice gave different tensors"))

    # 3. damaged bytes never verify again
    for d in ledger:
        if d["sha"] is None or _sha(store.read(f"{d['ckpt']}/{d['file']}")) != d["sha"]:
            continue
        url = store.url(d["ckpt"])
        if _verifies(trial, url):
            bad.append(("3", f"{d['ckpt']} verifies with the harness's damage in {d['file']} ({d['kind']})"))
        row = next((r for r in run_rows if r["url"] == url), None)
        if row is not None and row["verdict"] in ("ok", "sizes ok"):
            bad.append(("3", f"status says {d['ckpt']} is {row['verdict']}, with the harness's damage in {d['file']}"))

    # 4. leftovers listed by status; after a prune and a forced transfer, the staging and deleting ones gone
    for area in ("run", "mirror"):
        folders, files = store.entries(area)
        named = {r["name"]: r["verdict"] for r in rows[area] or []}
        for f in files:
            bad.append(("4", f"{area}/{f}: a file beside the checkpoints, which status does not list"))
        for n in folders:
            marked = store.read(f"{area}/{n}/{DELETING}") is not None
            what = "staging folder" if STAGING in n else "folder marked for deletion" if marked else "folder"
            want = ("leftover", "staging") if STAGING in n else ("deleting",) if marked else ()
            if n not in named or (want and named[n] not in want):
                bad.append(("4", f"{area}/{n} ({what}) is listed by status as {named.get(n, 'nothing')}"))
            if stage == "kill" or not (STAGING in n or marked) or store.young(f"{area}/{n}"):
                continue
            if (
                stage == "sweep"
                and STAGING in n
                and store.read(f"{area}/{n}/{MANIFEST}") is not None
                and store.read(f"{area}/{n[1:].split(STAGING)[0]}/{MANIFEST}") is None
            ):
                continue  # sealed while its destination is not: it may be the only copy, kept until a transfer seals it
            after = "the prunes" if stage == "sweep" else "the resumed loop's prunes and forced transfer"
            bad.append(("4", f"{area}/{n} ({what}) is still there after {after}"))
    top = sorted(store.entries("")[0] + store.entries("")[1])
    if not set(top) <= {"run", "mirror", "sentinel"}:
        bad.append(("4", f"the trial's folder holds {top}: something was written outside run and mirror"))
    if store.read("sentinel/keep.bin") != _sentinel(trial.seed) or set(store.files("sentinel")) != {"keep.bin"}:
        bad.append(("4", "the sentinel folder beside run and mirror changed"))
    return bad


def sweep(trial: Trial) -> None:
    """The next prunes after a kill, before anything else: each leftover they may remove goes."""
    import integrity_fs

    for area, keep in (("run", KEEP), ("mirror", 1)):
        if any(trial.store.entries(area)):
            integrity_fs.prune(trial.store.url(area), keep_last=keep, storage_options=trial.store.options())


def _sentinel(seed: int) -> bytes:
    return random.Random(seed).randbytes(4096)


# ----------------------------------------------------------------------------- one trial


@dataclass
class Outcome:
    seed: int
    world: int
    name: str = ""  # the seed, and the operation killed before when every operation is tried in turn
    killed: bool = False
    phase: str = ""
    detail: str = ""
    at: float = 0.0
    damage: list[str] = field(default_factory=list)
    violations: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    op: int = 0
    parts: dict[str, float] = field(default_factory=dict)  # when each part of the trial ended (monotonic)


class Harness:
    def __init__(
        self,
        backend: str,
        workdir: str,
        dist_share: float,
        damage_share: float,
        durations: dict[int, float] | None,
        sabotage: int | None = None,
        kill_at: tuple[float | None, Point | None] = (None, None),
    ) -> None:
        self.backend, self.workdir = backend, workdir
        self.dist_share, self.damage_share, self.sabotage = dist_share, damage_share, sabotage
        self.kill_after, self.kill_at_op = kill_at  # a replay's kill point: seconds into the loop, or an operation
        self.kill_before: dict[int | None, tuple[str, int]] = {}  # seed (None: any) -> the Nth operation of a kind
        self.board = Board(2)
        self.endpoint: str | None = None
        self.moto_proc: subprocess.Popen[bytes] | None = None
        self.moto: Track | None = None
        if backend == "s3":
            self._start_moto()
        self.pinned = durations is not None
        self.durations = dict(durations or {})
        self.measured: dict[int, list[float]] = {}  # every calibration, for the report

    # S3: moto in a process of its own (no thread in this one: it forks), noting each request
    def _start_moto(self) -> None:
        path = os.path.join(self.workdir, "moto.track")
        with open(path, "wb") as f:
            f.write(bytes(Track.SIZE))
        self._moto_file = open(path, "r+b")  # noqa: SIM115 (kept open: the mapping lives as long as the harness)
        self.moto = Track(mmap.mmap(self._moto_file.fileno(), Track.SIZE), 0)
        self.moto_proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.chaos", "--serve-moto", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=_repo(),
        )
        assert self.moto_proc.stdout is not None
        line = self.moto_proc.stdout.readline().decode().strip()
        if not line.startswith("http://"):
            raise RuntimeError(f"moto did not start: {line!r}")
        self.endpoint = line
        import boto3

        boto3.client(
            "s3",
            endpoint_url=line,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)

    def close(self) -> None:
        if self.moto_proc is not None:
            assert self.moto_proc.stdin is not None
            self.moto_proc.stdin.close()
            self.moto_proc.wait(10)

    def trial(self, seed: int, label: str) -> Trial:
        local = os.path.join(self.workdir, f"trial-{label}")
        shutil.rmtree(local, ignore_errors=True)
        os.makedirs(os.path.join(local, "records"))
        prefix = f"trial-{label}-{os.getpid()}"
        if self.backend == "local":
            store = Store("local", os.path.join(local, "tree"), "", None)
            os.makedirs(store.local_root)
        else:
            store = Store("s3", local, prefix, self.endpoint)
        store.write("sentinel/keep.bin", _sentinel(seed))
        return Trial(seed, store, local, self.board)

    def calibrate(self, world: int, runs: int = 1) -> float:
        """The loop's duration in seconds (after a two-step prefix, never killed): the median of the
        last three measures. Measured again every few trials, for the machine's load changes (a
        report states each trial's kill time, to replay it)."""
        if self.pinned:
            return self.durations[world]
        for i in range(runs):
            trial = self.trial(0, f"calibrate-{world}-{i}")
            self._must(run_loop(trial, "prefix", 1, 2), "calibration prefix")
            done = run_loop(trial, "loop", world, STEPS)
            self._must(done, "calibration loop")
            self.measured.setdefault(world, []).append(done.duration)
            trial.store.remove_all()
            shutil.rmtree(trial.local, ignore_errors=True)
        self.durations[world] = sorted(self.measured[world][-3:])[len(self.measured[world][-3:]) // 2]
        return self.durations[world]

    @staticmethod
    def _must(run: Run, what: str) -> None:
        if any(c != 0 for c in run.codes):
            raise RuntimeError(f"{what} failed: exit codes {run.codes}")

    def run_trial(self, seed: int, keep: bool = False, name: str = "") -> Outcome:
        started = time.monotonic()
        rng = random.Random(seed)
        world = 2 if rng.random() < self.dist_share else 1
        prefix = rng.choice((0, 1, 2, 2, 3, 3, 4))
        damage = rng.random() < self.damage_share
        when = rng.choice(("before", "after"))
        fraction = rng.random()
        damage_rng = random.Random(rng.getrandbits(64))
        out = Outcome(seed, world, name or str(seed))
        out.parts["start"] = started
        trial = self.trial(seed, out.name)
        try:
            self._trial(trial, out, world, prefix, damage, when, fraction, damage_rng)
        finally:
            out.seconds = time.monotonic() - started
            if not out.violations and not keep:
                trial.store.remove_all()
                shutil.rmtree(trial.local, ignore_errors=True)
        return out

    def _ran(self, trial: Trial, out: Outcome, run: Run, what: str) -> bool:
        """Record what a child's exit says (a hang, an exception); False when the trial cannot go on."""
        if any(c is None for c in run.codes):
            out.violations.append(("5", f"{what} did not finish within {TIMEOUT_S:.0f} s"))
            return False
        for rank, code in enumerate(run.codes):
            if (
                code == 0
                or (run.killed and code == -signal.SIGKILL)
                or (run.killed and rank and _peer_died(trial, what, rank))
            ):
                continue
            out.violations.append(("E", f"{what} failed (exit {run.codes}): {_tail(trial, what)}"))
            return False
        return True

    def _check(self, trial: Trial, out: Outcome, stage: str) -> bool:
        path = os.path.join(trial.local, f"check-{stage}.json")
        pid = fork(os.path.join(trial.local, f"check-{stage}.out"), check, trial, stage, path)
        code = reap([pid], time.monotonic() + TIMEOUT_S)[pid]
        if code is None:
            out.violations.append(("5", f"the check after the {stage} did not finish within {TIMEOUT_S:.0f} s"))
            return False
        if code != 0:
            out.violations.append(("E", f"the check after the {stage} failed: {_tail(trial, f'check-{stage}')}"))
        with contextlib.suppress(FileNotFoundError, ValueError), open(path, encoding="utf-8") as f:
            out.violations += [(a, f"after the {stage}: {b}") for a, b in json.load(f)]
        return code == 0

    def _damage(self, trial: Trial, out: Outcome, rng: random.Random) -> None:
        entry = inject(trial, rng)
        if entry is not None:
            out.damage.append(entry["kind"])

    def _trial(
        self,
        trial: Trial,
        out: Outcome,
        world: int,
        prefix: int,
        damage: bool,
        when: str,
        fraction: float,
        rng: random.Random,
    ) -> None:
        if prefix and not self._ran(trial, out, run_loop(trial, "prefix", 1, prefix), "prefix"):
            return
        out.parts["prefix"] = time.monotonic()
        if self.sabotage == trial.seed and prefix:  # a lie the checks must catch (the harness's own test)
            import torch

            rec = trial.record(prefix)
            assert rec is not None
            rec["model.b2"][0] += 1.0
            torch.save(rec, trial.record_path(prefix))
        if damage and when == "before":
            self._damage(trial, out, rng)
        point = self.kill_at_op or self.kill_before.get(trial.seed) or self.kill_before.get(None)
        kill_after = (
            None if point else self.kill_after if self.kill_after is not None else fraction * self.durations[world]
        )
        run = run_loop(trial, "killed", world, STEPS, kill_after=kill_after, kill_at=point, moto=self.moto)
        out.killed, out.phase, out.detail, out.at, out.op = (
            run.killed,
            run.phase or "(done before the kill)",
            run.detail,
            run.at if run.killed else kill_after or 0.0,
            run.op,
        )
        out.parts["killed"] = time.monotonic()
        if not self._ran(trial, out, run, "killed"):
            return
        if damage and when == "after":
            self._damage(trial, out, rng)
        if not self._check(trial, out, "kill"):
            return
        out.parts["check"] = time.monotonic()
        for area in ("run", "mirror"):
            for n in trial.store.entries(area)[0]:
                if STAGING in n:
                    trial.store.age(f"{area}/{n}")
        pid = fork(os.path.join(trial.local, "sweep-0.out"), sweep, trial)
        if not self._ran(trial, out, Run([reap([pid], time.monotonic() + TIMEOUT_S)[pid]]), "sweep"):
            return
        if not self._check(trial, out, "sweep"):
            return
        out.parts["sweep"] = time.monotonic()
        if not self._ran(trial, out, run_loop(trial, "continue", world, MORE, last_sync=True), "continue"):
            return
        out.parts["continue"] = time.monotonic()
        self._check(trial, out, "resume")
        out.parts["check again"] = time.monotonic()


def _tail(trial: Trial, role: str) -> str:
    for name in (f"{role}-0.out", f"{role}-1.out", f"{role}.out"):
        with contextlib.suppress(FileNotFoundError):
            with open(os.path.join(trial.local, name), encoding="utf-8", errors="replace") as f:
                lines = [line.rstrip() for line in f if line.strip()]
            if lines:
                return " | ".join(lines[-3:])[-600:]
    return "(no output)"


def _peer_died(trial: Trial, role: str, rank: int) -> bool:
    """Whether ``rank`` of a killed run ended because rank 0 was killed under it (gloo's error)."""
    with contextlib.suppress(FileNotFoundError):
        with open(os.path.join(trial.local, f"{role}-{rank}.out"), encoding="utf-8", errors="replace") as f:
            text = f.read()
        return "Connection closed by peer" in text or "Connection reset by peer" in text
    return False


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- moto, in its own process


def serve_moto(track_path: str) -> None:
    """moto's server on port 0, noting each request's kind in the shared ``track_path``; prints
    its URL, serves until stdin closes."""

    from moto import backends
    from moto.server import ThreadedMotoServer

    modules = tuple(backends.list_of_moto_modules())  # listed once, not per request (as tests/conftest.py)
    backends.list_of_moto_modules = lambda: modules
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    f = open(track_path, "r+b")  # noqa: SIM115
    track = Track(mmap.mmap(f.fileno(), Track.SIZE), 0)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    wsgi: Any = server._server  # werkzeug's server: its ``app`` is called per request
    app = wsgi.app

    def noted(environ: dict[str, Any], start_response: Any) -> Any:
        kind = s3_kind(
            environ.get("REQUEST_METHOD", ""),
            environ.get("PATH_INFO", ""),
            environ.get("QUERY_STRING", ""),
            bool(environ.get("HTTP_X_AMZ_COPY_SOURCE")),
        )
        if kind:
            track.note(kind, environ.get("PATH_INFO", ""))
        return app(environ, start_response)

    wsgi.app = noted
    host, port = server.get_host_and_port()
    print(f"http://{host}:{port}", flush=True)
    sys.stdin.read()
    server.stop()


def s3_kind(method: str, path: str, query: str, copy: bool) -> str:
    base = path.rstrip("/").rsplit("/", 1)[-1]
    if method in ("GET", "HEAD"):
        return "list" if "list-type" in query or path.strip("/").count("/") == 0 else "read"
    if method == "DELETE":
        return "unseal" if base == MANIFEST else "delete"
    if method == "POST":
        return "delete" if "delete" in query else "write"
    if method == "PUT":
        if copy:
            return "copy"
        if "partNumber" in query:
            return "write"
        if base == MANIFEST:
            return "manifest"
        return {DELETING: "mark", LEASE: "lease"}.get(base, "write")
    return ""


# ----------------------------------------------------------------------------- the report


def report(
    backend: str,
    outcomes: list[Outcome],
    measured: dict[int, list[float]],
    seconds: float,
    base: int,
    every_op: bool = False,
) -> tuple[str, int]:
    n = len(outcomes)
    which = (
        f"seed {base} killed before each file operation of rank 0 in turn"
        if every_op
        else f"seeds {base} to {base + n - 1}"
    )
    kills = sum(o.killed for o in outcomes)
    damaged = sum(len(o.damage) for o in outcomes)
    violations = [(o.name, a, b) for o in outcomes for a, b in o.violations]
    loops = "; ".join(
        f"{w} rank{'s' if w > 1 else ''}: {min(d):.3f} to {max(d):.3f} s ({len(d)} measures)"
        for w, d in sorted(measured.items())
    )
    lines = [
        f"## chaos ({backend}): {n} trials, {which}, {sum(o.world == 2 for o in outcomes)} with 2 gloo ranks",
        "",
        f"The killed loop: {STEPS} saves, {STEPS // EVERY} transfers; its duration (measured, never killed): "
        f"{loops or 'not measured, the kill points given'}.",
        f"Time: {seconds:.0f} s in all, {sum(o.seconds for o in outcomes) / max(n, 1):.2f} s a trial.",
        "",
        "| phase killed (rank 0) | kills |",
        "| --- | ---: |",
    ]
    phases = Counter(o.phase for o in outcomes if o.phase)
    lines += [f"| {p} | {c} |" for p, c in sorted(phases.items(), key=lambda x: (-x[1], x[0]))]
    lines += ["", "| damage injected | count |", "| --- | ---: |"]
    kinds = Counter(k for o in outcomes for k in o.damage)
    lines += [f"| {k} | {kinds.get(k, 0)} |" for k in DAMAGES]
    lines += ["", "| invariant | violations | seeds |", "| --- | ---: | --- |"]
    for key, what in INVARIANTS.items():
        seeds = sorted({s for s, a, _ in violations if a == key})
        more = " ..." if len(seeds) > 20 else ""
        lines.append(
            f"| {key}. {what} | {sum(a == key for _, a, _ in violations)} | {' '.join(map(str, seeds[:20]))}{more} |"
        )
    if violations:
        lines += [
            "",
            "Violations (replay: python -m benchmarks --only chaos --seed SEED --trials 1, and the options shown):",
        ]
        by_name: dict[str, list[str]] = {}
        for name, a, b in violations:
            by_name.setdefault(name, []).append(f"  [{a}] {b}")
        for name, texts in by_name.items():
            o = next(o for o in outcomes if o.name == name)
            seed = o.seed
            exact = (
                f" --kill-after {o.at:.4f}" + (f" (exactly: --kill-at-op {o.op})" if o.op else "") if o.killed else ""
            )
            lines.append(
                f"- seed {seed}: {o.world} rank{'s' if o.world > 1 else ''}, killed in {o.phase} at {o.at:.3f} s "
                f"({o.detail}), damage {o.damage or 'none'}; "
                f"replay: --backend {backend} --seed {seed} --trials 1{exact}"
            )
            lines += texts
    lines += ["", f"chaos: {n} trials, {kills} kills, {damaged} damaged, {len(violations)} violations"]
    return "\n".join(lines), len(violations)


def warm(backend: str) -> None:
    """Import and run once, here, what the children use: forked after this, they start warm."""
    import torch

    if backend == "s3":
        import s3fs  # noqa: F401 (imported only: no client, no thread, before the forks)

    torch.set_num_threads(1)
    import integrity_fs
    from integrity_fs import dcp
    from integrity_fs.cli import main as cli

    state = fresh_state()
    train(state, 1, 0, 1)
    logging.disable(logging.WARNING)  # its retention warnings say nothing here
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        for step in (1, 2, 3):
            dcp.save(state, f"{tmp}/run/step_{step}", keep_last=KEEP)
            integrity_fs.upload(f"{tmp}/run/step_{step}", f"{tmp}/mirror/latest", overwrite=True)
        integrity_fs.prune(f"{tmp}/run", keep_last=KEEP)
        integrity_fs.prune(f"{tmp}/mirror", keep_last=1)
        dcp.load_latest(blank_state(), f"{tmp}/run")
        dcp.load(blank_state(), f"{tmp}/mirror/latest")
        integrity_fs.latest_verified(f"{tmp}/run")
        integrity_fs.verify(f"{tmp}/mirror/latest")
        cli(["status", f"{tmp}/run", "--full", "--json"])
        torch.save(state, f"{tmp}/record.pt")
        torch.load(f"{tmp}/record.pt")
    logging.disable(logging.NOTSET)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --only chaos",
        description="Kill a training loop anywhere; check the invariants after each kill.",
    )
    parser.add_argument("--only", action="append", help=argparse.SUPPRESS)  # as python -m benchmarks --only chaos
    parser.add_argument("--trials", type=int, default=200, help="default %(default)s")
    parser.add_argument("--backend", choices=("local", "s3"), default="local")
    parser.add_argument(
        "--seed",
        type=int,
        help="the first trial's seed (trial i: SEED + i; default: random); one trial again: --seed S --trials 1",
    )
    parser.add_argument(
        "--dist-share", type=float, default=0.3, help="share of the trials with 2 gloo ranks (default %(default)s)"
    )
    parser.add_argument(
        "--damage-share", type=float, default=0.4, help="share of the trials with damage (default %(default)s)"
    )
    parser.add_argument(
        "--durations", help="the loop's duration per world size (1=0.4,2=0.6), not measured: fixed kill times"
    )
    parser.add_argument(
        "--kill-after", type=float, help="kill the loop this many seconds after it began (a report's kill time)"
    )
    parser.add_argument(
        "--kill-at-op",
        type=int,
        help="local: kill rank 0 just before its file operation N (a report's exact kill point)",
    )
    parser.add_argument(
        "--kill-before",
        action="append",
        default=[],
        metavar="[SEED=]KIND:N",
        help="local: kill rank 0 just before its Nth file operation of KIND (write, manifest, mark, lease, unlease, "
        "swap, rename, delete, unseal, read), in every trial or in the trial of SEED (repeatable)",
    )
    parser.add_argument(
        "--every-op",
        action="store_true",
        help="local: the trial of --seed once per file operation of rank 0, killed just before it (up to --trials)",
    )
    parser.add_argument("--dir", help="where the trials live (default: a temporary folder)")
    parser.add_argument(
        "--keep", action="store_true", help="keep every trial's files (those with violations are kept anyway)"
    )
    parser.add_argument("--verbose", action="store_true", help="a line per trial on stderr, with the time of each part")
    parser.add_argument("--sabotage", type=int, help=argparse.SUPPRESS)  # the harness's own test: a lie it must catch
    parser.add_argument("--serve-moto", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_moto:
        serve_moto(args.serve_moto)
        return 0
    if args.only and set(args.only) != {"chaos"}:
        parser.error("only the chaos section runs here")
    if (args.kill_at_op is not None or args.every_op or args.kill_before) and args.backend != "local":
        parser.error("--kill-at-op, --kill-before and --every-op count local file operations: --backend local")
    kill_before: dict[int | None, tuple[str, int]] = {}
    for spec in args.kill_before:
        seed, _, point = spec.rpartition("=")
        kind, _, nth = point.partition(":")
        kill_before[int(seed) if seed else None] = (kind, int(nth or 1))
    if args.every_op and args.seed is None:
        parser.error("--every-op tries every kill point of one trial: give its --seed")
    base = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    seeds = [base] * args.trials if args.every_op else [base + i for i in range(args.trials)]
    worlds = sorted({2 if random.Random(seed).random() < args.dist_share else 1 for seed in seeds})
    durations = (
        {int(k): float(v) for k, v in (p.split("=") for p in args.durations.split(","))} if args.durations else None
    )
    if args.kill_after is not None or args.kill_at_op is not None or args.every_op or None in kill_before:
        durations = {w: 0.0 for w in worlds}  # the kill point is given: nothing to measure
    workdir = args.dir or tempfile.mkdtemp(prefix="integrity-chaos-")
    os.makedirs(workdir, exist_ok=True)
    warm(args.backend)
    if os.path.isdir("/proc/self/task") and len(os.listdir("/proc/self/task")) > 1:
        print("chaos: warning: threads running before the first fork", file=sys.stderr)
    harness = Harness(
        args.backend,
        workdir,
        args.dist_share,
        args.damage_share,
        durations,
        args.sabotage,
        (args.kill_after, args.kill_at_op),
    )
    harness.kill_before = kill_before
    started = time.monotonic()
    outcomes: list[Outcome] = []
    try:
        for i, seed in enumerate(seeds):
            if i % RECALIBRATE == 0:
                for w in worlds:
                    harness.calibrate(w, 3 if i == 0 else 1)
            if args.every_op:
                harness.kill_at_op = i + 1
            o = harness.run_trial(seed, keep=args.keep, name=f"{seed}@op{i + 1}" if args.every_op else "")
            outcomes.append(o)
            if args.verbose or o.violations:
                parts = list(o.parts.items())
                times = " ".join(f"{k} {t - parts[j][1]:.2f}" for j, (k, t) in enumerate(parts[1:]))
                mark = f" VIOLATIONS: {len(o.violations)}" if o.violations else ""
                print(
                    f"  trial {i + 1}/{args.trials} seed {o.seed}: {o.world}r, {o.phase} at {o.at:.3f} s op {o.op} "
                    f"({o.detail}), damage {o.damage or '-'}; {o.seconds:.2f} s ({times}){mark}",
                    file=sys.stderr,
                    flush=True,
                )
            if args.every_op and not o.killed:
                break  # the loop ended before this operation: every one was tried
    finally:
        harness.close()
    measured = harness.measured or {w: [d] for w, d in harness.durations.items() if d}
    text, violations = report(args.backend, outcomes, measured, time.monotonic() - started, base, args.every_op)
    print(text, flush=True)
    if not violations and not args.keep and args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
