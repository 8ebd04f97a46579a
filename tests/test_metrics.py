"""The metrics people read (issue 43): each step's `--log` line holds the learning rate,
the gradient norm before clipping, every rank's peak memory and the bubble measured beside
the simulator's; `--tensorboard DIR` writes the same scalars (and the measured timeline);
the end of a run shows them.

Oracles: the learning-rate schedule itself; the one-process `--check` reference, whose
clipping norm is recorded as it computes it (`reference.clip_coefficient`); `pipelang
simulate`'s bubble ratio; TensorBoard's own reader of its event files.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelang.api import compile_schedule
from pipelang.backends.config import RunConfig
from pipelang.backends.metrics import StepReport, combine
from tests.helpers import run, run_in_process, stdlib

KEYS = [
    "step",
    "loss",
    "seconds",
    "tokens",
    "tokens_per_s",
    "lr",
    "grad_norm",
    "peak_memory",
    "bubble",
    "predicted_bubble",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _reference_norms(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The norms the `--check` reference clips by, one per step, as it computes them."""
    from pipelang.backends import reference

    norms: list[float] = []
    clip = reference.clip_coefficient

    def recorded(square_sum: torch.Tensor, max_norm: float) -> torch.Tensor:
        norms.append(float(square_sum.sqrt()))
        return clip(square_sum, max_norm)

    monkeypatch.setattr(reference, "clip_coefficient", recorded)
    return norms


def _sane(lines: list[dict[str, Any]], world: int, predicted: float, lrs: list[float]) -> None:
    """Every key in every line; the lr the schedule's, exactly; memory per rank; bubbles
    between 0 and 1, the predicted one the simulator's."""
    assert [list(line) for line in lines] == [KEYS] * len(lines)
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert [line["lr"] for line in lines] == lrs
    for line in lines:
        assert len(line["peak_memory"]) == world and all(b > 2**20 for b in line["peak_memory"])
        assert 0.0 <= line["bubble"] <= 1.0
        assert line["predicted_bubble"] == predicted
        assert line["grad_norm"] > 0


@pytest.mark.slow
def test_the_log_holds_every_metric_with_replicas_and_dp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Chimera (every stage on two ranks) times --dp 2 on the local backend, clipping:
    the logged norm is the one the one-process reference clips by (each stage counted
    once), step by step; the schedule's lr per step; a peak per process."""
    norms = _reference_norms(monkeypatch)
    log = tmp_path / "m.jsonl"
    options = ["--steps", "4", "--dp", "2", "--backend", "local", "--log", str(log)]
    schedule = ["--lr", "0.01", "--lr-schedule", "cosine", "--warmup-steps", "1"]
    clip = ["--clip-grad", "0.5", "--check"]
    assert run(stdlib("chimera", D=4, N=4), *options, *schedule, *clip) == 0
    out = capsys.readouterr().out
    assert "check OK" in out
    config = RunConfig(lr=0.01, lr_schedule="cosine", warmup_steps=1, steps=4)
    lrs = [config.lr_schedule_at().lr(step) for step in range(4)]
    predicted = compile_schedule("chimera", {"D": "4", "N": "4"}).timeline().bubble_ratio
    lines = _lines(log)
    _sane(lines, 8, predicted, lrs)
    assert len(norms) == 4 and norms[0] > 0.5  # the clip clipped
    assert [line["grad_norm"] for line in lines] == pytest.approx(norms, rel=1e-6)
    # the table at the end: the same quantities, each saying which step(s)
    bubble = sum(line["bubble"] for line in lines) / 4
    rows = {
        "learning rate": (f"{lrs[-1]:.4g}", "the last step"),
        "gradient norm": (f"{lines[-1]['grad_norm']:.4g}", "the last step, before clipping"),
        "bubble, measured": (f"{bubble:.3f}", "the mean over 4 steps"),
        "bubble, predicted": (f"{predicted:.3f}", "pipelang simulate, with the schedule's costs"),
    }
    for name, (value, which) in rows.items():
        assert re.search(rf"│ {name} +│ {re.escape(value)} +│ {re.escape(which)} +│", out), name


@pytest.mark.slow
def test_gloo_takes_the_norm_for_the_log_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --clip-grad, gloo processes take the norm only because --log asks: it
    equals the one-process reference's norm of the same step's gradients (a clip at 1e9
    multiplies them by 1, so the reference trains as the run does)."""
    from pipelang.backends.reference import train_reference
    from pipelang.backends.summation import accumulation

    program = stdlib("1f1b", D=2, N=4)
    log = tmp_path / "m.jsonl"
    assert run(program, "--steps", "3", "--backend", "gloo", "--log", str(log)) == 0
    norms = _reference_norms(monkeypatch)
    config = RunConfig(backend="gloo", steps=3, clip_grad=1e9).for_program(program)
    train_reference(config, 4, torch.device("cpu"), None, accumulation(program, 1), program)
    lines = _lines(log)
    predicted = compile_schedule("1f1b", {"D": "2", "N": "4"}).timeline().bubble_ratio
    _sane(lines, 2, predicted, [3e-3] * 3)
    assert [line["grad_norm"] for line in lines] == pytest.approx(norms, rel=1e-6)


@pytest.mark.slow
def test_the_norm_is_not_taken_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The norm costs a collective per step: without --log, --tensorboard or --clip-grad
    no rank computes it (and the table says so); with --log every rank does, every step."""
    from pipelang.backends import rank_sync

    calls: list[int] = []
    square_sum = rank_sync.SyncActions.grad_square_sum
    lock = threading.Lock()

    def counted(self: Any) -> torch.Tensor:
        with lock:
            calls.append(self.rank)
        return square_sum(self)

    monkeypatch.setattr(rank_sync.SyncActions, "grad_square_sum", counted)
    program = stdlib("1f1b", D=2, N=2)
    assert run(program, "--steps", "2", "--backend", "local") == 0
    assert calls == []
    assert "not taken (--log, --tensorboard or --clip-grad)" in capsys.readouterr().out
    assert run(program, "--steps", "2", "--backend", "local", "--log", str(tmp_path / "m")) == 0
    assert sorted(calls) == [0, 0, 1, 1]


