"""What the runtime adds to the layers' own times, read from the trace of a short run.

`pipelang profile --calibrate gloo` runs the profiled model with `pipelang run`: 1F1B on
`ranks` ranks of this machine, N = 4 x ranks micro-batches, the layers split as evenly
as they go, SGD, `steps` steps, `--trace`; `rounds` times (`--calibrate-rounds`, default
3), each cost the median of the runs' and their least and most kept as its spread. From
the trace (the first two steps left out: they warm up, a layer running 10-30% slower in
them than later on the development machine) it takes:

    action_ms      the median gap between two consecutive actions of a rank in a step: the
                   generated line's call and the runtime's bookkeeping
    send_ms        the median duration of a send (the sender's host work; sends do not block)
    recv_ms        the shortest receive: the receiver's host work when the message is
                   there (a minimum: any other receive also waited)
    message_ms     how long a receive took after its send had ended, beyond recv_ms
                   (0 for a receive that began later and took only recv_ms): the time a
                   message takes to arrive once sent; a median over all messages
    compute_scale  a compute action's time over the profile's time for the same
                   layers (the median over actions): how much slower a layer runs beside
                   the other ranks than alone

The run's messages are the stage boundaries' activations and gradients
(`message_bytes`, the largest layer output of the model's first stages). On one
machine, `message_ms` is the transport's own time (gloo: TCP over loopback).
"""

from __future__ import annotations

import itertools
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipelang.backends.backend import DEFAULT
from pipelang.backends.measure import ProfileOptions
from pipelang.diagnostics import fail
from pipelang.ir.program import even_split
from pipelang.profile import RUNTIME_FIELDS, Profile, RuntimeCosts
from pipelang.trace import TraceError, load, read_actions

WARMUP_STEPS = 2
"""Steps of the calibration run left out of its statistics."""
_TRANSFER = re.compile(r"^(send|recv):(.+?)[<>]\d+$")
_COMPUTE = re.compile(r"^([FBW])\d+@(\d+)/")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One action of one rank in a Chrome trace: times in milliseconds."""

    rank: int
    step: int
    index: int
    name: str
    kind: str
    start: float
    end: float


def calibrate(
    profile: Profile,
    options: ProfileOptions,
    backend: str = DEFAULT,
    ranks: int = 2,
    steps: int = 8,
    rounds: int = 3,
) -> RuntimeCosts:
    """Run the profiled model under the runtime `rounds` times and measure what it adds
    (see the module docstring): each cost is the median of the runs' own, with the least
    and most one run measured as its spread (one run on a busy machine can be 10x off).
    A run that fails is E0404 with the run's own error."""
    ranks = max(1, min(ranks, len(profile.layers)))
    counts = even_split(len(profile.layers), ranks)
    runs = [
        _calibration_run(profile, options, backend, ranks, steps, counts) for _ in range(rounds)
    ]
    return combined(runs)


def combined(runs: Sequence[RuntimeCosts]) -> RuntimeCosts:
    """Several calibration runs as one: each cost their median, its least and most kept
    as its spread."""
    if len(runs) == 1:
        return runs[0]
    keys = (*RUNTIME_FIELDS, "compute_scale")
    values = {key: [float(getattr(run, key)) for run in runs] for key in keys}
    medians: dict[str, Any] = {key: round(statistics.median(v), 6) for key, v in values.items()}
    return replace(
        runs[0],
        **medians,
        rounds=len(runs),
        spread={key: (min(v), max(v)) for key, v in values.items() if key != "message_bytes"},
    )


