"""integrity_fs.distributed: every rank of a real gloo process group reaches the same verdict.

One launch per world size runs every scenario of this file in one process group
(tests/dist_worker.py): 2 ranks, both modes, a manifest file and signatures; 3 ranks, both modes,
a subgroup, and ranks that disagree, are interrupted or see different storage. The outcomes of
every rank are compared with each other and with the local functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed")

from dist_launch import run_ranks

import integrity_fs as ifs
from integrity_fs import MANIFEST_FILENAME, IntegrityError, distributed

SIGNATURE = "model.sig"  # SIGNATURE_FILENAME is not public any more

MODES = ("sharded", "rank0")
CHUNK = 256 * 1024
BIG = 4 * 1024 * 1024 + 1000  # 17 chunks, the last one short
WORLDS = (2, 3)
Results = dict[str, list[dict[str, Any]]]


def _files(root: Path, seed: int = 1) -> None:
    sizes = {"a.bin": 300_000, "b.bin": 200_000, "sub/c.bin": 100_000, "d.bin": 50_000, "empty.bin": 0}
    for i, (name, size) in enumerate(sizes.items()):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes((seed * 31 + i * 7 + j) % 251 for j in range(size)))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def _local(fn: Any) -> dict[str, Any]:
    """The outcome of a local call, in the worker's format."""
    try:
        report = fn()
    except Exception as exc:
        report_dict = exc.report.to_dict() if isinstance(exc, IntegrityError) else None
        return {"type": type(exc).__name__, "message": str(exc), "report": report_dict}
    return {"type": "Report", "report": report.to_dict()}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints for every scenario; each seal scenario of each world size gets its own unsealed copy."""
    root = tmp_path_factory.mktemp("ckpts")
    for name in ("good", "corrupt", "nomanifest", "badmanifest", "quick"):
        _files(root / name)
    for name in ("good", "corrupt", "quick"):
        ifs.seal(root / name)
    _flip(root / "corrupt" / "a.bin", 10)
    _flip(root / "corrupt" / "b.bin", 20)
    (root / "quick" / "d.bin").write_bytes(b"short")
    (root / "badmanifest" / MANIFEST_FILENAME).write_text("{not json")
    big = root / "big"
    big.mkdir()
    (big / "big.bin").write_bytes(os.urandom(BIG))
    for name in ("big-verify", "big-corrupt"):
        shutil.copytree(big, root / name)
        ifs.seal(root / name, granularity="chunk", chunk_size=CHUNK)
    _flip(root / "big-corrupt" / "big.bin", 5 * CHUNK + 3)
    for world in WORLDS:
        for mode in MODES:
            for name in ("seal", "seal-fault", "seal-bogus"):
                shutil.copytree(root / "nomanifest", root / f"{name}-{mode}-{world}")
            shutil.copytree(big, root / f"big-seal-{mode}-{world}")
    return root


def _scenarios(root: Path, mode: str, world: int) -> list[dict[str, Any]]:
    def sc(name: str, op: str, ckpt: str, **extra: Any) -> dict[str, Any]:
        return {"id": f"{name}/{mode}", "op": op, "mode": mode, "url": str(root / ckpt), **extra}

    reader = 1 if mode == "sharded" else 0  # a rank that reads file content in this mode
    return [
        sc("verify-ok", "verify", "good"),
        sc("verify-corrupt", "verify", "corrupt"),
        sc("verify-no-manifest", "verify", "nomanifest"),
        sc("verify-bad-manifest", "verify", "badmanifest"),
        sc("verify-quick", "verify", "quick", kwargs={"quick": True}),
        sc("verify-strict", "verify", "good", kwargs={"strict": True}),
        sc("verify-permission", "verify", "good", faulty_rank=reader, fault="permission"),
        sc("verify-unexpected", "verify", "good", faulty_rank=reader, fault="unexpected"),
        sc("verify-unprintable", "verify", "good", faulty_rank=reader, fault="unprintable"),
        sc("verify-bad-option", "verify", "good", rank_kwargs={str(reader): {"max_workers": 0}}),
        sc("verify-rank1-faulty", "verify", "good", faulty_rank=1, fault="permission"),
        sc("verify-chunks", "verify", "big-verify"),
        sc("verify-chunks-corrupt", "verify", "big-corrupt"),
        sc("seal", "seal", f"seal-{mode}-{world}"),
        sc("seal-permission", "seal", f"seal-fault-{mode}-{world}", faulty_rank=reader, fault="permission"),
        sc("seal-bogus", "seal", f"seal-bogus-{mode}-{world}", kwargs={"granularity": "bogus"}),
        sc("seal-chunks", "seal", f"big-seal-{mode}-{world}", kwargs={"granularity": "chunk", "chunk_size": CHUNK}),
        sc("verify-subgroup", "verify", "corrupt", group=[1, 2]),
    ]


@pytest.fixture(scope="module")
def two_ranks(
    tree: Path,
    manifest_file_scenarios: tuple[Path, list[dict[str, Any]]],
    signed_scenarios: tuple[Path, list[dict[str, Any]]],
) -> Results:
    """One launch of 2 ranks for the scenarios of both modes, then those of a manifest file and of
    signatures (each launch of ranks costs seconds)."""
    scenarios = [s for mode in MODES for s in _scenarios(tree, mode, 2) if "group" not in s]
    scenarios += manifest_file_scenarios[1] + signed_scenarios[1]
    return run_ranks("dist_worker.py", 2, {"scenarios": scenarios}, tree / "run-2")


@pytest.fixture(scope="module")
def three_ranks(tree: Path, hostile_scenarios: tuple[Path, list[dict[str, Any]]]) -> Results:
    """One launch of 3 ranks for the scenarios of both modes and then for the hostile ones below
    (each launch of ranks costs seconds); a hang fails it (20 s collective timeout, 120 s in all)."""
    scenarios = [s for mode in MODES for s in _scenarios(tree, mode, 3)] + hostile_scenarios[1]
    spec = {"scenarios": scenarios, "pg_timeout_s": 20}
    return run_ranks("dist_worker.py", 3, spec, tree / "run-3", timeout=120)


@pytest.fixture(scope="module", params=WORLDS, ids=["2-ranks", "3-ranks"])
def runs(request: pytest.FixtureRequest) -> tuple[int, Results]:
    world: int = request.param
    return world, request.getfixturevalue("two_ranks" if world == 2 else "three_ranks")


def _same_on_every_rank(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """The outcome all ranks share (ignoring what each hashed and where an error arose)."""
    shared = [{k: v for k, v in o.items() if k not in ("hashed", "notes")} for o in outcomes]
    assert all(o == shared[0] for o in shared), json.dumps(shared, indent=1)
    return shared[0]


@pytest.mark.parametrize("mode", MODES)
def test_verify_matches_local_verify(runs: Any, tree: Path, mode: str) -> None:
    _world, results = runs
    for name, ckpt, kwargs in [
        ("verify-ok", "good", {}),
        ("verify-strict", "good", {"strict": True}),
        ("verify-corrupt", "corrupt", {}),
        ("verify-quick", "quick", {"quick": True}),
        ("verify-chunks", "big-verify", {}),
        ("verify-chunks-corrupt", "big-corrupt", {}),
        ("verify-no-manifest", "nomanifest", {}),
        ("verify-bad-manifest", "badmanifest", {}),
    ]:
        shared = _same_on_every_rank(results[f"{name}/{mode}"])
        assert shared == _local(lambda c=ckpt, k=kwargs: ifs.verify(tree / c, **k)), name


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_raises_the_exception_of_each_verdict(runs: Any, mode: str) -> None:
    _world, results = runs
    corrupt = _same_on_every_rank(results[f"verify-corrupt/{mode}"])
    assert corrupt["type"] == "IntegrityError"
    assert [p["path"] for p in corrupt["report"]["problems"]] == ["a.bin", "b.bin"]
    chunks = _same_on_every_rank(results[f"verify-chunks-corrupt/{mode}"])
    assert chunks["report"]["problems"][0]["byte_ranges"] == [[5 * CHUNK, 6 * CHUNK]]
    assert _same_on_every_rank(results[f"verify-no-manifest/{mode}"])["type"] == "ManifestNotFoundError"
    assert _same_on_every_rank(results[f"verify-bad-manifest/{mode}"])["type"] == "ManifestError"
    assert _same_on_every_rank(results[f"seal-bogus/{mode}"])["type"] == "NotImplementedError"
    quick = _same_on_every_rank(results[f"verify-quick/{mode}"])
    assert quick["type"] == "IntegrityError" and quick["report"]["bytes_checked"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_failure_on_one_rank_is_raised_on_every_rank(runs: Any, tree: Path, mode: str) -> None:
    world, results = runs
    reader = 1 if mode == "sharded" else 0
    for name in ("verify-permission", "seal-permission"):
        shared = _same_on_every_rank(results[f"{name}/{mode}"])
        assert shared["type"] == "PermissionError"
        assert "Permission denied (injected)" in shared["message"]
        other = 1 - reader  # a rank that did not hit it: told where it arose
        assert results[f"{name}/{mode}"][other]["notes"] == [f"(raised on rank {reader})"]
        assert results[f"{name}/{mode}"][reader]["notes"] == []
    assert not (tree / f"seal-fault-{mode}-{world}" / MANIFEST_FILENAME).exists()
    unexpected = _same_on_every_rank(
        results[f"verify-unexpected/{mode}"]
    )  # any exception that pickles travels as itself
    assert unexpected == {"type": "ZeroDivisionError", "message": "injected", "report": None}
    # An exception whose str() raises: every rank still gathers, and raises the same error (the
    # rank that hit it too).
    unprintable = _same_on_every_rank(results[f"verify-unprintable/{mode}"])
    message = f"Unprintable on rank {reader}: <exception str() failed>"
    assert unprintable == {"type": "RuntimeError", "message": message, "report": None}
    assert results[f"verify-unprintable/{mode}"][1 - reader]["notes"] == [f"(raised on rank {reader})"]
    bad_option = _same_on_every_rank(results[f"verify-bad-option/{mode}"])
    assert bad_option["type"] == "ValueError" and "max_workers" in bad_option["message"]


def test_rank0_mode_reads_on_rank0_only(runs: Any) -> None:
    _world, results = runs
    outcomes = results["verify-rank1-faulty/rank0"]
    assert _same_on_every_rank(outcomes)["type"] == "Report"
    assert outcomes[0]["hashed"] == 650_000
    assert all(o["hashed"] == 0 for o in outcomes[1:])


def test_sharded_mode_spreads_the_bytes_over_ranks(runs: Any) -> None:
    _world, results = runs
    assert _same_on_every_rank(results["verify-rank1-faulty/sharded"])["type"] == "PermissionError"
    for name in ("verify-ok", "verify-chunks", "seal-chunks"):
        hashed = [o["hashed"] for o in results[f"{name}/sharded"]]
        assert all(h > 0 for h in hashed), (name, hashed)
        assert sum(hashed) == (BIG if "chunks" in name else 650_000), (name, hashed)
    chunk_shares = [o["hashed"] for o in results["seal-chunks/sharded"]]
    assert max(chunk_shares) - min(chunk_shares) <= CHUNK  # one big file, balanced by chunks


@pytest.mark.parametrize("mode", MODES)
def test_seal_writes_the_manifest_a_local_seal_writes(runs: Any, tree: Path, tmp_path: Path, mode: str) -> None:
    world, results = runs
    for name, ckpt, kwargs in [
        ("seal", f"seal-{mode}-{world}", {}),
        ("seal-chunks", f"big-seal-{mode}-{world}", {"granularity": "chunk", "chunk_size": CHUNK}),
    ]:
        shared = _same_on_every_rank(results[f"{name}/{mode}"])
        written = (tree / ckpt / MANIFEST_FILENAME).read_bytes()
        assert shared == {"type": "Manifest", "manifest": written.decode()}
        copy = tmp_path / name
        shutil.copytree(tree / ckpt, copy)
        (copy / MANIFEST_FILENAME).unlink()
        assert ifs.seal(copy, **kwargs).to_json() == written


def test_verify_in_a_subgroup_runs_on_its_members_only(runs: Any, tree: Path) -> None:
    world, results = runs
    if world < 3:
        pytest.skip("needs a third rank outside the group")
    for mode in MODES:
        outcomes = results[f"verify-subgroup/{mode}"]
        assert outcomes[0] == {"type": "not a member"}
        assert _same_on_every_rank(outcomes[1:]) == _local(lambda: ifs.verify(tree / "corrupt"))


# --- a manifest file (Megatron's integrity.json) instead of ours ------------------------------------


def _integrity_json(root: Path) -> None:
    """What Megatron-LM's save_integrity_manifest writes: the SHA-256 of each top-level file."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}
    (root / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=2))


