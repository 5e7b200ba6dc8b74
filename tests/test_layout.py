"""The package's import graph and module rules, read from the source (lazy imports count too):

- the command line sits on top: no library module imports ``integrity_fs.cli``;
- no module imports itself back through others (no cycle);
- pure modules (the manifest, hashing, reports, errors, options, formats, signing) never import
  fsspec, and only ``storage`` imports fsspec's backends or the stores' own packages;
- every module says what it exports (``__all__``), and none imports another's underscored names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import integrity_fs

PACKAGE = Path(integrity_fs.__file__).parent
#: Modules without I/O: they may not import fsspec at all.
PURE = {"manifest", "hashing", "report", "errors", "text", "options", "formats", "signing", "recorded"}
#: What only ``storage`` may import: fsspec's backends and the stores' own client packages.
#: The demo runs an S3 server of its own and talks to it: the one edge module that may.
EDGE_BACKENDS = {"cli.demo"}
BACKENDS = ("fsspec.implementations", "fsspec.asyn", "s3fs", "gcsfs", "botocore", "aiobotocore", "aiohttp", "google")


def module_name(path: Path) -> str:
    """``storage.read`` for integrity_fs/storage/read.py, ``storage`` for its __init__.py."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _package_of(name: str, path: Path) -> list[str]:
    parts = [] if name == "__init__" else name.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def imports_of(name: str, path: Path, known: set[str]) -> tuple[set[str], list[tuple[str, str]]]:
    """The package's modules that ``path`` imports, and every (module, imported name) pair taken
    with ``from ... import`` from anywhere (to check underscored names and outside packages)."""
    found: set[str] = set()
    names: list[tuple[str, str]] = []
    package = _package_of(name, path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.append((alias.name, ""))
                if alias.name.startswith("integrity_fs."):
                    found.add(alias.name.removeprefix("integrity_fs."))
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - node.level + 1] if node.level > 1 else list(package)
            target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
        elif (node.module or "").startswith("integrity_fs"):
            target = (node.module or "").removeprefix("integrity_fs").lstrip(".")
        else:
            names.extend((node.module or "", alias.name) for alias in node.names)
            continue
        for alias in node.names:
            child = f"{target}.{alias.name}" if target else alias.name
            if child in known:
                found.add(child)
            else:
                found.add(target or "__init__")
                names.append((f"integrity_fs.{target}" if target else "integrity_fs", alias.name))
    return {m for m in found if m in known and m != name}, names


def graph() -> dict[str, set[str]]:
    known = set(modules())
    return {name: imports_of(name, path, known)[0] for name, path in modules().items()}


def is_cli(name: str) -> bool:
    return name == "__main__" or name == "cli" or name.startswith("cli.")


def test_library_modules_do_not_import_the_command_line() -> None:
    offenders = {
        name: sorted(m for m in imported if is_cli(m))
        for name, imported in graph().items()
        if not is_cli(name) and any(is_cli(m) for m in imported)
    }
    assert offenders == {}


def test_the_import_graph_has_no_cycle() -> None:
    edges = graph()
    edges["__init__"] = set()  # every module imports the package's __init__ implicitly; its re-exports are the top
    for name in list(edges):  # a subpackage's __init__ re-exports its modules: importing it is importing them
        edges[name] = {m for m in edges[name] if m != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path[path.index(module) :], module))
        if module in done:
            return
        for imported in sorted(edges.get(module, ())):
            if imported.startswith(module + "."):  # a package importing its own modules
                continue
            visit(imported, (*path, module))
        done.add(module)

    for module in edges:
        visit(module, ())


def _outside_imports(name: str, path: Path) -> list[str]:
    known = set(modules())
    _found, names = imports_of(name, path, known)
    return [module for module, _ in names if not module.startswith("integrity_fs")]


def test_pure_modules_never_import_fsspec_and_only_storage_imports_backends() -> None:
    bad = {}
    for name, path in modules().items():
        imported = _outside_imports(name, path)
        if name.split(".")[0] in PURE:
            wrong = [m for m in imported if m == "fsspec" or m.startswith("fsspec.")]
        elif name.split(".")[0] != "storage" and name not in EDGE_BACKENDS:
            wrong = [m for m in imported if m.startswith(BACKENDS)]
        else:
            wrong = []
        if wrong:
            bad[name] = sorted(set(wrong))
    assert bad == {}


def test_every_module_has_all_and_none_imports_another_modules_underscored_names() -> None:
    known = set(modules())
    missing_all = []
    private = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if name not in ("__main__",) and not any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
            for node in tree.body
        ):
            missing_all.append(name)
        for module, imported in imports_of(name, path, known)[1]:
            if module.startswith("integrity_fs") and imported.startswith("_") and imported != "__version__":
                private.append(f"{name}: from {module} import {imported}")
    assert missing_all == []
    assert private == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("seal", "from .cli import main\n", "cli"),
        ("seal", "from . import cli\n", "cli"),
        ("seal", "import integrity_fs.cli\n", "cli"),
        ("storage.read", "from ..cli.commands import main\n", "cli.commands"),
    ],
)
def test_the_graph_reader_sees_relative_and_absolute_imports(
    tmp_path: Path, module: str, source: str, expected: str
) -> None:
    """The checks above can fail: a library module that imports the CLI, any way, is seen."""
    scratch = tmp_path / "probe.py"
    scratch.write_text(source, encoding="utf-8")
    found, _names = imports_of(module, scratch, set(modules()))
    assert expected in found
