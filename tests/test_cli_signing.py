"""Signing on the command line: seal --sign-key, sign --key, verify --public-key, upload --sign-key."""

from __future__ import annotations

import json
from pathlib import Path

from cli_run import cli, cli_process, flip, make_keys, stderr_pair
from conftest import Backend


def test_signed_seal_catches_a_resealed_tampering(ckpt: Path, tmp_path: Path) -> None:
    keys, other = make_keys(tmp_path), make_keys(tmp_path, "other")
    seal = cli("seal", str(ckpt), "--sign-key", str(keys.private))
    assert seal.returncode == 0, seal.stderr
    assert f"wrote model.sig: the manifest's digests, signed with {keys.private}" in seal.stdout
    ok = cli("verify", str(ckpt), "--public-key", str(keys.public), "--strict")
    assert ok.returncode == 0 and f"signature checked with {keys.public}" in ok.stdout
    assert json.loads(cli("verify", str(ckpt), "--public-key", str(keys.public), "--json").stdout)["signature_checked"]

    wrong = cli("verify", str(ckpt), "--public-key", str(other.public))
    assert wrong.returncode == 1 and "signed by another key" in wrong.stdout
    assert "changed after signing, or was signed by another key" in stderr_pair(wrong)[1]

    signature = (ckpt / "model.sig").read_bytes()
    flip(ckpt / "model.bin", 10)  # the attack: change a shard, re-seal the manifest to match
    resealed = cli("seal", str(ckpt), "--force")
    assert resealed.returncode == 0 and "removed" in resealed.stderr and "model.sig" in resealed.stderr
    assert cli("verify", str(ckpt)).returncode == 0  # what a manifest alone cannot catch
    unsigned = cli("verify", str(ckpt), "--public-key", str(keys.public))
    assert unsigned.returncode == 1 and "not signed" in unsigned.stdout
    (ckpt / "model.sig").write_bytes(signature)  # the attacker puts the old signature back
    caught = cli("verify", str(ckpt), "--public-key", str(keys.public), "--json")
    assert caught.returncode == 1
    report = json.loads(caught.stdout)
    assert report["ok"] is False and [p["path"] for p in report["problems"]] == ["model.bin"]
    assert "model.bin" in report["error"] and "model.bin" in stderr_pair(caught)[0]


def test_sign_verifies_first_and_refuses_unsealed_or_damaged(ckpt: Path, tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    unsealed = cli("sign", str(ckpt), "--key", str(keys.private))
    assert unsealed.returncode == 3 and stderr_pair(unsealed)
    assert cli("seal", str(ckpt)).returncode == 0
    unsigned = cli("verify", str(ckpt), "--public-key", str(keys.public))
    assert unsigned.returncode == 1 and "not signed" in stderr_pair(unsigned)[0]

    flip(ckpt / "optim.bin", 3)
    damaged = cli("sign", str(ckpt), "--key", str(keys.private))
    assert damaged.returncode == 1 and "not signed" in damaged.stdout
    assert "optim.bin" in stderr_pair(damaged)[0] and "nothing was signed" in stderr_pair(damaged)[1]
    assert not (ckpt / "model.sig").exists()
    flip(ckpt / "optim.bin", 3)
    signed = cli("sign", str(ckpt), "--key", str(keys.private))
    assert signed.returncode == 0, signed.stderr
    assert (ckpt / "model.sig").exists() and "wrote model.sig" in signed.stdout
    assert cli("verify", str(ckpt), "--public-key", str(keys.public)).returncode == 0
    assert cli("sign", str(ckpt)).returncode == 2  # --key is required


def test_bad_key_files_are_usage_errors(sealed: Path, tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    (tmp_path / "junk.pem").write_text("not a key")
    for args in (
        ["verify", str(sealed), "--json", "--public-key", str(tmp_path / "missing.pub")],
        ["verify", str(sealed), "--json", "--public-key", str(keys.private)],  # a private key for a public one
        ["sign", str(sealed), "--key", str(tmp_path / "junk.pem")],
        ["seal", str(sealed), "--force", "--sign-key", str(keys.public)],
    ):
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        if "--json" in args:
            assert json.loads(proc.stdout)["exit_code"] == 2
        assert "PEM file of an unencrypted EC key" in stderr_pair(proc)[1]
    assert not (sealed / "model.sig").exists()


def test_signed_upload_to_s3_verifies_with_the_public_key(ckpt: Path, s3: tuple[Backend, list[str]]) -> None:
    backend, options = s3
    keys = make_keys(ckpt.parent)
    target = f"{backend.url}/run/step_1"
    proc = cli("upload", str(ckpt), target, "--chunk-size", "8MiB", "--sign-key", str(keys.private), *options)
    assert proc.returncode == 0, proc.stderr
    assert "wrote model.sig" in proc.stdout
    ok = cli("verify", target, "--public-key", str(keys.public), "--attested", *options)
    assert ok.returncode == 0, ok.stderr
    assert "every file attested" in ok.stdout and "signature checked" in ok.stdout
    latest = cli("latest", f"{backend.url}/run", "--public-key", str(keys.public), *options)
    assert latest.returncode == 0 and latest.stdout.strip() == target


def test_latest_with_a_key_calls_a_checkpoint_that_was_never_sealed_unsealed(ckpt: Path, tmp_path: Path) -> None:
    """A save that died before sealing has neither a manifest nor a signature: it is skipped as
    unsealed, not as a bad signature."""
    keys = make_keys(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    ckpt.rename(run / "step_1000")
    assert cli("seal", str(run / "step_1000"), "--sign-key", str(keys.private)).returncode == 0
    (run / "step_3000").mkdir()
    (run / "step_3000" / "model.bin").write_bytes(b"half written")
    proc = cli("latest", str(run), "--public-key", str(keys.public))
    assert proc.returncode == 0 and proc.stdout == f"{run / 'step_1000'}\n", proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "WARNING: skipping" in line]
    assert len(warnings) == 1 and f"{run / 'step_3000'} (unsealed)" in warnings[0], proc.stderr


def test_signing_without_its_package_says_what_to_install_once(ckpt: Path, tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    proc = cli_process(
        "seal", str(ckpt), "--sign-key", str(keys.private), code="import sys; sys.modules['cryptography'] = None"
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("pip install 'integrity-fs[sign]'") == 1, proc.stderr  # in the error line, not again
    assert "install the package" in stderr_pair(proc)[1]
    assert not (ckpt / "_integrity_manifest.json").exists()
