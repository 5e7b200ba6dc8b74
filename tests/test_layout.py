"""The package's import graph and module rules, read from the source (lazy imports count too):

- the command line sits on top: no library module imports ``integrity_fs.cli``;
- no module imports itself back through others (no cycle);
- ``storage`` is the only door to fsspec: no module outside it imports fsspec at run time (an
  import under ``if TYPE_CHECKING:`` is for annotations only), calls ``fsspec.<anything>(...)``,
  or calls a file system's own method (``fs.rm(...)``: a method of fsspec's
  ``AbstractFileSystem`` on ``fs``, ``self.fs``, ``dst_fs``, ...); only ``storage`` imports
  fsspec's backends or the stores' own packages (and the demo, the S3 server it runs);
- ``storage`` exports what the modules outside it use, no more: each name of its ``__all__`` is
  used as ``storage.NAME`` or imported from ``storage`` by one of them (or taken through the
  package by a storage module, ``from . import NAME``, so that tests can replace it);
- a verb (``verify``, ``seal``, ``read``, ``transfer``, ``checkpoints``, ``retention``) never imports
  another verb: what two verbs share lives in a lower module (``verification``, ``sealing``,
  ``runs``, ``work``, ``options``, ...);
- every module says what it exports (``__all__``), and none imports another's underscored names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

import integrity_fs

PACKAGE = Path(integrity_fs.__file__).parent
#: The modules (and packages) of the verbs SPEC names, single-process: none imports another.
VERBS = {"verify", "seal", "read", "transfer", "checkpoints", "retention"}
#: What a file system call looks like: a public method of fsspec's file systems.
FS_METHODS = {name for name in dir(fsspec.AbstractFileSystem) if not name.startswith("_")}
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


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _names_a_file_system(node: ast.expr) -> bool:
    """``fs``, ``dst_fs``, ``fs_``, ``self.fs``, ``src.fs``: a name or attribute that holds one."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "fs" or name.endswith("_fs") or name == "fs_"


def _root_name(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def fsspec_uses(source: str) -> list[str]:
    """The run-time fsspec imports and the fsspec calls of a module's ``source``, with their lines."""
    found = []
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module or ""]
        else:
            modules = []
        if any(m == "fsspec" or m.startswith("fsspec.") for m in modules):
            found.append(f"line {node.lineno}: import {', '.join(modules)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, node.func.value
            if _root_name(receiver) == "fsspec" or (method in FS_METHODS and _names_a_file_system(receiver)):
                found.append(f"line {node.lineno}: {ast.unparse(node.func)}()")
    return found


def test_storage_is_the_only_door_to_fsspec() -> None:
    bad = {}
    for name, path in modules().items():
        if name.split(".")[0] == "storage":
            continue
        uses = fsspec_uses(path.read_text(encoding="utf-8"))
        if name not in EDGE_BACKENDS:
            uses += [f"import {m}" for m in _outside_imports(name, path) if m.startswith(BACKENDS)]
        if uses:
            bad[name] = uses
    assert bad == {}


def test_storage_exports_what_the_modules_outside_it_use() -> None:
    from integrity_fs import storage

    used: set[str] = set()
    for name, path in modules().items():
        inside = name.split(".")[0] == "storage"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if inside:  # a storage module taking a name through the package (where tests can replace it)
                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                    used.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "storage":
                used.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "storage":
                used.update(alias.name for alias in node.names)
    assert sorted(set(storage.__all__) - used) == []


def test_no_verb_imports_another_verb() -> None:
    bad = {
        name: sorted(m for m in imported if m.split(".")[0] in VERBS - {name.split(".")[0]})
        for name, imported in graph().items()
        if name.split(".")[0] in VERBS
    }
    assert {name: verbs for name, verbs in bad.items() if verbs} == {}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import fsspec\n", ["line 1: import fsspec"]),
        ("from fsspec.callbacks import Callback\n", ["line 1: import fsspec.callbacks"]),
        ("def f():\n    import fsspec.asyn\n", ["line 2: import fsspec.asyn"]),
        ("fs = storage.fs()\nfsspec.filesystem('file')\n", ["line 2: fsspec.filesystem()"]),
        ("def f(fs):\n    fs.rm('x')\n", ["line 2: fs.rm()"]),
        ("def f(self):\n    self.fs.copy('a', 'b')\n", ["line 2: self.fs.copy()"]),
        ("def f(dst_fs):\n    dst_fs.pipe_file('a', b'')\n", ["line 2: dst_fs.pipe_file()"]),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fsspec\n", []),
        ("def f(fs):\n    storage.remove_file(fs, 'x')\n    self.fs.create_stream('a', 'rb')\n", []),
    ],
)
def test_the_door_check_sees_fsspec_imports_and_calls(source: str, expected: list[str]) -> None:
    """The check above can fail: an import at run time, a call of fsspec or of a file system is seen."""
    assert fsspec_uses(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from .verify import verify\n", {"verify"}),
        ("from . import read\n", {"read"}),
        ("from .transfer.streaming import stream\n", {"transfer.streaming"}),
        ("from .verification import check\nfrom .sealing import seal_at\n", set()),
    ],
)
def test_the_verb_check_sees_a_verb_imported(tmp_path: Path, source: str, expected: set[str]) -> None:
    """The check above can fail: ``seal`` importing another verb, any way, is seen."""
    scratch = tmp_path / "probe.py"
    scratch.write_text(source, encoding="utf-8")
    found, _names = imports_of("seal", scratch, set(modules()))
    assert {m for m in found if m.split(".")[0] in VERBS} == expected


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
