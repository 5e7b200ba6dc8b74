"""A run's checkpoints: which folders they are and in what order, the newest that verifies, each
one's state, and retention. The rules are SPEC's "Newest good checkpoint" and "Retention":

- A checkpoint's step is stated by ``pattern`` (``"step_{step}"``; ``*`` matches any text) or
  inferred only when the names are equal but for exactly one integer; anything else is a
  ``ValueError`` that names ``pattern=``. Names starting with ``.`` or ``_``, and links, are
  never checkpoints.
- One verdict for one checkpoint, whoever asks (``status``, ``latest_verified``, ``prune``):
  ``ok``, ``sizes ok`` (quick), ``damaged``, ``unsealed``, ``invalid``, ``changing``, ``deleting``.
  A verdict reached in this process on unchanged files (the same names, sizes and versions) is
  reused, not recomputed.
- ``prune`` keeps the ``keep_last`` newest that verify and deletes only what is older on both
  clocks: a smaller step, and a manifest (or, unsealed, a newest file) not written after that of
  any kept one; of those, verified and damaged ones (unsealed ones with ``unsealed=True``), never
  an invalid or changing one. Older ones are judged by names and sizes only (``sizes ok``).
  Deleting marks the folder first, then removes the signature and manifest, then the files,
  then the folder (locally through the folder opened without following links); a marked folder
  is finished by the next prune, whatever its ``keep_last``. A store that keeps what it was told
  to delete is an ``OSError``. Dead staging leftovers go too (see :mod:`.staging`).
- A run that never saved (its root not there) has no checkpoints: ``latest_verified`` says so
  and returns ``None``; ``find_checkpoints``, ``status`` and ``prune`` raise ``FileNotFoundError``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from . import staging, storage
from .errors import FileChangedError, IntegrityError, ManifestError, ManifestNotFoundError, SignatureError
from .manifest import MANIFEST_FILENAME
from .options import VerifyOptions, count, flag
from .report import PruneResult, Report, printable, shortened
from .storage import URL, Stat
from .verify import attest, finish, hash_units, prepare

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import VerifyKeywords

__all__ = ["MARKER", "find_checkpoints", "latest_verified", "prune", "remember", "status"]

log = logging.getLogger("integrity_fs")

#: Written into a folder before a prune deletes anything of it.
MARKER = "_integrity_deleting"
_DIGITS = re.compile(r"[0-9]+")  # ASCII digits only: "x_\u0663" holds no step
GOOD = ("ok", "sizes ok")


# ----------------------------------------------------------------------------- steps


def _regex(pattern: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a string such as 'step_{{step}}', not {pattern!r}")
    if pattern.count("{step}") != 1 or "/" in pattern:
        raise ValueError(f"pattern {pattern!r} must hold '{{step}}' once and no '/' (e.g. 'step_{{step}}')")
    text = re.escape(pattern).replace(re.escape("{step}"), r"([0-9]+)").replace(r"\*", r"[^/]*")
    return re.compile(text)


def steps_of(names: Iterable[str], pattern: str | None) -> dict[str, int]:
    """Each checkpoint name of the run → its step (see the module docstring)."""
    names = sorted(names)
    if pattern is not None:
        regex = _regex(pattern)
        return {n: int(m[1]) for n in names if (m := regex.fullmatch(n))}
    runs: dict[str, list[str]] = {}
    for name in names:
        if _DIGITS.search(name):
            runs.setdefault(_DIGITS.sub("#", name), []).append(name)
    if not runs:
        return {}
    if len(runs) > 1:
        a, b = (group[0] for group in list(runs.values())[:2])
        raise ValueError(
            f"{a!r} and {b!r} are not checkpoints of one run: "
            "pass pattern= (e.g. pattern='step_{step}') to say which names are"
        )
    (run,) = runs.values()
    digits = {n: _DIGITS.findall(n) for n in run}
    differ = [i for i in range(len(digits[run[0]])) if len({d[i] for d in digits.values()}) > 1]
    if len(differ) > 1:
        other = next(n for n in run if sum(a != b for a, b in zip(digits[n], digits[run[0]], strict=True)) > 1)
        shape = _DIGITS.sub("*", run[0])
        raise ValueError(
            f"{run[0]!r} and {other!r} differ in more than one integer, so which one is the step is not "
            f"certain: pass pattern= ({shape!r} with {{step}} in place of the step's *)"
        )
    at = differ[0] if differ else len(digits[run[0]]) - 1
    return {n: int(d[at]) for n, d in digits.items()}


Candidates = tuple[list[str], dict[str, int], list[str]]


def candidates_of(fs: Any, root: str, pattern: str | None) -> tuple[list[str], dict[str, int], list[str]]:
    """The run's names newest first, their steps, and the other folders (not checkpoints). A root
    not there yet (a run that never saved) has none: the verbs that need it there say so
    (:func:`_there`)."""
    try:
        folders = storage.list_dirs(fs, root)
    except FileNotFoundError:
        return [], {}, []
    names = [n for n, link in folders.items() if not link and n[:1] not in (".", "_")]
    steps = steps_of(names, pattern)
    order = sorted(steps, key=lambda n: (steps[n], n), reverse=True)
    return order, steps, sorted(n for n in names if n not in steps)


def _there(fs: Any, root: str, candidates: Candidates) -> None:
    """``FileNotFoundError`` when ``root`` holds no folder because it does not exist."""
    if not candidates[0] and not candidates[2]:
        storage.check_root(fs, root)


def _url(fs: Any, path: str) -> str:
    return path if storage.is_local(fs) else str(fs.unstrip_protocol(path))


def find_checkpoints(
    root: URL, *, pattern: str | None = None, storage_options: dict[str, Any] | None = None, fs: Any = None
) -> list[str]:
    """The checkpoints of the run under ``root``, newest first by their step (one listing, no reads)."""
    fs_, root_ = storage.resolve(root, storage_options, fs)
    found = candidates_of(fs_, root_, pattern)
    _there(fs_, root_, found)
    return [_url(fs_, storage.join(root_, n)) for n in found[0]]


# ----------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Judged:
    verdict: str
    report: Report | None = None
    reason: str = ""
    sealed: bool = False
    files: int = 0
    bytes: int = 0
    time: float | None = None  # when its manifest (unsealed: its newest file) was written
    held: int = 0  # every byte a delete frees: the files, the manifest and the signature


_VERDICTS: OrderedDict[tuple[Any, ...], Judged] = OrderedDict()


def _key(
    fs: Any, path: str, options: VerifyOptions, listing: dict[str, Stat], meta: dict[str, Stat]
) -> tuple[Any, ...]:
    key = options.public_key
    key_id = None if key is None else key.public_bytes(*_der())
    checks = (options.quick, options.attested, options.strict, key_id, options.expected_name)
    return (id(fs), path, checks, tuple((n, s.size, s.version) for n, s in (*listing.items(), *meta.items())))


def _der() -> tuple[Any, Any]:
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo


def remember(fs: Any, root: str, report: Report) -> None:
    """Record that the checkpoint at ``root`` was just hashed whole (by the writer that sealed it): ok."""
    meta: dict[str, Stat] = {}
    listing = storage.list_files(fs, root, meta)
    _store(
        _key(fs, root, VerifyOptions(), listing, meta),
        Judged(
            "ok",
            report,
            "",
            True,
            len(listing),
            sum(s.size for s in listing.values()),
            _time(listing, meta),
            _held(listing, meta),
        ),
    )


def _store(key: tuple[Any, ...], judged: Judged) -> None:
    _VERDICTS[key] = judged
    while len(_VERDICTS) > 4096:
        _VERDICTS.popitem(last=False)


def _held(listing: dict[str, Stat], meta: dict[str, Stat]) -> int:
    return sum(s.size for s in (*listing.values(), *meta.values()))


def _time(listing: dict[str, Stat], meta: dict[str, Stat]) -> float | None:
    if MANIFEST_FILENAME in meta:
        return meta[MANIFEST_FILENAME].mtime
    times = [s.mtime for s in listing.values() if s.mtime is not None]
    return max(times) if times else None


def survey(fs: Any, path: str, options: VerifyOptions) -> tuple[Judged, dict[str, Stat], dict[str, Stat]]:
    """What a listing alone says of the checkpoint at ``path`` (its size, its clock, whether it is
    sealed or being deleted), before any verdict; with the listing (files, then manifest and signature)."""
    meta: dict[str, Stat] = {}
    try:
        listing = storage.list_files(fs, path, meta)
    except (FileNotFoundError, NotADirectoryError) as exc:
        return Judged("changing", reason=f"gone while it was read ({exc})"), {}, {}
    sealed = MANIFEST_FILENAME in meta or (options.public_key is not None and storage.SIGNATURE_FILENAME in meta)
    base = Judged(
        "",
        None,
        "",
        sealed,
        len(listing),
        sum(s.size for s in listing.values()),
        _time(listing, meta),
        _held(listing, meta),
    )
    if MARKER in listing:
        base = replace(base, verdict="deleting", reason="a prune was deleting it")
    return base, listing, meta


def verdict(base: Judged, check: Any, quick: bool) -> Judged:
    """``base`` with the verdict of ``check()`` (a report, or the exception it raised); a storage
    failure is raised, never a verdict."""
    try:
        report = check()
        if report.ok:
            return replace(base, verdict="sizes ok" if quick else "ok", report=report)
        return replace(
            base, verdict="damaged", report=report, reason=shortened([str(p) for p in report.problems], 10, sep="; ")
        )
    except ManifestNotFoundError as exc:
        return replace(base, verdict="unsealed", reason=str(exc))
    except SignatureError as exc:
        return replace(base, verdict="damaged" if base.sealed else "unsealed", report=exc.report, reason=str(exc))
    except IntegrityError as exc:
        return replace(base, verdict="damaged", report=exc.report, reason=str(exc))
    except (ManifestError, NotImplementedError) as exc:  # unreadable, or of an algorithm this installation lacks
        return replace(base, verdict="invalid", reason=str(exc))
    except FileChangedError as exc:
        return replace(base, verdict="changing", reason=f"changed while it was read ({exc})")


def judge(fs: Any, path: str, options: VerifyOptions) -> Judged:
    """The verdict on the checkpoint at ``path`` (reused when its files are unchanged)."""
    base, listing, meta = survey(fs, path, options)
    if base.verdict:
        return base
    key = _key(fs, path, options, listing, meta)
    if key in _VERDICTS:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]

    def check() -> Report:
        plan = prepare(fs, path, options, listing)
        if options.attested:
            attest(fs, path, plan)
        digests = hash_units(
            fs,
            path,
            plan.manifest.algorithm,
            plan.units,
            listing,
            max_workers=options.max_workers,
            callback=options.callback,
        )
        return finish(plan, digests)

    judged = verdict(base, check, options.quick)
    if judged.verdict != "changing":
        _store(key, judged)
    return judged


def _for(options: VerifyOptions, name: str) -> VerifyOptions:
    """The options for the checkpoint ``name``: with a key, its signature must name it (replay)."""
    return options.but(expected_name=name) if options.public_key is not None else options


# ----------------------------------------------------------------------------- the verbs


def latest(
    fs: Any,
    root: str,
    pattern: str | None,
    options: VerifyOptions,
    judge_fn: Any = judge,
    candidates: Candidates | None = None,
) -> tuple[str, Report] | None:
    order, _, _ = candidates or candidates_of(fs, root, pattern)
    if not order:
        log.warning("no checkpoints under %s", printable(storage.describe(fs, root)))
    for name in order:
        path = storage.join(root, name)
        judged = judge_fn(fs, path, _for(options, name))
        if judged.verdict in GOOD:
            assert judged.report is not None
            return _url(fs, path), judged.report
        log.warning(
            "skipping %s (%s): %s", printable(storage.describe(fs, path)), judged.verdict, printable(judged.reason)
        )
    return None


def latest_verified(
    root: URL,
    *,
    pattern: str | None = None,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Unpack[VerifyKeywords],
) -> tuple[str, Report] | None:
    """The newest checkpoint under ``root`` that verifies (hashed; ``quick=True``: names and sizes),
    with its report; ``None`` when none does. Unsealed, invalid, damaged and changing ones are
    skipped with a WARNING; a storage error is raised (an outage must not roll a run back).
    Always a local call: ``integrity_fs.distributed.latest_verified`` is the collective."""
    checked = VerifyOptions.of(**options)
    fs_, root_ = storage.resolve(root, storage_options, fs)
    return latest(fs_, root_, pattern, checked)


def status(
    fs: Any,
    root: str,
    pattern: str | None,
    options: VerifyOptions,
    judge_fn: Any = judge,
    candidates: Candidates | None = None,
    leftovers: dict[str, bool] | None = None,
) -> list[dict[str, Any]]:
    """One row per checkpoint (newest first), then the other folders and staging leftovers."""
    candidates = candidates or candidates_of(fs, root, pattern)
    _there(fs, root, candidates)
    order, _, others = candidates
    rows = []
    for name in order:
        path = storage.join(root, name)
        j = judge_fn(fs, path, _for(options, name))
        problems = (
            [str(p) for p in j.report.problems]
            if j.report is not None
            else ([j.reason] if j.verdict != "unsealed" and j.reason else [])
        )
        rows.append(
            {
                "name": name,
                "url": _url(fs, path),
                "sealed": j.sealed,
                "files": j.files,
                "bytes": j.bytes,
                "verdict": j.verdict,
                "problems": problems,
            }
        )
    for name in others:
        rows.append(
            {
                "name": name,
                "url": _url(fs, storage.join(root, name)),
                "sealed": None,
                "files": None,
                "bytes": None,
                "verdict": "other",
                "problems": [],
            }
        )
    for name, dead in (staging.leftovers(fs, root) if leftovers is None else leftovers).items():
        rows.append(
            {
                "name": name,
                "url": _url(fs, storage.join(root, name)),
                "sealed": None,
                "files": None,
                "bytes": None,
                "verdict": "leftover" if dead else "staging",
                "problems": [],
            }
        )
    return rows


def delete_checkpoint(fs: Any, path: str) -> None:
    """Marker first, then signature and manifest, then the files, then the folder. Locally every
    step goes through the folder opened without following links: a folder replaced by a link
    since it was judged loses the link, never a byte of what it points at."""
    if storage.is_local(fs):
        _delete_local(fs, path)
        return
    if not storage.exists(fs, storage.join(path, MARKER)):
        storage.write_atomic(fs, storage.join(path, MARKER), b"")
    meta: dict[str, Stat] = {}
    files = storage.list_files(fs, path, meta)
    storage.remove(fs, [storage.join(path, n) for n in meta])  # the signature and the manifest there
    storage.remove(fs, [storage.join(path, n) for n in files if n != MARKER])
    _gone(fs, path, but=MARKER)  # the marker stays until the rest is gone
    staging.remove_tree(fs, path)  # the marker, and folder markers (zero-byte "name/" objects)
    _gone(fs, path)


def _gone(fs: Any, path: str, but: str | None = None) -> None:
    """``OSError`` naming what the store kept under ``path`` (besides ``but``): a store may refuse
    deletions without an error (S3's DeleteObjects answers them one by one)."""
    meta: dict[str, Stat] = {}
    try:
        left = [n for n in [*storage.list_files(fs, path, meta), *meta] if n != but]
    except FileNotFoundError:
        return
    if left:
        raise OSError(
            f"could not delete {printable(storage.describe(fs, path))}: the store kept {shortened(sorted(left), 5)}"
        )


def _delete_local(fs: Any, path: str) -> None:
    try:
        tree = storage.LocalTree(path)
    except ValueError:  # a link (or a file) now: the link goes, its target is not touched
        if os.path.islink(path):
            os.unlink(path)
            return
        raise
    try:
        try:
            os.stat(MARKER, dir_fd=tree.fd, follow_symlinks=False)
        except FileNotFoundError:
            fd = tree.create(MARKER)
            os.fsync(fd)
            os.close(fd)
            tree.sync()
        for name in (storage.SIGNATURE_FILENAME, MANIFEST_FILENAME, *storage.list_files(fs, path)):
            if name != MARKER:
                tree.unlink(name)
        for folder in sorted(tree_folders(path), key=lambda f: -f.count("/")):
            with contextlib.suppress(OSError):  # not empty: what is left goes below
                tree.rmdir(folder)
        for entry in os.listdir(tree.fd):  # what a listing does not call content: links, FIFOs, temporary files
            if entry != MARKER:
                try:
                    os.unlink(entry, dir_fd=tree.fd)
                except IsADirectoryError:
                    shutil.rmtree(entry, dir_fd=tree.fd)
        tree.unlink(MARKER)
    finally:
        tree.close()
    os.rmdir(path)


def tree_folders(path: str) -> list[str]:
    """The folders beneath ``path`` (links not followed, not listed)."""
    out = []
    for folder, dirs, _ in os.walk(path):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        out += [os.path.relpath(os.path.join(folder, d), path) for d in dirs]
    return out


def prune_root(  # noqa: PLR0913  # prune's arguments, and the collective's hooks
    fs: Any,
    root: str,
    *,
    keep_last: int,
    pattern: str | None,
    unsealed: bool,
    dry_run: bool,
    options: VerifyOptions,
    keep: Iterable[str] = (),
    judge_fn: Any = judge,
    candidates: Candidates | None = None,
    delete: bool = True,
) -> PruneResult:
    """:func:`prune` at ``root`` of ``fs``; ``keep``: names kept whatever their state. The
    collective passes its own ``judge_fn`` and agreed ``candidates``, and deletes on one rank."""
    candidates = candidates or candidates_of(fs, root, pattern)
    _there(fs, root, candidates)
    order, steps, _ = candidates
    judged: dict[str, Judged] = {}
    kept: list[str] = []
    for name in order:
        good = len(kept) < keep_last
        j = judge_fn(
            fs, storage.join(root, name), _for(options if good else options.but(quick=True, attested=False), name)
        )
        judged[name] = j
        if good and j.verdict in GOOD:
            kept.append(name)
    # A folder a prune began to delete (marked) is finished whatever else is decided.
    marked = {n for n in order if judged[n].verdict == "deleting" and n not in keep}
    older: set[str] = set()
    if len(kept) < keep_last:
        done = "only what an interrupted prune began is deleted" if marked else "nothing deleted"
        log.warning(
            "%d of the checkpoints under %s verify, fewer than keep_last=%d: %s",
            len(kept),
            printable(storage.describe(fs, root)),
            keep_last,
            done,
        )
    else:
        oldest = steps[kept[-1]]
        times = [judged[n].time for n in kept]
        first_kept = None if None in times else min(t for t in times if t is not None)
        for name in order:
            j = judged[name]
            certain = steps[name] < oldest and j.time is not None and first_kept is not None and j.time <= first_kept
            if name in kept or name in keep:
                continue
            if certain and (j.verdict in (*GOOD, "damaged") or (unsealed and j.verdict == "unsealed")):
                older.add(name)  # never an invalid one (a newer installation may read it), nor one changing
    doomed = [n for n in order if n in marked or n in older]
    freed = sum(judged[n].held for n in doomed)
    if delete and not dry_run:
        for name in doomed:
            delete_checkpoint(fs, storage.join(root, name))
            log.info("deleted %s", printable(storage.describe(fs, storage.join(root, name))))
        staging.clear(fs, root)
    urls = {n: _url(fs, storage.join(root, n)) for n in order}
    return PruneResult(
        kept=tuple(urls[n] for n in kept),
        deleted=tuple(urls[n] for n in doomed),
        left=tuple(urls[n] for n in order if n not in kept and n not in doomed),
        verdicts={urls[n]: judged[n].verdict for n in order},
        bytes_freed=freed,
        dry_run=dry_run,
    )


def prune(
    root: URL,
    *,
    keep_last: int,
    pattern: str | None = None,
    unsealed: bool = False,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    **options: Unpack[VerifyKeywords],
) -> PruneResult:
    """Keep the ``keep_last`` newest checkpoints under ``root`` that verify, and delete the ones
    older than all of them (see the module docstring); unsealed ones only with ``unsealed=True``.
    Fewer than ``keep_last`` verify, or storage fails: nothing is deleted. ``dry_run``: the plan.
    The options (``quick``, ``attested``, ``public_key``, ``max_workers``) are as for ``verify``."""
    count("keep_last", keep_last, optional=False)
    flag("unsealed", unsealed)
    flag("dry_run", dry_run)
    checked = VerifyOptions.of(**options)
    fs_, root_ = storage.resolve(root, storage_options, fs)
    return prune_root(
        fs_, root_, keep_last=keep_last, pattern=pattern, unsealed=unsealed, dry_run=dry_run, options=checked
    )
