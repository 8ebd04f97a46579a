"""The capturable optimizers against torch's own code, bit for bit.

torch runs `Adam(capturable=True)` only on accelerators; its single-tensor formula is
plain tensor code, so the test lets it run on the CPU by widening its device check.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipelang.backends.optim import SGD, Adam, CapturableAdam, CapturableSGD


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
