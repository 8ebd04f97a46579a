"""Write a plan as a `.pipe` file that `pipelang check`, `viz` and `run` accept as is.

The file is the stdlib schedule's own text, with the chosen parameters as the
defaults, and three kinds of lines added at the top of the schedule's body: the
`partition` (layers per stage), one `cost` line per stage (milliseconds per micro-batch
from the profile; where W is split off, also the share of the activations W keeps,
`MW`), and `cost C` with `C[b]` for each stage boundary whose transfers
take another time than most (each as the prediction timed it on its link). A comment
header names the plan, its prediction and the device each rank runs on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipelang import __version__, api
from pipelang.diagnostics import QUOTED
from pipelang.planner.costs import stage_w_shares
from pipelang.planner.plans import Plan
from pipelang.planner.search import Planner
from pipelang.planner.units import format_bytes
from pipelang.profile import Profile
from pipelang.source import one_line


def plan_source(plan: Plan, planner: Planner, profile_name: str, topology_name: str) -> str:
    """The text of the `.pipe` file for `plan`."""
    file = api.load_file(plan.candidate.schedule)
    text = file.source.text
    schedule = file.schedule
    values = dict(plan.candidate.params)
    edits: list[tuple[int, int, str]] = []
    for param in schedule.params:
        if param.name in values and param.default is not None:
            span = param.default.span
            edits.append((span.start, span.end, str(values[param.name])))
    first = schedule.body[0].span.start
    line_start = text.rfind("\n", 0, first) + 1
    indent = text[line_start:first]
    transfers = planner.boundary_transfers(plan)
    added = [f"{indent}{line}\n" for line in _body_lines(plan, planner, transfers)]
    edits.append((line_start, line_start, "".join(added)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return _header(plan, planner, profile_name, topology_name, transfers) + text


def _body_lines(plan: Plan, planner: Planner, transfers: list[float | None]) -> list[str]:
    lines = [
        "# Planned by `pipelang plan`: layers per stage, and each stage's costs in ms"
        + (" (MW: the share of its activations W keeps after B)." if plan.split_w else "."),
        "partition " + ", ".join(map(str, plan.partition)),
    ]
    speeds = planner.plan_speeds(plan)
    stage_costs = planner.costs.stage_costs(plan.partition, plan.split_w, speeds=speeds)
    shares = stage_w_shares(planner.inputs.profile, plan.partition)
    for stage, (f, b, w) in enumerate(stage_costs):
        items = [f"F[{stage}] = {_ms(f)}", f"B[{stage}] = {_ms(b)}"]
        if plan.split_w:  # and what W keeps after B, as the plan's memory counted it
            items += [f"W[{stage}] = {_ms(w)}", f"MW[{stage}] = {_ms(shares[stage])}"]
        lines.append("cost " + ", ".join(items))
    lines.append("cost " + ", ".join(_transfer_items(plan, transfers)))
    return lines


def _transfer_items(plan: Plan, transfers: list[float | None]) -> list[str]:
    """`C`, and `C[b]` for each stage boundary whose transfers take another time. `C` is
    the boundaries' most common time, or where pipelines cross some boundary over links
    of different times, the mean of all the plan's transfers (what those then take)."""
    times = [None if t is None else _ms(t) for t in transfers]
    known = [t for t in times if t is not None]
    mixed = None in times or not known
    base = _ms(plan.transfer_ms) if mixed else max(known, key=known.count)
    return [f"C = {base}"] + [f"C[{b}] = {t}" for b, t in enumerate(times) if t not in (None, base)]


def _ms(value: float) -> str:
    """A cost literal: fixed-point (the grammar has no exponent), 4 decimals at most."""
    text = f"{value:.4f}".rstrip("0").rstrip(".")
    return text or "0"


def _header(
    plan: Plan,
    planner: Planner,
    profile_name: str,
    topology_name: str,
    transfers: list[float | None],
) -> str:
    inputs = planner.inputs
    profile = inputs.profile
    names = inputs.topology.names
    peak, rank = plan.peak()
    devices = _devices([names[d] for d in plan.devices])
    lines = [
        f"{HEADER.removeprefix('# ')} (pipelang {__version__}): {plan.candidate.label}",
        f"  profile {named(profile_name)}: {named(profile.model)} on {named(profile.device)}, "
        f"{named(profile.dtype)}, micro-batches of {profile.micro_batch_size} x "
        f"{profile.seq_len} tokens",
        f"  assumes {named(_assumed(profile), 2 * NAMED)}",
        f"  topology {named(topology_name)}: {len(names)} devices",
        f"  predicted iteration {plan.time_ms:.3f} ms, bubble ratio {plan.bubble_ratio:.3f}, "
        f"peak memory {format_bytes(peak)} (rank {rank})",
        f"  devices: {devices}",
        *_copies(plan),
        *_transfers(transfers),
        "",
    ]
    return "".join(f"# {one_line(line)}".rstrip() + "\n" for line in lines)


