"""Stream programs run eagerly over gloo (`run --backend gloo --graphs`).

Each rank runs its part of the stream program (backends/executor.py): receives posted
early as `irecv`s, sends as `isend`s, the compute stream waiting for exactly the works its
events name. Oracle: the single-process reference (`--check`).
"""

from __future__ import annotations

import json

import pytest

from pipelang.backends.backend import runs_streams
from pipelang.backends.config import RunConfig
from pipelang.backends.executor import Call, StreamRankProgram, action_call, stream_rank
from pipelang.cli import main
from pipelang.compiler import stream_program as lower_streams
from tests.helpers import run, stdlib

BPIPE = stdlib("bpipe", D=4, N=8)

GRAPHS = ("--backend", "gloo", "--graphs", "--steps", "2", "--check")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("1f1b", {"D": 2, "N": 4}),
        ("chimera", {"D": 4, "N": 4}),
        ("interleaved-1f1b", {"D": 2, "N": 4}),
        ("zbv", {"D": 2, "N": 4}),
        ("pipedream", {"D": 2, "N": 4}),
    ],
)
def test_stream_programs_train_like_one_process_over_gloo(
    name: str, params: dict[str, int]
) -> None:
    assert run(stdlib(name, **params), *GRAPHS) == 0


def test_data_parallel_copies_over_gloo() -> None:
    assert run(stdlib("1f1b", D=2, N=2), *GRAPHS, "--dp", "2") == 0


@pytest.mark.slow
def test_warm_up_capture_and_replays_train_like_one_process() -> None:
    """Past the WARMUP eager steps the driver captures once and replays (on a CPU a replay
    runs the kept iteration); inputs come from static buffers loaded before each step."""
    options = ["--backend", "gloo", "--graphs", "--check", "--steps", "6"]
    assert run(stdlib("chimera", D=4, N=4), *options) == 0


def test_a_ranks_stream_calls_read_as_its_dump() -> None:
    """One call per op of the rank's stream program that a CPU host must issue (no
    record on compute, no wait on another stream), its slots' stage boundaries in
    `slots`; receives come first (posted early)."""
    program = stdlib("1f1b", D=2, N=2)
    streams = lower_streams(program, 1)
    part = stream_rank(program, streams, 1, cuda=False)
    body = [call.text() for call in part.calls]
    assert part.ops == tuple(op for _, op in streams.host_ops(1))
    assert part.slots == {"d0": (0,), "d1": (0,)}
    assert len(body) < len(list(streams.by_rank(1)))
    assert len(stream_rank(program, streams, 1, cuda=True).calls) == len(list(streams.by_rank(1)))
    assert not [line for line in body if 'on="compute")' in line and "record_event" in line]
    assert not [line for line in body if "wait_event" in line and 'on="compute")' not in line]
    first_recv = next(i for i, line in enumerate(body) if "rt.recv(" in line)
    first_compute = next(i for i, line in enumerate(body) if "rt.slot_forward(" in line)
    assert first_recv < first_compute
    assert 'rt.slot_forward(mb=0, stage=1, pipeline="main", x="d0")' in body


class _Driven:
    """What the stream driver asks of a runtime, recorded."""

    def __init__(self) -> None:
        self.graph: object = None
        self.said: list[str] = []

    def load_inputs(self, step: int) -> None:
        self.said.append(f"load {step}")

    def run_eager(self, iteration: object) -> None:
        self.said.append("eager")

    def capture(self, iteration: object) -> None:
        self.graph = iteration
        self.said.append("capture")

    def replay(self) -> None:
        self.said.append("replay")

    def step(self) -> None:
        self.said.append("step")


@pytest.mark.parametrize(
    ("warmup", "said"),
    [
        (None, ["load 0", "eager", "load 1", "eager", "load 2", "eager", "load 3", "eager"]),
        (
            2,
            [
                "load 0",
                "eager",
                "load 1",
                "eager",
                "load 2",
                "capture",
                "replay",
                "load 3",
                "replay",
            ],
        ),
    ],
)
def test_the_stream_driver_warms_up_captures_once_and_replays(
    warmup: int | None, said: list[str]
) -> None:
    """Without --graphs every step runs eagerly; with it the first WARMUP steps do, the
    next captures the iteration once, and every later step replays it."""
    runtime = _Driven()
    program = StreamRankProgram(runtime, [Call("step")], warmup)  # type: ignore[arg-type]
    for step in range(4):
        program.run(step)
    assert runtime.said == said