def _calibration_run(
    profile: Profile,
    options: ProfileOptions,
    backend: str,
    ranks: int,
    steps: int,
    counts: tuple[int, ...],
) -> RuntimeCosts:
    """One calibration run and the costs its trace shows."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        command = [
            sys.executable,
            "-m",
            "pipelang.cli",
            "run",
            "1f1b",
            "-p",
            f"D={ranks}",
            "-p",
            f"N={4 * ranks}",
            "--model",
            options.model,
            "--backend",
            backend,
            "--steps",
            str(max(WARMUP_STEPS + 1, steps)),
            "--micro-batch-size",
            str(options.micro_batch_size),
            "--dtype",
            options.dtype,
            "--optimizer",
            "sgd",
            "--partition",
            ",".join(map(str, counts)),
            "--seed",
            str(options.seed),
            "--trace",
            str(trace),
        ]
        if options.seq_len is not None:
            command += ["--seq-len", str(options.seq_len)]
        proc = subprocess.run(command, cwd=tmp, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not trace.exists():
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            raise fail(
                "E0404",
                f"the calibration run on {backend} failed (exit {proc.returncode})",
                notes=tuple(lines[-3:]),
                help="profile without --calibrate, or check `pipelang run` on this model",
            )
        events = trace_events(trace, backend)
    return runtime_costs(events, profile, counts, backend, ranks)


def trace_events(path: Path, backend: str = DEFAULT) -> list[TraceEvent]:
    """The actions of the Chrome trace that `pipelang run --trace` wrote, read as
    `viz --trace` reads them (pipelang/trace.py); one that does not read is E0404."""
    try:
        actions = read_actions(load(path), str(path))
    except TraceError as err:
        raise fail(
            "E0404",
            f"the calibration run on {backend} wrote a trace that does not read: {err}",
            help="profile without --calibrate, or check `pipelang run --trace` on this model",
        ) from None
    return [
        TraceEvent(t.rank, t.step, t.index, t.name, t.action.kind.value, t.start / 1e3, t.end / 1e3)
        for t in actions
    ]


def runtime_costs(
    events: Sequence[TraceEvent],
    profile: Profile,
    counts: Sequence[int],
    backend: str,
    ranks: int,
) -> RuntimeCosts:
    """The costs of the module docstring, from the trace of a run of `profile`'s model
    cut into stages of `counts` layers (steps after the warm-up only)."""
    events = [e for e in events if e.step >= WARMUP_STEPS] or list(events)
    gaps: list[float] = []
    sends: list[float] = []
    delivery: list[float] = []
    by_rank: dict[int, list[TraceEvent]] = {}
    for event in events:
        by_rank.setdefault(event.rank, []).append(event)
    for row in by_rank.values():
        row.sort(key=lambda e: (e.step, e.index))
        gaps += [b.start - a.end for a, b in itertools.pairwise(row) if a.step == b.step]
    sent: dict[tuple[int, str], TraceEvent] = {}
    received: list[tuple[TraceEvent, str]] = []
    for event in events:
        match = _TRANSFER.match(event.name)
        if match is None:
            continue
        if match.group(1) == "send":
            sends.append(event.end - event.start)
            sent[(event.step, match.group(2))] = event
        else:
            received.append((event, match.group(2)))
    pairs: dict[tuple[int, int], list[tuple[TraceEvent, TraceEvent]]] = {}
    for event, what in received:
        send = sent.get((event.step, what))
        if send is not None:
            pairs.setdefault((send.rank, event.rank), []).append((send, event))
    receives = [recv.end - recv.start for matched in pairs.values() for _, recv in matched]
    recv_ms = min(receives, default=0.0)
    for (a, b), matched in pairs.items():
        offset = _clock_offset(matched, pairs.get((b, a), []))
        for send, recv in matched:
            # beyond its own host work, the time the receive took after the send ended
            start = max(recv.start - offset, send.end)
            delivery.append(max(0.0, recv.end - offset - start - recv_ms))
    return RuntimeCosts(
        backend=backend,
        ranks=ranks,
        action_ms=round(max(0.0, _median(gaps)), 6),
        send_ms=round(_median(sends), 6),
        recv_ms=round(recv_ms, 6),
        message_ms=round(_median(delivery), 6),
        message_bytes=max(c.output_bytes for c in profile.layers[: len(profile.layers) - 1])
        if len(profile.layers) > 1
        else 0.0,
        compute_scale=round(_compute_scale(events, profile, counts), 6),
    )


def _compute_scale(events: Sequence[TraceEvent], profile: Profile, counts: Sequence[int]) -> float:
    """The median over compute actions of their time over the profile's time for the
    same layers (a median: a burst of other load on the machine moves it little)."""
    forward, backward, start = [], [], 0
    for count in counts:
        part = profile.layers[start : start + count]
        forward.append(sum(c.forward_ms for c in part))
        backward.append(sum(c.full_backward_ms for c in part))
        start += count
    ratios = []
    for event in events:
        match = _COMPUTE.match(event.name)
        if match is None:
            continue
        expected = (forward if match.group(1) == "F" else backward)[int(match.group(2))]
        if expected > 0:
            ratios.append((event.end - event.start) / expected)
    return _median(ratios) if ratios else 1.0


def _clock_offset(
    there: Sequence[tuple[TraceEvent, TraceEvent]], back: Sequence[tuple[TraceEvent, TraceEvent]]
) -> float:
    """The receiver's trace clock less the sender's: each rank's times count from its
    own start after a barrier. The fastest delivery each way is the link's time plus
    the offset one way and minus it the other, so the offset is half their difference
    (as NTP estimates it); 0 without messages back."""
    if not there or not back:
        return 0.0
    forth = min(recv.end - send.end for send, recv in there)
    return (forth - min(recv.end - send.end for send, recv in back)) / 2


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
