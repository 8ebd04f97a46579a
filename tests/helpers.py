"""What the tests share, in one module (a test module never imports another).

- Programs straight from IR text (`program_from_dump`: one line of tokens per rank, each
  action with a span into that text, so diagnostics point at the token that caused
  them), and the per-rank orders of known schedules (`one_f_one_b`, `gpipe`, ...).
- Compiling and simulating: `timeline` (a `.pipe` text), `replay` (a Program), `errors`
  and `at` (a text's diagnostics and where they point).
- The command line: `run_in_process` (in this process, output checked clean),
  `pipelang_cmd` (a subprocess, as a user runs it), `GOOD` (a small valid schedule).
- Runs: `run` (`pipelang run` on a Program), `stdlib`, `host_op`, `read_checkpoint`,
  `make_profile`; and `lowered_by_hand`, an independent lowering (sends, receives, sync)
  that the runtime tests use as an oracle against the compiler's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import socket
import subprocess
import sys
import tempfile
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import pipelang
from pipelang import api
from pipelang.api import load_program
from pipelang.backends.launch import run_program
from pipelang.backends.processes import action_labels
from pipelang.cli import main
from pipelang.cli.run_options import add_run_arguments, config_from_args
from pipelang.compiler import SCHEDULE_DONE, Options, run_passes, stream_program
from pipelang.diagnostics import Diagnostic, PipelangError
from pipelang.import_torch import check_pipe
from pipelang.ir import Action, CostModel, Dependency, Kind, Pipeline, Program
from pipelang.ir.graph import op_graph
from pipelang.parser import stdlib_dir
from pipelang.passes.insert_comms import insert_comms
from pipelang.passes.validate import validate
from pipelang.planner.topology import Link, Topology
from pipelang.profile import LayerCost, Profile
from pipelang.sim.timeline import Timeline, simulate
from pipelang.source import SourceFile, Span


def program_from_dump(
    lines: Sequence[str],
    *,
    pipelines: Mapping[str, Sequence[int]] | None = None,
    assignment: Sequence[str] | None = None,
    kinds: str = "FB",
    after: Sequence[tuple[str, str]] = (),
    name: str = "test",
    params: Mapping[str, int] | None = None,
    costs: CostModel | None = None,
) -> Program:
    """A Program from one line of action tokens per rank (`rank r:` prefixes allowed).

    By default one pipeline `main` places stage s on rank s (as many stages as lines) and
    every micro-batch named in the text travels through `main`.
    """
    source = SourceFile.of("<dump>", "\n".join(lines))
    ranks: list[tuple[Action, ...]] = []
    offset = 0
    for line in lines:
        body = re.sub(r"^\s*rank\s+\d+\s*:", lambda m: " " * len(m.group()), line)
        ranks.append(
            tuple(
                Action.parse(m.group(), Span(source, offset + m.start(), offset + m.end()))
                for m in re.finditer(r"\S+", body)
            )
        )
        offset += len(line) + 1
    placements = dict(pipelines) if pipelines else {"main": range(len(lines))}
    if assignment is None:
        count = 1 + max((a.mb for r in ranks for a in r if a.mb is not None), default=-1)
        assignment = [next(iter(placements))] * count
    return Program(
        name=name,
        source="<dump>",
        params=tuple((params or {}).items()),
        num_ranks=len(lines),
        num_stages=len(next(iter(placements.values()))),
        pipelines=tuple(Pipeline(n, tuple(p)) for n, p in placements.items()),
        assignment=tuple(assignment),
        kinds=tuple(Kind(k) for k in kinds),
        ranks=tuple(ranks),
        after=tuple(Dependency(Action.parse(a), Action.parse(b)) for a, b in after),
        costs=costs or CostModel(),
        order_span=Span(source, 0, len(lines[0])) if lines else None,
    )


def one_f_one_b(num_ranks: int, num_mbs: int) -> list[str]:
    """1F1B: min(D-r-1, N) forwards, then F and B in turn, then the remaining Bs."""
    lines = []
    for r in range(num_ranks):
        warm = min(num_ranks - r - 1, num_mbs)
        ops = [f"F{i}@{r}/main" for i in range(warm)]
        for i in range(num_mbs - warm):
            ops += [f"F{warm + i}@{r}/main", f"B{i}@{r}/main"]
        ops += [f"B{i}@{r}/main" for i in range(num_mbs - warm, num_mbs)]
        lines.append(" ".join(ops))
    return lines


def gpipe(num_ranks: int, num_mbs: int) -> list[str]:
    """GPipe: every forward, then every backward."""
    return [
        " ".join(
            [f"F{i}@{r}/main" for i in range(num_mbs)] + [f"B{i}@{r}/main" for i in range(num_mbs)]
        )
        for r in range(num_ranks)
    ]


def interleaved(num_ranks: int, num_mbs: int, chunks: int) -> list[str]:
    """Megatron's interleaved 1F1B; stage s on rank s % D, N a multiple of D."""
    d, total = num_ranks, num_mbs * chunks
    lines = []
    for r in range(d):
        warm = min((d - r - 1) * 2 + (chunks - 1) * d, total)

        def fwd(k: int, r: int = r) -> str:
            mb, stage = (k // (d * chunks)) * d + k % d, ((k // d) % chunks) * d + r
            return f"F{mb}@{stage}/main"

        def bwd(i: int, r: int = r) -> str:
            mb, stage = (i // (d * chunks)) * d + i % d, (chunks - 1 - (i // d) % chunks) * d + r
            return f"B{mb}@{stage}/main"

        ops = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            ops += [fwd(warm + i), bwd(i)]
        ops += [bwd(i) for i in range(total - warm, total)]
        lines.append(" ".join(ops))
    return lines


CHIMERA_4 = [
    "F0@0/down F1@0/down F2@3/up B2@3/up F3@3/up B3@3/up B0@0/down B1@0/down",
    "F0@1/down F2@2/up F1@1/down F3@2/up B2@2/up B0@1/down B3@2/up B1@1/down",
    "F2@1/up F0@2/down F3@1/up F1@2/down B0@2/down B2@1/up B1@2/down B3@1/up",
    "F2@0/up F3@0/up F0@3/down B0@3/down F1@3/down B1@3/down B2@0/up B3@0/up",
]
"""Chimera D = 4, N = 4 (papers.md section 1.1): mbs 0, 1 down, 2, 3 up."""

CHIMERA_4_PIPELINES = {"down": (0, 1, 2, 3), "up": (3, 2, 1, 0)}
CHIMERA_4_ASSIGNMENT = ("down", "down", "up", "up")


def chimera_4(costs: CostModel | None = None) -> Program:
    """The Chimera D = 4, N = 4 program of papers.md section 1.1."""
    return program_from_dump(
        CHIMERA_4,
        pipelines=CHIMERA_4_PIPELINES,
        assignment=CHIMERA_4_ASSIGNMENT,
        name="chimera",
        params={"D": 4, "N": 4},
        costs=costs,
    )


def costs(**values: float) -> CostModel:
    """A CostModel from keyword times: `costs(F=1, B=2)`."""
    return CostModel().merged(CostModel(tuple((k, None, float(v)) for k, v in values.items())))


def replay(program: Program, model: CostModel) -> Timeline:
    """Simulate a Program made outside the compiler (a dump, a hand-built order): build
    its op graph and validate it first, as the compiler does (raises PipelangError); a
    backward that is not split takes B + W, as the compiler times it."""
    graph = op_graph(program)
    problems = validate(program, graph, None)
    if problems:
        raise PipelangError(problems)
    return simulate(program, graph, model.for_kinds(program.kinds))


def with_comms(program: Program) -> Program:
    """Pass `insert-comms` on a Program made outside the compiler."""
    return insert_comms(program, op_graph(program))


PACKAGE = str(Path(pipelang.__file__).resolve().parent)
STDLIB = str(stdlib_dir().resolve())

GOOD = """\
schedule good(D: int = 2, N: int = 2) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r { for i in 0..N { F(i) B(i) } }
}
"""


def assert_clean(out: str, err: str) -> None:
    for stream in (out, err):
        assert "Traceback" not in stream
        assert not re.search(r"^internal error:", stream, re.M)
    assert PACKAGE not in err
    assert STDLIB not in err


def pipelang_cmd(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `pipelang ARGS` as a user would, in `cwd`; check that the output is clean."""
    proc = subprocess.run(
        [sys.executable, "-m", "pipelang.cli", *args],
        cwd=cwd,
        capture_output=True,
        encoding="utf-8",
        errors="replace",
        timeout=timeout,
        env={**os.environ, "COLUMNS": "100"},
        check=False,
    )
    assert_clean(proc.stdout, proc.stderr)
    return proc


def pipelang_here(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`pipelang_cmd` in this process, in `cwd` with the same 100 columns and the same
    checks, but no Python start-up (seconds, with torch): for tests of what a command
    does rather than of the process around it. (`timeout` is `pipelang_cmd`'s.)"""
    here, columns = Path.cwd(), os.environ.get("COLUMNS")
    os.chdir(cwd)
    os.environ["COLUMNS"] = "100"
    try:
        status, out, err = run_in_process(list(args))
    finally:
        os.chdir(here)
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return subprocess.CompletedProcess(list(args), status, out, err)


def free_port() -> str:
    """A TCP port free now, for a rendezvous a test starts itself (a fixed one would
    clash with another test running at the same time: `pytest -n 2`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_in_process(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(args)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    assert_clean(out.getvalue(), err.getvalue())
    return status, out.getvalue(), err.getvalue()


def timeline(text: str, **params: int | bool) -> Timeline:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.pipe"
        path.write_text(text)
        options = Options({k: str(v).lower() for k, v in params.items()})
        done = run_passes(api.load_file(str(path)), options, SCHEDULE_DONE)
    program, graph = done.need_program(), done.graph
    assert graph is not None
    return simulate(program, graph, program.costs)


def errors(text: str) -> list[Diagnostic]:
    with pytest.raises(PipelangError) as err:
        check_pipe(text, "t.pipe")
    return err.value.diagnostics


def at(text: str, d: Diagnostic) -> str:
    """The source text a diagnostic points at."""
    assert d.span is not None
    return text[d.span.start : d.span.end]


def two_nodes() -> Topology:
    """Two nodes of two devices each (d0, d1 | d2, d3): 1 TB/s inside a node, 1 GB/s
    between, no latency, 1 TB of memory each."""
    fast, slow = Link(1e12, 0.0), Link(1e9, 0.0)
    node = [0, 0, 1, 1]
    return Topology(
        tuple(f"d{i}" for i in range(4)),
        (1e12,) * 4,
        tuple(
            tuple(None if a == b else fast if node[a] == node[b] else slow for b in range(4))
            for a in range(4)
        ),
    )


def make_profile(
    forward: list[float], backward: list[float] | None = None, **sizes: float
) -> Profile:
    backward = backward or [2 * f for f in forward]
    layers = tuple(
        LayerCost(
            f"l{i}",
            f,
            b,
            0.0,
            sizes.get("activation", 1e6),
            sizes.get("weight", 1e6),
            sizes.get("output", 1e5),
        )
        for i, (f, b) in enumerate(zip(forward, backward, strict=True))
    )
    return Profile("synthetic", "cpu", "float32", 1, 1, layers)


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, read in this process."""
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


# ---- runs, and an independent lowering: the runtime tests' oracle ----------------


def run(program: Program, *options: str) -> int:
    """`pipelang run` on a Program, in this process; returns the exit status. As the
    command does, the compiler gives the stream program where the ranks run one."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    parser.add_argument("--debug", action="store_true")
    config = config_from_args(parser.parse_args(list(options)))
    return run_program(program, config, lambda: stream_program(program, config.dp))


def stdlib(name: str, **params: int) -> Program:
    """A compiled stdlib schedule."""
    return load_program(name, {k: str(v) for k, v in params.items()})


def host_op(program: Program, rank: int, index: int, dp: int = 1) -> str:
    """How a failure names op `index` of program rank `rank` in a gloo run: the stream
    op the host issues there (`r1.compute F0@1/main`), as the launcher labels it."""
    return action_labels(program, stream_program(program, dp))[rank][index]


def _consumer(program: Program, op: Action) -> Action | None:
    """The compute op on another stage that reads what `op` produces, if any."""
    assert op.stage is not None
    if op.kind is Kind.F and op.stage + 1 < program.num_stages:
        return Action(Kind.F, op.mb, op.stage + 1, op.pipeline)
    if op.kind is Kind.B and op.stage > 0:
        return Action(Kind.B, op.mb, op.stage - 1, op.pipeline)
    return None


def _rank(program: Program, op: Action) -> int:
    assert op.stage is not None and op.pipeline is not None
    return program.rank_of(op.stage, op.pipeline)


def lowered_by_hand(program: Program) -> Program:
    """`program` with sends, receives, allreduces and steps inserted (see module doc)."""
    world = program.num_ranks
    position = [0] * world
    out: list[list[Action]] = [[] for _ in range(world)]
    channel: dict[tuple[int, int], deque[Action]] = {}
    received: list[set[Action]] = [set() for _ in range(world)]
    while any(position[r] < len(program.ranks[r]) for r in range(world)):
        progressed = False
        for rank in range(world):
            while position[rank] < len(program.ranks[rank]):
                op = program.ranks[rank][position[rank]]
                if not _receive_inputs(program, op, rank, channel, received, out):
                    break
                out[rank].append(op)
                position[rank] += 1
                progressed = True
                consumer = _consumer(program, op)
                if consumer is not None and (peer := _rank(program, consumer)) != rank:
                    out[rank].append(op._replace(kind=Kind.SEND, peer=peer, of=op.kind))
                    channel.setdefault((rank, peer), deque()).append(op)
        if not progressed:
            raise ValueError("the test program deadlocks")
    _add_sync(program, out)
    return dataclasses.replace(program, ranks=tuple(tuple(r) for r in out))


def _receive_inputs(
    program: Program,
    op: Action,
    rank: int,
    channel: dict[tuple[int, int], deque[Action]],
    received: list[set[Action]],
    out: list[list[Action]],
) -> bool:
    for dep in program.inputs_of(op):
        src = _rank(program, dep)
        if src == rank or dep in received[rank]:
            continue
        queue = channel.get((src, rank), deque())
        if dep not in queue:
            return False
        while True:
            got = queue.popleft()
            received[rank].add(got)
            out[rank].append(got._replace(kind=Kind.RECV, peer=src, of=got.kind))
            if got == dep:
                break
    return True


def _add_sync(program: Program, out: list[list[Action]]) -> None:
    last_grad = Kind.W if Kind.W in program.kinds else Kind.B
    for rank, actions in enumerate(out):
        for stage, pipe in program.stage_copies(rank):
            if len(set(program.replicas(stage))) < 2:
                continue
            last = max(
                i
                for i, a in enumerate(actions)
                if a.kind is last_grad and a.stage == stage and a.pipeline == pipe
            )
            # after the op and any send that follows it
            while last + 1 < len(actions) and actions[last + 1].kind is Kind.SEND:
                last += 1
            actions.insert(last + 1, Action(Kind.ALLREDUCE, None, stage, pipe))
        actions.append(Action(Kind.STEP))