NAMED = 200
"""The most characters of one name from the inputs (a profile's model, a device) that the
header writes; a longer one is cut in the middle, saying how long it was, so that no
input makes the plan longer than the 1 MiB `check` reads (with the devices' line,
`DEVICES_LINE`, and a profile's at most 1,024 stages of cost lines, far inside it)."""


def named(text: str, most: int = NAMED) -> str:
    """`text` from a user's input as the header writes it: on one line (`one_line`), and
    past `most` characters cut in the middle, saying how long it was."""
    text = one_line(text)
    if len(text) <= most:
        return text
    keep = most // 2
    return f"{text[:keep]}...{text[-keep // 2 :]} ({len(text):,} characters)"


DEVICES_LINE = 20_000
"""The most characters of the header's line of each rank's device; the rest are counted."""


def _devices(names: list[str]) -> str:
    """Each rank's device, by name (`named`, at most `QUOTED` characters each), as many
    as DEVICES_LINE characters hold, then how many more ranks there are."""
    shown: list[str] = []
    length = 0
    for rank, name in enumerate(names):
        item = f"rank {rank} -> {named(name, QUOTED)}"
        length += len(item) + 2
        if length > DEVICES_LINE:
            return ", ".join(shown) + f", ... and {len(names) - rank:,} more ranks"
        shown.append(item)
    return ", ".join(shown)


def _transfers(transfers: list[float | None]) -> list[str]:
    """What the `cost C` lines say of the transfers the prediction timed."""
    mixed = [b for b, t in enumerate(transfers) if t is None]
    if not mixed:
        return ["  The `cost C` line below times each transfer as the prediction did."]
    shown = ", ".join(map(str, mixed[:8])) + (" ..." if len(mixed) > 8 else "")
    return [
        f"  Stage boundaries {shown} are crossed over links of different times; their",
        "  transfers take `cost C`, the mean of all, so `pipelang simulate` on this file",
        "  can differ slightly from the prediction.",
    ]


def _assumed(profile: Profile) -> str:
    """The speed of the runtime the prediction assumes, in one line."""
    if profile.runtime is None:
        return "no runtime calibration: the runtime's work per action and message as 0"
    return profile.runtime.described()


HEADER = "# Plan from `pipelang plan`"
PREDICTED = re.compile(r"^#   predicted iteration ([0-9.]+) ms", re.MULTILINE)
PROFILE = re.compile(r"^#   profile .*?: (\S+) on (.+?), ", re.MULTILINE)
ASSUMED = re.compile(r"^#   assumes (.+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a plan's header says about its step time."""

    ms: float
    model: str
    device: str
    assumed: str | None = None
    """The runtime speed the prediction assumed (the profile's calibration), in words."""


def read_prediction(text: str) -> Prediction | None:
    """The prediction in the header `plan_source` writes; None for any other file."""
    if not text.startswith(HEADER):
        return None
    ms, profile = PREDICTED.search(text), PROFILE.search(text)
    if ms is None or profile is None:
        return None
    assumed = ASSUMED.search(text)
    return Prediction(
        float(ms.group(1)), profile.group(1), profile.group(2), assumed and assumed.group(1)
    )


def read_plan(path: str | Path) -> Prediction | None:
    """The prediction of the schedule file at `path` when `pipelang plan` wrote it; None
    for any other file, or one that cannot be read."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return read_prediction(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError):
        return None


def _copies(plan: Plan) -> list[str]:
    """How to run a plan of data-parallel copies; nothing for one pipeline."""
    dp, ranks = plan.candidate.dp, plan.candidate.ranks
    if dp == 1:
        return []
    return [
        f"  data parallel: run with `pipelang run THIS.pipe --dp {dp}`: {dp} copies, copy k",
        f"  on the devices above + k x {ranks}, each with N = "
        f"{dict(plan.candidate.params)['N']} micro-batches ({dp} x N per iteration).",
    ]
