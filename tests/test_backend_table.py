"""The backends are one table (backends/backend.py): the runtime asks a backend's row,
never compares its name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipelang.backends.backend import BACKENDS, DEFAULT
from pipelang.backends.config import RunConfig
from tests.helpers import run_in_process

ROOT = Path(__file__).resolve().parent.parent
NAMES = set(BACKENDS)


def _names_in(node: ast.AST) -> list[str]:
    """The backend names a comparison operand or a tuple of choices spells out."""
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [name for element in node.elts for name in _names_in(element)]
    return []


def test_no_backend_name_is_compared_outside_the_table() -> None:
    """`config.backend == "nccl"` in 16 places made a new backend touch 9 files; every
    such question is a row's answer now (`Backend.cuda`, `processes`, `streams`, ...)."""
    table = ROOT / "backends" / "backend.py"
    found = []
    files = [*(ROOT / "pipelang").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]
    for file in files:
        if file == table:
            continue
        name = file.relative_to(ROOT)
        for node in ast.walk(ast.parse(file.read_text())):
            spelled: list[str] = []
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    spelled += _names_in(operand)
            elif isinstance(node, ast.Tuple) and len(_names_in(node)) > 1:
                spelled += _names_in(node)  # a list of choices
            if spelled:
                found.append(f"{name}:{node.lineno}: {', '.join(spelled)}")
    assert found == []


def test_the_run_options_come_from_the_table() -> None:
    """`--backend`'s choices, default and help are the table's rows, in order."""
    status, out, _ = run_in_process(["run", "--help"])
    assert status == 0
    assert "--backend {" + ",".join(BACKENDS) + "}" in out
    assert RunConfig().backend == DEFAULT
    help_text = "".join(out.split())  # argparse wraps lines at spaces and hyphens
    for name, row in BACKENDS.items():
        assert "".join(f"{name}: {row.help}".split()) in help_text


@pytest.mark.parametrize("option", ["--save", "--resume"])
def test_checkpoints_name_the_backends_that_spawn_processes(option: str, tmp_path: Path) -> None:
    local = [name for name, row in BACKENDS.items() if not row.processes]
    assert local == ["local"]
    status, _, err = run_in_process(["run", "1f1b", "--backend", "local", option, str(tmp_path)])
    assert status == 2
    assert (
        "checkpoints (--save, --resume) need a process per rank: use --backend gloo or "
        "nccl, not local"
    ) in err


UPWARD = (
    "pipelang.passes",
    "pipelang.compiler",
    "pipelang.api",
    "pipelang.planner",
    "pipelang.cli",
)
"""What the runtime may not import: the compiler delivers what it runs (the checked stream
program too), the command line hands it the plan's prediction. What both sides read lies
below them: the profile's format in `pipelang/profile.py`, the even split of a model's
layers in `pipelang/ir/program.py`."""


def _imported(tree: ast.AST, package: list[str]) -> list[list[str]]:
    """For every import statement, at any depth (lazy imports count), the modules it may
    name: `from pipelang import planner` may name `pipelang.planner`, and a relative
    import is read from `package`, the importing module's."""
    statements = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            statements += [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) + 1 - node.level]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            statements.append([module, *(f"{module}.{alias.name}" for alias in node.names)])
    return statements


def test_the_runtime_imports_no_pass_compiler_or_command_line() -> None:
    """The runtime ran the `streams` and `check-streams` passes itself (worker.py, a
    second pass driver) and imported upward: passes (worker, torchrun_rank), the
    planner (launch; then models and calibrate for the even split, measure and calibrate
    for the profile's data), the CLI. `python -m pipelang.backends` (__main__.py) is the
    command line's entry, which nothing imports."""
    found = []
    for file in sorted((ROOT / "backends").rglob("*.py")):
        if file.name == "__main__.py":
            continue
        name = str(file.relative_to(ROOT))
        package = ["pipelang", "backends", *file.relative_to(ROOT / "backends").parent.parts]
        for names in _imported(ast.parse(file.read_text()), package):
            upward = [m for m in names if any(m == u or m.startswith(u + ".") for u in UPWARD)]
            if upward:
                found.append(f"{name}: {upward[0]}")
    assert found == []


def test_nothing_generated_is_executed() -> None:
    """Each rank rendered Python source and `exec`ed it (codegen.load_iteration), in
    process too (local); the executor's table runs the calls instead, and a rank file is
    a listing of the same calls (`Call.text`)."""
    found = []
    for file in [*(ROOT / "pipelang").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]:
        for node in ast.walk(ast.parse(file.read_text())):
            name = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
            if name in ("exec", "eval", "compile"):
                found.append(f"{file.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}: {name}")
    assert found == []


def test_a_rank_file_lists_the_calls_the_executor_makes() -> None:
    """`compile -o`'s rank{r}.py: one line per action, the executor's call for it."""
    from pipelang.backends.codegen import render_rank_program
    from pipelang.backends.executor import action_call
    from tests.helpers import stdlib

    program = stdlib("zb-h1", D=2, N=4)
    for rank, actions in enumerate(program.ranks):
        text = render_rank_program(program, rank)
        body = text.split("def iteration(rt):\n")[1].split("\n\n")[0].splitlines()
        assert [line.split("#")[0].strip() for line in body] == [
            action_call(a).text() for a in actions
        ]
        assert [line.split("#")[1].split()[1] for line in body] == [a.text() for a in actions]
