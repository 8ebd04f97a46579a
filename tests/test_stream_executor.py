"""The CPU executor of stream programs (`run --backend local --graphs` without CUDA).

Oracles: the single-process reference (`--check`) for every stdlib schedule the runtime
runs, over several interleavings; and the negative: a stream program with one `wait`
deleted (which `check-streams` rejects) trains wrong on the CPU for some interleaving.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelang import api
from pipelang.backends.config import RunConfig
from pipelang.backends.models import plan_stages
from pipelang.backends.stream_executor import StreamExecutor, slot_bytes
from pipelang.compiler import Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.ir.streams import StreamProgram
from tests.helpers import run, stdlib

LOWERED = [name for name in api.stdlib_names() if name != "bpipe"]


def executor(name: str, text: str | None = None, seed: int = 0, **params: int) -> StreamExecutor:
    c = run_passes(
        api.load_file(name), Options({k: str(v) for k, v in params.items()}), "check-streams"
    )
    assert c.program is not None and c.streams is not None
    streams = c.streams if text is None else StreamProgram.parse(text)
    config = RunConfig(backend="local", steps=2, optimizer="sgd")
    shapes = plan_stages(config.spec, c.program.num_stages, None).shapes
    return StreamExecutor(c.program, streams, config, shapes, seed)


@pytest.mark.slow
@pytest.mark.parametrize("name", LOWERED)
def test_every_stdlib_schedule_checks_on_the_executor(name: str) -> None:
    """One interleaving per schedule, seeds alternating over the list (any two legal
    interleavings train the same: `test_any_legal_interleaving_trains_the_same`); four
    micro-batches where the schedule takes them (warm-up, steady state and cool-down
    all occur at D = 4), to keep the suite short."""
    try:
        program = stdlib(name, N=4)
    except PipelangError:  # its `require`s ask for more micro-batches
        program = stdlib(name)
    seed = str(LOWERED.index(name) % 2)
    options = ["--backend", "local", "--graphs", "--stream-seed", seed, "--steps", "2"]
    assert run(program, *options, "--check") == 0


def final_weights(run: StreamExecutor) -> list[torch.Tensor]:
    run.run(lambda *_: None)
    return [p for r in run.processes for c in r.runtime.copies.values() for p in c.params]


def test_any_legal_interleaving_trains_the_same() -> None:
    first = final_weights(executor("1f1b", seed=0, D=3, N=4))
    for seed in (1, 2, 3):
        again = final_weights(executor("1f1b", seed=seed, D=3, N=4))
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "deleted",
    [
        "r1.compute  wait",  # the forward's wait for its receive (read-after-write)
        "r0.send1    wait",  # the send's wait for the forward that writes its slot
    ],
)
def test_a_missing_wait_trains_wrong_on_the_cpu(deleted: str) -> None:
    """Delete the first such `wait` (after the stream's fork): some interleaving then
    reads a dead slot (NaN) or another micro-batch's value."""
    good = executor("1f1b", D=2, N=4)
    lines = good.streams.dump().split("\n")
    matches = [n for n, line in enumerate(lines) if line.startswith(deleted)]
    n = matches[1] if deleted.startswith("r0.send1") else matches[0]
    racy = "\n".join(lines[:n] + lines[n + 1 :])
    expected = final_weights(good)
    wrong = 0
    for seed in range(6):
        got = final_weights(executor("1f1b", racy, seed=seed, D=2, N=4))
        if not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)):
            wrong += 1
    assert wrong >= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "chimera", "zb-h1", "interleaved-1f1b"])
def test_the_executor_holds_what_the_slot_plan_says(name: str) -> None:
    """Data slots: allocated = planned bytes, each slot one boundary activation (gpt:tiny:
    4 x 32 x 64 float32 = 32 KiB). Saved slots: the runtime's own peak of kept forwards
    equals the plan's saved slots on every rank."""
    run = executor(name)
    planned = [
        sum(slot_bytes(run.streams, r, run.shapes).values()) for r in range(run.streams.ranks)
    ]
    assert run.allocated_bytes == planned
    slots = [len(run.streams.slots(r)["data"]) for r in range(run.streams.ranks)]
    assert planned == [n * 4 * 32 * 64 * 4 for n in slots]
    run.run(lambda *_: None)
    assert run.peak_saved == [len(run.streams.slots(r)["saved"]) for r in range(run.streams.ranks)]


@pytest.mark.slow
def test_the_gpu_benchmark_runs_here_in_smoke_mode() -> None:
    """benchmarks/graphs_vs_eager.py is for a GPU (gpu_batch.sh runs it); `--smoke` runs
    it here, with the CPU executor as its graphs runner, so a GPU session finds it working."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "graphs_vs_eager.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| gpt:tiny | 1 |"))
    eager, graphs = (float(cell) for cell in row.split("|")[3:5])
    assert eager > 0 and graphs > 0
