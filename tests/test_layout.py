"""The package's import graph: the command line sits on top, library modules never import it, and
no module imports itself back through others (read from the source, so lazy imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import integrity_fs

PACKAGE = Path(integrity_fs.__file__).parent
CLI_MODULES = {"cli", "__main__"} | {path.stem for path in PACKAGE.glob("cli_*.py")}


def imports_of(path: Path) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in the file (``from . import x`` names x)."""
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith("integrity_fs")):
            base = (node.module or "").removeprefix("integrity_fs").lstrip(".")
            names = [base.split(".")[0]] if base else [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            name = name.removeprefix("integrity_fs.")
            if name in modules:
                found.add(name)
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {path.stem: imports_of(path) for path in sorted(PACKAGE.glob("*.py"))}


def test_library_modules_do_not_import_the_command_line() -> None:
    offenders = {
        module: sorted(imported & CLI_MODULES)
        for module, imported in graph().items()
        if module not in CLI_MODULES and imported & CLI_MODULES
    }
    assert offenders == {}


def test_the_import_graph_has_no_cycle() -> None:
    edges = graph()
    edges["__init__"] = set()  # every module imports the package's __init__ implicitly; its re-exports are the top
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path[path.index(module) :], module))
        if module in done:
            return
        for imported in sorted(edges.get(module, ())):
            visit(imported, (*path, module))
        done.add(module)

    for module in edges:
        visit(module, ())


def test_the_graph_reader_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    """The checks above can fail: a library module that imports the CLI, either way, is seen."""
    for source in ("from .cli import main\n", "from . import cli_output\n", "import integrity_fs.cli\n"):
        path = tmp_path / "core.py"
        path.write_text(source, encoding="utf-8")
        assert imports_of(path) & CLI_MODULES, source
