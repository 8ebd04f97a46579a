"""`pipelang run` on asynchronous schedules: PipeDream, PipeDream-2BW, PipeMare.

Oracles, none of them the pipelined run itself:

- `--check`'s asynchronous reference (backends/async_reference.py), which replays the
  versions pipelang.weights assigns, in one process, in no rank's order;
- plain synchronous training (`reference.train_reference`) where the schedule has no
  staleness: PipeDream-2BW with one update of all N micro-batches per iteration is
  synchronous training with the mean gradient;
- torch.optim itself, for one stage (D = 1): PipeDream is then SGD on one micro-batch
  at a time, 2BW SGD on the mean of each group of m.

Negative tests show the check notices a runtime that reads the wrong versions: a
reference that ignores stashing disagrees with PipeDream, one that stashes disagrees with
PipeMare. gloo runs start D processes on a two-core machine, so they are few.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pipelang.api import load_program
from pipelang.backends.async_reference import train_async_reference
from pipelang.backends.config import RunConfig
from pipelang.backends.local import run_local
from pipelang.backends.models import plan_stages
from pipelang.backends.reference import compare, train_reference
from pipelang.backends.report import Outcome
from pipelang.ir import Program, WeightPolicy
from pipelang.weights import weight_versions
from tests.helpers import run, stdlib

SCHEDULES = ("pipedream", "pipedream-2bw", "pipemare")
N = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def measured_versions(out: str) -> list[tuple[int, int]]:
    """(measured, predicted) live weight versions per rank, from the run's report."""
    line = next(x for x in out.splitlines() if x.startswith("weight versions live"))
    return [(int(a), int(b)) for a, b in re.findall(r"rank \d+ (\d+) \((\d+)\)", line)]


def local_outcome(program: Program, config: RunConfig) -> Outcome:
    shapes = plan_stages(config.spec, program.num_stages, config.partition).shapes
    return run_local(program, config, shapes, lambda *_: None)


# ---- --check passes ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("D", [2, 3, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_check_passes_on_local(
    name: str, D: int, optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib(name, D=D, N=N)
    status = run(program, "--backend", "local", "--steps", "2", "--check", "--optimizer", optimizer)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out and "(bitwise equal)" in out
    # the versions the runtime keeps alive are the ones pipelang.weights predicts
    versions = measured_versions(out)
    assert [m for m, _ in versions] == list(weight_versions(program).peak)
    assert all(m == p for m, p in versions)


GLOO_CASES = [
    ("pipedream", 4, "adam"),
    ("pipedream-2bw", 3, "sgd"),
    ("pipemare", 2, "adam"),
    ("pipemare", 3, "sgd"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "D", "optimizer"), GLOO_CASES)
