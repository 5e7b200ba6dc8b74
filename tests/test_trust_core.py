"""Issue 36's findings on the core, each through the public API on the store where it lives:

- 16: ``integrity_fs.open`` hashes an empty unit like any other: a file truncated to nothing is
  refused when the manifest has no sizes (seed manifests, ``SHA256SUMS``, b3sum, Megatron,
  model_signing ``files`` signatures with ``public_key``).
- 19: a file deleted, or replaced by a folder, after the listing is a ``FileChangedError`` (CLI
  exit 4), never ``missing`` damage: ``verify`` and ``open`` on local disks, moto S3, the GCS emulator.
- 22: a flag is a ``bool``, a count an ``int``, or ``TypeError``, everywhere; a refused call reads,
  writes and deletes nothing (a flipped file never passes as "quick").
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import AfterListing, Backend, backends

import integrity_fs as ifs
from integrity_fs import FileChangedError, IntegrityError, SignatureError

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _hexdigest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# --- 16: an empty unit is hashed like any other ------------------------------------------------------

FILES = {"weights.bin": os.urandom(3000), "config.json": b'{"layers": 2}'}


def _seed_manifest(root: Path) -> dict[str, Any]:
    """What the seed writes: the four keys, no sizes."""
    files = {name: _hexdigest(data) for name, data in sorted(FILES.items())}
    manifest = {"algorithm": "sha256", "files": files, "granularity": "file", "version": 1}
    (root / ifs.MANIFEST_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {}


def _sha256sums(root: Path) -> dict[str, Any]:
    lines = "".join(f"{_hexdigest(data)}  {name}\n" for name, data in sorted(FILES.items()))
    (root / "SHA256SUMS").write_text(lines)
    return {"manifest": "SHA256SUMS"}


def _b3sums(root: Path) -> dict[str, Any]:
    blake3 = pytest.importorskip("blake3")
    lines = "".join(f"{blake3.blake3(data).hexdigest()}  {name}\n" for name, data in sorted(FILES.items()))
    (root / "B3SUMS").write_text(lines)
    return {"manifest": "B3SUMS"}


def _megatron(root: Path) -> dict[str, Any]:
    files = {name: _hexdigest(data) for name, data in sorted(FILES.items())}
    (root / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}))
    return {"manifest": "integrity.json"}


def _model_signing_files(root: Path) -> dict[str, Any]:
    """A ``files`` signature made by the model_signing package itself, and no manifest: the signed
    digests are the manifest (they carry no sizes)."""
    model_signing = pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private = root.parent / "key.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=["model.sig", ifs.MANIFEST_FILENAME])
    config = model_signing.signing.Config().use_elliptic_key_signer(private_key=private)
    config.set_hashing_config(hashing).sign(root, root / "model.sig")
    return {"public_key": key.public_key()}


SIZELESS = {
    "seed": _seed_manifest,
    "sha256sum": _sha256sums,
    "b3sum": _b3sums,
    "megatron": _megatron,
    "model_signing": _model_signing_files,
}


@pytest.mark.parametrize("kind", list(SIZELESS))
def test_open_hashes_a_file_truncated_to_nothing_when_the_manifest_has_no_sizes(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "model"
    root.mkdir()
    for name, data in FILES.items():
        (root / name).write_bytes(data)
    options = SIZELESS[kind](root)
    with ifs.open(root, "weights.bin", **options) as f:
        assert f.read() == FILES["weights.bin"]  # the manifest is one open reads
    (root / "weights.bin").write_bytes(b"")
    with pytest.raises(IntegrityError) as err, ifs.open(root, "weights.bin", **options) as f:
        got = f.read()
        pytest.fail(f"open returned {got!r} for a file sealed with {len(FILES['weights.bin'])} bytes")
    assert not isinstance(err.value, SignatureError)  # the signature is fine: the content is not
    assert [p.path for p in err.value.report.problems] == ["weights.bin"]


# --- 19: a file deleted, or replaced by a folder, after the listing is a change -------------------

store = backends("local", "s3", "gcs")


def _gone(backend: Backend, name: str, how: str) -> None:
    backend.remove(name)
    if how == "folder":
        backend.write(f"{name}/part", b"a folder now")


@pytest.mark.parametrize("how", ["deleted", "folder"])
def test_a_file_deleted_or_made_a_folder_while_verify_reads_it_is_a_file_changed_error(
    store: Backend, how: str
) -> None:
    for name, data in FILES.items():
        store.write(name, data)
    ifs.seal(store.url, storage_options=store.storage_options)
    callback = AfterListing(lambda: _gone(store, "weights.bin", how))
    with pytest.raises(FileChangedError, match="weights.bin") as err:
        ifs.verify(store.url, storage_options=store.storage_options, callback=callback)
    assert not isinstance(err.value, IntegrityError)


@pytest.mark.parametrize("how", ["deleted", "folder"])
def test_a_file_deleted_or_made_a_folder_after_open_is_a_file_changed_error(store: Backend, how: str) -> None:
    for name, data in FILES.items():
        store.write(name, data)
    ifs.seal(store.url, storage_options=store.storage_options)
    with ifs.open(store.url, "weights.bin", storage_options=store.storage_options) as f:
        _gone(store, "weights.bin", how)
        with pytest.raises(FileChangedError, match="weights.bin"):
            f.read()


def _opened_by_this_process(paths: list[Path]) -> Path | None:
    """The first of ``paths`` that this process holds open, if any."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        for path in paths:
            if target == str(path):
                return path
    return None


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="watches the process's open files (Linux)")
@pytest.mark.parametrize("how", ["deleted", "folder"])
def test_the_cli_exits_4_when_a_file_is_deleted_or_made_a_folder_after_the_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """One worker reads two large files one after the other: once the first is open (the listing
    is done), the other is deleted or replaced by a folder before it is read."""
    from integrity_fs.cli import main

    root = tmp_path / "step_1"
    root.mkdir()
    files = [root / "a.bin", root / "b.bin"]
    for path in files:
        with path.open("wb") as f:
            f.truncate(96 * 1024 * 1024)  # long enough to read that the change lands before the other is opened
    assert main(["seal", str(root)]) == 0
    capsys.readouterr()
    changed: list[Path] = []
    done = threading.Event()

    def change_the_other_once_one_is_open() -> None:
        while (first := _opened_by_this_process(files)) is None:
            if done.wait(0.0002):
                return  # verify ended before either file was seen open: nothing changed
        other = files[1] if first == files[0] else files[0]
        other.unlink()
        if how == "folder":
            other.mkdir()
        changed.append(other)

    thread = threading.Thread(target=change_the_other_once_one_is_open, daemon=True)
    thread.start()
    try:
        code = main(["verify", "--workers", "1", str(root)])
    finally:
        done.set()
        thread.join()
    err = capsys.readouterr().err
    assert changed
    assert code == 4, err
    assert changed[0].name in err and "changed" in err


