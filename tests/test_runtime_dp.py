"""`pipelang run --dp K`: K data-parallel copies of the whole pipeline.

The oracles are independent of the pipelined run: `--check`'s single-process reference
(plain training on all K x N micro-batches of a step), and, for one SGD step, the
gradient of the whole model computed here with torch.autograd. Negative tests show the
check notices the two classic data-parallel bugs (every copy on the same data, copies
never synchronised). The gloo runs start K x R = 4 processes on a small machine, so
they keep to a few steps of small schedules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipelang.backends import codegen
from pipelang.backends.config import RunConfig
from pipelang.backends.local import run_local
from pipelang.backends.models import plan_stages
from pipelang.backends.runtime import RankRuntime
from pipelang.ir import placement
from tests.helpers import free_port, host_op, run, stdlib

SCHEDULES = {
    "1f1b-D2-N2": ("1f1b", {"D": 2, "N": 2}),
    "chimera-D2-N2": ("chimera", {"D": 2, "N": 2}),
}


def _pipelang(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipelang.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


# ---- exactness -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("case", list(SCHEDULES))
def test_dp2_passes_check_on_gloo(
    case: str, optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name, params = SCHEDULES[case]
    status = run(
        stdlib(name, **params), "--dp", "2", "--check", "--steps", "2", "--optimizer", optimizer
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out
    assert "on gpt:tiny, gloo, 2 x 2 ranks (--dp 2)" in out
    # every process reports its stage copies: 4 rows, the second copy as ranks 2 and 3
    cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    rows = [cell for cell in cells if cell.isdigit()]  # the ranks' table, not the metrics'
    assert rows == ["0", "1", "2", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SCHEDULES))
def test_dp2_passes_check_on_local(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    name, params = SCHEDULES[case]
    status = run(stdlib(name, **params), "--dp", "2", "--check", "--backend", "local")
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out


def test_dp3_tokens_per_step_count_every_copy(capsys: pytest.CaptureFixture[str]) -> None:
    """Throughput counts K x N micro-batches per step (local: no extra processes)."""
    program = stdlib("1f1b", D=2, N=2)
    assert run(program, "--dp", "3", "--check", "--backend", "local", "--steps", "1") == 0
    out = capsys.readouterr().out
    assert "check OK" in out
    title = next(line for line in out.splitlines() if "steps/s" in line)
    seconds = float(title.split(" steps in ")[1].split(" s,")[0])
    tokens = float(title.split("steps/s, ")[1].split(" tokens/s")[0].replace(",", ""))
    # 3 copies x 2 micro-batches x 4 sequences x 32 tokens, one step
    assert tokens == pytest.approx(3 * 2 * 4 * 32 / seconds, rel=0.01)


def _whole_model_sgd_step(config: RunConfig, microbatches: int) -> dict[str, torch.Tensor]:
    """Weights after one step of plain SGD on the whole model (momentum's first step is
    plain SGD), on the mean loss of `microbatches` micro-batches: torch.autograd only."""
    model = config.spec.build()
    full = nn.Sequential(*model.layers)
    losses = []
    for mb in range(microbatches):
        ids, targets = model.batch(0, mb, torch.device("cpu"))
        logits = full(ids)
        losses.append(
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        )
    loss = torch.stack(losses).mean()
    params = dict(full.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    with torch.no_grad():
        return {
            name: (p - config.learning_rate * g).detach()
            for (name, p), g in zip(params.items(), grads, strict=True)
        }


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_one_dp_step_is_sgd_on_every_copys_microbatches(case: str) -> None:
    """After one step every stage copy in every data-parallel copy holds w - lr * grad of
    the mean loss over all K x N micro-batches, and the reported loss is their mean."""
    name, params = SCHEDULES[case]
    program = stdlib(name, **params)
    config = RunConfig(backend="local", steps=1, check=True, optimizer="sgd", dp=2)
    shapes = plan_stages(config.spec, program.num_stages, None).shapes
    outcome = run_local(program, config, shapes, lambda *_: None)
    expected = _whole_model_sgd_step(config, 2 * program.num_microbatches)
    assert len(outcome.results) == 4
    for result in outcome.results:
        for weights in result.copy_weights:
            for key, tensor in weights.items():
                torch.testing.assert_close(tensor, expected[key], atol=1e-6, rtol=1e-5)
    model = config.spec.build()
    full = nn.Sequential(*model.layers)
    with torch.no_grad():
        first = [
            float(model.loss(full(ids), targets))
            for ids, targets in (model.batch(0, mb, torch.device("cpu")) for mb in range(4))
        ]
    assert outcome.losses[0] == pytest.approx(sum(first) / 4, rel=1e-5)


# ---- the check notices data-parallel bugs ---------------------------------------------------


def test_check_fails_when_every_copy_trains_on_the_same_data(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built = RankRuntime.__init__

    def same_data(self: RankRuntime, *args: object, **kwargs: object) -> None:
        built(self, *args, **kwargs)  # type: ignore[arg-type]
        self.first_mb = 0

    monkeypatch.setattr(RankRuntime, "__init__", same_data)
    program = stdlib("1f1b", D=2, N=2)
    assert run(program, "--dp", "2", "--check", "--backend", "local", "--optimizer", "sgd") == 1
    assert "check FAILED" in capsys.readouterr().out


def test_check_fails_when_the_copies_never_synchronise(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(placement, "reduced_at_step", lambda *_: [])
    program = stdlib("1f1b", D=2, N=2)
    assert run(program, "--dp", "2", "--check", "--backend", "local", "--optimizer", "sgd") == 1
    assert "check FAILED" in capsys.readouterr().out


# ---- faults and usage errors ------------------------------------------------------------------


def test_fault_in_the_second_copy_names_its_process_and_action(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """PIPELANG_FAULT and the error name the process (rank 3 = copy 1, program rank 1)."""
    program = stdlib("1f1b", D=2, N=2)
    monkeypatch.setenv("PIPELANG_FAULT", "3:1:2:raise")
    assert run(program, "--dp", "2", "--timeout", "20") == 1
    err = capsys.readouterr().err
    action = host_op(program, 1, 2, dp=2)
    assert f"error: rank 3 failed at step 1, action 2 `{action}`: RuntimeError: injected" in err
    assert "stopped the other ranks (0, 1, 2)" in err


def test_dp_zero_is_a_usage_error() -> None:
    done = _pipelang("run", "1f1b", "-p", "D=2", "-p", "N=2", "--dp", "0")
    assert done.returncode == 2
    assert "error: argument --dp: must be at least 1, not 0" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_torchrun_world_must_be_dp_times_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = free_port()
    done = _pipelang("run", "1f1b", "-p", "D=2", "-p", "N=2", "--dp", "2", env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: torchrun started 2 processes but the run needs 4 ranks (--dp 2 x 2 ranks); "
        "WORLD_SIZE must be --dp x the program's ranks"
    )


def test_nccl_needs_a_gpu_per_process(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has 4 GPUs")
    have = torch.cuda.device_count()
    assert run(stdlib("1f1b", D=2, N=2), "--dp", "2", "--backend", "nccl") == 2
    assert capsys.readouterr().err.strip() == (
        "error: the nccl backend needs one GPU per rank: 4 ranks (--dp 2 x 2 ranks), "
        f"{have} GPUs here (use --backend gloo or local)"
    )


@pytest.mark.slow
def test_generated_programs_run_standalone_with_dp(tmp_path: Path) -> None:
    """rank{r}.py started by hand as torchrun would, twice each (RANK = copy x R + r):
    four processes train two copies and pass the check; a RANK that runs another file is
    refused."""
    program = stdlib("1f1b", D=2, N=2)
    (tmp_path / "schedule.json").write_text(program.to_json())
    paths = codegen.write_rank_programs(program, tmp_path)
    base = {**os.environ, "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    wrong = subprocess.run(
        [sys.executable, str(paths[0]), "--dp", "2"],
        env={**base, "RANK": "3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 2
    assert "this file is rank 0; RANK = copy x 2 + 0" in wrong.stderr
    procs = [
        subprocess.Popen(
            [sys.executable, str(paths[rank % 2]), "--dp", "2", "--check", "--steps", "1"],
            env={**base, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    assert "check OK" in outs[0][0]
    assert "2 x 2 ranks (--dp 2)" in outs[0][0]
