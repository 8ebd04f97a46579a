"""The Python entry points: find a schedule, compile it, get a Program."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipelang import ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import fail, quote
from pipelang.evaluate import MAX_OPS
from pipelang.ir import CostModel, Program
from pipelang.parser import parse_file, stdlib_dir


def stdlib_names() -> list[str]:
    """The standard-library schedule names, sorted."""
    return sorted(p.stem for p in stdlib_dir().glob("*.pipe"))


def find_schedule(sched: str) -> tuple[Path, str]:
    """A path to a `.pipe` file, or a stdlib name; returns (path, name to display)."""
    if not sched.strip():  # Path("") is ".", a directory: say what was given
        raise fail(
            "usage",
            f"the schedule is {'an empty path' if not sched else quote(sched)}: give a .pipe "
            "file or a stdlib name (`pipelang list`)",
        )
    path = Path(sched)
    try:
        exists = path.exists()
    except OSError as err:  # a name too long for the file system, say
        raise fail("E0003", f"cannot read {quote(sched)}: {err.strerror}") from None
    if path.suffix == ".pipe" or exists:
        return path, sched
    candidate = stdlib_dir() / f"{sched}.pipe"
    if candidate.exists():
        return candidate, f"<stdlib>/{sched}.pipe"
    raise fail(
        "E0003",
        f"no schedule {quote(sched)}: not a file and not a stdlib name",
        help="stdlib schedules: " + ", ".join(stdlib_names()),
    )


def load_file(sched: str) -> ast.File:
    """Parse a schedule given as a path or a stdlib name."""
    path, display = find_schedule(sched)
    return parse_file(path, display)


def compile_schedule(
    sched: str,
    params: Mapping[str, str] | None = None,
    *,
    max_activations: int | None = None,
    stop_after: str | None = None,
    dp: int = 1,
    max_ops: int = MAX_OPS,
    shapes: tuple[tuple[int, int], ...] | None = None,
    costs: CostModel | None = None,
    shard: int = 1,
) -> Compilation:
    """Run the passes on a schedule (path or stdlib name) with `-p`-style string params;
    `dp` is the data-parallel copies a stream program is lowered for; a schedule of more
    than `max_ops` ops is refused (E0106); `shapes` are the micro-batches' (samples,
    length), instead of the schedule's `lengths` and `sizes` lines (and N, the
    micro-batch count, is their number unless `params` give it); `costs` come after its
    `cost` lines, and orders that depend on the costs are expanded under them; `shard`
    K > 1 shards every stage copy over K data-parallel copies (`insert-shard`)."""
    file = load_file(sched)
    params = dict(params or {})
    declared = {p.name for p in file.schedule.params}
    if shapes is not None and "N" in declared and "N" not in params:
        params["N"] = str(len(shapes))
    options = Options(params, max_activations, dp, max_ops, shapes, costs, shard)
    return run_passes(file, options, stop_after)


def load_program(sched: str, params: Mapping[str, str] | None = None) -> Program:
    """The fully compiled Program (comms and sync inserted), ready for a backend."""
    return compile_schedule(sched, params).need_program()