def test_check_passes_on_gloo(
    name: str, D: int, optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib(name, D=D, N=N)
    status = run(program, "--steps", "2", "--check", "--optimizer", optimizer)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out and "(bitwise equal)" in out
    assert all(m == p for m, p in measured_versions(out))


def test_stash_keeps_versions_that_pipemare_does_not() -> None:
    # PipeDream keeps D - s versions on stage s, PipeMare one: measured, not predicted
    config = RunConfig(backend="local", steps=1, check=True, optimizer="sgd")
    stash = local_outcome(stdlib("pipedream", D=4, N=N), config)
    latest = local_outcome(stdlib("pipemare", D=4, N=N), config)
    assert [r.peak_weight_versions for r in stash.results] == [4, 3, 2, 1]
    assert [r.peak_weight_versions for r in latest.results] == [1, 1, 1, 1]


# ---- independent oracles -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_2bw_with_one_update_per_iteration_is_synchronous_training(optimizer: str) -> None:
    # m = N: every stage applies the mean gradient of all N micro-batches once, at the
    # end, and no forward reads a stale version: plain training (a different summation
    # order, so within the tolerance rather than bitwise)
    program = stdlib("pipedream-2bw", D=3, N=4, m=4)
    config = RunConfig(backend="local", steps=3, check=True, optimizer=optimizer)
    outcome = local_outcome(program, config)
    sync = train_reference(config, 4, torch.device("cpu"))
    assert compare(sync, outcome.results, outcome.losses, config).ok
    replay = train_async_reference(config, program, torch.device("cpu"))
    assert compare(replay, outcome.results, outcome.losses, config).ok


@pytest.mark.parametrize(("name", "group"), [("pipedream", 1), ("pipedream-2bw", 2)])
def test_one_stage_is_torch_sgd_on_each_group(name: str, group: int) -> None:
    program = stdlib(name, D=1, N=4, **({"m": group} if group > 1 else {}))
    config = RunConfig(backend="local", steps=2, check=True, optimizer="sgd")
    outcome = local_outcome(program, config)
    model = config.spec.build()
    whole = nn.Sequential(*model.layers)
    sgd = torch.optim.SGD(whole.parameters(), lr=config.learning_rate, momentum=0.9)
    losses = []
    for step in range(config.steps):
        total = 0.0
        for mb in range(4):
            ids, targets = model.batch(step, mb, torch.device("cpu"))
            loss = model.loss(whole(ids), targets)
            (loss / group).backward()
            total += loss.item()
            if mb % group == group - 1:
                sgd.step()
                sgd.zero_grad()
        losses.append(total / 4)
    got = outcome.results[0].copy_weights[0]
    expected = whole.state_dict()
    assert got.keys() == expected.keys()
    for key, tensor in got.items():
        torch.testing.assert_close(tensor, expected[key], atol=1e-6, rtol=1e-5)
    assert outcome.losses == pytest.approx(losses, rel=1e-6)


SPLIT = """\
schedule split(D: int = 3, N: int = 6) {
    ops F, B, W, R
    weights POLICY
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        let warm = min(D - r - 1, N)
        for i in 0..warm { F(i) }
        for i in 0..N - warm { F(warm + i) R(i) B(i) U() W(i) }
        for i in N - warm..N { R(i) B(i) U() W(i) }
        U()
    }
}
"""


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "wrong"), [("stash", "latest"), ("latest", "stash")])
def test_recompute_and_split_weight_gradient_across_an_update(
    policy: str, wrong: str, tmp_path: Path
) -> None:
    # R and W read versions too; an update between B and W applies nothing the first
    # time (an empty update) and W's gradient at the next one
    path = tmp_path / "split.pipe"
    path.write_text(SPLIT.replace("POLICY", policy))
    program = load_program(str(path))
    config = RunConfig(backend="local", steps=2, check=True, optimizer="sgd")
    outcome = local_outcome(program, config)
    assert [r.peak_weight_versions for r in outcome.results] == list(weight_versions(program).peak)
    cpu = torch.device("cpu")
    right = train_async_reference(config, program, cpu)
    assert compare(right, outcome.results, outcome.losses, config).ok
    misread = dataclasses.replace(program, weights=WeightPolicy(wrong))
    assert not compare(
        train_async_reference(config, misread, cpu), outcome.results, outcome.losses, config
    ).ok


# ---- the check can fail --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "wrong"), [("pipedream", "latest"), ("pipedream-2bw", "latest"), ("pipemare", "stash")]
)
def test_reference_with_the_wrong_versions_disagrees(name: str, wrong: str) -> None:
    program = stdlib(name, D=3, N=N, **({"m": 2} if name == "pipedream-2bw" else {}))
    config = RunConfig(backend="local", steps=2, check=True, optimizer="sgd")
    outcome = local_outcome(program, config)
    cpu = torch.device("cpu")
    right = train_async_reference(config, program, cpu)
    assert compare(right, outcome.results, outcome.losses, config).ok
    misread = dataclasses.replace(program, weights=WeightPolicy(wrong))
    wrong_ref = train_async_reference(config, misread, cpu)
    comparison = compare(wrong_ref, outcome.results, outcome.losses, config)
    assert not comparison.ok
    assert comparison.max_weight_diff > 100 * comparison.atol


def test_synchronous_reference_disagrees_with_pipedream() -> None:
    program = stdlib("pipedream", D=3, N=N)
    config = RunConfig(backend="local", steps=2, check=True, optimizer="sgd")
    outcome = local_outcome(program, config)
    sync = train_reference(config, N, torch.device("cpu"))
    assert not compare(sync, outcome.results, outcome.losses, config).ok


# ---- what does not run ---------------------------------------------------------------------


def test_dp_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status = run(stdlib("pipemare", D=2, N=4), "--dp", "2", "--backend", "local")
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("error: `pipemare` is asynchronous (`weights latest`)")
    assert "with --dp yet" in err


