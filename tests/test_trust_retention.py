"""Issue 36, retention and "newest" (findings 1-5, 7-9 and 28): each test states a rule of SPEC's
"Newest good checkpoint" and "Retention" sections (finding 6, save_on_each_node, is tested with
the transformers integration), through the public API (``integrity_fs``,
``integrity_fs.dcp``, the transformers callback, the CLI's ``main``) on the backend where the
behaviour lives. Faults come by real means: a symbolic link, manifest times set with ``os.utime``,
a process killed mid-prune (by an audit
hook at its first delete of a file's content, or an S3 filesystem subclass at its first
DeleteObjects of content), and the process's own read counter (``/proc/self/io``).
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import fork_server
import pytest
from cli_run import cli, make_keys
from conftest import Backend

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME

SIGNATURE = "model.sig"  # SIGNATURE_FILENAME is not public any more
MARKER = "_integrity_deleting"  # what a prune writes into a folder before its first delete


def _checkpoint(root: Path, name: str, *, size: int = 1000, seal: bool = True, **seal_options: Any) -> Path:
    folder = root / name
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(os.urandom(size))
    (folder / "sub" / "optim.bin").write_bytes(os.urandom(size // 4 + 1))
    if seal:
        ifs.seal(folder, **seal_options)
    return folder


def _paths(root: Path, *names: str) -> tuple[str, ...]:
    return tuple(str(root / name) for name in names)


def _flip(path: Path, offset: int = 10) -> None:
    """One bit flipped, the size unchanged: only hashing sees it."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _set_times(folder: Path, when: float) -> None:
    """Every file of ``folder`` (its manifest included) last written at ``when``."""
    for path in folder.rglob("*"):
        if path.is_file():
            os.utime(path, (when, when))


def _status(*args: str) -> dict[str, dict[str, Any]]:
    """``integrity-fs status ARGS --json``: each checkpoint's object by name."""
    result = cli("status", *args, "--json")
    assert result.returncode == 0, result.stderr
    return {entry["name"]: entry for entry in json.loads(result.stdout)}