@pytest.mark.slow
def test_tensorboard_holds_the_same_scalars_per_step(tmp_path: Path) -> None:
    """TensorBoard's own reader finds every --log number at its step, each rank's peak
    memory, and the measured timeline (a text linking timeline.svg, and its picture)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, log, trace = tmp_path / "tb", tmp_path / "m.jsonl", tmp_path / "t.json"
    options = ["--steps", "3", "--backend", "local", "--tensorboard", str(board)]
    options += ["--log", str(log), "--trace", str(trace), "--clip-grad", "1"]
    status, out, _ = run_in_process(["run", "1f1b", "-p", "D=2", "-p", "N=4", *options])
    assert status == 0
    assert f"wrote the measured timeline to {board / 'timeline.svg'}" in out
    accumulator = EventAccumulator(str(board), size_guidance={"images": 0, "tensors": 0})
    accumulator.Reload()
    lines = _lines(log)
    tags = accumulator.Tags()
    scalars = ["loss", "lr", "grad_norm", "seconds", "tokens_per_s", "bubble"]
    scalars += ["predicted_bubble", "peak_memory/rank0", "peak_memory/rank1"]
    scalars += [f"{k}_bytes/rank{r}" for k in ("param", "grad", "optimizer") for r in (0, 1)]
    assert sorted(tags["scalars"]) == sorted(scalars)
    for tag in scalars:
        key, _, rank = tag.partition("/rank")
        wanted = [line[key][int(rank)] if rank else line[key] for line in lines]
        events = accumulator.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx(wanted, rel=1e-6)
    assert [image.step for image in accumulator.Images("timeline")] == [3]
    text = accumulator.Tensors("timeline/text_summary")[0].tensor_proto.string_val[0]
    assert b"[timeline.svg](timeline.svg)" in text
    assert (board / "timeline.svg").read_text().startswith("<svg")


def test_tensorboard_without_its_extra_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard fails
    board = tmp_path / "tb"
    status, _, err = run_in_process(["run", "1f1b", "-p", "D=2", "--tensorboard", str(board)])
    assert status == 2
    assert err.strip() == (
        "error: --tensorboard needs the tensorboard package, an optional extra: pip install "
        "pipelang[tensorboard] (or pip install tensorboard)"
    )
    assert not board.exists()


def test_a_tensorboard_dir_that_cannot_be_made_is_a_usage_error(tmp_path: Path) -> None:
    """One line, exit 2, before any rank starts; a name past 200 characters is cut (a
    name too long for the system made Path.exists raise: an internal error)."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    status, _, err = run_in_process(["run", "1f1b", "--tensorboard", str(blocked / "tb")])
    assert status == 2
    assert err.strip() == f"error: --tensorboard: cannot make `{blocked / 'tb'}`: Not a directory"
    status, _, err = run_in_process(["run", "1f1b", "--tensorboard", str(blocked)])
    assert (status, err.strip()) == (
        2,
        f"error: --tensorboard: `{blocked}` is a file; give a directory",
    )
    status, _, err = run_in_process(["run", "1f1b", "--tensorboard", "x" * 5000])
    assert status == 2
    assert err.strip().endswith("` (5,000 characters): File name too long")
    assert len(err) < 300


def test_combine_adds_the_ranks_reports() -> None:
    """The mean loss in micro-batch order, the slowest rank's time, the idle share of
    ranks x that time, one norm, each rank's peak; a rank without busy time: no bubble."""
    reports = [
        StepReport({0: 1.0, 2: 3.0}, 1.0, 0.1, 500_000_000, 10, 2.5),
        StepReport({1: 2.0}, 0.8, 0.1, 250_000_000, 20, 2.5),
    ]
    loss, seconds, metrics = combine(reports, 3)
    assert (loss, seconds) == (2.0, 1.0)
    assert (metrics.lr, metrics.grad_norm, metrics.peak_memory) == (0.1, 2.5, (10, 20))
    assert metrics.bubble == pytest.approx(1 - 0.75 / 2)
    unmeasured = [reports[0], replace(reports[1], busy_ns=None, grad_norm=None)]
    assert combine(unmeasured, 3)[2].bubble is None
    assert combine(unmeasured, 3)[2].grad_norm == 2.5
    assert combine(reports, 4)[0] != combine(reports, 4)[0]  # a missing loss: NaN


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_torchrun_rank_0_logs_every_rank(tmp_path: Path) -> None:
    """Under torchrun rank 0 gets the others' numbers in the step's one all-reduce.
    (`--` ends torchrun's options: its parser takes `--log` for its own `--log-dir`.)"""
    log = tmp_path / "m.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(_port()), "--no-python", "--", "pipelang", "run", "1f1b"]
    command += ["-p", "D=2", "-p", "N=2", "--backend", "gloo", "--steps", "2"]
    command += ["--log", str(log)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    predicted = compile_schedule("1f1b", {"D": "2", "N": "2"}).timeline().bubble_ratio
    _sane(_lines(log), 2, predicted, [3e-3, 3e-3])