def test_a_failure_names_the_stream_op(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib("1f1b", D=2, N=2)
    labels = [op for _, op in lower_streams(program, 1).host_ops(1)]
    index = next(i for i, op in enumerate(labels) if op.what == "F0@1/main")
    monkeypatch.setenv("PIPELANG_FAULT", f"1:0:{index}:raise")
    assert run(program, "--backend", "gloo", "--graphs", "--timeout", "20") == 1
    err = capsys.readouterr().err
    assert f"error: rank 1 failed at step 0, action {index} `r1.compute F0@1/main`" in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--backend", "gloo", "--trace", "t.json"), "error: --trace times every action"),
    ],
)
def test_graphs_refusals(
    options: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(stdlib("1f1b", D=2, N=2), "--graphs", *options) == 2
    assert capsys.readouterr().err.startswith(message)


def test_a_plain_gloo_run_executes_the_stream_program_eagerly() -> None:
    """Without --graphs, gloo and nccl ranks run their stream programs (every step eager;
    --graphs captures after 3); the local backend and a schedule with evictions run
    action lists."""
    program = stdlib("1f1b", D=2, N=4)
    assert runs_streams(program, RunConfig())
    assert runs_streams(program, RunConfig(backend="nccl"))
    assert runs_streams(program, RunConfig(backend="local", graphs=True))
    for config, evicting in ((RunConfig(backend="local"), program), (RunConfig(), BPIPE)):
        assert not runs_streams(evicting, config)
        calls = [action_call(a).text() for a in evicting.ranks[0]]
        assert any(call.startswith("rt.send_activation(") for call in calls)


@pytest.mark.parametrize(
    ("name", "params"),
    [("1f1b", {"D": 2, "N": 4}), ("chimera", {"D": 4, "N": 4}), ("zbv", {"D": 2, "N": 4})],
)
def test_actions_name_the_action_each_op_performs(name: str, params: dict[str, int]) -> None:
    """`actions` (what --trace records an op as) holds every action of the rank once, at
    the op that performs it; events map to None."""
    program = stdlib(name, **params)
    streams = lower_streams(program, 1)
    for rank, actions in enumerate(program.ranks):
        part = stream_rank(program, streams, rank, cuda=False)
        assert len(part.actions) == len(part.calls) == len(part.ops)
        assert sorted(i for i in part.actions if i is not None) == list(range(len(actions)))
        for index, op, call in zip(part.actions, part.ops, part.calls, strict=True):
            if index is None:
                assert op.is_event and call.method.endswith("_event")
            else:
                assert op.what == actions[index].text()


def test_a_run_allocates_the_slot_bytes_that_simulate_and_compile_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`simulate --model` and `compile --dump-after streams --model` give each rank's
    data-slot bytes; a gloo run allocates exactly those (its summary's last column)."""
    sched = ["1f1b", "-p", "D=4", "-p", "N=8", "--model", "gpt:tiny"]
    assert main(["simulate", *sched, "--json"]) == 0
    planned = [row["data_slot_bytes"] for row in json.loads(capsys.readouterr().out)["ranks"]]
    assert planned == [131072, 131072, 98304, 65536]  # 4, 4, 3, 2 slots of 4x32x64 fp32
    assert main(["compile", *sched, "--dump-after", "streams"]) == 0
    sizes = ", ".join(f"rank {r} {n:,}" for r, n in enumerate(planned))
    assert f"# data slot bytes on gpt:tiny: {sizes}\n" in capsys.readouterr().out
    assert run(stdlib("1f1b", D=4, N=8), "--steps", "1") == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" B │")]
    assert [int(row.split("│")[-2].strip()[:-2].replace(",", "")) for row in rows] == planned


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compile", "1f1b", "-o", "out", "--model", "gpt:tiny"], "use it with --dump-after"),
        (["simulate", "1f1b", "--model", "nowhere:nothing"], "cannot load `nothing`"),
        (["simulate", "gpipe", "-p", "D=10", "--model", "gpt:tiny"], "has only 8 layers"),
        (["simulate", "1f1b", "--partition", "2,2,2,2"], "give --model too"),
        (["compile", "1f1b", "--dump-after", "streams", "--partition", "2,2"], "--model too"),
        (
            ["simulate", "1f1b", "--model", "gpt:tiny", "--partition", "4,4"],
            "gives 2 stages but the schedule has 4",
        ),
        (["simulate", "1f1b", "--model", "gpt:tiny", "--partition", "2,2,2,1"], "8 layers"),
        (["simulate", "1f1b", "--model", "gpt:tiny", "--partition", "2,x"], "layer counts"),
    ],
)
def test_slot_bytes_need_a_model_that_fits(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_graphs_refusal_comes_before_the_stream_program(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The launcher asks the compiler for the stream program after the run's own checks:
    `--graphs --trace` on a schedule that has no stream program is the --trace refusal
    (exit 2), as before the compiler delivered it (E0506 came first, exit 1)."""
    assert run(BPIPE, "--graphs", "--trace", "t.json") == 2
    assert capsys.readouterr().err.startswith("error: --trace times every action")
    assert run(BPIPE, "--graphs", "--steps", "1") == 1
    assert capsys.readouterr().err.startswith("error[E0506]: `bpipe` evicts activations")
