"""The ``integrity-fs`` command on local paths and S3 (moto): ``main(argv)`` in-process for speed, and real
subprocesses where the process matters (exit status, a terminal, the demo, a missing package)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend

from integrity_fs import MANIFEST_FILENAME
from integrity_fs.cli import main
from integrity_fs.cli.args import build_storage_options, parse_option
from integrity_fs.text import format_bytes, format_work, parse_size, short_digest

TIMEOUT_S = 120
COMMANDS = ["seal", "sign", "verify", "show", "export", "status", "latest", "download", "upload", "copy", "demo"]
FILES = {
    "model.bin": random.Random(1).randbytes(300_000),
    "optim.bin": random.Random(2).randbytes(100_000),
    "sub/meta.json": b'{"step": 1000}\n',
}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, traceback: bool = False) -> Result:
    """``integrity-fs ARGS`` in this process: ``main(argv)`` with stdout and stderr captured (not a terminal)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit:  # --help, --version
            code = int(exit.code or 0)
    result = Result(code, out.getvalue(), err.getvalue())
    assert ("Traceback" in result.stderr) == traceback, result.stderr
    return result


def cli_process(*args: str, timeout: float = TIMEOUT_S, code: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m integrity_fs ARGS`` as a real process (``code``: Python run first, in the same process)."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    run = "import runpy, sys; sys.argv[0] = 'integrity-fs'; runpy.run_module('integrity_fs', run_name='__main__')"
    command = ["-c", f"{code}\n{run}"]
    return subprocess.run(
        [sys.executable, *command, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def error_lines(proc: Result | subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("integrity-fs: error:")]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A local, unsealed checkpoint directory."""
    root = tmp_path / "step_1000"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def sealed(ckpt: Path) -> Path:
    proc = cli("seal", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    return ckpt


@pytest.fixture
def s3(s3_backend: Backend, s3_endpoint: str) -> tuple[Backend, list[str]]:
    """An unsealed checkpoint in the moto bucket, and the -o options that reach it."""
    for name, data in FILES.items():
        s3_backend.write(name, data)
    return s3_backend, ["-o", f"client_kwargs.endpoint_url={s3_endpoint}"]


def manifest_of(root: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((root / MANIFEST_FILENAME).read_text())
    return result


# --------------------------------------------------------------------------- parsing and usage


def test_storage_options_nest_dotted_keys_and_parse_json_values() -> None:
    pairs = [
        parse_option("anon=true"),
        parse_option("x=abc"),
        parse_option("client_kwargs.endpoint_url=http://127.0.0.1:9000"),
        parse_option("config_kwargs.retries.max_attempts=2"),
        parse_option("empty="),
        parse_option("list=[1, 2]"),
        parse_option("query=a=b"),
    ]
    assert build_storage_options(pairs) == {
        "anon": True,
        "x": "abc",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
        "config_kwargs": {"retries": {"max_attempts": 2}},
        "empty": "",
        "list": [1, 2],
        "query": "a=b",
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["-o", "anon"], "has no '='"),
        (["-o", "=true"], "empty key"),
        (["-o", "a..b=1"], "empty key"),
        (["-o", "a=1", "-o", "a.b=2"], "also used as a group"),
    ],
)
def test_bad_option_syntax_is_a_usage_error(sealed: Path, options: list[str], message: str) -> None:
    proc = cli("verify", str(sealed), *options)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_unknown_or_missing_command_is_a_usage_error() -> None:
    unknown = cli("frobnicate")
    assert unknown.returncode == 2 and "invalid choice: 'frobnicate'" in unknown.stderr
    assert cli().returncode == 2


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command: str) -> None:
    proc = cli(command, "--help")
    assert proc.returncode == 0
    assert "example" in proc.stdout and f"integrity-fs {command}" in proc.stdout


def test_top_level_help_lists_commands_and_exit_codes() -> None:
    proc = cli("--help")
    assert proc.returncode == 0
    assert all(command in proc.stdout for command in COMMANDS)
    assert "4  storage or I/O error" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--granularity", "file", "--chunk-size", "1024"],  # ValueError from seal
        ["--chunk-size", "lots"],
        ["--workers", "0"],
    ],
)
def test_bad_seal_arguments_are_usage_errors(ckpt: Path, args: list[str]) -> None:
    proc = cli("seal", str(ckpt), *args)
    assert proc.returncode == 2, proc.stderr
    assert not (ckpt / MANIFEST_FILENAME).exists()


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "integrity-fs"
    if not script.exists():
        pytest.skip("integrity-fs script not installed in this environment")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0 and "integrity-fs" in proc.stdout


# --------------------------------------------------------------------------- seal, verify, show (local)


def test_seal_then_verify_passes(ckpt: Path) -> None:
    seal = cli("seal", str(ckpt))
    assert seal.returncode == 0, seal.stderr
    assert set(manifest_of(ckpt)["files"]) == set(FILES)
    proc = cli("verify", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout and "3 files" in proc.stdout
    assert re.search(r"in [\d.]+ s( at [\d.]+ [KMG]iB/s)?$", proc.stdout.strip())
    assert proc.stderr == ""


def test_seal_refuses_a_sealed_checkpoint_unless_forced(sealed: Path) -> None:
    before = (sealed / MANIFEST_FILENAME).read_bytes()
    flip(sealed / "model.bin", 10)
    proc = cli("seal", str(sealed))
    assert proc.returncode == 2, proc.stderr
    assert "already sealed" in error_lines(proc)[0] and str(sealed) in error_lines(proc)[0]
    assert "integrity-fs: hint: pass --force to replace the manifest (only for content you trust)" in proc.stderr
    assert (sealed / MANIFEST_FILENAME).read_bytes() == before
    assert cli("verify", str(sealed)).returncode == 1  # the damage was not laundered
    forced = cli("seal", str(sealed), "--force")
    assert forced.returncode == 0, forced.stderr
    assert cli("verify", str(sealed)).returncode == 0


def test_corrupted_file_fails_and_is_named(sealed: Path) -> None:
    expected = manifest_of(sealed)["files"]["model.bin"]
    flip(sealed / "model.bin", 1234)
    actual = sha256((sealed / "model.bin").read_bytes())

    proc = cli("verify", str(sealed))
    assert proc.returncode == 1
    assert len(error_lines(proc)) == 1 and "model.bin" in error_lines(proc)[0]
    assert f"model.bin: mismatch (expected {short_digest(expected)}, found {short_digest(actual)})" in proc.stdout
    assert expected not in proc.stdout  # whole digests only in --json
    assert "optim.bin" not in proc.stdout + proc.stderr

    as_json = cli("verify", str(sealed), "--json")
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["url"] == str(sealed)
    assert report["problems"] == [
        {"path": "model.bin", "kind": "mismatch", "expected": expected, "actual": actual, "byte_ranges": []}
    ]
    assert report["files_checked"] == 3 and "elapsed_s" in report


def test_verify_json_on_success(sealed: Path) -> None:
    proc = cli("verify", str(sealed), "--json")
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["bytes_checked"] == sum(len(d) for d in FILES.values())


def test_missing_manifest_exits_3(ckpt: Path) -> None:
    proc = cli("verify", str(ckpt))
    assert proc.returncode == 3
    assert MANIFEST_FILENAME in error_lines(proc)[0] and "integrity-fs seal" in proc.stderr
    as_json = cli("verify", str(ckpt), "--json")
    assert as_json.returncode == 3 and json.loads(as_json.stdout)["ok"] is False


def test_debug_adds_the_traceback(ckpt: Path) -> None:
    proc = cli("verify", str(ckpt), "--debug", traceback=True)
    assert proc.returncode == 3
    assert "ManifestNotFoundError" in proc.stderr and len(error_lines(proc)) == 1


def test_invalid_manifest_exits_3(sealed: Path) -> None:
    (sealed / MANIFEST_FILENAME).write_text("{not json")
    for command in ("verify", "show"):
        proc = cli(command, str(sealed))
        assert proc.returncode == 3
        assert "not valid JSON" in error_lines(proc)[0]


def test_unsupported_algorithm_in_manifest_exits_3(sealed: Path) -> None:
    manifest = manifest_of(sealed)
    manifest["algorithm"] = "md5"
    (sealed / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    proc = cli("verify", str(sealed))
    assert proc.returncode == 3
    assert "md5" in error_lines(proc)[0]


def test_quick_compares_sizes_without_reading(sealed: Path) -> None:
    flip(sealed / "model.bin", 0)  # same size: only a full verify sees it
    assert cli("verify", str(sealed), "--quick").returncode == 0
    assert cli("verify", str(sealed)).returncode == 1
    (sealed / "optim.bin").write_bytes(FILES["optim.bin"][:10])
    proc = cli("verify", str(sealed), "--quick")
    assert proc.returncode == 1
    assert "optim.bin: size (expected 100000 bytes, found 10)" in proc.stdout


def test_strict_rejects_extra_files(sealed: Path) -> None:
    (sealed / "extra.bin").write_bytes(b"not sealed")
    lenient = cli("verify", str(sealed))
    assert lenient.returncode == 0
    assert "extra.bin" in lenient.stdout and "not in the manifest" in lenient.stdout
    strict = cli("verify", str(sealed), "--strict")
    assert strict.returncode == 1
    assert "extra.bin" in error_lines(strict)[0]


def test_a_manifest_listing_no_files_fails_its_files_without_blaming_strict(ckpt: Path) -> None:
    (ckpt / MANIFEST_FILENAME).write_text('{"algorithm": "sha256", "files": {}, "granularity": "file", "version": 1}')
    proc = cli("verify", str(ckpt))
    assert proc.returncode == 1  # it vouches for nothing: every file is a problem, --strict or not
    assert "--strict" not in proc.stdout and "were not checked" not in proc.stdout
    what, hint = stderr_pair(proc)
    assert "model.bin (extra)" in what and "--strict" not in hint and "lists no files" in hint


def test_show_summarises_the_manifest(sealed: Path) -> None:
    proc = cli("show", str(sealed))
    assert proc.returncode == 0
    assert "sha256" in proc.stdout and "file" in proc.stdout
    assert re.search(r"files\s+3\b", proc.stdout)
    assert "400015 bytes" in proc.stdout
    largest = [line.split()[-1] for line in proc.stdout.split("largest files:")[1].splitlines() if line.strip()]
    assert largest == ["model.bin", "optim.bin", "sub/meta.json"]

    summary = json.loads(cli("show", str(sealed), "--json").stdout)
    assert summary["file_count"] == 3 and summary["total_bytes"] == 400_015
    assert summary["largest"][0] == {"path": "model.bin", "size": 300_000}
    assert summary["files"]["optim.bin"]["digest"] == sha256(FILES["optim.bin"])


def test_chunk_manifest_reports_the_corrupt_byte_range(ckpt: Path) -> None:
    seal = cli("seal", str(ckpt), "--granularity", "chunk", "--chunk-size", "64K")
    assert seal.returncode == 0, seal.stderr
    assert manifest_of(ckpt)["chunk_size"] == 65536
    assert "chunk" in cli("show", str(ckpt)).stdout
    flip(ckpt / "model.bin", 100_000)
    proc = cli("verify", str(ckpt))
    assert proc.returncode == 1
    assert "model.bin: mismatch in bytes 65536-131071" in proc.stdout
    report = json.loads(cli("verify", str(ckpt), "--json").stdout)
    assert report["problems"][0]["byte_ranges"] == [[65536, 131072]]


# --------------------------------------------------------------------------- S3 (moto)


def test_s3_seal_verify_and_reject(s3: tuple[Backend, list[str]]) -> None:
    backend, options = s3
    assert cli("seal", backend.url, *options).returncode == 0
    assert MANIFEST_FILENAME in backend.listdir()
    ok = cli("-o", options[1], "verify", backend.url)  # options before the command work too
    assert ok.returncode == 0, ok.stderr
    backend.corrupt("sub/meta.json", 3)
    bad = cli("verify", backend.url, "--json", *options)
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False and [p["path"] for p in report["problems"]] == ["sub/meta.json"]
    assert "sub/meta.json" in error_lines(bad)[0]


def test_s3_missing_manifest_exits_3(s3: tuple[Backend, list[str]]) -> None:
    backend, options = s3
    proc = cli("verify", backend.url, *options)
    assert proc.returncode == 3
    assert backend.url in error_lines(proc)[0]


def test_unreachable_endpoint_is_a_storage_error() -> None:
    proc = cli(
        "verify",
        "s3://bucket/run/step_1000",
        "-o",
        "client_kwargs.endpoint_url=http://127.0.0.1:1",
        "-o",
        "config_kwargs.retries.max_attempts=1",  # fail in one try, to keep the test short
    )
    assert proc.returncode == 4
    assert len(error_lines(proc)) == 1 and "connect" in error_lines(proc)[0].lower()


# --------------------------------------------------------------------------- download


def test_download_verified_checkpoint(s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    assert cli("seal", backend.url, *options).returncode == 0
    backend.write("late.bin", b"written after sealing")
    dest = tmp_path / "downloads" / "step_1000"
    proc = cli("download", backend.url, str(dest), *options)
    assert proc.returncode == 0, proc.stderr
    assert "late.bin" in proc.stdout and "not downloaded" in proc.stdout
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted(
        [*FILES, MANIFEST_FILENAME]
    )
    assert all((dest / name).read_bytes() == data for name, data in FILES.items())
    assert cli("verify", str(dest), "--strict").returncode == 0
    assert os.listdir(dest.parent) == ["step_1000"]  # no staging directory left behind


def test_download_of_corrupt_checkpoint_writes_nothing(s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    assert cli("seal", backend.url, "--chunk-size", "64K", *options).returncode == 0
    backend.corrupt("model.bin", 200_000)
    parent = tmp_path / "downloads"
    parent.mkdir()
    proc = cli("download", backend.url, str(parent / "step_1000"), "--workers", "2", *options)
    assert proc.returncode == 1
    assert "model.bin" in error_lines(proc)[0]
    assert "model.bin: mismatch in bytes 196608-262143" in proc.stdout
    assert os.listdir(parent) == []  # neither DEST nor a staging directory with the corrupt bytes


def test_download_without_manifest_exits_3_and_writes_nothing(s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    proc = cli("download", backend.url, str(tmp_path / "dl" / "step_1000"), *options)
    assert proc.returncode == 3
    assert not (tmp_path / "dl").exists()


def test_download_refuses_a_non_empty_destination(sealed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    proc = cli("download", str(sealed), str(dest))
    assert proc.returncode == 2
    assert "not an empty directory" in error_lines(proc)[0]
    assert os.listdir(dest) == ["keep.txt"]


# --------------------------------------------------------------------------- upload


def test_upload_then_verify(ckpt: Path, s3_backend: Backend, s3_endpoint: str) -> None:
    options = ["-o", f"client_kwargs.endpoint_url={s3_endpoint}"]
    proc = cli("upload", str(ckpt), s3_backend.url, "--granularity", "chunk", "--chunk-size", "64K", *options)
    assert proc.returncode == 0, proc.stderr
    # 64 KiB chunks are parts S3 refuses: sent as plain streams, whose S3 MD5s are recorded beside the manifest.
    assert s3_backend.listdir() == sorted([*FILES, MANIFEST_FILENAME, "_integrity_store_checksums.json"])
    assert all(s3_backend.read(name) == data for name, data in FILES.items())
    manifest = json.loads(s3_backend.read(MANIFEST_FILENAME))
    assert manifest["granularity"] == "chunk" and len(manifest["chunks"]["model.bin"]) == 5
    assert manifest["files"]["sub/meta.json"] != sha256(FILES["sub/meta.json"])  # a chunk-derived digest
    assert cli("verify", s3_backend.url, "--strict", *options).returncode == 0

    again = cli("upload", str(ckpt), s3_backend.url, *options)
    assert again.returncode == 2 and "already holds a sealed checkpoint" in error_lines(again)[0]


@pytest.mark.parametrize("granularity", [["--granularity", "file"], ["--chunk-size", "64K"]])
def test_upload_to_local_url_gives_the_same_manifest_as_seal(
    ckpt: Path, tmp_path: Path, granularity: list[str]
) -> None:
    """The digests computed while streaming equal seal's, chunk boundaries included."""
    (ckpt / "empty.bin").write_bytes(b"")
    (ckpt / "exact.bin").write_bytes(bytes(2 * 65536))  # ends on a chunk boundary
    target = tmp_path / "uploaded"
    assert cli("upload", str(ckpt), f"file://{target}", *granularity).returncode == 0
    assert cli("seal", str(ckpt), *granularity).returncode == 0
    assert (target / MANIFEST_FILENAME).read_bytes() == (ckpt / MANIFEST_FILENAME).read_bytes()


# --------------------------------------------------------------------------- demo and progress


def test_demo_catches_the_flipped_byte() -> None:
    # Without torch the demo writes random shards instead of a state dict: the same steps, 10 s sooner.
    proc = cli_process("demo", "--no-progress", code="import sys; sys.modules['torch'] = None")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    victim = re.search(r"Flipped one bit of byte \d+ of (\S+) in the bucket", proc.stdout)
    assert victim, proc.stdout
    assert f"{victim.group(1)}: mismatch in bytes" in proc.stdout
    assert "refused" in proc.stdout and "Demo complete" in proc.stdout
    assert not re.search(r"integrity-fs \w+ \S*integrity-fs-demo-", proc.stdout)  # no command for a deleted dir


def run_on_terminal(*args: str, code: str = "") -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; returns the exit code and what the terminal got.

    ``code`` runs first in the same interpreter (to hide a package, say)."""
    pty = pytest.importorskip("pty")
    fcntl = pytest.importorskip("fcntl")
    termios = pytest.importorskip("termios")
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{code}\nimport runpy; runpy.run_module('integrity_fs', run_name='__main__')", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=terminal,
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(controller, 4096)
        except OSError as exc:  # EIO: the child closed the terminal
            assert exc.errno == errno.EIO
            break
        if not data:
            break
        chunks.append(data)
    os.close(controller)
    return proc.wait(timeout=TIMEOUT_S), b"".join(chunks).decode(errors="replace")


def test_progress_bar_only_on_a_terminal(sealed: Path) -> None:
    pytest.importorskip("tqdm")
    piped = cli("verify", str(sealed))
    assert piped.returncode == 0 and "\r" not in piped.stderr and piped.stderr == ""

    code, terminal = run_on_terminal("verify", str(sealed))
    assert code == 0
    assert "\r" in terminal and "verify" in terminal and "B/s" in terminal  # a tqdm bar: label, rate

    code, terminal = run_on_terminal("verify", str(sealed), "--no-progress")
    assert code == 0 and "\r" not in terminal


def test_without_tqdm_a_terminal_gets_no_noise(sealed: Path) -> None:
    """Issue 11: a half-built TqdmCallback printed 'Exception ignored in ... __del__' on every command."""
    code, terminal = run_on_terminal("verify", str(sealed), code="import sys; sys.modules['tqdm'] = None")
    assert code == 0 and terminal == ""


# --------------------------------------------------------------------------- what a new user meets


def stderr_pair(proc: Result | subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """The two stderr lines every error prints: what failed, then the hint."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("integrity-fs: ")]
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("integrity-fs: error: ") and lines[1].startswith("integrity-fs: hint: ")
    return lines[0], lines[1]


@pytest.mark.parametrize("args", [["-o", "noequals"], ["--workers", "0"], ["--bogus"]])
def test_json_argument_errors_print_one_json_object(sealed: Path, args: list[str]) -> None:
    proc = cli("verify", str(sealed), "--json", *args)
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"url": None, "ok": False, "exit_code": 2, "error": stderr_pair(proc)[0][21:]}
    assert "help" in stderr_pair(proc)[1]


def test_a_missing_path_is_a_path_problem_not_an_unsealed_checkpoint(tmp_path: Path) -> None:
    for target in (tmp_path / "typo", tmp_path / "a-file"):
        if target.name == "a-file":
            target.write_text("x")
        proc = cli("seal", str(target))
        assert proc.returncode == 4
        error, hint = stderr_pair(proc)
        assert str(target) in error and "check the path" in hint and "seal" not in hint and "credential" not in hint


def test_library_file_not_found_maps_to_exit_4_with_a_path_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 10 item 15: once verify raises FileNotFoundError for a missing root, the CLI says so."""

    def missing(url: str, **kw: object) -> None:
        raise FileNotFoundError(f"no checkpoint at {url}")

    monkeypatch.setattr("integrity_fs.cli.launch.verify", missing)
    proc = cli("verify", str(tmp_path / "typo"))
    assert proc.returncode == 4 and "check the path" in stderr_pair(proc)[1]
    remote = cli("verify", "s3://bucket/typo")
    assert remote.returncode == 4 and "bucket and prefix" in stderr_pair(remote)[1]


def test_strict_failure_hints_at_the_extra_files_not_a_restore(sealed: Path) -> None:
    (sealed / "extra.bin").write_bytes(b"x")
    hint = stderr_pair(cli("verify", str(sealed), "--strict"))[1]
    assert "not in the manifest" in hint and "restore" not in hint


def test_refusals_exit_2_with_a_hint(sealed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    proc = cli("download", str(sealed), str(dest))
    assert proc.returncode == 2 and "choose a new DEST" in stderr_pair(proc)[1]
    target = tmp_path / "up"
    assert cli("upload", str(sealed), str(target)).returncode == 0
    again = cli("upload", str(sealed), str(target))
    assert again.returncode == 2 and "--force" in stderr_pair(again)[1]
    assert cli("upload", str(sealed), str(target), "--force").returncode == 0
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "empty", target_is_directory=True)
    (tmp_path / "empty").mkdir()
    assert cli("download", str(sealed), str(link)).returncode == 2 and (tmp_path / "empty").is_dir()


def test_disk_full_gets_a_disk_hint(monkeypatch: pytest.MonkeyPatch, sealed: Path, tmp_path: Path) -> None:
    def full(*args: object, **kw: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "d" / "model.bin"))

    monkeypatch.setattr("integrity_fs.transfer.download", full)
    proc = cli("download", str(sealed), str(tmp_path / "d"))
    assert proc.returncode == 4 and "disk is full" in stderr_pair(proc)[1]


def test_missing_backend_says_which_extra_to_install() -> None:
    proc = cli_process("verify", "s3://bucket/x", code="import sys; sys.modules['s3fs'] = None")
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'integrity-fs[s3]'" in stderr_pair(proc)[1]


def test_demo_without_its_dependencies_says_what_to_install() -> None:
    proc = cli_process("demo", code="import sys; sys.modules['moto'] = None; sys.modules['moto.server'] = None")
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'integrity-fs[demo]'" in stderr_pair(proc)[1]


def test_custom_gcs_endpoint_does_not_stall(gcs_backend: Backend, gcs_endpoint: str, tmp_path: Path) -> None:
    """Without GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false, gcsfs probes each bucket over gRPC (45-90 s here)."""
    (tmp_path / "a.bin").write_bytes(b"a")
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    options = ["-o", f"endpoint_url={gcs_endpoint}", "-o", "token=anon"]
    proc = subprocess.run(
        [sys.executable, "-m", "integrity_fs", "upload", str(tmp_path), gcs_backend.url, *options],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("text", "size"),
    [
        *[("64MiB", 64 * 2**20), ("64Mi", 64 * 2**20), ("64M", 64 * 2**20), ("64MB", 64 * 10**6), ("1kB", 1000)],
        *[("1 KiB", 1024), ("5", 5), ("2GB", 2 * 10**9), ("1g", 2**30)],
    ],
)
def test_chunk_sizes_mean_what_they_say(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_seal_chunk_size_in_decimal_units(ckpt: Path) -> None:
    assert cli("seal", str(ckpt), "--chunk-size", "64kB").returncode == 0
    assert manifest_of(ckpt)["chunk_size"] == 64_000


@pytest.mark.parametrize("text", ["0", "lots", "64XB", "-1M", "1.5M"])
def test_bad_chunk_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_sizes_print_in_binary_units() -> None:
    assert [format_bytes(n) for n in (5, 1536, 64 * 2**20, 3 * 2**40)] == ["5 B", "1.5 KiB", "64.0 MiB", "3.0 TiB"]
    assert format_work(1, 10, 0.001) == "1 file, 10 B in 0.00 s"  # no rate from a time that rounds to zero
    assert format_work(2, 3 * 2**20, 0.5) == "2 files, 3.0 MiB in 0.50 s at 6.0 MiB/s"


def test_texts_read_as_english(sealed: Path) -> None:
    (sealed / "extra.bin").write_bytes(b"x")
    assert "1 file is not in the manifest and was not checked" in cli("verify", str(sealed)).stdout
    (sealed / "optim.bin").write_bytes(b"short")
    quick = cli("verify", str(sealed), "--quick").stdout.splitlines()[0]
    assert quick.startswith("FAILED") and not re.search(r"\([^)]*\(", quick)  # no nested parentheses
    assert "MB/s" not in cli("seal", str(sealed / "sub")).stdout


@pytest.mark.parametrize(("command", "ignored"), [("show", ["--workers", "--no-progress"]), ("demo", ["--option"])])
def test_help_lists_no_option_the_command_ignores(command: str, ignored: list[str]) -> None:
    out = cli(command, "--help").stdout
    assert not [option for option in ignored if option in out]


def test_copy_between_urls(sealed: Path, s3: tuple[Backend, list[str]], tmp_path: Path) -> None:
    backend, options = s3
    assert cli("upload", str(sealed), f"{backend.url}/copy-src", "--dst-o", "x=1", *options).returncode == 2
    assert cli("upload", str(sealed), f"{backend.url}/copy-src", *options).returncode == 0
    proc = cli("copy", f"{backend.url}/copy-src", str(tmp_path / "copied"), "--src-o", options[1])
    assert proc.returncode == 0, proc.stderr
    assert "copied and verified" in proc.stdout
    assert cli("verify", str(tmp_path / "copied"), "--strict").returncode == 0


@pytest.mark.parametrize("page", ["README.md", "docs/cli.md"])
def test_docs_failure_sample_is_what_the_cli_prints(tmp_path: Path, page: str) -> None:
    text = (Path(__file__).resolve().parent.parent / page).read_text(encoding="utf-8")
    sample = text.split("$ integrity-fs verify /data/step_1000\n", 1)[1].split("```", 1)[0].splitlines()
    root = tmp_path / "step_1000"
    root.mkdir()
    (root / "model.pt").write_bytes(random.Random(3).randbytes(3 * 2**20))
    assert cli("seal", str(root), "--chunk-size", "1MiB").returncode == 0
    flip(root / "model.pt", 2**20 + 5)
    proc = cli("verify", str(root))
    assert proc.returncode == 1

    def shape(lines: list[str]) -> list[str]:
        return [re.sub(r"[0-9a-f]{8}…[0-9a-f]{8}", "<digest>", line.replace(str(tmp_path), "/data")) for line in lines]

    assert shape(proc.stdout.splitlines() + proc.stderr.splitlines()) == shape(sample)


# --------------------------------------------------------------------------- attested, other formats (issues 12, 13)


def test_verify_attested_confirms_s3_files_unread(ckpt: Path, s3_backend: Backend, s3_endpoint: str) -> None:
    options = ["-o", f"client_kwargs.endpoint_url={s3_endpoint}"]
    assert cli("upload", str(ckpt), s3_backend.url, *options).returncode == 0  # files up to 64 MiB: one PUT each
    proc = cli("verify", s3_backend.url, "--attested", *options)
    assert proc.returncode == 0, proc.stderr
    assert "every file attested by the store, none read (--attested)" in proc.stdout
    report = json.loads(cli("verify", s3_backend.url, "--attested", "--json", *options).stdout)
    assert report["files_attested"] == 3 and report["files_checked"] == 3 and report["bytes_checked"] == 0
    assert report["attested"] is True
    plain = json.loads(cli("verify", s3_backend.url, "--json", *options).stdout)
    assert plain["files_attested"] == 0 and plain["bytes_checked"] == sum(map(len, FILES.values()))

    s3_backend.write("optim.bin", FILES["optim.bin"])  # the same bytes, put by another tool: no checksum
    mixed = cli("verify", s3_backend.url, "--attested", *options)
    assert mixed.returncode == 0 and "2 files attested by the store unread, the rest hashed" in mixed.stdout
    s3_backend.corrupt("model.bin", 5)  # rewritten without a checksum: read, and caught
    bad = cli("verify", s3_backend.url, "--attested", *options)
    assert bad.returncode == 1 and "model.bin" in stderr_pair(bad)[0]


def test_verify_attested_on_local_disk_hashes_every_file(sealed: Path) -> None:
    proc = cli("verify", str(sealed), "--attested")
    assert proc.returncode == 0 and "no file attested by the store, all hashed (--attested)" in proc.stdout


def test_export_writes_other_formats_that_verify_reads_back(sealed: Path) -> None:
    sums = cli("export", str(sealed), "--format", "sha256sum")
    assert sums.returncode == 0, sums.stderr
    assert sums.stdout.splitlines() == [f"{sha256(FILES[name])}  {name}" for name in sorted(FILES)]
    megatron = cli("export", str(sealed), "--format", "megatron")
    assert json.loads(megatron.stdout) == {"algorithm": "sha256", "files": manifest_of(sealed)["files"]}

    (sealed / "SHA256SUMS").write_text(sums.stdout)
    (sealed / MANIFEST_FILENAME).unlink()
    proc = cli("verify", str(sealed), "--manifest", "SHA256SUMS", "--strict")
    assert proc.returncode == 0, proc.stderr
    assert "; against SHA256SUMS" in proc.stdout
    assert json.loads(cli("verify", str(sealed), "--manifest", "SHA256SUMS", "--json").stdout)["manifest"] == (
        "SHA256SUMS"
    )
    flip(sealed / "optim.bin", 7)
    bad = cli("verify", str(sealed), "--manifest", str(sealed / "SHA256SUMS"))
    assert bad.returncode == 1 and "optim.bin: mismatch" in bad.stdout and "optim.bin" in stderr_pair(bad)[0]
    missing = cli("verify", str(sealed), "--manifest", "integrity.json")
    assert missing.returncode == 3 and "check --manifest" in stderr_pair(missing)[1]


def test_export_refuses_what_the_format_cannot_hold(ckpt: Path) -> None:
    unsealed = cli("export", str(ckpt), "--format", "sha256sum")
    assert unsealed.returncode == 3 and unsealed.stdout == ""
    assert cli("seal", str(ckpt), "--chunk-size", "64K").returncode == 0
    chunked = cli("export", str(ckpt), "--format", "megatron")
    assert chunked.returncode == 2 and chunked.stdout == ""
    error, hint = stderr_pair(chunked)
    assert "chunk granularity" in error and "whole-file SHA-256" in hint
    assert cli("export", str(ckpt), "--format", "md5sum").returncode == 2


def test_exported_sha256sums_pass_coreutils(sealed: Path) -> None:
    """Through a real stdout (bytes, not text): what `sha256sum -c` reads, odd names included."""
    if subprocess.run(["sha256sum", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no coreutils sha256sum")
    for name in ("with space.bin", "ünïcode.bin", "new\nline.bin"):
        (sealed / name).write_bytes(name.encode())
    assert cli("seal", str(sealed), "--force").returncode == 0
    proc = cli_process("export", str(sealed), "--format", "sha256sum")
    assert proc.returncode == 0, proc.stderr
    check = subprocess.run(
        ["sha256sum", "-c", "--strict"], input=proc.stdout, capture_output=True, text=True, cwd=sealed
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == len(FILES) + 3


# --------------------------------------------------------------------------- a run's checkpoints (issue 14)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """step_4 unsealed, step_3 damaged (same size), step_2 truncated, step_1 good, step_0 invalid."""
    root = tmp_path / "run"
    for step in range(5):
        for name, data in FILES.items():
            (root / f"step_{step}" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / f"step_{step}" / name).write_bytes(data)
        if step != 4:
            assert cli("seal", str(root / f"step_{step}")).returncode == 0
    flip(root / "step_3" / "model.bin", 99)
    (root / "step_2" / "optim.bin").write_bytes(b"short")
    (root / "step_0" / MANIFEST_FILENAME).write_text("{not json")
    return root


def test_status_lists_every_checkpoint_with_its_verdict(run: Path) -> None:
    proc = cli("status", str(run))
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[:2] for line in lines] == [
        ["step_4", "unsealed"],
        ["step_3", "sealed"],
        ["step_2", "sealed"],
        ["step_1", "sealed"],
        ["step_0", "sealed"],
    ]
    verdicts = {line[0]: " ".join(line[6:]) for line in lines}
    assert verdicts["step_3"] == "sizes ok"  # quick: a flipped bit keeps the size, and it says what it checked
    assert verdicts["step_2"] == "damaged: optim.bin (size)"
    assert verdicts["step_4"] == "unsealed" and verdicts["step_1"] == "sizes ok"
    assert verdicts["step_0"].startswith("invalid: ") and "not valid JSON" in verdicts["step_0"]
    assert lines[1][2:6] == ["3", "files", "390.6", "KiB"]

    full = cli("status", str(run), "--full", "--json")
    assert full.returncode == 0, full.stderr
    found = json.loads(full.stdout)
    assert [c["name"] for c in found] == ["step_4", "step_3", "step_2", "step_1", "step_0"]
    assert set(found[0]) == {"name", "url", "sealed", "files", "bytes", "verdict", "problems", "checked"}
    assert [c["verdict"] for c in found] == ["unsealed", "damaged", "damaged", "ok", "invalid"]
    assert found[1]["problems"][0]["path"] == "model.bin" and found[1]["url"] == str(run / "step_3")
    assert found[3] == {
        "name": "step_1",
        "url": str(run / "step_1"),
        "sealed": True,
        "files": 3,
        "bytes": sum(map(len, FILES.values())),
        "verdict": "ok",
        "problems": [],
        "checked": "content",
    }
    quick = json.loads(cli("status", str(run), "--json").stdout)
    assert {c["checked"] for c in quick} == {"sizes"} and quick[1]["verdict"] == "ok"
    assert [line.split()[-1] for line in cli("status", str(run), "--full").stdout.splitlines()][3] == "ok"


def test_status_lists_a_checkpoint_of_an_unsupported_algorithm_as_invalid(run: Path) -> None:
    manifest = manifest_of(run / "step_1")
    (run / "step_1" / MANIFEST_FILENAME).write_text(json.dumps({**manifest, "algorithm": "md5"}))
    proc = cli("status", str(run), "--json")
    assert proc.returncode == 0, proc.stderr  # exit 0 whatever the verdicts
    found = {c["name"]: c for c in json.loads(proc.stdout)}
    assert len(found) == 5 and found["step_1"]["verdict"] == "invalid" and found["step_1"]["sealed"]
    human = cli("status", str(run))
    rows = {line.split()[0]: " ".join(line.split()[6:]) for line in human.stdout.splitlines()}
    assert human.returncode == 0 and rows["step_1"].startswith("invalid: unsupported hash algorithm 'md5'")


def test_status_of_a_missing_root_is_a_storage_error(tmp_path: Path) -> None:
    proc = cli("status", str(tmp_path / "typo"), "--json")
    assert proc.returncode == 4
    assert json.loads(proc.stdout)["url"] == str(tmp_path / "typo")
    assert str(tmp_path / "typo") in stderr_pair(proc)[0] and "check the path" in stderr_pair(proc)[1]
    assert "run's directory" in stderr_pair(proc)[1]  # ROOT holds checkpoints; it is not one
    (tmp_path / "file").write_bytes(b"x")
    for command in ("status", "latest"):
        on_a_file = cli(command, str(tmp_path / "file"))
        assert on_a_file.returncode == 4 and "run's directory" in stderr_pair(on_a_file)[1]
    (tmp_path / "empty").mkdir()
    empty = cli("status", str(tmp_path / "empty"), "--json")
    assert empty.returncode == 0 and json.loads(empty.stdout) == []


def test_status_on_s3_and_an_unreachable_store(s3: tuple[Backend, list[str]]) -> None:
    backend, options = s3
    for step in (1, 2):
        assert cli("upload", str(Path(__file__).parent), f"{backend.url}/run/step_{step}", *options).returncode == 0
    proc = cli("status", f"{backend.url}/run", "--full", *options)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["step_2", "step_1"]
    unreachable = ["-o", "client_kwargs.endpoint_url=http://127.0.0.1:1", "-o", "config_kwargs.retries.max_attempts=1"]
    down = cli("status", "s3://bucket/run", *unreachable)
    assert down.returncode == 4 and down.stdout == "" and stderr_pair(down)


def test_progress_bar_for_status_full(run: Path) -> None:
    pytest.importorskip("tqdm")
    code, terminal = run_on_terminal("status", str(run), "--full")
    assert code == 0 and "\r" in terminal and "status" in terminal


def test_latest_prints_the_newest_checkpoint_that_verifies(run: Path) -> None:
    proc = cli("latest", str(run))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{run / 'step_1'}\n"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("integrity-fs: WARNING: skipping")]
    assert [w.split()[3] for w in warnings] == [str(run / f"step_{n}") for n in (4, 3, 2)]
    assert "(unsealed)" in warnings[0] and "(damaged)" in warnings[1] and "model.bin" in warnings[1]
    assert not error_lines(proc)
    quick = cli("latest", str(run), "--quick")
    assert quick.returncode == 0 and quick.stdout == f"{run / 'step_3'}\n"  # names and sizes only

    flip(run / "step_1" / "sub" / "meta.json", 0)
    none = cli("latest", str(run))
    assert none.returncode == 1 and none.stdout == ""
    last = none.stderr.splitlines()[-2:]  # after the WARNING lines, the usual two
    assert last[0] == f"integrity-fs: error: no checkpoint under {run} verifies"
    assert last[1].startswith("integrity-fs: hint: ") and "WARNING" in last[1]
    assert "(invalid manifest)" in none.stderr


def test_status_and_latest_given_a_checkpoint_instead_of_its_run_say_so(sealed: Path) -> None:
    """ROOT is the run's directory; a checkpoint given by mistake (its sub/ is no checkpoint) gets a hint."""
    none = cli("latest", str(sealed))
    assert none.returncode == 1 and none.stdout == ""
    what, hint = none.stderr.splitlines()[-2:]  # after the WARNING line of sub/ (unsealed)
    assert what == f"integrity-fs: error: no checkpoint under {sealed} verifies"
    assert f"{sealed} is itself a sealed checkpoint" in hint and f"integrity-fs verify {sealed}" in hint
    status = cli("status", str(sealed), "--json")
    assert status.returncode == 0 and [c["name"] for c in json.loads(status.stdout)] == ["sub"]
    assert f"{sealed} is itself a sealed checkpoint" in status.stderr

    empty = sealed.parent / "empty"
    empty.mkdir()
    nothing = cli("latest", str(empty))
    assert nothing.returncode == 1 and nothing.stdout == "" and "WARNING" not in nothing.stderr  # none skipped
    what, hint = stderr_pair(nothing)
    assert what == f"integrity-fs: error: no checkpoint under {empty} verifies: it holds no checkpoint directory"
    assert "WARNING" not in hint and "one directory per checkpoint" in hint


# --------------------------------------------------------------------------- signing, algorithms (issue 16)


@dataclass
class KeyPair:
    private: Path
    public: Path


def make_keys(directory: Path, name: str = "signing-key") -> KeyPair:
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pair = KeyPair(directory / f"{name}.pem", directory / f"{name}.pub")
    pair.private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pair.public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pair


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
    target = f"{backend.url}/signed"
    proc = cli("upload", str(ckpt), target, "--chunk-size", "8MiB", "--sign-key", str(keys.private), *options)
    assert proc.returncode == 0, proc.stderr
    assert "wrote model.sig" in proc.stdout
    ok = cli("verify", target, "--public-key", str(keys.public), "--attested", *options)
    assert ok.returncode == 0, ok.stderr
    assert "every file attested" in ok.stdout and "signature checked" in ok.stdout
    latest = cli("latest", backend.url, "--public-key", str(keys.public), *options)
    assert latest.returncode == 0 and latest.stdout.strip() == target


def test_seal_and_upload_with_blake3(ckpt: Path, tmp_path: Path) -> None:
    pytest.importorskip("blake3")
    target = tmp_path / "uploaded"
    assert cli("upload", str(ckpt), str(target), "--algorithm", "blake3").returncode == 0
    proc = cli("seal", str(ckpt), "--algorithm", "blake3")
    assert proc.returncode == 0 and "blake3, file granularity" in proc.stdout
    assert manifest_of(ckpt)["algorithm"] == "blake3"
    assert (target / MANIFEST_FILENAME).read_bytes() == (ckpt / MANIFEST_FILENAME).read_bytes()
    assert cli("verify", str(target)).returncode == 0
    export = cli("export", str(ckpt), "--format", "sha256sum")
    assert export.returncode == 2 and "blake3" in stderr_pair(export)[0]
    assert cli("seal", str(ckpt), "--force", "--algorithm", "md5").returncode == 2


def test_seal_with_blake3_missing_says_what_to_install(ckpt: Path) -> None:
    proc = cli_process("seal", str(ckpt), "--algorithm", "blake3", code="import sys; sys.modules['blake3'] = None")
    assert proc.returncode == 3, proc.stderr
    assert "pip install 'integrity-fs[blake3]'" in stderr_pair(proc)[1]
    assert not (ckpt / MANIFEST_FILENAME).exists()


def test_no_file_or_checkpoint_name_can_add_lines_to_the_output(tmp_path: Path) -> None:
    """Names are data: a newline or an escape sequence in one is shown escaped, so that a crafted
    name cannot print a fake "verified" line or a fake status row (or recolour the terminal)."""
    fake = "x\nverified ckpt: 3 files, 1.0 KiB in 0.01 s\x1b[0m"
    ckpt = tmp_path / "run" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / fake).write_bytes(b"a" * 100)
    (ckpt / "b.bin").write_bytes(b"b" * 100)
    assert cli("seal", str(ckpt)).returncode == 0
    (ckpt / fake).write_bytes(b"c" * 100)
    (ckpt / f"extra{fake}").write_bytes(b"d")

    verify = cli("verify", str(ckpt))
    assert verify.returncode == 1
    assert not any(line.startswith("verified") for line in verify.stdout.splitlines()), verify.stdout
    assert "\x1b" not in verify.stdout + verify.stderr
    assert "x\\nverified ckpt" in verify.stdout and "x\\nverified ckpt" in verify.stderr

    (tmp_path / "run" / "step_2\nstep_0  sealed    2 files  200 B  ok").mkdir()
    status = cli("status", str(tmp_path / "run"))
    assert status.returncode == 0, status.stderr
    assert len(status.stdout.splitlines()) == 2, status.stdout
    assert "step_2\\nstep_0" in status.stdout


def test_main_in_process_leaves_the_callers_logging_as_it_was(sealed: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A program that calls main() keeps its own logging: integrity_fs's records propagate to it
    afterwards, and no handler is left on a stream that main() was given (closed since)."""
    logger = logging.getLogger("integrity_fs")
    stream = io.StringIO()
    with contextlib.redirect_stderr(stream), contextlib.redirect_stdout(io.StringIO()):
        assert main(["verify", str(sealed)]) == 0
    stream.close()
    assert logger.propagate and logger.level == logging.NOTSET
    assert not [h for h in logger.handlers if getattr(h, "stream", None) is stream]
    with caplog.at_level(logging.WARNING, logger="integrity_fs"):
        logging.getLogger("integrity_fs.core").warning("after main()")
    assert "after main()" in caplog.text


# --------------------------------------------------------------------------- trust at the edges, round 3


class RewriteOnFirstBytes:
    """A progress callback that, when the first bytes are counted, replaces ``victims`` with new
    files (their bytes, or ``data``): another writer at work while the command reads. The CLI
    passes its progress callback to the library, so this is the CLI's own read that sees it."""

    def __init__(self, victims: list[Path], data: bytes | None = None) -> None:
        self.victims, self.data, self.done = victims, data, False

    def set_size(self, size: int) -> None:
        pass

    def relative_update(self, inc: int = 1) -> None:
        if self.done:
            return
        self.done = True
        for victim in self.victims:
            fresh = victim.with_name(victim.name + ".new")
            fresh.write_bytes(victim.read_bytes() if self.data is None else self.data)
            os.replace(fresh, victim)  # a new inode: seen however fine the clock


def rewrite_while_read(monkeypatch: pytest.MonkeyPatch, victims: list[Path], data: bytes | None = None) -> None:
    from integrity_fs.cli import output

    @contextlib.contextmanager
    def progress(args: Any, desc: str, *, enabled: bool = True) -> Any:
        yield RewriteOnFirstBytes(victims, data)

    monkeypatch.setattr(output, "progress", progress)


#: Files read in several blocks: progress is counted, and another writer can act, mid-read.
LARGE = {"model.bin": random.Random(3).randbytes(3 << 20), "optim.bin": random.Random(4).randbytes(2 << 20)}


def write_large(root: Path) -> Path:
    root.mkdir(parents=True)
    for name, data in LARGE.items():
        (root / name).write_bytes(data)
    return root


@pytest.mark.parametrize("command", ["verify", "seal", "sign", "download", "upload", "copy"])
def test_a_file_changed_while_read_exits_4_with_the_writers_hint(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue round 3, item 17: another writer replaces the files (or, for sign, the manifest) while
    the command reads them: exit 4, "run again once writers are done", and nothing written."""
    ckpt = write_large(tmp_path / "step_1")
    if command != "seal":
        assert cli("seal", str(ckpt)).returncode == 0
    contents = [ckpt / name for name in LARGE]
    dest = tmp_path / "dest"
    args = {
        "verify": ["verify", str(ckpt)],
        "seal": ["seal", str(ckpt)],
        "download": ["download", str(ckpt), str(dest)],
        "upload": ["upload", str(ckpt), str(dest)],
        "copy": ["copy", str(ckpt), str(dest)],
    }
    if command == "sign":
        keys = make_keys(tmp_path)
        resealed = {k: v for k, v in manifest_of(ckpt).items() if k != "sizes"}  # sealed again, the seed's way
        rewrite_while_read(monkeypatch, [ckpt / MANIFEST_FILENAME], json.dumps(resealed).encode())
        proc = cli("sign", str(ckpt), "--key", str(keys.private), "--workers", "1")
    else:
        rewrite_while_read(monkeypatch, contents)
        proc = cli(*args[command], "--workers", "1")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    what, hint = stderr_pair(proc)
    assert "changed while" in what and "unexpected" not in what
    assert hint == "integrity-fs: hint: a file changed while it was read: run again once writers are done"
    assert not (ckpt / "model.sig").exists()
    assert not dest.exists() or not list(dest.iterdir())  # upload and copy leave the empty directory they made
    if command == "seal":
        assert not (ckpt / MANIFEST_FILENAME).exists()


def test_status_and_latest_show_a_checkpoint_changing_while_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status --full shows the verdict "changing"; latest skips it, saying so, and goes on."""
    run = tmp_path / "run"
    for step in (1, 2):
        assert cli("seal", str(write_large(run / f"step_{step}"))).returncode == 0
    rewrite_while_read(monkeypatch, [run / "step_2" / name for name in LARGE])
    status = cli("status", str(run), "--full", "--workers", "1")
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: " ".join(line.split()[6:]) for line in status.stdout.splitlines()}
    assert rows["step_2"].startswith("changing: ") and "run again once writers are done" in rows["step_2"]
    assert rows["step_1"] == "ok"

    rewrite_while_read(monkeypatch, [run / "step_2" / name for name in LARGE])
    latest = cli("latest", str(run), "--workers", "1")
    assert latest.returncode == 0 and latest.stdout == f"{run / 'step_1'}\n"
    assert f"skipping {run / 'step_2'} (changed while it was read)" in latest.stderr


def test_latest_of_a_root_that_is_not_there_is_a_path_problem(run: Path) -> None:
    """Item 22: a mistyped ROOT is exit 4 with a path hint, told apart from "none verifies" (exit 1)."""
    typo = cli("latest", str(run) + "x")
    assert typo.returncode == 4 and typo.stdout == ""
    what, hint = stderr_pair(typo)
    assert str(run) + "x" in what and "check the path" in hint and "create ROOT first" in hint
    assert "WARNING" not in typo.stderr
    for step in range(5):
        shutil.rmtree(run / f"step_{step}")
    empty = cli("latest", str(run))
    assert empty.returncode == 1 and "holds no checkpoint directory" in stderr_pair(empty)[0]


def test_latest_shows_a_progress_bar_while_it_hashes(run: Path) -> None:
    pytest.importorskip("tqdm")
    code, terminal = run_on_terminal("latest", str(run))
    assert code == 0 and "\r" in terminal and "latest" in terminal
    code, terminal = run_on_terminal("latest", str(run), "--no-progress")
    assert code == 0 and not re.search("\r(?!\n)", terminal)  # the WARNING lines end in a terminal's \r\n


@pytest.mark.parametrize("command", [["show"], ["export", "--format", "sha256sum"], ["latest"], ["verify"], ["status"]])
def test_the_common_options_are_accepted_by_every_command_they_can_be_given_to(
    command: list[str], sealed: Path
) -> None:
    """Item 24: --workers and --no-progress after any command that reads a checkpoint."""
    url = str(sealed.parent) if command[0] in ("latest", "status") else str(sealed)
    proc = cli(command[0], url, *command[1:], "--workers", "2", "--no-progress")
    assert proc.returncode == 0, proc.stderr


def test_bar_and_summary_agree_on_binary_units(sealed: Path) -> None:
    """Item 26: tqdm's unit_scale printed "kB"/"MB" for KiB/MiB (and a rate in 1000s); the bar
    now prints what the summary prints."""
    pytest.importorskip("tqdm")
    code, terminal = run_on_terminal("verify", str(sealed))
    assert code == 0 and "\r" in terminal
    assert "KiB" in terminal and "B/s" in terminal
    assert not re.search(r"\d(?:[kKMG])B\b", terminal), terminal  # tqdm's own: 391kB, 1.2MB/s


def test_debug_tracebacks_chain_nothing_from_the_progress_bar(tmp_path: Path) -> None:
    """Item 26: with no bar to draw, the command's own error chained an ImportError under --debug."""
    proc = cli("--debug", "verify", str(tmp_path / "typo"), traceback=True)
    assert proc.returncode == 4
    assert "ImportError" not in proc.stderr and "progress_bar" not in proc.stderr, proc.stderr


def test_no_gcs_traceback_without_debug(tmp_path: Path) -> None:
    """Item 19: an anonymous caller refused by GCS (401): gcsfs logs its traceback through logging
    (54 lines on stderr); the CLI prints its two lines, and the traceback only with --debug."""
    import http.server
    import threading

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"error": {"code": 401, "message": "Anonymous caller does not have access"}}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        args = ["verify", "gs://bucket/run/step_1", "-o", f"endpoint_url={endpoint}", "-o", "token=anon"]
        quiet = cli_process(*args)
        debug = cli_process(*args, "--debug")
    finally:
        server.shutdown()
    assert quiet.returncode == 4, quiet.stderr
    assert len(quiet.stderr.splitlines()) == 2 and "Traceback" not in quiet.stderr, quiet.stderr
    assert stderr_pair(quiet)
    assert debug.returncode == 4 and "Traceback" in debug.stderr


def test_warnings_print_names_escaped(tmp_path: Path) -> None:
    """Item 20: every WARNING line that names a file or a checkpoint escapes it: a skipped FIFO, a
    symlink that leaves the root, a checkpoint skipped by latest, files upload leaves behind."""
    fake = "x\nintegrity-fs: verified ckpt: 3 files"
    run = tmp_path / "run"
    good, bad = run / "step_1", run / f"step_2{fake}"
    good.mkdir(parents=True)
    (good / "w.bin").write_bytes(b"weights")
    assert cli("seal", str(good)).returncode == 0
    shutil.copytree(good, bad)
    flip(bad / "w.bin", 0)
    os.mkfifo(good / f"fifo{fake}")
    (tmp_path / "outside.bin").write_bytes(b"o")
    (good / f"link{fake}").symlink_to(tmp_path / "outside.bin")
    (good / f"extra{fake}").write_bytes(b"e")

    outputs = [
        cli("verify", str(good)),  # the FIFO and the symlink are skipped, with a WARNING each
        cli("latest", str(run)),  # step_2... is damaged: skipped, with a WARNING
        cli("upload", str(good), str(tmp_path / "up")),  # the extra file is not uploaded
    ]
    for proc in outputs:
        assert proc.returncode == 0, proc.stderr
        assert "WARNING" in proc.stderr
        lines = (proc.stdout + proc.stderr).splitlines()
        assert not [line for line in lines if line.startswith("integrity-fs: verified")], lines
        assert "x\\nintegrity-fs: verified" in proc.stderr