# ---- weight prediction (XPipe, --predict-weights) ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "D", "optimizer"),
    [("pipedream", 3, "sgd"), ("pipedream", 4, "adam"), ("pipedream-2bw", 3, "sgd")],
)
def test_predicted_weights_pass_the_check_on_local(
    name: str, D: int, optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib(name, D=D, N=N)
    argv = ["--backend", "local", "--steps", "2", "--check", "--optimizer", optimizer]
    assert run(program, *argv, "--predict-weights") == 0
    out = capsys.readouterr().out
    assert "check OK" in out and "(bitwise equal)" in out, out


def test_predicted_weights_pass_the_check_on_gloo(capsys: pytest.CaptureFixture[str]) -> None:
    program = stdlib("pipedream", D=3, N=N)
    assert run(program, "--steps", "2", "--check", "--predict-weights") == 0
    out = capsys.readouterr().out
    assert "check OK" in out and "(bitwise equal)" in out, out


@pytest.mark.slow
def test_prediction_changes_training_and_a_reference_without_it_disagrees() -> None:
    program = stdlib("pipedream", D=3, N=N)
    plain = RunConfig(backend="local", steps=2, check=True, optimizer="sgd")
    predicting = dataclasses.replace(plain, predict_weights=True)
    outcome = local_outcome(program, predicting)
    cpu = torch.device("cpu")
    assert compare(
        train_async_reference(predicting, program, cpu), outcome.results, outcome.losses, plain
    ).ok
    comparison = compare(
        train_async_reference(plain, program, cpu), outcome.results, outcome.losses, plain
    )
    assert not comparison.ok and comparison.max_weight_diff > 100 * comparison.atol


def test_prediction_without_delay_changes_nothing() -> None:
    # 2BW with one update per iteration: every gradient meets the version its forward
    # read (delay 0), so predicting is bitwise the same run
    program = stdlib("pipedream-2bw", D=3, N=4, m=4)
    assert set(weight_versions(program).gradient_delays().values()) == {0}
    plain = RunConfig(backend="local", steps=3, check=True, optimizer="adam")
    a = local_outcome(program, plain)
    b = local_outcome(program, dataclasses.replace(plain, predict_weights=True))
    assert a.losses == b.losses
    for x, y in zip(a.results, b.results, strict=True):
        for wx, wy in zip(x.copy_weights, y.copy_weights, strict=True):
            assert all(torch.equal(wx[k], wy[k]) for k in wx)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_prediction_is_the_papers_formula(optimizer: str) -> None:
    """PipeOptim / XPipe: W_t - s * lr * momentum (SGD) and W_t - s * lr * m_hat /
    (sqrt(v_hat) + eps) (Adam), from torch.optim's own state after the same update."""
    from pipelang.backends.rank_base import make_optimizer
    from pipelang.backends.versions import CopyVersions

    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    params = list(module.parameters())
    config = RunConfig(optimizer=optimizer, lr=0.05)
    versions = CopyVersions(module, params, stash=True, predict=True)
    twin = [p.detach().clone().requires_grad_(True) for p in params]
    torch_opt = (
        torch.optim.SGD(twin, lr=0.05, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.Adam(twin, lr=0.05)
    )
    ours = make_optimizer(params, config)
    for _ in range(2):  # two updates: momentum and moments are not the first gradient
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(versions.newest, grads, strict=True):
            p.grad = g.clone()
        versions.collect(versions.newest)
        versions.update(ours, versions.updates + 1)
        for p, g in zip(twin, grads, strict=True):
            p.grad = g.clone()
        torch_opt.step()
    for delay in (1, 3):
        for got, base in zip(versions.predicted(delay), twin, strict=True):
            state = torch_opt.state[base]
            if optimizer == "sgd":
                direction = state["momentum_buffer"]
            else:
                step = float(state["step"])
                m_hat = state["exp_avg"] / (1 - 0.9**step)
                v_hat = state["exp_avg_sq"] / (1 - 0.999**step)
                direction = m_hat / (v_hat.sqrt() + 1e-8)
            expected = base.detach() - delay * 0.05 * direction
            torch.testing.assert_close(got.detach(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("name", "what"), [("1f1b", "synchronous"), ("pipemare", "latest")])
def test_prediction_is_refused_where_it_has_no_meaning(
    name: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = run(stdlib(name, D=2, N=4), "--backend", "local", "--predict-weights")
    err = capsys.readouterr().err
    assert status == 1 and err.startswith(f"error: --predict-weights: `{stdlib(name).name}`")
    assert what in err
