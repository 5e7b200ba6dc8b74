"""The package's shape, read from the source, as SPEC and the project's habits state it:

- at most 8,000 lines in ``integrity_fs/``; at most 36 public objects (the names in ``__all__`` of
  ``integrity_fs``, ``.dcp``, ``.distributed``, ``.formats`` and ``.integrations.*``; one object
  exported twice counts once); no public function or method with more than 8 parameters;
- the command line sits on top: no library module imports ``integrity_fs.cli``; no import cycle;
- ``storage`` is the only door to fsspec's backends and the stores' client packages;
- the tests patch integrity_fs's internals in at most 10 places, each with a comment saying why.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import integrity_fs

PACKAGE = Path(integrity_fs.__file__).parent
TESTS = Path(__file__).parent
PUBLIC_MODULES = ["integrity_fs", "integrity_fs.dcp", "integrity_fs.distributed", "integrity_fs.formats"]
INTEGRATIONS = ["integrity_fs.integrations.transformers", "integrity_fs.integrations.safetensors"]
BACKENDS = ("fsspec.implementations", "fsspec.asyn", "s3fs", "gcsfs", "botocore", "aiobotocore", "aiohttp", "google")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _public_objects() -> dict[int, str]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    found: dict[int, str] = {}
    for name in PUBLIC_MODULES + INTEGRATIONS:
        module = importlib.import_module(name)
        for attr in module.__all__:
            found.setdefault(id(getattr(module, attr)), f"{name}.{attr}")
    return found


def test_the_package_holds_at_most_8000_lines() -> None:
    lines = sum(len(path.read_text(encoding="utf-8").splitlines()) for path in PACKAGE.rglob("*.py"))
    assert lines <= 8000, lines


def test_the_public_surface_is_at_most_36_objects() -> None:
    objects = _public_objects()
    assert len(objects) <= 36, sorted(objects.values())


def test_no_public_function_takes_more_than_8_parameters() -> None:
    too_many = []
    for obj_name in _public_objects().values():
        module, attr = obj_name.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), attr)
        callables = [obj] if inspect.isfunction(obj) else []
        if inspect.isclass(obj):
            callables = [
                m for n, m in vars(obj).items() if inspect.isfunction(m) and (n == "__init__" or not n.startswith("_"))
            ]
        for fn in callables:
            params = [p for p in inspect.signature(fn).parameters if p != "self"]
            if len(params) > 8:
                too_many.append(f"{obj_name}.{fn.__name__}: {len(params)}")
    assert too_many == []


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved into integrity_fs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ["integrity_fs", *path.relative_to(PACKAGE).parent.parts]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            if node.module is not None:
                found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_no_library_module_imports_the_command_line() -> None:
    offenders = [
        name
        for name, path in _modules().items()
        if not name.startswith(("cli", "__main__")) and any(i.startswith("integrity_fs.cli") for i in _imports(path))
    ]
    assert offenders == []


def test_only_storage_talks_to_the_backends() -> None:
    allowed = ("storage", "cli.demo")
    offenders = [
        f"{name}: {imported}"
        for name, path in _modules().items()
        if not name.startswith(allowed)
        for imported in _imports(path)
        if imported.startswith(BACKENDS)
    ]
    assert offenders == []


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {
        name: {i[len("integrity_fs.") :] for i in _imports(path) if i.startswith("integrity_fs.")} & set(modules)
        for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if nxt == node or nxt in ("", "__init__"):
                continue
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


#: A test's reach into the library's internals: patching a module or object of integrity_fs.
PATCH = re.compile(
    r"monkeypatch\.setattr\(\s*(?:\"integrity_fs\.|[a-z_]*(?:storage|read|dcp|verify|runs|transfer|work|options|manifest|hashing|ifs)\b)|mock\.patch(?:\.object)?\(\s*(?:\"integrity_fs|[a-z_]*(?:storage|read|dcp))"
)


def test_the_tests_patch_internals_in_at_most_10_places() -> None:
    found = [
        f"{path.name}:{n}"
        for path in sorted(TESTS.glob("*.py"))
        if path.name != "test_layout.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if PATCH.search(line)
    ]
    assert len(found) <= 10, found