def _rchar() -> int:
    """Bytes this process has read so far through read(2) and its kin, every thread included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _tensor_state(value: float, numel: int = 64) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    return {"w": torch.full((numel,), float(value)), "step": torch.tensor([int(value)])}


# --- 1: a save with keep_last prunes only its own series ----------------------------------------------


def test_a_save_with_keep_last_refuses_a_name_whose_step_is_not_certain_and_prunes_nothing(tmp_path: Path) -> None:
    """Two runs in one folder (learning rates 1e-4 and 3e-4), each saved with keep_last=2: the
    step of ``lr1e-4_step_100`` is one of three integers (1, 4, 100), so every such save is refused
    at the call (ValueError naming the name and ``pattern=``, nothing written); saved without
    keep_last, nothing of either run is ever deleted."""
    pytest.importorskip("torch")
    from integrity_fs import dcp

    runs = tmp_path / "runs"
    a = [f"lr1e-4_step_{step}" for step in (100, 200)]
    b = [f"lr3e-4_step_{step}" for step in (100, 200, 300, 400)]
    for name in a + b:
        with pytest.raises(ValueError, match="pattern=") as err:
            dcp.save(_tensor_state(1), runs / name, keep_last=2)
        assert name in str(err.value), err.value
        assert not (runs / name).exists()  # refused before anything was written
        dcp.save(_tensor_state(int(name.rsplit("_", 1)[1])), runs / name)
    assert sorted(p.name for p in runs.iterdir()) == sorted(a + b)


def test_a_save_with_keep_last_and_a_pattern_prunes_only_its_own_series(tmp_path: Path) -> None:
    """The same two runs, each save naming its series (``pattern='lr3e-4_step_{step}'``): run B is
    pruned to its two newest, run A (whose names the pattern does not match) is untouched."""
    pytest.importorskip("torch")
    from integrity_fs import dcp

    runs = tmp_path / "runs"
    a = [f"lr1e-4_step_{step}" for step in (100, 200)]
    b = [f"lr3e-4_step_{step}" for step in (100, 200, 300, 400)]
    for names, pattern in ((a, "lr1e-4_step_{step}"), (b, "lr3e-4_step_{step}")):
        for name in names:
            dcp.save(_tensor_state(int(name.rsplit("_", 1)[1])), runs / name, keep_last=2, pattern=pattern)
    assert sorted(p.name for p in runs.iterdir()) == sorted([*a, "lr3e-4_step_300", "lr3e-4_step_400"])
    for name in [*a, "lr3e-4_step_300", "lr3e-4_step_400"]:
        assert ifs.verify(runs / name).ok, name


# --- 2: a link is never a candidate -------------------------------------------------------------------


@pytest.mark.parametrize("link", ["newest", "oldest"])
def test_a_link_is_never_a_candidate_and_what_it_points_at_survives(tmp_path: Path, link: str) -> None:
    """``step_3 -> step_2`` (the newest name is a link to a real checkpoint), or ``step_0 -> a
    checkpoint outside the run``: the link is neither kept nor deleted nor judged, the candidates
    are the real folders, and afterwards the checkpoint kept still verifies."""
    root = tmp_path / "run"
    for n in (1, 2):
        _checkpoint(root, f"step_{n}")
    if link == "newest":
        name, target = "step_3", Path("step_2")  # relative, as `ln -s step_2 step_3` makes it
    else:
        name, target = "step_0", _checkpoint(tmp_path / "elsewhere", "ckpt")
    (root / name).symlink_to(target, target_is_directory=True)

    assert ifs.find_checkpoints(root) == list(_paths(root, "step_2", "step_1"))
    result = ifs.prune(root, keep_last=1)

    assert result.kept == _paths(root, "step_2")
    assert result.deleted == _paths(root, "step_1")
    assert str(root / name) not in (*result.kept, *result.deleted, *result.left, *result.verdicts)
    assert (root / name).is_symlink()  # the link itself is not touched
    assert ifs.verify(root / "step_2").ok  # the kept checkpoint: still whole
    assert ifs.verify((root / name).resolve()).ok  # and what the link points at
    found = ifs.latest_verified(root)
    assert found is not None and found[0] == str(root / "step_2")


# --- 3: the step is stated or certain; ambiguity names pattern= ---------------------------------------


AMBIGUOUS = {
    "loss": (("step_1000_loss_0.80", "step_3000_loss_0.30"), "step_{step}_loss_*", "step_3000_loss_0.30"),
    "epoch": (("epoch_1_step_900", "epoch_2_step_450"), "epoch_*_step_{step}", "epoch_1_step_900"),
}


@pytest.mark.parametrize("kind", AMBIGUOUS)
def test_names_that_differ_in_two_integers_are_ambiguous_without_a_pattern(tmp_path: Path, kind: str) -> None:
    """``step_1000_loss_0.80`` beside ``step_3000_loss_0.30`` (the loss varies too), ``epoch_1_step_900``
    beside ``epoch_2_step_450``: no step can be inferred; every reader says so, naming ``pattern=``
    and the names, and never picks one."""
    names, _pattern, _newest = AMBIGUOUS[kind]
    root = tmp_path / "run"
    for name in names:
        _checkpoint(root, name)
    for call in (ifs.find_checkpoints, ifs.latest_verified, lambda r: ifs.prune(r, keep_last=1)):
        with pytest.raises(ValueError, match="pattern=") as err:
            call(root)
        assert all(name in str(err.value) for name in names), err.value
    assert sorted(p.name for p in root.iterdir()) == sorted(names)  # prune deleted nothing


@pytest.mark.parametrize("kind", AMBIGUOUS)
def test_a_pattern_names_the_step_and_orders_by_it(tmp_path: Path, kind: str) -> None:
    names, pattern, newest = AMBIGUOUS[kind]
    root = tmp_path / "run"
    for name in names:
        _checkpoint(root, name)
    (root / "logs_7").mkdir()  # does not match the pattern: not a checkpoint of the run
    (root / "logs_7" / "events").write_bytes(b"x")

    by_step = sorted(names, key=lambda n: n != newest)
    assert ifs.find_checkpoints(root, pattern=pattern) == list(_paths(root, *by_step))
    found = ifs.latest_verified(root, pattern=pattern)
    assert found is not None and found[0] == str(root / newest)
    latest = cli("latest", str(root), "--pattern", pattern)
    assert (latest.returncode, latest.stdout.strip()) == (0, str(root / newest)), latest.stderr


def test_the_placeholder_decides_which_integer_is_the_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for name in ("epoch_1_step_900", "epoch_2_step_450"):
        _checkpoint(root, name)
    assert ifs.find_checkpoints(root, pattern="epoch_{step}_step_*") == list(
        _paths(root, "epoch_2_step_450", "epoch_1_step_900")
    )


@pytest.mark.parametrize(
    "names",
    [("step_900", "step_1000"), ("ckpt-100-bf16", "ckpt-200-bf16")],
    ids=["step_N", "ckpt-N-bf16"],
)
def test_names_equal_but_for_one_integer_are_ordered_by_it_without_a_pattern(
    tmp_path: Path, names: tuple[str, str]
) -> None:
    """Holds today (the finding says so): 1000 after 900 (by value, not text), and the 16 of
    ``bf16`` that every name shares says nothing about age."""
    root = tmp_path / "run"
    for name in names:
        _checkpoint(root, name)
    newest_first = list(_paths(root, names[1], names[0]))
    assert ifs.find_checkpoints(root) == newest_first
    found = ifs.latest_verified(root)
    assert found is not None and found[0] == newest_first[0]


@pytest.mark.parametrize("kind", AMBIGUOUS)
def test_load_latest_loads_by_the_stated_step_and_refuses_to_guess(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("torch")
    from integrity_fs import dcp

    names, pattern, newest = AMBIGUOUS[kind]
    root = tmp_path / "run"
    for value, name in enumerate(names, 1):
        dcp.save(_tensor_state(value), root / name)
    state = _tensor_state(0)
    with pytest.raises(ValueError, match="pattern="):
        dcp.load_latest(state, root)
    assert float(state["w"][0]) == 0.0  # nothing loaded

    assert dcp.load_latest(state, root, pattern=pattern) == str(root / newest)
    assert float(state["w"][0]) == float(names.index(newest) + 1)


# --- 4: a checkpoint sealed after a kept one is never deleted -----------------------------------------


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "unsealed"])
def test_a_checkpoint_written_after_a_kept_one_is_never_deleted(tmp_path: Path, sealed: bool) -> None:
    """A run rolled back: step_100, step_200, step_300 written in that order, then the run resumed
    from step_100 and wrote step_150 (sealed, or still unsealed: its newest file stands in for a
    manifest). Older by step, newer by clock: not certainly older, never deleted. step_100 is
    older on both clocks (its time equal to the oldest kept one's: a coarse clock does not block)."""
    root = tmp_path / "run"
    t0 = 1_700_000_000.0
    for n, when in ((100, t0 + 100), (200, t0 + 100), (300, t0 + 200)):
        _set_times(_checkpoint(root, f"step_{n}"), when)
    _set_times(_checkpoint(root, "step_150", seal=sealed), t0 + 300)

    plan = ifs.prune(root, keep_last=2, unsealed=True, dry_run=True)
    result = ifs.prune(root, keep_last=2, unsealed=True)

    assert result.kept == _paths(root, "step_300", "step_200")
    assert result.deleted == _paths(root, "step_100")
    assert result.left == _paths(root, "step_150")
    assert (plan.kept, plan.deleted, plan.left) == (result.kept, result.deleted, result.left)
    assert sorted(p.name for p in root.iterdir()) == ["step_150", "step_200", "step_300"]
    if sealed:
        assert ifs.verify(root / "step_150").ok


def test_saves_after_a_rollback_keep_the_resumed_branch(tmp_path: Path) -> None:
    """The same rollback through ``dcp.save(keep_last=2)``: the resumed run saves step_150, then
    step_160; neither save deletes the other checkpoint of the branch the run is on."""
    pytest.importorskip("torch")
    from integrity_fs import dcp

    root = tmp_path / "run"
    t0 = 1_700_000_000.0
    for i, n in enumerate((100, 200, 300)):
        dcp.save(_tensor_state(n), root / f"step_{n}")
        _set_times(root / f"step_{n}", t0 + 100 * i)  # written long before the resumed run's saves
    dcp.save(_tensor_state(150), root / "step_150", keep_last=2)
    dcp.save(_tensor_state(160), root / "step_160", keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_150", "step_160", "step_200", "step_300"]
    for n in (150, 160):
        assert ifs.verify(root / f"step_{n}").ok


# --- 5: keep_last where the saved name has no step: refused at the call -------------------------------


@pytest.mark.parametrize(
    ("saved", "parent"),
    [("model", "step_3"), ("epoch_1_step_100", "")],
    ids=["no-integer", "two-integers"],
)
def test_a_save_with_keep_last_refuses_a_name_without_one_step_before_writing(
    tmp_path: Path, saved: str, parent: str
) -> None:
    """``run/step_3/model`` (the saved name, ``model``, has no integer; the step is in the folder
    above) and ``run/epoch_1_step_100`` (two integers could be the step): ValueError at the call,
    naming the saved name, before anything is written; the same save without keep_last works."""
    pytest.importorskip("torch")
    from integrity_fs import dcp

    run = tmp_path / "run"
    for n in (1, 2):  # earlier saves, without keep_last
        dcp.save(_tensor_state(n), run / f"step_{n}" / "model")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    url = run / parent / saved if parent else run / saved

    with pytest.raises(ValueError) as err:
        dcp.save(_tensor_state(3), url, keep_last=1)
    assert saved in str(err.value), err.value
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # nothing written, nothing deleted

    dcp.save(_tensor_state(3), url)
    assert ifs.verify(url).ok


def test_a_save_with_keep_last_and_one_integer_in_its_name_is_not_refused(tmp_path: Path) -> None:
    """The control: ``run/step_3`` has exactly one integer, its step."""
    pytest.importorskip("torch")
    from integrity_fs import dcp

    run = tmp_path / "run"
    for n in (1, 2, 3):
        dcp.save(_tensor_state(n), run / f"step_{n}", keep_last=1)
    assert sorted(p.name for p in run.iterdir()) == ["step_3"]


# --- 7: one verdict for a signature-only checkpoint ---------------------------------------------------


def test_a_signature_only_checkpoint_has_one_verdict_in_status_latest_and_prune(tmp_path: Path) -> None:
    """``model.sig`` and no manifest (what model_signing leaves; here integrity_fs's own signature
    with the manifest gone): with the public key, ``status --full``, ``latest_verified`` and
    ``prune`` give it the same verdict: ``ok`` when its files match the signed digests,
    ``damaged`` when not. (step_1, older than the one prune keeps, is only size-checked by prune:
    ``sizes ok``, status's word for that check, never ``ok``.)"""
    keys = make_keys(tmp_path)
    root = tmp_path / "run"
    _checkpoint(root, "step_1", private_key=keys.private)
    for n in (2, 3):
        folder = _checkpoint(root, f"step_{n}", private_key=keys.private)
        (folder / MANIFEST_FILENAME).unlink()
        assert sorted(p.name for p in folder.iterdir()) == [SIGNATURE, "sub", "weights.bin"]
    _flip(root / "step_3" / "weights.bin")
    expected = dict(zip(_paths(root, "step_3", "step_2", "step_1"), ["damaged", "ok", "ok"], strict=True))

    status = _status(str(root), "--full", "--public-key", str(keys.public))
    assert {entry["url"]: entry["verdict"] for entry in status.values()} == expected
    found = ifs.latest_verified(root, public_key=keys.public)
    assert found is not None and found[0] == str(root / "step_2")
    result = ifs.prune(root, keep_last=1, public_key=keys.public, dry_run=True)
    assert result.verdicts == {**expected, str(root / "step_1"): "sizes ok"}
    assert result.kept == _paths(root, "step_2") and result.deleted == _paths(root, "step_1")


def test_without_a_key_a_signature_only_checkpoint_still_has_one_verdict(tmp_path: Path) -> None:
    """Whatever the verdict without a key is, ``status --full``, ``prune`` and ``latest_verified``
    agree on it (holds today: all three call it ``unsealed``)."""
    keys = make_keys(tmp_path)
    root = tmp_path / "run"
    _checkpoint(root, "step_1")
    (_checkpoint(root, "step_2", private_key=keys.private) / MANIFEST_FILENAME).unlink()
    verdict = _status(str(root), "--full")["step_2"]["verdict"]
    assert ifs.prune(root, keep_last=1, dry_run=True).verdicts[str(root / "step_2")] == verdict
    found = ifs.latest_verified(root)
    assert found is not None and (found[0] == str(root / "step_2")) == (verdict == "ok")


# --- 8: prune's words and counts are status's ---------------------------------------------------------


def test_a_quick_prune_says_sizes_ok_in_its_table_and_json(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for n in (1, 2, 3, 4):
        _checkpoint(root, f"step_{n}")
    dry = ["--keep-last", "2", "--quick", "--dry-run"]
    as_json = cli("prune", str(root), *dry, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert set(json.loads(as_json.stdout)["verdicts"].values()) == {"sizes ok"}
    table = cli("prune", str(root), *dry)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines() if line.startswith("step_")}
    assert sorted(rows) == ["step_1", "step_2", "step_3", "step_4"], table.stdout
    for n, action in ((4, "kept"), (3, "kept"), (2, "delete"), (1, "delete")):
        assert "sizes ok" in rows[f"step_{n}"] and action in rows[f"step_{n}"], table.stdout
    assert {e["verdict"] for e in _status(str(root)).values()} == {"sizes ok"}  # status's word for the same check


def test_a_prune_never_says_ok_of_a_checkpoint_it_did_not_hash(tmp_path: Path) -> None:
    """A hashed prune judges the keep_last newest by their content; an older one it only
    size-checks is ``sizes ok``, never ``ok``: step_1 has a flipped bit only hashing sees."""
    root = tmp_path / "run"
    for n in (1, 2, 3, 4):
        _checkpoint(root, f"step_{n}")
    _flip(root / "step_1" / "weights.bin")
    result = cli("prune", str(root), "--keep-last", "2", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    verdicts = json.loads(result.stdout)["verdicts"]
    assert verdicts[str(root / "step_4")] == verdicts[str(root / "step_3")] == "ok"
    assert verdicts[str(root / "step_1")] in ("sizes ok", "damaged")


@pytest.mark.parametrize("quick", [False, True], ids=["hashed", "quick"])
def test_prunes_summary_counts_agree_with_its_warning_and_verdicts(tmp_path: Path, quick: bool) -> None:
    """Fewer verify than --keep-last 3 (step_3 truncated; ``base_model`` has no integer: not a
    checkpoint of the run): the WARNING, the summary line and the JSON verdicts count the same
    two, in status's words."""
    root = tmp_path / "run"
    for name in ("base_model", "step_1", "step_2", "step_3"):
        _checkpoint(root, name)
    (root / "step_3" / "weights.bin").write_bytes(b"short")
    args = ["prune", str(root), "--keep-last", "3", *(["--quick"] if quick else [])]
    word = "sizes ok" if quick else "ok"

    table = cli(*args)
    assert table.returncode == 0, table.stderr
    summary = table.stdout.strip().splitlines()[-1]
    said = re.search(r"\b(\d+) (?:checkpoints? )?verif", summary)
    assert said is not None, f"the summary does not say how many verify: {summary!r}"
    # The WARNING's wording is not SPEC's: where one states a count of checkpoints that verify,
    # it is the summary's.
    warned = re.findall(r"WARNING: .*?\b(\d+) (?:of the )?checkpoints?\b.*?\bverif", table.stderr)
    assert set(warned) <= {said.group(1)}, table.stderr
    verdicts = json.loads(cli(*args, "--json").stdout)["verdicts"]
    assert sum(v == word for v in verdicts.values()) == int(said.group(1)) == 2
    assert set(verdicts.values()) <= {word, "damaged"}
    assert sorted(p.name for p in root.iterdir()) == ["base_model", "step_1", "step_2", "step_3"]


# --- 9: a verdict reached on unchanged files is reused ------------------------------------------------


@pytest.mark.parametrize("how", [{}, {"attested": True}], ids=["hashed", "attested"])
def test_a_second_prune_reads_no_content_of_unchanged_checkpoints(tmp_path: Path, how: dict[str, Any]) -> None:
    """The second prune in one process, nothing changed since the first: its verdicts come from
    the first (bytes read: far below one checkpoint's). After a change (a bit flipped in the
    newest, the size the same), the checkpoint is judged again and found damaged."""
    size = 4 << 20
    root = tmp_path / "run"
    for n in (1, 2, 3, 4):
        _checkpoint(root, f"step_{n}", size=size)
    first = ifs.prune(root, keep_last=2, **how)
    assert first.kept == _paths(root, "step_4", "step_3")

    before = _rchar()
    again = ifs.prune(root, keep_last=2, **how)
    read = _rchar() - before
    assert again.kept == first.kept and again.deleted == ()
    assert read < size // 16, f"the second prune read {read} bytes of unchanged checkpoints ({size} each)"

    _flip(root / "step_4" / "weights.bin", 1 << 20)
    os.utime(root / "step_4" / "weights.bin", ns=(1, 1))  # whatever the clock: a new listing identity
    third = ifs.prune(root, keep_last=2, dry_run=True, **how)
    assert third.verdicts[str(root / "step_4")] == "damaged"


def test_saves_with_keep_last_read_at_most_one_checkpoint_each(tmp_path: Path) -> None:
    """``dcp.save(keep_last=3)`` in a training loop: in steady state each save reads at most about
    one checkpoint's bytes (the new one, confirmed) beyond what it writes, not all three kept."""
    pytest.importorskip("torch")
    from integrity_fs import dcp

    numel = 1 << 20  # 4 MiB of float32
    root = tmp_path / "run"
    reads = []
    for step in range(1, 8):
        before = _rchar()
        dcp.save(_tensor_state(step, numel), root / f"step_{step}", keep_last=3)
        reads.append(_rchar() - before)
    size = sum(p.stat().st_size for p in (root / "step_7").rglob("*") if p.is_file())
    assert sorted(p.name for p in root.iterdir()) == ["step_5", "step_6", "step_7"]
    steady = reads[4:]  # saves 5 to 7: three kept, one deleted each time
    assert max(steady) <= 1.5 * size, f"bytes read per save: {steady}, one checkpoint is {size}"


# --- 28: an interrupted prune is marked, shown, and finished ------------------------------------------


_KILL_AT_FIRST_CONTENT_DELETE_LOCAL = """
import os, signal, sys

def kill_at_content_delete(event, args):
    # os.remove/os.unlink (with or without dir_fd) raise "os.remove"; kill before any file of
    # content goes: what the prune has done by then stays on disk
    if event == "os.remove" and os.path.basename(os.fsdecode(args[0])) in ("weights.bin", "optim.bin"):
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(kill_at_content_delete)
import integrity_fs as ifs
ifs.prune(sys.argv[1], keep_last=1)
print("prune finished: the kill never landed")
"""

_KILL_AT_FIRST_CONTENT_DELETE_S3 = """
import json, os, signal, sys
import s3fs
import integrity_fs as ifs

class KillAtContentDelete(s3fs.S3FileSystem):
    async def _call_s3(self, method, *args, **kwargs):
        keys = []
        if method == "delete_objects":
            keys = [o["Key"] for o in kwargs.get("Delete", {}).get("Objects", [])]
        elif method == "delete_object":
            keys = [kwargs.get("Key", "")]
        if any(k.rsplit("/", 1)[-1] in ("weights.bin", "optim.bin") for k in keys):
            os.kill(os.getpid(), signal.SIGKILL)
        return await super()._call_s3(method, *args, **kwargs)

fs = KillAtContentDelete(skip_instance_cache=True, **json.loads(sys.argv[2]))
ifs.prune(sys.argv[1], keep_last=1, fs=fs)
print("prune finished: the kill never landed")
"""


def _killed_prune(tmp_path: Path, script: str, *args: str) -> None:
    path = tmp_path / "killed_prune.py"
    path.write_text(textwrap.dedent(script))
    proc = fork_server.run([path, *args], cwd=os.getcwd(), timeout=120)
    assert proc.returncode == -9, f"{proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_a_prune_killed_mid_delete_leaves_a_marked_folder_that_the_next_prune_finishes(tmp_path: Path) -> None:
    """Local disk: the prune is killed at its first delete of a file's content. Each folder it had
    begun holds the marker and neither manifest nor signature (never a sealed folder with files
    missing); ``status`` shows it as ``deleting``; the next prune, whatever its keep_last and
    without ``unsealed``, deletes it."""
    keys = make_keys(tmp_path)
    root = tmp_path / "run"
    for n in (1, 2, 3):
        _checkpoint(root, f"step_{n}", private_key=keys.private)

    _killed_prune(tmp_path, _KILL_AT_FIRST_CONTENT_DELETE_LOCAL, str(root))

    marked = [name for name in ("step_1", "step_2") if (root / name / MARKER).exists()]
    assert marked, f"no {MARKER} in the folders being deleted: {sorted(map(str, root.rglob('*')))}"
    for name in ("step_1", "step_2", "step_3"):
        folder = root / name
        if name in marked:
            assert not (folder / MANIFEST_FILENAME).exists() and not (folder / SIGNATURE).exists()
            assert (folder / "weights.bin").exists()  # killed before its content went
        else:
            assert ifs.verify(folder, public_key=keys.public).ok  # untouched, still whole
    status = _status(str(root))
    assert {name: status[name]["verdict"] for name in marked} == dict.fromkeys(marked, "deleting")
    found = ifs.latest_verified(root)
    assert found is not None and found[0] == str(root / "step_3")

    ifs.prune(root, keep_last=5)  # more than there are, unsealed=False: finishes what was begun all the same
    assert not any((root / name).exists() for name in marked)
    assert ifs.verify(root / "step_3", public_key=keys.public).ok


def test_a_prune_killed_mid_delete_on_s3_leaves_a_marked_folder_that_the_next_prune_finishes(
    tmp_path: Path, s3_backend: Backend
) -> None:
    """The same on S3 (moto): the prune's filesystem kills its process when it is about to send
    the first DeleteObjects (or DeleteObject) of a content file."""
    store = s3_backend
    for n in (1, 2, 3):
        store.write(f"step_{n}/weights.bin", os.urandom(1000))
        store.write(f"step_{n}/sub/optim.bin", os.urandom(300))
        ifs.seal(f"{store.url}/step_{n}", storage_options=store.storage_options)

    _killed_prune(tmp_path, _KILL_AT_FIRST_CONTENT_DELETE_S3, store.root, json.dumps(store.storage_options))

    files = store.listdir()
    marked = [name for name in ("step_1", "step_2") if f"{name}/{MARKER}" in files]
    assert marked, f"no {MARKER} in the folders being deleted: {files}"
    for name in ("step_1", "step_2", "step_3"):
        if name in marked:
            assert f"{name}/{MANIFEST_FILENAME}" not in files and f"{name}/weights.bin" in files
        else:
            assert ifs.verify(f"{store.url}/{name}", storage_options=store.storage_options).ok
    endpoint = store.storage_options["client_kwargs"]["endpoint_url"]
    status = _status(store.url, "-o", f"client_kwargs.endpoint_url={endpoint}")
    assert {name: status[name]["verdict"] for name in marked} == dict.fromkeys(marked, "deleting")

    ifs.prune(store.url, keep_last=5, storage_options=store.storage_options)
    files = store.listdir()
    assert not any(f.startswith(f"{name}/") for name in marked for f in files), files
    assert ifs.verify(f"{store.url}/step_3", storage_options=store.storage_options).ok
