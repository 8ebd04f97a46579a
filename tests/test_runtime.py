"""The runtime trains for real: pipelined runs match single-process training (`--check`),
faults stop every rank with one clear message, and codegen output is stable.

Runs on the CPU with gloo (one process per rank) unless a test says otherwise. Programs
are compiled stdlib schedules (`pipelang.api.load_program`); the few shapes the stdlib
lacks (recompute, a backward split without reordering) are built by hand with
tests/helpers.py (`lowered_by_hand`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import one_f_one_b, program_from_dump

from pipelang.backends import codegen
from pipelang.backends.config import RunConfig
from pipelang.backends.local import run_local
from pipelang.backends.measure import activation_peaks, stage_activation_bytes
from pipelang.backends.models import ModelSpec, plan_stages
from pipelang.backends.optim import SGD, Adam
from pipelang.backends.runtime import RankRuntime
from pipelang.cli import main
from pipelang.ir import Action, Kind, Program
from tests.helpers import free_port, host_op, lowered_by_hand, run, stdlib

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "codegen" / "1f1b_D2_N2_rank0.expected"


SCHEDULES = {
    "gpipe-D2-N4": ("gpipe", {"D": 2, "N": 4}),
    "gpipe-D4-N4": ("gpipe", {"D": 4, "N": 4}),
    "1f1b-D2-N4": ("1f1b", {"D": 2, "N": 4}),
    "1f1b-D4-N8": ("1f1b", {"D": 4, "N": 8}),
    "chimera-D4-N4": ("chimera", {"D": 4, "N": 4}),
    "chimera-D4-N8": ("chimera", {"D": 4, "N": 8}),
    "interleaved-1f1b-D2-N4": ("interleaved-1f1b", {"D": 2, "N": 4, "v": 2}),
    "zb-h1-D4-N8": ("zb-h1", {"D": 4, "N": 8}),
    "dualpipev-D2-N4": ("dualpipev", {"D": 2, "N": 4}),
}


# ---- exactness -----------------------------------------------------------------------------


ADAM_ON = ("1f1b-D2-N4", "chimera-D4-N8", "zb-h1-D4-N8")
"""Adam on a pipeline, on Chimera's replicas and on a split backward; every schedule with
SGD (Adam's arithmetic is the same whatever the schedule: tests/test_optim.py)."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "optimizer"),
    [(case, "sgd") for case in SCHEDULES] + [(case, "adam") for case in ADAM_ON],
)
def test_check_passes_on_gloo(
    case: str, optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name, params = SCHEDULES[case]
    status = run(stdlib(name, **params), "--check", "--steps", "3", "--optimizer", optimizer)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out
    assert "steps/s" in out


@pytest.mark.slow
def test_v_placement_passes_check_on_local(capsys: pytest.CaptureFixture[str]) -> None:
    """Two stages of one pipeline on one rank hand over without communication."""
    assert run(stdlib("v-half", D=2, N=4), "--check", "--backend", "local") == 0
    assert "check OK" in capsys.readouterr().out


@pytest.mark.slow
def test_signal_and_wait_pass_check(capsys: pytest.CaptureFixture[str]) -> None:
    """`after` dependencies across ranks become signal/wait pairs that carry no data."""
    one_f_one_b2 = stdlib("1f1b", D=2, N=2)
    rank0, rank1 = list(one_f_one_b2.ranks[0]), list(one_f_one_b2.ranks[1])
    rank1.insert(rank1.index(Action.parse("F0@1/main")) + 1, Action.parse("signal:F0@1/main>0"))
    rank0.insert(rank0.index(Action.parse("recv:B0@1/main<1")), Action.parse("wait:F0@1/main<1"))
    signalled = dataclasses.replace(one_f_one_b2, ranks=(tuple(rank0), tuple(rank1)))
    assert run(signalled, "--check") == 0
    assert run(signalled, "--check", "--backend", "local") == 0
    assert capsys.readouterr().out.count("check OK") == 2


def test_recompute_passes_check(capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        " ".join(f"F{i}@{r}/main" for i in range(2))
        + " "
        + " ".join(f"R{i}@{r}/main B{i}@{r}/main" for i in range(2))
        for r in range(2)
    ]
    recompute = lowered_by_hand(program_from_dump(lines, kinds="FBR"))
    assert run(recompute, "--check", "--backend", "local") == 0
    assert "check OK" in capsys.readouterr().out


def test_split_backward_equals_full_backward_bitwise() -> None:
    """B (input grad) then W (weight grad) gives exactly the full backward's weights."""
    config = RunConfig(steps=2, check=True)
    lines = one_f_one_b(2, 4)
    full = lowered_by_hand(program_from_dump(lines))
    split = lowered_by_hand(
        program_from_dump(
            [
                " ".join(
                    t + (" " + t.replace("B", "W") if t.startswith("B") else "")
                    for t in line.split()
                )
                for line in lines
            ],
            kinds="FBW",
        )
    )
    shapes = plan_stages(config.spec, 2, None).shapes
    a = run_local(full, config, shapes, lambda *_: None)
    b = run_local(split, config, shapes, lambda *_: None)
    assert a.losses == b.losses
    for ra, rb in zip(a.results, b.results, strict=True):
        for wa, wb in zip(ra.copy_weights, rb.copy_weights, strict=True):
            assert wa.keys() == wb.keys()
            assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_local_backend_runs_chimera(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(stdlib("chimera", D=4, N=4), "--backend", "local", "--check") == 0
    assert "check OK" in capsys.readouterr().out


@pytest.mark.slow
def test_check_catches_a_wrong_gradient(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two classic pipeline bugs fail the check (exit 1): the loss scaled twice (SGD sees
    it; Adam would not), and replicas that never synchronise (with Adam)."""
    original = RankRuntime._scaled_loss

    def doubled(
        self: RankRuntime, mb: int, logits: torch.Tensor, record: bool, chunk: int | None
    ) -> torch.Tensor:
        return 2 * original(self, mb, logits, record, chunk)

    monkeypatch.setattr(RankRuntime, "_scaled_loss", doubled)
    status = run(stdlib("1f1b", D=2, N=4), "--check", "--backend", "local", "--optimizer", "sgd")
    assert status == 1
    assert "check FAILED" in capsys.readouterr().out
    monkeypatch.setattr(RankRuntime, "_scaled_loss", original)

    def skipped(self: RankRuntime, stage: int, pipeline: str) -> None:
        self.action_index += 1

    monkeypatch.setattr(RankRuntime, "allreduce", skipped)
    status = run(stdlib("chimera", D=4, N=4), "--check", "--backend", "local")
    assert status == 1
    assert "check FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_optimizers_match_torch(name: str) -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    if name == "sgd":
        mine: SGD | Adam = SGD(ours, lr=0.1, momentum=0.9)
        ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, foreach=False)
    else:
        mine = Adam(ours, lr=0.01)
        ref = torch.optim.Adam(theirs, lr=0.01, foreach=False)
    for step in range(4):
        grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(step)) for _ in ours]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))


# ---- faults ------------------------------------------------------------------------------


def test_raising_rank_stops_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    chimera = stdlib("chimera", D=4, N=4)
    monkeypatch.setenv("PIPELANG_FAULT", "1:1:3:raise")
    start = time.monotonic()
    assert run(chimera, "--timeout", "20") == 1
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    action = host_op(chimera, 1, 3)
    assert f"error: rank 1 failed at step 1, action 3 `{action}`: RuntimeError: injected" in err
    assert "stopped the other ranks (0, 2, 3)" in err
    assert "Traceback" not in err


def _session_processes(sid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (
            "2:1:4:exit",
            "error: rank 2 failed at step 1, action 4 `{action}`: the process died (exit status 3)",
        ),
        ("0:0:2:hang", "error: rank 0 stopped responding at step 0, action 2 `{action}`"),
    ],
)
def test_dead_or_hung_rank_stops_every_rank_and_leaves_no_process(
    fault: str, expected: str, tmp_path: Path
) -> None:
    """The real command in a subprocess of its own session: after it exits, nothing of
    it (ranks, forkserver) is left."""
    one_f_one_b4 = stdlib("1f1b", D=4, N=8)
    (tmp_path / "schedule.json").write_text(one_f_one_b4.to_json())
    env = {**os.environ, "PIPELANG_FAULT": fault}
    start = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipelang.backends",
            str(tmp_path / "schedule.json"),
            "--steps",
            "3",
            "--timeout",
            "3",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=tmp_path,
    )
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    rank, _, index, _ = fault.split(":")
    action = host_op(one_f_one_b4, int(rank), int(index))
    assert proc.returncode == 1, err
    assert expected.format(action=action) in err
    assert "Traceback" not in err
    assert took < 60
    # start_new_session made the command a session leader: its session id is its pid.
    deadline = time.monotonic() + 5
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_processes(proc.pid) == []


def _swap_first_recvs(program: Program, rank: int) -> dict:
    """`program`'s JSON with rank `rank`'s first two recvs swapped: a hand edit that
    would leave the ranks waiting on each other."""
    doc = json.loads(program.to_json())
    actions = doc["ranks"][rank]
    first, second = [i for i, text in enumerate(actions) if text.startswith("recv:")][:2]
    actions[first], actions[second] = actions[second], actions[first]
    return doc


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["python -m pipelang.backends", "rank0.py"])
def test_a_hand_edited_schedule_json_is_refused_before_any_rank_runs(
    entry: str, tmp_path: Path
) -> None:
    """Every runtime that reads a schedule.json checks its transfers first
    (`lowered.read_lowered`): recvs out of the channel's order are E0307, exit 1, before
    anything starts (a run would hang until its timeout); a file that is not a program
    is E0003."""
    program = stdlib("1f1b", D=2, N=2)
    codegen.write_rank_programs(program, tmp_path)
    schedule = tmp_path / "schedule.json"
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = free_port()
    command = (
        [sys.executable, "-m", "pipelang.backends", str(schedule)]
        if entry.startswith("python")
        else [sys.executable, str(tmp_path / "rank0.py")]
    )
    cases = [(json.dumps(_swap_first_recvs(program, 1)), "E0307")]
    if entry.startswith("python"):  # a rank file reads it the same way (`read_lowered`)
        cases += [('{"format": "pipelang-program/1", "ranks": 3}', "E0003"), ("\x00", "E0003")]
    for text, code in cases:
        schedule.write_text(text)
        done = subprocess.run(
            [*command, "--steps", "1", "--timeout", "5"],
            env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith(f"error[{code}]") and "Traceback" not in done.stderr


def test_program_that_does_not_fit_the_model_fails_before_any_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ten = stdlib("gpipe", D=10, N=1)
    assert run(ten) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "error: the schedule has 10 stages but gpt:tiny has only 8 layers; every stage needs "
        "at least one"
    )
    assert run(stdlib("gpipe", D=2, N=2), "--partition", "3,3") == 1
    assert "--partition 3,3 must give every stage at least one layer" in capsys.readouterr().err


def test_missing_allreduce_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    chimera = stdlib("chimera", D=4, N=4)
    stripped = [
        tuple(a for a in actions if a.kind is not Kind.ALLREDUCE) for actions in chimera.ranks
    ]
    assert run(dataclasses.replace(chimera, ranks=tuple(stripped))) == 1
    assert "never runs `allreduce@" in capsys.readouterr().err


def test_graphs_refuses_a_program_it_cannot_lower(capsys: pytest.CaptureFixture[str]) -> None:
    """`--graphs` runs the stream program (tests/test_stream_runtime.py); a program the
    streams pass cannot lower (evictions) is a diagnostic, exit 1, before any rank starts."""
    for backend in ("local", "gloo"):
        status = run(stdlib("bpipe", D=4, N=8), "--graphs", "--backend", backend)
        err = capsys.readouterr().err
        assert status == 1
        assert err.startswith("error[E0506]: `bpipe` evicts activations")


# ---- output ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", "local"])
def test_trace_has_every_action_of_every_rank(backend: str, tmp_path: Path) -> None:
    """Once per step, in the order the rank issued them: over gloo a rank runs its stream
    program, which posts receives early, so only the compute actions keep the action
    list's order; the local backend runs the action list itself."""
    chimera = stdlib("chimera", D=4, N=4)
    trace = tmp_path / "trace.json"
    assert run(chimera, "--steps", "2", "--trace", str(trace), "--backend", backend) == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank, actions in enumerate(chimera.ranks):
        mine = [e for e in events if e["pid"] == rank]
        names = [e["name"] for e in mine]
        assert [e["args"]["step"] for e in mine] == [0] * len(actions) + [1] * len(actions)
        for step in (names[: len(actions)], names[len(actions) :]):
            assert sorted(step) == sorted(a.text() for a in actions)
            computes = [a.text() for a in actions if a.kind.is_compute]
            assert [n for n in step if n in computes] == computes
        if backend == "local":
            assert names == [a.text() for a in actions] * 2
        starts = [e["ts"] for e in mine]
        assert starts == sorted(starts)
        assert all(e["dur"] >= 0 for e in mine)


def test_user_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "toy_model.py").write_text(
        "from torch import nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh(),\n"
        "                         nn.Linear(16, 50))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        run(stdlib("1f1b", D=2, N=4), "--model", "toy_model:make", "--backend", "local", "--check")
        == 0
    )
    assert "check OK" in capsys.readouterr().out


USER_MODELS = """
from torch import nn

def layers():
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 50))

def stages():
    return [nn.Embedding(50, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 50))]

def broken():
    raise ValueError("no weights here")

def wrong():
    return 3
"""


@pytest.mark.parametrize("func", ["layers", "stages"])
def test_a_user_model_from_a_file_trains_like_one_process(
    func: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--model FILE.py:FUNC`: an nn.Sequential is layers that pipelang splits, a list is
    the stages themselves; over gloo (each rank loads the file) against one process."""
    (tmp_path / "models.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    assert run(stdlib("1f1b", D=2, N=4), "--model", f"models.py:{func}", "--check") == 0
    assert "check OK" in capsys.readouterr().out


@pytest.mark.slow  # each case loads the model in a child process first
@pytest.mark.parametrize(
    ("model", "ranks", "options", "message"),
    [
        ("models.py:broken", 2, (), "`broken()` failed: ValueError: no weights here"),
        ("models.py:wrong", 2, (), "must return an nn.Sequential (its layers"),
        ("models.py:absent", 2, (), "cannot load `absent` from `models.py`"),
        ("elsewhere.py:layers", 2, (), "cannot load `layers` from `elsewhere.py`: no file"),
        ("models.py:stages", 3, (), "gives 2 stages (a list of stage modules, or split at"),
        ("models.py:stages", 2, ("--partition", "2,1"), "gives its stages itself"),
    ],
)
def test_a_user_model_that_cannot_run_is_one_clear_line(
    model: str,
    ranks: int,
    options: tuple[str, ...],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "models.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    assert run(stdlib("1f1b", D=ranks, N=2), "--model", model, *options) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "name", ["1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "dualpipev", "interleaved-zb"]
)
def test_saved_activations_follow_the_order(name: str, one_torch_thread: None) -> None:
    """Each rank's peak bytes of saved activations are what `simulate --model` says
    (`activation_peaks`: each stage's bytes, and what W keeps of them, held along the
    rank's order by the one counter): the runtime releases after B all that W does not
    read, also under `--graphs` (the CPU's stream executor) and `--mixed-precision` (as
    `simulate --model --dtype bfloat16` counts it). Kept whole until W, zb-h1's last
    rank would hold four forwards' bytes."""
    config = RunConfig(backend="local", steps=1, count_activations=True)
    program = stdlib(name, D=4, N=8)
    for run_config in (
        config,
        dataclasses.replace(config, graphs=True),
        dataclasses.replace(config, mixed_precision="bfloat16"),
    ):
        shapes = plan_stages(run_config.spec, program.num_stages, None).shapes
        outcome = run_local(program, run_config, shapes, lambda *_: None)
        measured = [r.peak_activation_bytes for r in outcome.results]
        assert measured == pytest.approx(activation_peaks(run_config.spec, program, program.costs))
    if name == "zb-h1":
        stages = stage_activation_bytes(run_config.spec, 4, None)  # the last run's
        assert measured[3] < 4 * stages[3][0]  # whole graphs until W: 4 on the last rank
        assert stages[3][1] < stages[3][0]  # what W keeps is less than what F saved


def test_zb_h1_holds_1f1b_s_peak_where_no_stage_saves_more_than_the_first(
    one_torch_thread: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The zero-bubble paper's ZB-H1 peak is 1F1B's, p M_B, on alike stages. gpt:tiny's W
    reads about all that B kept, so ZB-H1's rank r holds about p of its stage's forwards
    where 1F1B's holds p - r: with the even split, stage 0 (the embedding and one block)
    is half of stage 1, and ZB-H1's largest rank is 1.33x 1F1B's; cut 3,2,1,2 (the first
    stage saves as much as any), it is 1F1B's within 1%. `simulate --partition` says so
    to the byte."""
    config = RunConfig(backend="local", steps=1, count_activations=True)
    largest = {}
    for cut in (None, (3, 2, 1, 2)):
        for name in ("1f1b", "zb-h1"):
            program = dataclasses.replace(stdlib(name, D=4, N=8), partition=cut)
            shapes = plan_stages(config.spec, 4, cut).shapes
            run_config = dataclasses.replace(config, partition=cut)
            outcome = run_local(program, run_config, shapes, lambda *_: None)
            measured = [r.peak_activation_bytes for r in outcome.results]
            largest[cut, name] = max(measured)
            if cut is not None:
                argv = ["simulate", name, "-p", "D=4", "-p", "N=8", "--model", "gpt:tiny"]
                assert main([*argv, "--partition", "3,2,1,2", "--json"]) == 0
                rows = json.loads(capsys.readouterr().out)["ranks"]
                assert [row["peak_activation_bytes"] for row in rows] == pytest.approx(measured)
    assert largest[None, "zb-h1"] / largest[None, "1f1b"] == pytest.approx(4 / 3, rel=0.01)
    assert largest[(3, 2, 1, 2), "zb-h1"] / largest[(3, 2, 1, 2), "1f1b"] < 1.01


# ---- codegen -----------------------------------------------------------------------------


def test_codegen_golden(update_golden: bool) -> None:
    one_f_one_b2 = stdlib("1f1b", D=2, N=2)
    text = codegen.render_rank_program(one_f_one_b2, 0)
    ast.parse(text)
    if update_golden or not GOLDEN.exists():
        GOLDEN.write_text(text)
        if not update_golden:
            pytest.fail(f"wrote new golden file {GOLDEN.name}; review and rerun")
    assert text == GOLDEN.read_text()


@pytest.mark.slow
def test_generated_programs_run_standalone(tmp_path: Path) -> None:
    """DIR/rank{r}.py started by hand (as torchrun would) train and pass the check."""
    one_f_one_b2 = stdlib("1f1b", D=2, N=4)
    (tmp_path / "schedule.json").write_text(one_f_one_b2.to_json())
    paths = codegen.write_rank_programs(one_f_one_b2, tmp_path)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    env.pop("RANK", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(p), "--check", "--steps", "2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in paths
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "check OK" in outs[0][0]
    assert outs[1][0] == ""


def test_model_sizes() -> None:
    tiny = ModelSpec("gpt:tiny").build()
    assert len(tiny.layers) == 8
    assert [len(b) for b in plan_stages(ModelSpec("gpt:medium"), 4, None).bounds] == [7, 7, 6, 6]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_ranks_die_with_a_launcher_killed_outright(tmp_path: Path) -> None:
    """SIGKILL gives the launcher no chance to stop its ranks: the forkserver that
    started them and the ranks themselves must go with it, not train on unwatched."""
    argv = [sys.executable, "-m", "pipelang.cli", "run", "1f1b", "-p", "D=2", "-p", "N=2"]
    argv += ["--steps", "100000", "--log", str(tmp_path / "m.jsonl")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (tmp_path / "m.jsonl").exists() or not (tmp_path / "m.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    spawned = [p for server in _children(proc.pid) for p in [server, *_children(server)]]
    assert len(spawned) >= 3  # the forkserver and two ranks
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in spawned) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in spawned if _alive(p)]