# --- 22 helpers --------------------------------------------------------------------------------


def _flip(path: Path, offset: int = 3) -> None:
    """One bit of ``path`` flipped in place, its size unchanged: a quick check (names and sizes)
    cannot see it, a hash does."""
    with open(path, "r+b") as f:
        f.seek(offset, 2 if offset < 0 else 0)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 1]))


def _checkpoint(folder: Path, seed: int = 0, *, sealed: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(bytes((i * 7 + seed) % 256 for i in range(4096)))
    (folder / "opt.bin").write_bytes(bytes((i * 13 + seed) % 256 for i in range(2048)))
    if sealed:
        ifs.seal(folder)
    return folder


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (folders as None, files as their bytes): what a refused call must
    leave exactly as it was."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


# --- 22: a flag is a bool, a count an int -----------------------------------------------------------


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    """``damaged``: sealed, then one bit flipped (quick passes it, a hash does not); ``good``:
    sealed; ``run``: step_0 (sealed, verifies), step_1 (never sealed), step_2 (sealed, verifies),
    step_3 (sealed, then a bit flipped) — a prune with keep_last=1 may delete step_0 and, with
    unsealed=True, step_1; a quick latest_verified would return step_3."""
    damaged = _checkpoint(tmp_path / "damaged")
    _flip(damaged / "w.bin")
    good = _checkpoint(tmp_path / "good", 1)
    run = tmp_path / "run"
    _checkpoint(run / "step_0", 2)
    _checkpoint(run / "step_1", 3, sealed=False)
    _checkpoint(run / "step_2", 4)
    _checkpoint(run / "step_3", 5)
    _flip(run / "step_3" / "w.bin")
    return {"damaged": damaged, "good": good, "run": run, "dest": tmp_path / "dest", "tmp": tmp_path}


#: The library as a caller that ignores its type hints sees it (these calls pass wrong types on purpose).
loose: Any = ifs

#: call -> the error it must raise, on the paths of ``world``; ids say what is refused.
REFUSED: dict[str, tuple[Callable[[dict[str, Path]], Any], type[Exception]]] = {
    'verify(quick="false")': (lambda w: loose.verify(w["damaged"], quick="false"), TypeError),
    "verify(quick=1)": (lambda w: loose.verify(w["damaged"], quick=1), TypeError),
    'verify(strict="false")': (lambda w: loose.verify(w["good"], strict="false"), TypeError),
    'verify(attested="false")': (lambda w: loose.verify(w["damaged"], attested="false"), TypeError),
    "verify(max_workers=1.5)": (lambda w: loose.verify(w["good"], max_workers=1.5), TypeError),
    'VerifyOptions(quick="false")': (lambda w: loose.VerifyOptions(quick="false"), TypeError),
    'VerifyOptions(attested="yes")': (lambda w: loose.VerifyOptions(attested="yes"), TypeError),
    "seal(overwrite=1)": (lambda w: loose.seal(w["damaged"], overwrite=1), TypeError),
    'seal(overwrite="yes")': (lambda w: loose.seal(w["damaged"], overwrite="yes"), TypeError),
    "seal(max_workers=1.5)": (lambda w: loose.seal(w["damaged"], overwrite=True, max_workers=1.5), TypeError),
    "SealOptions(overwrite=1)": (lambda w: loose.SealOptions(overwrite=1), TypeError),
    'latest_verified(strict="no")': (lambda w: loose.latest_verified(w["run"], strict="no"), TypeError),
    'latest_verified(quick="false")': (lambda w: loose.latest_verified(w["run"], quick="false"), TypeError),
    'prune(unsealed="false")': (lambda w: loose.prune(w["run"], keep_last=1, unsealed="false"), TypeError),
    'prune(quick="false")': (lambda w: loose.prune(w["run"], keep_last=1, quick="false"), TypeError),
    "prune(dry_run=0)": (lambda w: loose.prune(w["run"], keep_last=1, dry_run=0), TypeError),
    'prune(keep_last="2")': (lambda w: loose.prune(w["run"], keep_last="2"), TypeError),
    "prune(keep_last=True)": (lambda w: loose.prune(w["run"], keep_last=True), TypeError),
    "prune(keep_last=1.0)": (lambda w: loose.prune(w["run"], keep_last=1.0), TypeError),
    "prune(max_workers=1.5)": (lambda w: loose.prune(w["run"], keep_last=1, max_workers=1.5), TypeError),
    "prune(keep_last=0)": (lambda w: loose.prune(w["run"], keep_last=0), ValueError),
    'download(strict="x")': (lambda w: loose.download(w["good"], w["dest"], strict="x"), TypeError),
    "download(max_workers=1.5)": (lambda w: loose.download(w["good"], w["dest"], max_workers=1.5), TypeError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_flag_must_be_a_bool_and_a_count_an_int_and_a_refused_call_changes_nothing(
    world: dict[str, Path], case: str
) -> None:
    """``quick="false"`` is truthy: coerced, it would turn a hash into a size check and pass the
    flipped file; ``unsealed="false"`` would delete the never-sealed step_1; ``overwrite=1`` would
    re-seal the damaged checkpoint as good. Each is a TypeError (``keep_last=0``: ValueError),
    raised before anything is read, written or deleted."""
    call, error = REFUSED[case]
    before = _tree(world["tmp"])
    try:
        accepted = call(world)
    except error:
        pass
    else:
        changed = sorted(set(before) ^ set(_tree(world["tmp"])))
        pytest.fail(f"{case} was accepted: returned {accepted!r:.300}; paths added or deleted: {changed}")
    assert _tree(world["tmp"]) == before  # nothing written (no manifest, no dest), nothing deleted
    with pytest.raises(ifs.IntegrityError):  # and the damage is still damage
        ifs.verify(world["damaged"])


@pytest.mark.skipif(not HAS_TORCH, reason="torch is an optional dependency")
def test_dcp_load_refuses_a_flag_that_is_not_a_bool_before_touching_the_state_dict(tmp_path: Path) -> None:
    import torch

    from integrity_fs import dcp as typed_dcp

    dcp: Any = typed_dcp  # wrong types on purpose
    url = str(tmp_path / "step_1")
    dcp.save({"w": torch.full((1024,), 1.0)}, url)
    before = _tree(tmp_path)
    state = {"w": torch.zeros(1024)}
    with pytest.raises(TypeError):
        dcp.load(state, url, strict="false")
    with pytest.raises(TypeError):
        dcp.load(state, url, verify="no")
    with pytest.raises(TypeError):
        dcp.load_latest(state, str(tmp_path), quick="false")
    assert torch.equal(state["w"], torch.zeros(1024))  # nothing loaded
    assert _tree(tmp_path) == before
    with pytest.raises(TypeError):
        dcp.save({"w": torch.zeros(4)}, str(tmp_path / "step_2"), keep_last="2")
    assert not (tmp_path / "step_2").exists()  # refused before anything was written
