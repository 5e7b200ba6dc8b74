"""integrity_fs.formats: manifests written by other tools (the real ones), read and verified by ours.

model_signing bundles come from the model_signing package itself (a local EC key), sha256sum files
from coreutils, Megatron's integrity.json from a copy of Megatron-LM's own writer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend

import integrity_fs as ifs
from integrity_fs import (
    MANIFEST_FILENAME,
    IntegrityError,
    Manifest,
    ManifestError,
    ManifestNotFoundError,
    formats,
)

SHARD = 1024
NAMES = ["a.bin", "sp ace.bin", "ü-non-ascii.bin", "sub/b.bin", "empty.bin"]


def _tree(root: Path) -> Path:
    """A small checkpoint: one file of several shards, odd names, an empty file."""
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(NAMES):
        size = 0 if name == "empty.bin" else (2 * SHARD + 452 if name == "sub/b.bin" else 100 + i)
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes((i * 13 + j) % 251 for j in range(size)))
    return root


def _flip(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _must_fail(root: Path | str, name: str, **kwargs: Any) -> IntegrityError:
    with pytest.raises(IntegrityError) as info:
        ifs.verify(root, **kwargs)
    assert [p.path for p in info.value.report.problems] == [name]
    assert name in str(info.value)
    return info.value


# --- model_signing -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ec_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path_factory.mktemp("key") / "key.pem"
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


def _model_sign(root: Path, key: Path, signature: Path, **hashing: Any) -> bytes:
    """Sign ``root`` with the real model_signing package; ``hashing``: use_shard_serialization args."""
    ms = pytest.importorskip("model_signing")
    config = ms.signing.Config().use_elliptic_key_signer(private_key=key)
    if hashing:
        method = hashing.pop("method")
        config.set_hashing_config(getattr(ms.hashing.Config(), method)(**hashing))
    config.sign(root, signature)
    return signature.read_bytes()


def _statement(bundle: bytes) -> dict[str, Any]:
    payload = json.loads(bundle)["dsseEnvelope"]["payload"]
    statement: dict[str, Any] = json.loads(base64.b64decode(payload))
    return statement


def test_model_signing_files_bundle(tmp_path: Path, ec_key: Path) -> None:
    root = _tree(tmp_path / "model")
    bundle = _model_sign(root, ec_key, root / "model.sig")
    manifest = formats.load(bundle)
    assert formats.detect(bundle) == "model_signing"
    assert manifest == formats.load(bundle, "model_signing")
    assert manifest.granularity == "file" and manifest.sizes is None
    assert dict(manifest.files) == {name: _sha256(root / name) for name in NAMES}
    report = ifs.verify(root, manifest="model.sig", strict=True)  # the bundle itself is not extra
    assert report.files_checked == len(NAMES) and report.extra == ()
    _flip(root / "ü-non-ascii.bin")
    _must_fail(root, "ü-non-ascii.bin", manifest="model.sig")


def test_model_signing_shards_bundle_is_a_chunk_manifest(tmp_path: Path, ec_key: Path) -> None:
    root = _tree(tmp_path / "model")
    bundle = _model_sign(root, ec_key, tmp_path / "model.sig", method="use_shard_serialization", shard_size=SHARD)
    assert _statement(bundle)["predicate"]["serialization"]["shard_size"] == float(SHARD)  # as 1.1.1 writes it
    manifest = formats.load(bundle)
    assert manifest.granularity == "chunk" and manifest.chunk_size == SHARD
    # Empty files have no shard: they are not in the manifest. Sizes come from each last shard's end.
    listed = [n for n in NAMES if n != "empty.bin"]
    assert sorted(manifest.files) == sorted(listed)
    assert manifest.sizes == {n: (root / n).stat().st_size for n in listed}
    assert manifest.chunks is not None and len(manifest.chunks["sub/b.bin"]) == 3
    # Our chunk manifest of the same bytes at the same chunk size is the same manifest.
    sealed = ifs.seal(shutil.copytree(root, tmp_path / "copy"), granularity="chunk", chunk_size=SHARD)
    assert dict(manifest.files) == {n: sealed.files[n] for n in listed}
    assert ifs.verify(root, manifest=str(tmp_path / "model.sig")).files_checked == len(listed)
    _flip(root / "sub" / "b.bin", SHARD + 10)
    error = _must_fail(root, "sub/b.bin", manifest=str(tmp_path / "model.sig"))
    assert error.report.problems[0].byte_ranges == ((SHARD, 2 * SHARD),)


def test_model_signing_other_hashes_and_tampered_payloads_are_refused(tmp_path: Path, ec_key: Path) -> None:
    root = _tree(tmp_path / "model")
    blake = _model_sign(root, ec_key, tmp_path / "b.sig", method="use_file_serialization", hashing_algorithm="blake2")
    with pytest.raises(ManifestError, match="hash type 'blake2.*not supported"):
        formats.load(blake)
    bundle = json.loads(_model_sign(root, ec_key, tmp_path / "m.sig"))
    statement = _statement(json.dumps(bundle).encode())
    statement["predicate"]["resources"][0]["digest"] = "0" * 64  # unsigned edit: the root digest no longer fits
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    with pytest.raises(ManifestError, match="inconsistent"):
        formats.load(json.dumps(bundle).encode())
    statement = _statement((tmp_path / "m.sig").read_bytes())
    statement["predicate"]["serialization"]["method"] = "blocks"
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    with pytest.raises(ManifestError, match="method 'blocks' is not supported"):
        formats.load(json.dumps(bundle).encode())


def test_model_signing_shards_of_varying_size_are_refused(tmp_path: Path, ec_key: Path) -> None:
    root = _tree(tmp_path / "model")
    bundle = json.loads(
        _model_sign(root, ec_key, tmp_path / "m.sig", method="use_shard_serialization", shard_size=SHARD)
    )
    statement = _statement(json.dumps(bundle).encode())
    resources = statement["predicate"]["resources"]
    b_shards = [r for r in resources if r["name"].startswith("sub/b.bin:")]
    b_shards[1]["name"] = f"sub/b.bin:{SHARD}:{SHARD + 10}"  # a short shard in the middle
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    with pytest.raises(ManifestError, match="fixed shard size"):
        formats.load(json.dumps(bundle).encode())


@pytest.mark.timeout(2)
def test_model_signing_shard_offsets_of_a_huge_file_are_refused_at_once(tmp_path: Path, ec_key: Path) -> None:
    """A bundle is untrusted input here: a shard ending at byte 10**20 - 1 must not make the reader
    count out the 10**17 shards such a file would have."""
    root = _tree(tmp_path / "model")
    bundle = json.loads(
        _model_sign(root, ec_key, tmp_path / "m.sig", method="use_shard_serialization", shard_size=SHARD)
    )
    statement = _statement(json.dumps(bundle).encode())
    a_shard = next(r for r in statement["predicate"]["resources"] if r["name"].startswith("a.bin:"))
    a_shard["name"] = f"a.bin:0:{'9' * 20}"  # the root digest covers digests, not names: still consistent
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    with pytest.raises(ManifestError, match=f"unexpected a.bin:0:{'9' * 20}"):
        formats.load(json.dumps(bundle).encode())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bundle(resources: list[dict[str, Any]], *, method: str = "shards", shard_size: float = 4.0) -> bytes:
    """An unsigned model_signing bundle over ``resources`` (formats.load checks no signature)."""
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
    serialization: dict[str, Any] = {"method": method, "hash_type": "sha256"}
    if method == "shards":
        serialization["shard_size"] = shard_size
    statement = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "m", "digest": {"sha256": root}}],
        "predicateType": "https://model_signing/signature/v1.0",
        "predicate": {"serialization": serialization, "resources": resources},
    }
    payload = base64.b64encode(json.dumps(statement).encode()).decode()
    return json.dumps({"dsseEnvelope": {"payloadType": "application/vnd.in-toto+json", "payload": payload}}).encode()


def test_shard_offsets_are_ascii_digits_only() -> None:
    # Arabic-Indic digits: not a name model_signing writes; int() would take it.
    data = _bundle([{"name": "a:\u0660:\u0664", "algorithm": "sha256-sharded-4", "digest": _sha(b"abcd")}])
    with pytest.raises(ManifestError, match="shard name"):
        formats.load(data)


# --- sha256sum ---------------------------------------------------------------------------------


def _sha256sum(root: Path, *args: str, names: list[str] | None = None) -> bytes:
    shutil.which("sha256sum") or pytest.skip("coreutils sha256sum is not installed")
    return subprocess.run(
        ["sha256sum", *args, "--", *(names or NAMES)], cwd=root, check=True, capture_output=True
    ).stdout


@pytest.mark.parametrize("args", [(), ("-b",), ("--tag",)], ids=["text", "binary", "tag"])
def test_sha256sum_output(tmp_path: Path, args: tuple[str, ...]) -> None:
    root = _tree(tmp_path / "ckpt")
    odd = "new\nline\r.bin"  # GNU escapes it: a line starting with a backslash
    (root / odd).write_bytes(b"odd")
    names = [*NAMES, odd, "./dot.bin"]
    (root / "dot.bin").write_bytes(b"dot")
    sums = _sha256sum(root, *args, names=names)
    assert sums.startswith(b"\\") or b"\n\\" in sums
    (root / "SHA256SUMS").write_bytes(sums)
    manifest = formats.load(sums)
    assert formats.detect(sums) == "sha256sum"
    assert dict(manifest.files) == {n.removeprefix("./"): _sha256(root / n) for n in names}
    assert ifs.verify(root, manifest="SHA256SUMS", strict=True).files_checked == len(names)
    _flip(root / "sp ace.bin")
    _flip(root / odd)
    with pytest.raises(IntegrityError) as info:
        ifs.verify(root, manifest="SHA256SUMS")
    assert [p.path for p in info.value.report.problems] == sorted([odd, "sp ace.bin"])


def test_a_manifest_file_that_lists_itself(tmp_path: Path) -> None:
    """`sha256sum * > SHA256SUMS` run a second time lists SHA256SUMS (as it was): left out."""
    root = _tree(tmp_path / "ckpt")
    shutil.rmtree(root / "sub")
    for _ in range(2):
        subprocess.run("sha256sum -- * > SHA256SUMS", shell=True, cwd=root, check=True)
    assert b" SHA256SUMS\n" in (root / "SHA256SUMS").read_bytes()
    assert ifs.verify(root, manifest="SHA256SUMS", strict=True).files_checked == len(NAMES) - 1
    _flip(root / "a.bin")
    _must_fail(root, "a.bin", manifest="SHA256SUMS")


def test_sha256sum_names_are_checked_as_manifest_names(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ckpt")
    (root / "back\\slash").write_bytes(b"x")
    with pytest.raises(ManifestError, match=r"line 1: file name .*back.*slash.* is not a relative path"):
        formats.load(_sha256sum(root, names=["back\\slash"]))
    digest = "ab" * 32
    for bad in ("../outside", "/etc/passwd", "a/../../b", "sub//x"):
        with pytest.raises(ManifestError, match="line 2"):
            formats.load(f"{digest}  ok\n{digest}  {bad}\n".encode())
    with pytest.raises(ManifestError, match="not '<64 hex digits>"):
        formats.load(f"{digest}  ok\n{digest[:-1]}  short\n".encode(), "sha256sum")
    with pytest.raises(ManifestError, match="twice"):
        formats.load(f"{digest}  x\n{'cd' * 32}  ./x\n".encode())
    assert formats.load(f"{digest.upper()} *x\n".encode()).files == {"x": digest}
    # What `sha256sum -c` also takes: CRLF line ends, BSD's one space, no final newline.
    assert formats.load(f"{digest}  x\r\n{digest} y\r\n{digest}  z".encode()).files == dict.fromkeys("xyz", digest)


def test_sha256sum_file_with_leading_blank_lines_is_read(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "SUMS").write_text(f"\n\n{_sha(b'x')}  a\n")
    assert ifs.verify(tmp_path, manifest="SUMS").files_checked == 1
    (tmp_path / "a").write_bytes(b"y")
    with pytest.raises(IntegrityError, match="a: mismatch"):
        ifs.verify(tmp_path, manifest="SUMS")


# --- Megatron-LM -------------------------------------------------------------------------------


def _megatron_save_integrity_manifest(checkpoint_dir: str) -> None:
    """Megatron-LM megatron/core/dist_checkpointing/validation.py save_integrity_manifest, with
    maybe_msc (Megatron's storage wrapper) as plain pathlib/open."""
    manifest: dict[str, str] = {}
    ckpt_path = Path(checkpoint_dir)
    for entry in sorted(ckpt_path.iterdir(), key=lambda p: str(p)):
        if entry.is_file() and entry.name != "integrity.json":
            h = hashlib.sha256()
            with open(entry, "rb") as f:
                for chunk in iter(lambda: f.read(4 * 1024 * 1024), b""):
                    h.update(chunk)
            manifest[entry.name] = h.hexdigest()
    integrity_path = os.path.join(checkpoint_dir, "integrity.json")
    payload = {"algorithm": "sha256", "files": manifest}
    with open(integrity_path, "w") as f:
        json.dump(payload, f, indent=2)


def test_megatron_integrity_json(tmp_path: Path) -> None:
    root = _tree(tmp_path / "iter_0000100")
    shutil.rmtree(root / "sub")  # Megatron's checkpoints are flat
    (root / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    _megatron_save_integrity_manifest(str(root))
    raw = (root / "integrity.json").read_bytes()
    manifest = formats.load(raw)
    assert formats.detect(raw) == "megatron"
    assert manifest.sizes is None and "integrity.json" not in manifest.files
    assert formats.dump(manifest, "megatron") == raw  # byte for byte what Megatron writes
    assert ifs.verify(root, manifest="integrity.json", strict=True).files_checked == len(manifest.files)
    _flip(root / "a.bin")
    _must_fail(root, "a.bin", manifest="integrity.json")


def test_megatron_holds_top_level_files_only() -> None:
    """Megatron lists and checks the files directly in the checkpoint's directory: a manifest with
    files in subdirectories cannot be written as its integrity.json."""
    nested = Manifest(files={"a.bin": _sha(b"a"), "optim/shards/blob.bin": _sha(b"b")})
    with pytest.raises(ValueError, match=r"top-level files .*optim/shards/blob\.bin"):
        formats.dump(nested, "megatron")
    assert formats.dump(nested, "sha256sum").count(b"\n") == 2  # sha256sum lists every file


def test_a_foreign_manifest_may_list_ours(tmp_path: Path) -> None:
    """Megatron (or sha256sum *) run on a sealed directory lists _integrity_manifest.json: left out."""
    root = _tree(tmp_path / "ckpt")
    shutil.rmtree(root / "sub")
    ifs.seal(root)
    _megatron_save_integrity_manifest(str(root))
    raw = (root / "integrity.json").read_bytes()
    assert MANIFEST_FILENAME in json.loads(raw)["files"]
    assert MANIFEST_FILENAME not in formats.load(raw).files
    assert ifs.verify(root, manifest="integrity.json", strict=True).ok
    assert ifs.verify(root).extra == ("integrity.json",)  # and our manifest does not list integrity.json


@pytest.mark.parametrize("tool", ["sha256sum", "megatron"])
def test_a_foreign_manifest_made_over_a_signed_checkpoint_verifies(tmp_path: Path, tool: str) -> None:
    """`sha256sum *` (or Megatron's writer) run over a sealed and signed checkpoint lists the
    manifest and model.sig too; model.sig is never content, so listing it is no "missing" file."""
    from cryptography.hazmat.primitives.asymmetric import ec

    (tmp_path / "a.bin").write_bytes(os.urandom(1000))
    ifs.seal(tmp_path, private_key=ec.generate_private_key(ec.SECP256R1()))
    digests = {p.name: _sha(p.read_bytes()) for p in sorted(tmp_path.iterdir())}
    assert set(digests) == {"a.bin", ifs.MANIFEST_FILENAME, "model.sig"}
    if tool == "sha256sum":
        (tmp_path / "SUMS").write_text("".join(f"{d}  {n}\n" for n, d in digests.items()))
    else:
        (tmp_path / "SUMS").write_text(json.dumps({"algorithm": "sha256", "files": digests}))
    assert ifs.verify(tmp_path, manifest="SUMS").files_checked == 1
    (tmp_path / "a.bin").write_bytes(os.urandom(1000))
    with pytest.raises(IntegrityError, match="a.bin: mismatch"):
        ifs.verify(tmp_path, manifest="SUMS")


# --- detection, dump, errors -------------------------------------------------------------------


def test_explicit_formats_are_checked(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ckpt")
    ours = ifs.seal(root).to_json()
    top_level = {name: digest for name, digest in Manifest.from_json(ours).files.items() if "/" not in name}
    megatron = formats.dump(Manifest(files=top_level), "megatron")  # Megatron lists top-level files only
    sums = formats.dump(Manifest.from_json(ours), "sha256sum")
    assert formats.detect(ours) == "integrity_fs" and formats.load(ours) == Manifest.from_json(ours)
    for data, wrong in [(ours, "megatron"), (megatron, "integrity_fs"), (sums, "megatron"), (megatron, "sha256sum"),
                        (ours, "model_signing"), (b"", "sha256sum")]:  # fmt: skip
        with pytest.raises(ManifestError):
            formats.load(data, wrong)
    for junk in (b"", b"hello\n", b'{"a": 1}', b"[1]", b'{"files": {}, "files": {}}'):
        with pytest.raises(ManifestError):
            formats.load(junk)
    with pytest.raises(ValueError, match="unknown manifest format"):
        formats.load(ours, "json")


def test_dump_round_trips_and_sha256sum_checks_it(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ckpt")
    (root / "new\nline.bin").write_bytes(b"odd")
    manifest = ifs.seal(root)
    sums = formats.dump(manifest, "sha256sum")
    assert b"\\" in sums  # the newline name is GNU-escaped
    plain = Manifest(files=manifest.files)
    assert formats.load(sums) == plain
    top_level = Manifest(files={name: digest for name, digest in manifest.files.items() if "/" not in name})
    assert formats.load(formats.dump(top_level, "megatron")) == top_level  # Megatron lists top-level files only
    (tmp_path / "SUMS").write_bytes(sums)
    checked = subprocess.run(["sha256sum", "-c", "--strict", str(tmp_path / "SUMS")], cwd=root, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.count(b": OK") == len(manifest.files)
    chunked = ifs.seal(_tree(tmp_path / "c"), granularity="chunk", chunk_size=SHARD)
    for fmt in ("sha256sum", "megatron"):
        with pytest.raises(ValueError, match="whole-file SHA-256"):
            formats.dump(chunked, fmt)
    with pytest.raises(ValueError, match="cannot write"):
        formats.dump(manifest, "model_signing")


def test_verify_manifest_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _tree(tmp_path / "ckpt")
    manifest = ifs.seal(root)
    (root / MANIFEST_FILENAME).unlink()
    assert ifs.verify(root, manifest=manifest).files_checked == len(NAMES)  # a Manifest as is
    outside = tmp_path / "elsewhere.sha256"
    outside.write_bytes(formats.dump(manifest, "sha256sum"))
    assert ifs.verify(root, manifest=outside, strict=True).ok
    (root / "SUMS").write_bytes(outside.read_bytes())
    assert ifs.verify(root, manifest=root / "SUMS", strict=True).extra == ()  # absolute, inside the root
    assert ifs.verify(root, manifest=outside, strict=False).extra == ("SUMS",)  # not the one in use
    with pytest.raises(ManifestNotFoundError, match="nope.json"):
        ifs.verify(root, manifest="nope.json")
    with pytest.raises(FileNotFoundError) as info:
        ifs.verify(tmp_path / "missing", manifest="SUMS")
    assert not isinstance(info.value, ManifestNotFoundError)
    with pytest.raises(ValueError, match="not a name inside"):
        ifs.verify(root, manifest="sub/../../elsewhere.sha256")
    (root / "bad.json").write_text("{nope")
    with pytest.raises(ManifestError, match="bad.json"):
        ifs.verify(root, manifest="bad.json")


def test_verify_with_a_manifest_file_on_s3(tmp_path: Path, s3_backend: Backend) -> None:
    root = _tree(tmp_path / "ckpt")
    sums = _sha256sum(root)
    for name in NAMES:
        s3_backend.write(name, (root / name).read_bytes())
    s3_backend.write("SHA256SUMS", sums)
    opts = s3_backend.storage_options
    report = ifs.verify(s3_backend.url, manifest="SHA256SUMS", storage_options=opts, strict=True)
    assert report.files_checked == len(NAMES)
    elsewhere = f"s3://{s3_backend.root}-sums/SHA256SUMS"  # a URL outside the root, same store and options
    s3_backend.fs.pipe_file(elsewhere.removeprefix("s3://"), sums)
    assert ifs.verify(s3_backend.url, manifest=elsewhere, storage_options=opts).extra == ("SHA256SUMS",)
    s3_backend.corrupt("sub/b.bin", 5)
    _must_fail(s3_backend.url, "sub/b.bin", manifest="SHA256SUMS", storage_options=opts)


HUGE = "9" * 5000  # more digits than Python converts to int by default (4300)


@pytest.mark.parametrize("format", ["auto", "megatron", "integrity_fs"])
def test_json_manifest_with_a_huge_integer_is_a_manifest_error(format: str) -> None:
    data = f'{{"files": {{"a": "{_sha(b"")}"}}, "n": {HUGE}}}'.encode()
    with pytest.raises(ManifestError):
        formats.load(data, format)


def test_bundle_whose_payload_holds_a_huge_integer_is_a_manifest_error() -> None:
    data = _bundle([{"name": "a:0:4", "algorithm": "sha256-sharded-4", "digest": _sha(b"abcd")}])
    bundle = json.loads(data)
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    text = json.dumps(statement).replace('"shard_size": 4.0', f'"shard_size": {HUGE}')
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(text.encode()).decode()
    with pytest.raises(ManifestError):
        formats.load(json.dumps(bundle).encode())


def test_shard_offsets_with_huge_integers_are_a_manifest_error() -> None:
    data = _bundle([{"name": f"a:{HUGE}:{HUGE}1", "algorithm": "sha256-sharded-4", "digest": _sha(b"x")}])
    with pytest.raises(ManifestError, match="shard"):
        formats.load(data)


def test_verify_with_a_manifest_file_holding_a_huge_integer_is_a_manifest_error(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "integrity.json").write_text(f'{{"files": {{"a": "{_sha(b"x")}"}}, "n": {HUGE}}}')
    with pytest.raises(ManifestError, match="integrity.json"):
        ifs.verify(tmp_path, manifest="integrity.json")


# --- DCP takes the manifest too (distributed verify with one: test_distributed.py) --------------


def test_dcp_load_with_a_manifest_file(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from integrity_fs import dcp

    url = str(tmp_path / "ckpt")
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    manifest = dcp.save(state, url, granularity="file")  # sha256sum holds whole-file digests
    (tmp_path / "ckpt" / MANIFEST_FILENAME).unlink()
    (tmp_path / "ckpt" / "SHA256SUMS").write_bytes(formats.dump(manifest, "sha256sum"))
    target = {"w": torch.zeros(1000)}
    report = dcp.load(target, url, manifest="SHA256SUMS", require_manifest=True, strict=True)
    assert report is not None and report.files_checked == len(manifest.files)
    assert torch.equal(target["w"], state["w"])
    data_file = next(n for n in manifest.files if n.endswith(".distcp"))
    _flip(tmp_path / "ckpt" / data_file, 100)
    target = {"w": torch.zeros(1000)}
    with pytest.raises(IntegrityError, match=data_file):
        dcp.load(target, url, manifest="SHA256SUMS")
    assert not target["w"].any()  # untouched


# --- b3sum, sha256sum --zero, the seed's key set ------------------------------------------------


def _b3sum(root: Path, *names: str) -> bytes:
    shutil.which("b3sum") or pytest.skip("b3sum is not installed (apt-get install b3sum)")
    return subprocess.run(["b3sum", "--", *(names or NAMES)], cwd=root, check=True, capture_output=True).stdout


def test_b3sum_output_is_read_by_format_by_name_and_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: Any
) -> None:
    """b3sum lists look exactly like sha256sum's (64 hex digits, two spaces, a name): read as
    sha256sum, every file of an intact checkpoint "mismatches". b3sum is read by format name, by
    file name (B3SUMS, *.b3), and a list detected as sha256sum that every file differs from says so."""
    pytest.importorskip("blake3")
    from integrity_fs.cli import main

    root = _tree(tmp_path / "ckpt")
    odd = "new\nline.bin"  # b3sum escapes it as GNU does
    (root / odd).write_bytes(b"odd")
    sums = _b3sum(root, *NAMES, odd)
    manifest = formats.load(sums, "b3sum")
    assert manifest.algorithm == "blake3" and set(manifest.files) == {*NAMES, odd}
    assert formats.detect(sums) == "sha256sum" and formats.detect(sums, name="B3SUMS") == "b3sum"
    for name in ("B3SUMS", "weights.b3"):
        (root / name).write_bytes(sums)
        assert ifs.verify(root, manifest=name).files_checked == len(NAMES) + 1
    (root / "CHECKSUMS").write_bytes(sums)
    assert ifs.verify(root, manifest="CHECKSUMS", manifest_format="b3sum").ok
    assert main(["verify", str(root), "--manifest", "CHECKSUMS", "--manifest-format", "b3sum"]) == 0
    with pytest.raises(IntegrityError) as raised:
        ifs.verify(root, manifest="CHECKSUMS")
    assert "manifest_format='b3sum'" in " ".join(raised.value.__notes__)  # shown with the traceback
    capsys.readouterr()
    assert main(["verify", str(root), "--manifest", "CHECKSUMS"]) == 1
    assert "--manifest-format b3sum" in capsys.readouterr().err.splitlines()[-1]  # the hint line
    _flip(root / "a.bin")
    _must_fail(root, "a.bin", manifest="B3SUMS")


def test_export_b3sum_and_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("blake3")
    from integrity_fs.cli import main

    root = _tree(tmp_path / "b3")
    (root / "new\nline.bin").write_bytes(b"odd")
    ifs.seal(root, algorithm="blake3")
    assert main(["export", str(root), "--format", "b3sum"]) == 0
    (tmp_path / "B3SUMS").write_text(capsys.readouterr().out)
    shutil.which("b3sum") or pytest.skip("b3sum is not installed")
    checked = subprocess.run(["b3sum", "-c", str(tmp_path / "B3SUMS")], cwd=root, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.count(b": OK") == len(NAMES) + 1
    with pytest.raises(ValueError, match="BLAKE3"):
        formats.dump(ifs.seal(_tree(tmp_path / "sha"), overwrite=True), "b3sum")


def test_export_seed_writes_the_seeds_four_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Default manifests carry `sizes`; a seed-era verifier that checks the key set refuses them."""
    from integrity_fs.cli import main

    root = _tree(tmp_path / "ckpt")
    manifest = ifs.seal(root)
    assert "sizes" in json.loads((root / MANIFEST_FILENAME).read_bytes())
    assert main(["export", str(root), "--format", "seed"]) == 0
    data = capsys.readouterr().out.encode()
    seed = json.loads(data)
    assert set(seed) == {"version", "granularity", "algorithm", "files"}  # what the seed's reader checks
    assert seed == {"version": 1, "granularity": "file", "algorithm": "sha256", "files": dict(manifest.files)}
    assert data == Manifest(files=manifest.files).to_json()  # canonical, as the seed writes it
    (root / MANIFEST_FILENAME).write_bytes(data)
    assert ifs.verify(root, strict=True).files_checked == len(NAMES)
    chunked = ifs.seal(_tree(tmp_path / "c"), granularity="chunk", chunk_size=SHARD)
    with pytest.raises(ValueError, match="whole-file SHA-256"):
        formats.dump(chunked, "seed")


def test_sha256sum_zero_output(tmp_path: Path) -> None:
    root = _tree(tmp_path / "ckpt")
    odd = "new\nline.bin"  # --zero never escapes
    (root / odd).write_bytes(b"odd")
    for args in (("--zero",), ("--zero", "--tag")):
        sums = _sha256sum(root, *args, names=[*NAMES, odd])
        assert b"\0" in sums and not sums.startswith(b"\\")
        assert formats.detect(sums) == "sha256sum"
        assert dict(formats.load(sums).files) == {n: _sha256(root / n) for n in [*NAMES, odd]}
        (root / "SHA256SUMS").write_bytes(sums)
        assert ifs.verify(root, manifest="SHA256SUMS", strict=True).files_checked == len(NAMES) + 1


# --- which file --manifest names, and what verifying against it checked ----------------------------


def test_explicit_relative_manifest_paths_are_local_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`verify --manifest ./SHA256SUMS` means the file in the working directory, as in any shell
    command; a bare name stays inside the checkpoint."""
    from integrity_fs.cli import main

    root = _tree(tmp_path / "ckpt")
    work = tmp_path / "work" / "dir"
    work.mkdir(parents=True)
    sums = _sha256sum(root)
    (work / "SHA256SUMS").write_bytes(sums)
    (work.parent / "SHA256SUMS").write_bytes(sums)
    monkeypatch.chdir(work)
    for manifest in ("./SHA256SUMS", "../SHA256SUMS"):
        assert main(["verify", str(root), "--manifest", manifest, "--strict"]) == 0
        assert ifs.verify(root, manifest=manifest, strict=True).files_checked == len(NAMES)
    with pytest.raises(ManifestNotFoundError, match="ckpt/SHA256SUMS"):
        ifs.verify(root, manifest="SHA256SUMS")  # a bare name: inside the root, where there is none
    (root / "SHA256SUMS").write_bytes(sums)
    monkeypatch.chdir(root)
    assert ifs.verify(root, manifest="./SHA256SUMS", strict=True).extra == ()  # the file in use, in the root
    capsys.readouterr()


def test_verify_against_a_bundle_says_its_signature_was_not_checked(
    tmp_path: Path, ec_key: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryptography.hazmat.primitives import serialization

    from integrity_fs.cli import main

    root = _tree(tmp_path / "model")
    _model_sign(root, ec_key, root / "model.sig")
    assert main(["verify", str(root), "--manifest", "model.sig"]) == 0
    out, err = capsys.readouterr()
    assert "against model.sig" in out and "signature was NOT checked" in out
    assert "signature is NOT checked" in err  # the WARNING, for Python callers too
    private = serialization.load_pem_private_key(ec_key.read_bytes(), None)
    public = tmp_path / "key.pub"
    public.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    assert main(["verify", str(root), "--manifest", "model.sig", "--public-key", str(public)]) == 0
    out, err = capsys.readouterr()
    assert "signature checked with" in out and "NOT checked" not in out + err
    (root / "SHA256SUMS").write_bytes(_sha256sum(root))
    assert main(["verify", str(root), "--manifest", "SHA256SUMS"]) == 0
    assert "NOT checked" not in capsys.readouterr().out
