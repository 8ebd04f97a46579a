"""The capturable optimizers against torch's own code, bit for bit.

torch runs `Adam(capturable=True)` only on accelerators; its single-tensor formula is
plain tensor code, so the test lets it run on the CPU by widening its device check.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipelang.backends.optim import (
    SGD,
    Adam,
    CapturableAdam,
    CapturableSGD,
    LrSchedule,
    decays,
)


def _pairs(seed: int) -> tuple[list[nn.Parameter], list[nn.Parameter], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 2, 4)]
    ours = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(10)]
    return ours, theirs, grads


def _train_side_by_side(
    mine: CapturableAdam | CapturableSGD,
    reference: torch.optim.Optimizer,
    ours: list[nn.Parameter],
    theirs: list[nn.Parameter],
    grads: list[list[torch.Tensor]],
) -> None:
    """Step both optimizers with the same gradients; the parameters stay bitwise equal."""
    for step in grads:
        for p, q, g in zip(ours, theirs, step, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        mine.step()
        reference.step()
        for p, q in zip(ours, theirs, strict=True):
            assert torch.equal(p, q)


def test_capturable_adam_equals_torch_capturable_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.optim.adam as torch_adam

    monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", lambda: ["cpu"])
    ours, theirs, grads = _pairs(0)
    mine = CapturableAdam(ours, lr=3e-3)
    reference = torch.optim.Adam(theirs, lr=3e-3, capturable=True, foreach=False)
    _train_side_by_side(mine, reference, ours, theirs, grads)
    assert mine.step_count.item() == 10 and mine.step_count.dim() == 0


def test_capturable_sgd_equals_torch_sgd() -> None:
    ours, theirs, grads = _pairs(1)
    mine = CapturableSGD(ours, lr=0.05, momentum=0.9)
    reference = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, foreach=False)
    _train_side_by_side(mine, reference, ours, theirs, grads)


def test_capturable_adam_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step makes no Python number from a tensor (`item`, `float`, `bool`): on a GPU
    each would be a host sync, which a capture refuses."""
    ours, _, grads = _pairs(2)
    mine = CapturableAdam(ours, lr=3e-3)
    for p, g in zip(ours, grads[0], strict=True):
        p.grad = g

    def refuse(*_: object) -> None:
        raise AssertionError("host sync")

    for name in ("item", "__float__", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    mine.step()


@pytest.mark.parametrize("kind", [Adam, CapturableAdam, SGD, CapturableSGD])
def test_an_optimizer_resumed_from_its_state_steps_as_the_original(kind: type) -> None:
    """What a checkpoint keeps (`state`) and gives back (`load_state`) is everything: an
    optimizer rebuilt from it takes the same next steps, bit for bit."""
    ours, theirs, grads = _pairs(4)
    first = kind(ours, 0.01, 0.9) if kind in (SGD, CapturableSGD) else kind(ours, 0.01)
    for step in grads[:3]:
        for p, g in zip(ours, step, strict=True):
            p.grad = g.clone()
        first.step()
    with torch.no_grad():
        for p, q in zip(ours, theirs, strict=True):
            q.copy_(p)
    second = kind(theirs, 0.01, 0.9) if kind in (SGD, CapturableSGD) else kind(theirs, 0.01)
    for i in range(len(ours)):
        second.load_state(i, {k: v.clone() for k, v in first.state(i).items()})
    _train_side_by_side(first, second, ours, theirs, grads[3:])  # type: ignore[arg-type]


def _lrs() -> list[float]:
    """A rate that changes every step, as a schedule's does."""
    return [3e-3 * (0.5 + 0.1 * k) for k in range(10)]


def _torch_adamw(theirs: list[nn.Parameter], **kwargs: object) -> torch.optim.AdamW:
    """torch's AdamW with nanoGPT's groups: matrices decay, vectors do not."""
    groups = [
        {"params": [p for p in theirs if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in theirs if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, foreach=False, **kwargs)  # type: ignore[arg-type]


def _adamw_side_by_side(
    mine: Adam, reference: torch.optim.Optimizer, ours: list[nn.Parameter],
    theirs: list[nn.Parameter], grads: list[list[torch.Tensor]],
) -> None:  # fmt: skip
    for lr, step in zip(_lrs(), grads, strict=True):
        mine.set_lr(lr)
        for group in reference.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        _train_side_by_side(mine, reference, ours, theirs, [step])  # type: ignore[arg-type]


def test_adamw_equals_torch_adamw_with_a_changing_rate() -> None:
    ours, theirs, grads = _pairs(5)
    decay = [decays(p) for p in ours]
    assert decay == [True, False, True]  # biases and norms' gains have one dimension
    mine = Adam(ours, 3e-3, weight_decay=0.1, decay=decay)
    _adamw_side_by_side(mine, _torch_adamw(theirs, lr=3e-3), ours, theirs, grads)


def test_capturable_adamw_equals_torch_capturable_adamw_with_a_tensor_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rate is a tensor a captured step reads; `set_lr` rewrites it between steps."""
    import torch.optim.adam as torch_adam

    monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", lambda: ["cpu"])
    ours, theirs, grads = _pairs(6)
    mine = CapturableAdam(ours, 3e-3, weight_decay=0.1, decay=[decays(p) for p in ours])
    reference = _torch_adamw(theirs, lr=torch.tensor(3e-3), capturable=True)
    _adamw_side_by_side(mine, reference, ours, theirs, grads)


def test_capturable_sgd_follows_a_changing_rate_as_torch_sgd() -> None:
    ours, theirs, grads = _pairs(7)
    mine = CapturableSGD(ours, lr=0.05, momentum=0.9)
    reference = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, foreach=False)
    for lr, step in zip(_lrs(), grads, strict=True):
        mine.set_lr(lr)
        reference.param_groups[0]["lr"] = lr
        _train_side_by_side(mine, reference, ours, theirs, [step])


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    cosine = LrSchedule(1.0, "cosine", warmup=4, floor=0.1, steps=14)
    assert [cosine.lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # after the warm-up, step s is (s - 4) / 9 of the way: cos from 1 down to the floor
    for s in range(4, 14):
        done = (s - 4) / 9
        assert cosine.lr(s) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * done)))
    assert cosine.lr(4) == 1.0 and cosine.lr(13) == pytest.approx(0.1)
    linear = LrSchedule(2.0, "linear", warmup=0, floor=0.0, steps=5)
    assert [linear.lr(s) for s in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    assert LrSchedule(0.5, "constant", warmup=2, steps=10).lr(7) == 0.5
    assert LrSchedule(0.5, "constant", warmup=2, steps=10).lr(0) == 0.25


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--weight-decay", "0.1"], "--weight-decay and --decay-all are adamw's"),
        (["--optimizer", "sgd", "--decay-all"], "give --optimizer adamw"),
        (["--optimizer", "sgd", "--eps", "1e-6"], "--betas and --eps are adam's and adamw's"),
        (["--min-lr", "1e-4"], "--min-lr is where a decay ends"),
        (["--lr-schedule", "cosine", "--lr", "1e-3", "--min-lr", "0.1"], "above the peak"),
        (["--lr-schedule", "linear", "--warmup-steps", "3"], "leaves no step of the run"),
        (["--betas", "0.9"], "expected two numbers in [0, 1) as B1,B2"),
        (["--weight-decay", "-1", "--optimizer", "adamw"], "must be a number of at least 0"),
        (["--warmup-steps", "-2"], "--warmup-steps"),
    ],
)
def test_optimizer_options_that_do_not_fit_are_usage_errors(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipelang.cli import main

    assert main(["run", "1f1b", "-p", "D=2", "--steps", "3", *options]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