@pytest.fixture(scope="module")
def manifest_file_scenarios(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Flat checkpoints (as Megatron's are) with an integrity.json, intact and damaged."""
    root = tmp_path_factory.mktemp("manifest-file")
    for name in ("good", "corrupt"):
        _files(root / name)
        shutil.rmtree(root / name / "sub")
        _integrity_json(root / name)
    _flip(root / "corrupt" / "a.bin", 0)
    kwargs = {"manifest": "integrity.json", "strict": True}
    scenarios = [
        {"id": f"manifest-file-{name}/{mode}", "op": "verify", "mode": mode, "url": str(root / name), "kwargs": kwargs}
        for name in ("good", "corrupt")
        for mode in MODES
    ]
    return root, scenarios


def test_distributed_verify_with_a_manifest_file(
    two_ranks: Results, manifest_file_scenarios: tuple[Path, list[dict[str, Any]]]
) -> None:
    root, _ = manifest_file_scenarios
    listed = [p for p in (root / "good").iterdir() if p.is_file() and p.name != "integrity.json"]
    for mode in MODES:
        good = two_ranks[f"manifest-file-good/{mode}"]
        assert [o["type"] for o in good] == ["Report", "Report"], good
        assert good[0]["report"] == good[1]["report"] and good[0]["report"]["files_checked"] == len(listed)
        corrupt = two_ranks[f"manifest-file-corrupt/{mode}"]
        assert [o["type"] for o in corrupt] == ["IntegrityError", "IntegrityError"], corrupt
        assert [p["path"] for p in corrupt[0]["report"]["problems"]] == ["a.bin"]
    assert sum(o["hashed"] for o in two_ranks["manifest-file-good/sharded"]) == sum(p.stat().st_size for p in listed)


# --- signatures: every rank raises the same SignatureError -------------------------------------------

SIGNING_CHUNK = 64 * 1024
SIGNED_FILES = {
    "a.bin": bytes(i * 7 % 251 for i in range(300_000)),  # 5 chunks, the last one short
    "a/x.bin": b"sorts after a.bin as a string, before it as a path",
    "sub/b.bin": bytes(i * 13 % 251 for i in range(5000)),
    "sub/deep/c.bin": bytes(i % 199 for i in range(2 * SIGNING_CHUNK)),  # exactly 2 chunks
    "empty.bin": b"",
}


@pytest.fixture(scope="module")
def signed_scenarios(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A key pair (key.pem, key.pub); an unsealed checkpoint per mode for a signed seal; one
    tampered with and resealed without the key; one never signed."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    root = tmp_path_factory.mktemp("signed")
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = root / "key.pem", root / "key.pub"
    encoding, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    private.write_bytes(key.private_bytes(encoding, pkcs8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(encoding, serialization.PublicFormat.SubjectPublicKeyInfo))
    ckpt = root / "step_100"
    for name, data in SIGNED_FILES.items():
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(data)
    for mode in MODES:
        shutil.copytree(ckpt, root / f"seal-{mode}")
    tampered = root / "tampered"
    shutil.copytree(ckpt, tampered)
    chunks = {"granularity": "chunk", "chunk_size": SIGNING_CHUNK}
    ifs.seal(tampered, **chunks, private_key=private)  # type: ignore[arg-type]
    _flip(tampered / "a.bin", 1)
    (tampered / MANIFEST_FILENAME).unlink()  # what someone with write access and no key does
    ifs.seal(tampered, **chunks)  # type: ignore[arg-type]
    scenarios = []
    for mode in MODES:
        scenarios += [
            {"id": f"signed-seal/{mode}", "op": "seal", "mode": mode, "url": str(root / f"seal-{mode}"),
             "kwargs": {**chunks, "private_key": str(private)}},
            {"id": f"signed-verify/{mode}", "op": "verify", "mode": mode, "url": str(root / f"seal-{mode}"),
             "kwargs": {"public_key": str(public)}},
            {"id": f"tampered/{mode}", "op": "verify", "mode": mode, "url": str(tampered),
             "kwargs": {"public_key": str(public)}},
            {"id": f"unsigned/{mode}", "op": "verify", "mode": mode, "url": str(ckpt),
             "kwargs": {"public_key": str(public)}},
            {"id": f"replayed/{mode}", "op": "verify", "mode": mode, "url": str(root / f"seal-{mode}"),
             "kwargs": {"public_key": str(public), "expected_name": "step_9000"}},
        ]  # fmt: skip
    return root, scenarios


def test_every_rank_raises_the_same_signature_error(
    two_ranks: Results, signed_scenarios: tuple[Path, list[dict[str, Any]]]
) -> None:
    model_signing = pytest.importorskip("model_signing")
    root, _ = signed_scenarios
    for mode in MODES:
        assert [r["type"] for r in two_ranks[f"signed-seal/{mode}"]] == ["Manifest", "Manifest"]
        # model_signing's own verifier accepts what the ranks signed
        hashing = model_signing.hashing.Config().use_shard_serialization(shard_size=SIGNING_CHUNK)
        config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=root / "key.pub")
        config.set_hashing_config(hashing).verify(root / f"seal-{mode}", root / f"seal-{mode}" / SIGNATURE)
        assert [r["type"] for r in two_ranks[f"signed-verify/{mode}"]] == ["Report", "Report"]
        replayed = ("replayed", f"signed as 'seal-{mode}', not 'step_9000'")
        for name, needle in (("tampered", "a.bin: signed digest differs"), ("unsigned", "not signed"), replayed):
            outcomes = two_ranks[f"{name}/{mode}"]
            assert [o["type"] for o in outcomes] == ["SignatureError", "SignatureError"], outcomes
            assert outcomes[0]["message"] == outcomes[1]["message"] and needle in outcomes[0]["message"]
            assert outcomes[0]["report"] == outcomes[1]["report"]
        assert all(o["hashed"] == 0 for o in two_ranks[f"tampered/{mode}"])  # refused before any content is read


# --- without a process group, and pure pieces ----------------------------------------------------


def test_without_process_group_the_local_functions_run(tmp_path: Path) -> None:
    _files(tmp_path / "ckpt")
    manifest = distributed.seal(tmp_path / "ckpt", mode="sharded")
    assert manifest.to_json() == (tmp_path / "ckpt" / MANIFEST_FILENAME).read_bytes()
    for mode in MODES:
        assert distributed.verify(tmp_path / "ckpt", mode=mode) == ifs.verify(tmp_path / "ckpt")  # type: ignore[arg-type]
    _flip(tmp_path / "ckpt" / "a.bin", 0)
    with pytest.raises(IntegrityError, match="a.bin: mismatch"):
        distributed.verify(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="mode must be one of"):
        distributed.verify(tmp_path / "ckpt", mode="everyone")  # type: ignore[arg-type]


def test_import_integrity_fs_does_not_import_torch() -> None:
    code = "import sys, integrity_fs, integrity_fs.distributed; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "use", ["from integrity_fs import distributed; distributed.verify('.')", "import integrity_fs.dcp"]
)
def test_missing_torch_gives_an_install_hint(use: str) -> None:
    code = f"import sys; sys.modules['torch'] = None\ntry:\n    {use}\nexcept ImportError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install 'integrity-fs[torch]'" in out


# --- no hang, no false OK, whatever one rank does -------------------------------------------------

HOSTILE_WORLD = 3


@pytest.fixture(scope="module")
def hostile_scenarios(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The checkpoints and scenarios of every test below, run by the 3-rank launch (``three_ranks``).

    ``node0..2``: the same relative URL names a different directory on each rank (node-local
    paths). Ranks 1 and 2 hold exact copies (modification times included); rank 0's copy is
    damaged in b.bin, a file that rank 1 hashes in sharded mode.
    """
    root = tmp_path_factory.mktemp("hostile")
    for name in ("good", "unsealed-modes", "unsealed-interrupts", "resealed"):
        _files(root / name)
    for name in ("good", "resealed"):
        ifs.seal(root / name)
    _flip(root / "resealed" / "a.bin", 5)
    nodes = [root / f"node{rank}" for rank in range(HOSTILE_WORLD)]
    _files(nodes[0] / "ckpt")
    ifs.seal(nodes[0] / "ckpt")
    _files(nodes[0] / "raw")
    for node in nodes[1:]:
        shutil.copytree(nodes[0], node)
    for name in ("ckpt/b.bin", "raw/b.bin"):
        _flip(nodes[0] / name, 100)
        os.utime(nodes[0] / name, (1e9, 1e9))

    def sc(id_: str, op: str, mode: str, url: str, **extra: Any) -> dict[str, Any]:
        return {"id": id_, "op": op, "mode": mode, "url": url, **extra}

    for i in range(6):  # files read in several blocks: rank 1's first block ends mid-file
        (root / "unsealed-rewritten" / f"f{i}.bin").parent.mkdir(exist_ok=True)
        (root / "unsealed-rewritten" / f"f{i}.bin").write_bytes(bytes([i]) * (4 << 20))
    good, modes, interrupts = (str(root / n) for n in ("good", "unsealed-modes", "unsealed-interrupts"))
    rewritten = str(root / "unsealed-rewritten")
    cwd = [str(node) for node in nodes]
    scenarios = [
        # modes
        sc("bogus", "verify", "sharded", good, rank_kwargs={"1": {"mode": "bogus"}}),
        sc("bogus-rank0", "seal", "rank0", modes, rank_kwargs={"0": {"mode": 7}}),
        sc("mixed", "verify", "sharded", good, rank_kwargs={"2": {"mode": "rank0"}}),
        sc("mixed-seal", "seal", "rank0", modes, rank_kwargs={"1": {"mode": "sharded"}}),
        sc("after-modes", "verify", "sharded", good),  # the group is still in step
        # already sealed
        sc("sealed-sharded", "seal", "sharded", good),
        sc("sealed-rank0", "seal", "rank0", good),
        sc("resealed", "seal", "sharded", str(root / "resealed"), kwargs={"overwrite": True}),
        # interrupts (a KeyboardInterrupt raised by one rank's callback)
        sc("interrupt-verify-sharded", "verify", "sharded", good, interrupt_rank=1),
        sc("interrupt-verify-rank0", "verify", "rank0", good, interrupt_rank=0),
        sc("interrupt-seal-sharded", "seal", "sharded", interrupts, interrupt_rank=2),
        sc("interrupt-seal-rank0", "seal", "rank0", interrupts, interrupt_rank=0),
        sc("unbuildable", "verify", "sharded", good, interrupt_rank=1, interrupt="UnicodeEncodeError"),
        sc("after-interrupts", "verify", "sharded", good),
        # a writer steps in while a sharded seal reads (every file rewritten in place, same bytes)
        sc("rewritten-seal", "seal", "sharded", rewritten, rewrite_rank=1, rewrite_dir=rewritten),
        # node-local views
        sc("views-verify", "verify", "sharded", "ckpt", rank_cwd=cwd),
        sc("views-verify-quick", "verify", "sharded", "ckpt", rank_cwd=cwd, kwargs={"quick": True}),
        sc("views-seal", "seal", "sharded", "raw", rank_cwd=cwd),
        sc("views-rank0", "verify", "rank0", "ckpt", rank_cwd=cwd),  # rank 0's copy only
        sc("views-missing-on-1", "verify", "sharded", "ckpt", rank_cwd=[cwd[0], str(root), cwd[2]]),
    ]
    return root, scenarios


@pytest.fixture(scope="module")
def hostile(hostile_scenarios: tuple[Path, list[dict[str, Any]]], three_ranks: Results) -> tuple[Path, Results]:
    return hostile_scenarios[0], three_ranks


def test_a_bad_or_different_mode_on_one_rank_raises_on_every_rank(hostile: tuple[Path, Results]) -> None:
    root, results = hostile
    for name, says, where in [
        ("bogus", "mode must be one of sharded, rank0, not 'bogus'", 1),
        ("bogus-rank0", "not 7", 0),
        ("mixed", "ranks disagree on the arguments of verify: mode: 'sharded' on ranks 0, 1 | 'rank0' on rank 2", None),
        (
            "mixed-seal",
            "ranks disagree on the arguments of seal: mode: 'rank0' on ranks 0, 2 | 'sharded' on rank 1",
            None,
        ),
    ]:
        shared = _same_on_every_rank(results[name])
        assert shared["type"] == "ValueError" and says in shared["message"], (name, shared)
        if where is not None:  # every other rank is told which rank was given it
            assert [o["notes"] for o in results[name]] == [
                [] if r == where else [f"(raised on rank {where})"] for r in range(3)
            ]
    assert not (root / "unsealed-modes" / MANIFEST_FILENAME).exists()
    assert _same_on_every_rank(results["after-modes"])["type"] == "Report"


def test_seal_refuses_a_sealed_root_on_every_rank(hostile: tuple[Path, Results]) -> None:
    root, results = hostile
    for mode in MODES:
        shared = _same_on_every_rank(results[f"sealed-{mode}"])
        assert shared["type"] == "FileExistsError", (mode, shared)
        assert "already sealed" in shared["message"] and "overwrite=True" in shared["message"]
        assert all(o["hashed"] == 0 for o in results[f"sealed-{mode}"])  # refused before reading content
    assert ifs.verify(root / "good").ok
    resealed = _same_on_every_rank(results["resealed"])
    assert resealed == {"type": "Manifest", "manifest": (root / "resealed" / MANIFEST_FILENAME).read_text()}
    assert ifs.verify(root / "resealed").ok


def test_an_interrupt_on_one_rank_is_reraised_there_and_every_rank_raises(hostile: tuple[Path, Results]) -> None:
    root, results = hostile
    for mode_op, interrupted in [("verify-sharded", 1), ("verify-rank0", 0), ("seal-sharded", 2), ("seal-rank0", 0)]:
        outcomes = results[f"interrupt-{mode_op}"]
        assert outcomes[interrupted]["type"] == "KeyboardInterrupt", (mode_op, outcomes)
        others = [o for rank, o in enumerate(outcomes) if rank != interrupted]
        shared = _same_on_every_rank(others)
        assert shared == {
            "type": "RuntimeError",
            "message": f"KeyboardInterrupt on rank {interrupted}",
            "report": None,
        }, mode_op
        assert all(o["notes"] == [f"(raised on rank {interrupted})"] for o in others), mode_op
    assert not (root / "unsealed-interrupts" / MANIFEST_FILENAME).exists()
    unbuildable = _same_on_every_rank(results["unbuildable"])  # an exception of many arguments travels as itself
    assert unbuildable["type"] == "UnicodeEncodeError"
    assert unbuildable["message"].startswith("'utf-8' codec can't encode")
    assert _same_on_every_rank(results["after-interrupts"])["type"] == "Report"


def test_a_file_rewritten_while_a_sharded_seal_reads_it_is_never_sealed(hostile: tuple[Path, Results]) -> None:
    """The guard of the local seal holds in sharded mode too: rank 1's files change under it (in
    place, the same bytes: only their identity changes), and no rank writes or returns a manifest."""
    root, results = hostile
    shared = _same_on_every_rank(results["rewritten-seal"])
    assert shared["type"] == "FileChangedError", shared
    assert "changed while it was read" in shared["message"]
    assert not (root / "unsealed-rewritten" / MANIFEST_FILENAME).exists()


def test_sharded_mode_refuses_ranks_that_see_different_storage(hostile: tuple[Path, Results]) -> None:
    """Rank 0's damaged b.bin, hashed by rank 1 from its own intact copy, must never add up to OK."""
    root, results = hostile
    for name in ("views-verify", "views-verify-quick", "views-seal"):
        shared = _same_on_every_rank(results[name])
        assert shared["type"] == "OSError", (name, shared)
        assert "ranks see different files" in shared["message"] and "shared storage" in shared["message"]
        assert "ranks that agree: rank 0 | ranks 1, 2" in shared["message"], shared["message"]
        assert "b.bin" in shared["message"] and str(root / "node0") in shared["message"]
    assert not (root / "node0" / "raw" / MANIFEST_FILENAME).exists()
    rank0 = _same_on_every_rank(results["views-rank0"])
    assert rank0["type"] == "IntegrityError" and [p["path"] for p in rank0["report"]["problems"]] == ["b.bin"]
    missing = _same_on_every_rank(results["views-missing-on-1"])
    assert missing["type"] == "FileNotFoundError" and "no checkpoint at" in missing["message"]
    assert results["views-missing-on-1"][0]["notes"] == ["(raised on rank 1)"]
