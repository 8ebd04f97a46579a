"""`Schedule`: a compiled schedule as the public Python API hands it out (docs/api.md).

`pipelang.load("chimera", D=4, N=4)` returns one. It wraps a `Compilation`: the IR
`Program` (fully compiled: comms and sync inserted) and its op graph. It offers what
the CLI's commands do, as values: its sizes, each rank's ops, a simulated timeline,
exports and drawings.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipelang.compiler import Compilation
from pipelang.diagnostics import PipelangError, clip, fail
from pipelang.evaluate import MAX_DIGITS
from pipelang.ir import Action, CostModel, cost_name_problem, cost_problem
from pipelang.sim.timeline import Timeline

if TYPE_CHECKING:
    from pipelang.synthesis import Synthesized

"""The keys a cost model takes: op kinds, a transfer (C), an overlapped pair (FB), an
evicted activation's trips (E, L), and the shares and reference that split work over
sequence chunks and micro-batch shapes (A, S, O; docs/language.md "Costs")."""

Costs = Mapping[str, float | Sequence[float]]
"""`{"F": 1, "B": 2}`, or per stage `{"F": [1, 2, 1, 1]}` (one time per stage)."""


class Schedule:
    """A compiled schedule: sizes, each rank's ops, simulation, export and drawing."""

    def __init__(self, compilation: Compilation) -> None:
        self.compilation = compilation
        """What the compiler made: the Program and its op graph."""
        self.program = compilation.need_program()
        """The IR: every rank's actions, sends, receives and sync included."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.program.params)
        return (
            f"<Schedule {self.program.name}({params}): {self.ranks} ranks, "
            f"{self.stages} stages, {self.microbatches} micro-batches>"
        )

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def ranks(self) -> int:
        """How many ranks (workers) the schedule uses."""
        return self.program.num_ranks

    @property
    def stages(self) -> int:
        """How many stages the model is split into."""
        return self.program.num_stages

    @property
    def microbatches(self) -> int:
        """How many micro-batches one iteration runs."""
        return self.program.num_microbatches

    def ops(self, rank: int) -> list[Action]:
        """Rank `rank`'s compute ops (F, B, W, R) in order; each has `.kind`, `.mb`,
        `.stage`, `.pipeline`, and `.fused` when it starts together with the op before."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.ranks:
            raise _usage(f"rank {rank!r} is not one of the schedule's 0..{self.ranks - 1}")
        return [a for a in self.program.ranks[rank] if a.kind.is_compute]

    def simulate(self, costs: Costs | None = None) -> Timeline:
        """Replay the schedule in time: `costs` on top of the schedule's own `cost` line
        (unit times and free transfers by default). The Timeline has `makespan`,
        `bubble_ratio`, and per rank `ranks[r].busy`, `.idle`, `.peak_activations`."""
        model = cost_model(costs, self.stages)
        return self.compilation.timeline(model)

    def export(self, format: str) -> str | dict[str, object]:
        """`"json"`: a dict of every rank's compute ops (what `pipelang export --format
        json` prints); `"torch-csv"`: torch.distributed.pipelining's CSV schedule text."""
        from pipelang.export import ExportError, to_json, to_torch_csv

        if format == "json":
            doc: dict[str, object] = json.loads(to_json(self.program))
            return doc
        if format == "torch-csv":
            try:
                return to_torch_csv(self.program)
            except ExportError as err:
                raise _usage(str(err)) from None
        raise _usage(f"no export format {format!r}; use 'json' or 'torch-csv'")

    def draw(self, path: str | Path, costs: Costs | None = None) -> Path:
        """Draw the simulated timeline to `path`, in the format its suffix names (any
        `pipelang viz` writes: .svg, .html, .png, .json for Perfetto, .txt)."""
        from pipelang.visualize import FORMATS, render
        from pipelang.visualize.panel import simulated
        from pipelang.visualize.png import MissingMatplotlib, TooLarge

        if not isinstance(path, str | Path):
            raise _usage(f"draw takes a file name (a str or a Path), not {_shown(path)}")
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in FORMATS:
            raise _usage(f"cannot draw to {path}: give a name ending in {', '.join(FORMATS)}")
        try:
            data = render([simulated(self.simulate(costs))], suffix)
        except (MissingMatplotlib, TooLarge) as err:
            raise _usage(str(err)) from None
        try:
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)
        except OSError as err:
            raise _usage(f"cannot write `{path}`: {err.strerror}") from None
        return path


