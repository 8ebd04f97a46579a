"""The Chrome trace (JSON trace event format, for Perfetto and chrome://tracing): the one
home of how pipelang writes one and reads one back.

Two commands write it: `pipelang viz -o X.json` (`visualize/chrome.py`: simulated or
measured timelines) and `pipelang run --trace` (`backends/report.py`: every action of
every rank in every step). Two read it: `viz --trace` (`visualize/measured.py`) and
`profile --calibrate` (`backends/calibrate.py`). The format:

- a process per rank, named by a `process_name` metadata event `rank r` (`rank_name`;
  with the schedule's name in front where one file holds several);
- one complete event (`ph: "X"`) per action, named by the action's IR token
  (`F3@1/down`, `send:F3@1/down>2`, `allreduce@1/down`, `step`), `cat` its kind, `ts`
  and `dur` in microseconds, written to three decimals (nanoseconds); a run's events say
  in `args.step` the training step and in `args.action` the action's index in the
  rank's program.

Events are written with string formatting rather than `json.dumps` of one dict each:
at 10^5 ops that is most of the time. Action tokens and kinds need no JSON escaping
(they are `[A-Za-z0-9_@/:<>.]`); free text goes through `json.dumps`.

Read back (`read_actions`), an event's rank is the `r` of the `rank r` its process is
named, else its `pid`; events not named like actions (a profiler's, say) are skipped,
so a trace with other events mixed in still reads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelang.diagnostics import clip
from pipelang.evaluate import MAX_OPS
from pipelang.ir import Action
from pipelang.readers import ReadError, read_text


class TraceError(ValueError):
    """A trace that cannot be read, or that does not match the schedule."""


# ---- writing --------------------------------------------------------------------------------


def rank_name(rank: int, prefix: str = "") -> str:
    """The name of rank `rank`'s process, which `read_actions` maps back to the rank."""
    return f"{prefix} rank {rank}" if prefix else f"rank {rank}"


def metadata(what: str, pid: int, tid: int, **args: object) -> str:
    """A metadata event (`ph: "M"`): `process_name`, `process_sort_index`, `thread_name`."""
    return json.dumps({"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args})


def complete(
    name: str, cat: str, pid: int, tid: int, start: float, duration: float, more: str = ""
) -> str:
    """A complete event (`ph: "X"`) from `start` lasting `duration` (microseconds);
    `name` and `cat` are action tokens and kinds (no escaping), `more` further fields,
    already JSON (`,"args":{...}`)."""
    return (
        f'{{"name":"{name}","cat":"{cat}","ph":"X","pid":{pid},"tid":{tid},'
        f'"ts":{start:.3f},"dur":{duration:.3f}{more}}}'
    )


def document(events: Sequence[str], other: Mapping[str, object] | None = None) -> str:
    """The trace file of `events` (each one JSON object), with `other` as its
    `otherData` where given."""
    head = '{"displayTimeUnit":"ms",'
    if other is not None:
        head += '"otherData":' + json.dumps(other) + ","
    return head + '"traceEvents":[\n' + ",\n".join(events) + "\n]}\n"


# ---- reading --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Traced:
    """One action of one rank in a trace: its step, its index in the rank's program, the
    action and the event's name, its start and end in microseconds."""

    rank: int
    step: int
    index: int
    action: Action
    name: str
    start: float
    end: float


def load(path: Path) -> list[dict[str, Any]]:
    """The events of the trace file at `path` (a document or a bare list of events)."""
    try:
        doc = json.loads(read_text(path))
    except ReadError as err:
        raise TraceError(f"cannot read `{path}`: {err}") from None
    except ValueError as err:  # not JSON
        raise TraceError(f"`{path}` is not JSON: {err}") from None
    except RecursionError:
        raise TraceError(f"`{path}` nests too deep for a Chrome trace") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceError(f"`{path}` is not a Chrome trace (no traceEvents list)")
    return [e for e in events if isinstance(e, dict)]


def read_actions(events: Sequence[Mapping[str, Any]], source: str) -> list[Traced]:
    """Every complete event named like an action, with its rank (see the module
    docstring), in the trace's order. Such an event without a finite start and a duration
    of at least 0, a rank below `MAX_OPS` (the most ranks a schedule has) or a whole step
    and index, or an action a rank runs twice in one step (two runs in one file, say), is
    a TraceError naming `source` and the event."""
    ranks = _rank_names(events)
    found: list[Traced] = []
    seen: set[tuple[int, int, Action]] = set()
    for e in events:
        name = e.get("name")
        if e.get("ph") != "X" or not isinstance(name, str):
            continue
        try:
            action = Action.parse(name)
        except ValueError:
            continue
        start, duration = _time(e.get("ts")), _time(e.get("dur", 0.0))
        if start is None or duration is None or duration < 0:
            times = clip(f"ts {e.get('ts')!r}, dur {e.get('dur', 0.0)!r}")
            raise TraceError(
                f"{source}: event `{clip(name)}` has no time it ran ({times}): a finite ts "
                "and a dur of at least 0"
            )
        pid = e.get("pid")
        rank = ranks.get(pid, pid) if isinstance(pid, int | str) else pid
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise TraceError(f"{source}: event `{clip(name)}` has no rank (pid {clip(repr(pid))})")
        if rank >= MAX_OPS:
            raise TraceError(
                f"{source}: event `{clip(name)}` is on rank {rank:,}; a schedule has fewer than "
                f"{MAX_OPS:,} ranks"
            )
        args = e.get("args")
        args = args if isinstance(args, dict) else {}
        step, index = _whole(args.get("step", 0)), _whole(args.get("action", 0))
        if step is None or index is None:
            shown = clip(repr(args.get("step") if step is None else args.get("action")))
            raise TraceError(f"{source}: event `{clip(name)}` has no whole step or index ({shown})")
        if (rank, step, action) in seen:
            raise TraceError(f"{source}: rank {rank} runs `{action}` twice in step {step}")
        seen.add((rank, step, action))
        found.append(Traced(rank, step, index, action, name, start, start + duration))
    return found


def _rank_names(events: Sequence[Mapping[str, Any]]) -> dict[object, int]:
    """pid -> rank from `process_name` metadata events named `rank r` (`rank_name`)."""
    found: dict[object, int] = {}
    for e in events:
        args, pid = e.get("args"), e.get("pid")
        if e.get("ph") == "M" and e.get("name") == "process_name" and isinstance(args, dict):
            match = re.fullmatch(r"rank (\d{1,18})", str(args.get("name", "")))
            if match and isinstance(pid, int | str):
                found[pid] = int(match.group(1))
    return found


def _time(value: object) -> float | None:
    """A time in microseconds: a finite number (JSON's, or a string of one); None else."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        time = float(value)
    except (ValueError, OverflowError):
        return None
    return time if math.isfinite(time) else None


def _whole(value: object) -> int | None:
    """A step or an action's index: a whole number from 0 to 10^18 (JSON's 3 or 3.0, or
    "3"); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,18}", value):
        value = int(value)
    return value if isinstance(value, int) and 0 <= value <= 10**18 else None
