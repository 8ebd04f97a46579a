"""Weight versions of one stage copy in an asynchronous schedule (`weights ...`, `U`).

A synchronous run updates every copy once, with `step`, after the whole iteration. An
asynchronous one updates a copy at each of its `U` actions, while other micro-batches
are still in flight (pipelang/weights.py says which version every op reads):

- `stash` and `weights K` (PipeDream, PipeDream-2BW): `update` never writes over a
  version. It clones the newest parameters, applies the optimizer to the clones and
  installs them in the stage's module as new `nn.Parameter`s, so later forwards read the
  new version. An older version stays alive exactly as long as an autograd graph of a
  micro-batch forwarded on it does (the graph holds its parameters), so a backward reads
  the version its forward read, and memory holds what weights.py calls the live
  versions; `live()` counts them with weak references.
- `latest` (PipeMare): one version, updated in place through `.data` (which autograd's
  version counter does not see). A backward then reads the newest values of the
  parameter tensors its graph saved, while every activation the graph saved (anything
  the forward computed, even from the weights) keeps the forward's values.

Gradients: after a micro-batch's last backward (`W` when the schedule splits it off,
else `B`) its parameter gradients move from the version's `.grad` into the copy's sum,
in the order the backwards run; `update` applies their mean: the sum divided by the
number of micro-batches it holds (each loss is unscaled). A `U` with no gradient since
the one before makes a version equal to the newest without running the optimizer.

Weight prediction (`--predict-weights`, XPipe; stashing policies only): a forward whose
gradient will be applied `s` updates after the version it reads (`WeightVersions.
gradient_delays`) runs on `newest + s * delta`, `delta` being what the copy's last update
changed (`-lr * momentum` for SGD, `-lr * m/(sqrt(v)+eps)` for Adam, zero before the
first update and after an update without gradients). That prediction is a version of its
own: its micro-batch's backward reads it (it is stashed) and its gradient goes into the
sum like any other; the update still applies to the newest weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipelang.backends.optim import Optimizer
from pipelang.diagnostics import InternalError
from pipelang.ir import Program
from pipelang.weights import weight_versions

if TYPE_CHECKING:
    from pipelang.backends.rank_base import RankResult

Slots = list[list[tuple[nn.Module, str]]]
"""Per trainable parameter, the (module, attribute) places that hold it."""


def parameter_slots(module: nn.Module, params: Sequence[nn.Parameter]) -> Slots:
    """Where each of `params` sits in `module` (a shared parameter sits in several)."""
    index = {id(p): i for i, p in enumerate(params)}
    slots: Slots = [[] for _ in params]
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and id(param) in index:
                slots[index[id(param)]].append((sub, name))
    return slots


def install(slots: Slots, params: Sequence[nn.Parameter]) -> None:
    """Put `params` (one version of a stage's weights) into the module's places."""
    for param, places in zip(params, slots, strict=True):
        for sub, name in places:
            sub._parameters[name] = param


@contextmanager
def installed(
    slots: Slots, params: list[nn.Parameter], newest: list[nn.Parameter]
) -> Iterator[None]:
    """Run the module on `params` (an older version), then put `newest` back."""
    if params is newest:
        yield
        return
    install(slots, params)
    try:
        yield
    finally:
        install(slots, newest)


class CopyVersions:
    """The versions of one stage copy: its newest parameters, the gradient sum since the
    last update, and weak references to every version made, for `live()`."""

    def __init__(
        self, module: nn.Module, params: list[nn.Parameter], stash: bool, predict: bool = False
    ) -> None:
        self.stash = stash
        self.predict = predict
        self.delta: list[torch.Tensor] | None = None
        """What the last update changed, kept across iterations when predicting."""
        self.slots = parameter_slots(module, params)
        self.newest = params
        self.grads: list[torch.Tensor | None] | None = None
        self.count = 0
        """Micro-batches whose gradients `grads` sums."""
        self.updates = 0
        """Updates in this iteration (the generated `version=` counts from 1 each one)."""
        self.refs: list[weakref.ref[nn.Parameter]] = [weakref.ref(params[0])] if params else []

    def live(self) -> int:
        """Versions of this copy in memory now (1 under `latest`)."""
        self.refs = [r for r in self.refs if r() is not None]
        return len(self.refs)

    def collect(self, params: Sequence[nn.Parameter]) -> None:
        """Move one micro-batch's gradients from its version's `.grad` into the sum."""
        grads = []
        for param in params:
            grads.append(param.grad)
            param.grad = None
        if self.grads is None:
            self.grads = grads
        else:
            self.grads = [
                g if s is None else s if g is None else s + g
                for s, g in zip(self.grads, grads, strict=True)
            ]
        self.count += 1

    def update(self, optimizer: Optimizer, version: int) -> list[nn.Parameter]:
        """`U`: apply the mean gradient and make version `version` of this iteration;
        returns the newest parameters."""
        if version != self.updates + 1:
            raise InternalError(
                f"update to version {version} after {self.updates} updates in this iteration"
            )
        self.updates += 1
        grads, count = self.grads, self.count
        self.grads, self.count = None, 0
        if grads is None:
            self.delta = None
            if self.stash:
                self._make([nn.Parameter(p.detach().clone()) for p in self.newest], optimizer)
            return self.newest
        mean = [None if g is None else torch.div(g, count) for g in grads]
        if not self.stash:
            optimizer.apply([p.data for p in self.newest], mean)
            return self.newest
        new = [nn.Parameter(p.detach().clone()) for p in self.newest]
        optimizer.apply(new, mean)
        if self.predict:
            self.delta = [n.detach() - o.detach() for n, o in zip(new, self.newest, strict=True)]
        self._make(new, optimizer)
        return new

    def predicted(self, delay: int) -> list[nn.Parameter]:
        """The weights a forward whose gradient lags `delay` updates runs on: the newest
        moved `delay` times by the last update (the newest themselves when there is
        nothing to extrapolate)."""
        if delay == 0 or self.delta is None:
            return self.newest
        params = [
            nn.Parameter(torch.add(p.detach(), d, alpha=delay))
            for p, d in zip(self.newest, self.delta, strict=True)
        ]
        if params:
            self.refs.append(weakref.ref(params[0]))  # a version in memory too
        return params

    def _make(self, new: list[nn.Parameter], optimizer: Optimizer) -> None:
        install(self.slots, new)
        self.newest = new
        optimizer.params = new  # the optimizer must not keep version 0 alive
        if new:
            self.refs.append(weakref.ref(new[0]))

    def end_iteration(self) -> None:
        """Check every gradient was applied; the next iteration counts updates from 0."""
        if self.grads is not None:
            raise InternalError(f"{self.count} gradients were never applied by an update")
        self.updates = 0


def versions_line(program: Program, results: Sequence[RankResult]) -> str:
    """One line comparing each rank's measured peak of live weight versions with what
    pipelang.weights predicts (`pipelang simulate`'s peak_weight_versions)."""
    predicted = weight_versions(program).peak
    ranks = ", ".join(
        f"rank {r.rank} {r.peak_weight_versions} ({predicted[r.rank % program.num_ranks]})"
        for r in sorted(results, key=lambda r: r.rank)
    )
    return f"weight versions live at most, measured (predicted): {ranks}"
