"""The layer rules of docs/architecture.md, read from the source: no import cycles in the
package, argparse only in the CLI package, and the CLI reaches the rest through imports
of the package's public modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"pipelang": ROOT / "pipelang", "pipelang.backends": ROOT / "backends"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = [p for p in file.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if parts[-1:] != ["__main__"]:  # run as a script, imported by nothing
                modules[".".join([package, *parts])] = file
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: Collection[str] = ()) -> list[str]:
    """Every module an import statement names, at any depth (a lazy import inside a
    function is a dependency too), except those only for type checkers. `from a import
    b` names `a.b` when that is one of `modules`, else `a`."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.append(child if child in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> nx.DiGraph:
    """Module -> the modules of the package it imports."""
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, file in modules.items():
        for target in _imports(ast.parse(file.read_text()), modules):
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def test_the_import_graph_finds_the_package_and_its_layers() -> None:
    graph = import_graph()
    assert graph.has_edge("pipelang.cli.app", "pipelang.cli.check")
    assert graph.has_edge("pipelang.cli.check", "pipelang.cli.args")
    assert "pipelang.backends.runtime" in graph
    assert graph.number_of_edges() > 200


def test_no_import_cycles() -> None:
    cycles = list(nx.simple_cycles(import_graph()))
    shown = [" -> ".join([*c, c[0]]) for c in sorted(cycles, key=len)[:10]]
    assert cycles == [], "import cycles:\n" + "\n".join(shown)


def test_argparse_only_in_the_cli_package() -> None:
    cli = ROOT / "pipelang" / "cli"
    users = [
        str(file.relative_to(ROOT))
        for file in _modules().values()
        if "argparse" in _imports(ast.parse(file.read_text())) and cli not in file.parents
    ]
    assert users == []


def test_the_cli_args_module_is_a_leaf_of_the_cli_package() -> None:
    graph = import_graph()
    cli = [m for m in graph.successors("pipelang.cli.args") if m.startswith("pipelang.cli")]
    assert cli == []
    # no command imports another command, only what they share and its own parts
    shared = {"pipelang.cli.args", "pipelang.cli.run_options", "pipelang.cli.config_file"}
    parts = {"pipelang.cli.memory_table": "pipelang.cli.simulate"}  # a part: its command's
    commands = [m for m in graph if m.startswith("pipelang.cli.") and m != "pipelang.cli.app"]
    for module in commands:
        others = set(graph.successors(module)) & set(commands)
        own = {part for part, command in parts.items() if command == module}
        assert others <= shared | own, (module, others)
    for part, command in parts.items():
        assert set(graph.predecessors(part)) == {command}, part


def test_every_package_is_installed() -> None:
    """pyproject.toml lists every package of the source (a wheel leaves out the rest;
    the editable install the tests run under would not notice)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        f"{package}.{init.parent.relative_to(folder).as_posix().replace('/', '.')}".rstrip(".")
        for package, folder in PACKAGES.items()
        for init in folder.rglob("__init__.py")
    }
    assert found <= listed, f"add to pyproject.toml's packages: {sorted(found - listed)}"


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_no_module_over_600_lines_and_no_function_over_80() -> None:
    """docs/architecture.md's size limits, so they stay true: a module is read whole and a
    function at a glance. A function's lines run from its `def` (decorators not counted)
    to its last statement, its docstring included."""
    too_long = []
    for name, file in _modules().items():
        text = file.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    assert not too_long, "over the size limits:\n" + "\n".join(too_long)


def test_the_pass_names_are_the_passes_modules() -> None:
    from pipelang.compiler import PASS_NAMES, passes

    names = tuple(p.__module__.rsplit(".", 1)[1].replace("_", "-") for p in passes())
    assert names == PASS_NAMES


def test_the_command_line_imports_no_pass_and_no_synthesizer_until_one_runs() -> None:
    """`pipelang --help` imported every pass (compiler.py's top) and the synthesizer
    (cli/synthesize.py read its op limit there): 1.31x the start-up (benchmarks/
    RESULTS.md, "Lazy imports")."""
    code = (
        "import sys, pipelang.cli.app; "
        "print([m for m in sys.modules if m.startswith(('pipelang.passes', 'pipelang.synthesis'))])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