def cost_model(costs: Costs | None, stages: int) -> CostModel | None:
    """A CostModel from `{"F": 1, "B": [2, 2, 3, 2]}` (a list gives one time per stage of
    the `stages`, `C`'s one per boundary between them); raises PipelangError (E0209) on a
    key it does not know, a value out of range (`ir.cost_problem`) or a list of the wrong
    length."""
    if costs is None:
        return None
    if not isinstance(costs, Mapping):
        raise fail("E0209", f"costs are a mapping such as {{'F': 1, 'B': 2}}, not {_shown(costs)}")
    entries: list[tuple[str, int | None, float]] = []
    for kind, value in costs.items():
        problem = cost_name_problem(kind)
        if problem is not None:
            raise fail("E0209", problem)
        if _listed(value):
            times = list(value)  # type: ignore[arg-type]
            _check_length(kind, len(times), stages)
            entries.extend((kind, stage, _time(kind, t)) for stage, t in enumerate(times))
        else:
            entries.append((kind, None, _time(kind, value)))
    return CostModel(tuple(entries))


def _listed(value: object) -> bool:
    """Whether a cost is given per stage: a list, a tuple, a 1-d numpy array (not a
    number, a string or a mapping)."""
    if isinstance(value, numbers.Real | str | bytes | Mapping):
        return False
    if isinstance(value, Sequence):
        return True
    try:
        len(value)  # type: ignore[arg-type]
    except TypeError:  # no length, or a 0-d array
        return False
    return hasattr(value, "__iter__")


def _check_length(kind: str, count: int, stages: int) -> None:
    """A per-stage list holds one time per stage, and `C`'s one per stage boundary (the
    link between stages b and b + 1): a list of another length is refused, never cut or
    padded (a fourth `C` on four stages was dropped)."""
    expected, what = (stages - 1, "stage boundaries") if kind == "C" else (stages, "stages")
    if count != expected:
        each = "boundary: `C[b]` is the link between stages b and b + 1" if kind == "C" else "stage"
        raise fail(
            "E0209",
            f"cost `{kind}` lists {count} times; the schedule has {expected} {what} "
            f"(give one number for all, or one per {each})",
        )


def _shown(value: object) -> str:
    return clip(f"`{value!r}`")


def _usage(message: str) -> PipelangError:
    """An API argument that cannot be used, as the CLI's bad command line would be."""
    return fail("usage", message)


def _time(kind: str, value: object) -> float:
    """A cost's number: any real number (int, float, Fraction, numpy's integers and
    floats), not a bool, and within `cost_problem`'s range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise fail("E0209", f"cost `{kind}`: {_shown(value)} is not a number (an int or a float)")
    try:
        time = float(value)
    except OverflowError:  # 10**400
        message = f"cost `{kind}` is past 10^308; a time is between 0 and 10^15"
        raise fail("E0209", message) from None
    problem = cost_problem(kind, time)
    if problem is not None:
        raise fail("E0209", f"cost {problem}")
    return time


def load(sched: str | Path, **params: int | bool) -> Schedule:
    """Compile a schedule: a stdlib name (`pipelang list`) or a path to a `.pipe` file,
    its parameters as keywords. Raises PipelangError with every problem found."""
    from pipelang.api import compile_schedule

    return Schedule(compile_schedule(str(sched), _param_text(params)))


def synthesize(
    sched: str | Path,
    *,
    costs: Costs | None = None,
    max_activations: float | None = None,
    split: bool | None = None,
    time_limit: float = 30.0,
    name: str | None = None,
    **params: int | bool,
) -> Synthesized:
    """The fastest order for the placement of a schedule (a stdlib name or a `.pipe`
    path, its parameters as keywords) under `costs` (as for `simulate`; `C` as a list
    gives each stage boundary's link), with at most `max_activations` micro-batches of
    activations on any rank; `split` splits the backward into B and W (None: as the
    schedule does). Needs `pipelang[synth]`; docs/synthesize.md says what it returns."""
    from pipelang.synthesis import stages_of
    from pipelang.synthesis import synthesize as search

    text = _param_text(params)
    model = None if costs is None else cost_model(costs, stages_of(str(sched), text)[0])
    return search(
        str(sched),
        text,
        costs=model,
        max_activations=max_activations,
        split=split,
        time_limit=time_limit,
        name=name,
    )


def _param_text(params: Mapping[str, int | bool]) -> dict[str, str]:
    """Keyword parameters as `-p` would give them (E0203 on a value that is neither)."""
    text = {}
    for name, value in params.items():
        if isinstance(value, bool):
            text[name] = str(value).lower()
        elif isinstance(value, numbers.Integral) and abs(int(value)) < 10**MAX_DIGITS:
            text[name] = str(int(value))  # numpy's integers too, as costs take them
        else:
            big = isinstance(value, numbers.Integral)
            what = f"over {MAX_DIGITS} digits" if big else _shown(value)
            raise fail("E0203", f"parameter `{name}` is {what}; give an int or a bool")
    return text
