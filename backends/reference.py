"""`--check`: train the same model without pipelining and compare.

The reference runs in one process: the whole model, the same seed, data, micro-batches
and optimizer; per step it runs every micro-batch's backward, sums the gradients in the
order the run sums them (`backends/summation.py`: each copy's micro-batches in its order,
each parameter in the order of the ops that add it where W's run in another order than
B's, then the copies by `tree_sum`; a weight tied across stages a tensor per stage, its
uses summed as `step` sums them, `reference_ties.py`; the clipping norm likewise), takes
one optimizer step, and records the mean loss. A schedule with sequence chunks has each
chunk's gradient computed as a stage computes it (`reference_runs.ChunkedModel`). On a
CPU that makes a run bit for bit equal to it. Where the run's sums cannot be repeated
(a rank with two copies of one stage; ties with sequence chunks or `--shard`)
micro-batch gradients add in micro-batch order, and on GPUs kernels may add in another
order each run, so the verdict is a tolerance, not bitwise equality:

    |pipelined - reference| <= ATOL + RTOL * |reference|, elementwise,

for every parameter of every stage copy and for every step's loss, with (ATOL, RTOL) =
(1e-5, 1e-4) in fp32 and (2e-2, 2e-2) in bf16/fp16. Adam adds lr/20 to ATOL: its step
is lr * m / (sqrt(v) + eps), so where a gradient is within eps (1e-8) of zero, a rounding
difference dg in it moves the weight by about lr * dg / eps, a visible fraction of lr. A
real mistake (a missing micro-batch, an unsynchronised replica) changes most steps by
about lr and still fails. Per-step fingerprints of the parameters (`rank_base.fingerprint`)
name the first step that differs in any bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pipelang.backends.checkpoint import held_by_model, load
from pipelang.backends.config import RunConfig
from pipelang.backends.precision import copy_back
from pipelang.backends.rank_base import RankResult, fingerprint
from pipelang.backends.rank_sync import clip_coefficient
from pipelang.backends.reference_runs import ChunkedModel, WholeModel, added_by_backward
from pipelang.backends.reference_ties import TiedSums
from pipelang.backends.summation import SumPlan, Unit, shard_piece, tree_sum
from pipelang.ir import Program

TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2),
}
"""(atol, rtol) by dtype."""
ADAM_ATOL_PER_LR = 5e-2
"""With Adam, ATOL grows by this times the learning rate (see the module docstring)."""


def tolerance(config: RunConfig) -> tuple[float, float]:
    """(atol, rtol) of `--check` for this run's dtype and optimizer."""
    atol, rtol = TOLERANCE.get(config.spec.torch_dtype, TOLERANCE[torch.float32])
    if config.optimizer == "adam":
        atol += ADAM_ATOL_PER_LR * config.learning_rate
    return atol, rtol


@dataclass(frozen=True, slots=True)
class Reference:
    """The reference run: mean loss per step, the final parameters by name, and the wall
    time of every step (device work included; empty where the run was not timed)."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    step_seconds: list[float] = field(default_factory=list)
    fingerprints: list[list[int]] = field(default_factory=list)
    """Per step, each stage's parameters' `fingerprint` (empty when not asked for)."""


def train_reference(
    config: RunConfig,
    num_microbatches: int,
    device: torch.device,
    threads: int | None = None,
    sums: SumPlan | None = None,
    program: Program | None = None,
) -> Reference:
    """Train the whole model in one process for `config.steps` steps (from the checkpoint
    of `--resume`, when given, for the steps after it).

    `threads`: CPU threads for the reference, as many as one rank had (kernels then split
    their work the same way, and an oversubscribed machine does not slow it down).
    `sums`: the run's gradient sums (`summation.accumulation`), repeated exactly; without
    them (or with tied weights) the micro-batch gradients add in micro-batch order.
    `program`: the run's, for its stages (each fingerprinted every step) and its
    sequence chunks (computed as the run computes them, `reference_runs.ChunkedModel`).
    """
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(config, num_microbatches, device, sums, program)
    finally:
        torch.set_num_threads(saved)


def _train(
    config: RunConfig,
    n: int,
    device: torch.device,
    sums: SumPlan | None,
    program: Program | None,
) -> Reference:
    chunked = program is not None and program.chunks is not None
    untie = None  # ties replayed where the sums are (`reference_ties`)
    if program is not None and sums is not None and not config.shard:
        untie = (program.num_stages, config.partition)
    run = (
        ChunkedModel(config, device, 1.0 / n, program, n)  # type: ignore[arg-type]
        if chunked
        else WholeModel(config, device, 1.0 / n, untie)
    )
    trained = run.masters or run.params
    if config.resume is not None:
        load([held_by_model(run.full, run.optimizer, masters=run.masters)], config.resume)
        if run.masters is not None:
            copy_back(run.params, run.masters)
    by_stage = run.stage_params(program.num_stages, config.partition) if program else []
    grouped = None
    untied = run.stages is not None and run.bounds is not None
    if sums is not None and program is not None and by_stage and (untied or not run.model.ties):
        trained_of = {id(p): t for p, t in zip(run.params, trained, strict=True)}
        early = None
        if any(m.late is not None for ms in sums.stages.values() for m in ms):
            early = added_by_backward(config, program, device)
        ties = None
        if run.stages is not None and run.bounds is not None:
            ties = TiedSums(run.model, run.bounds, run.stages, program, config.dp)
        params = [[trained_of[id(p)] for p in ps] for ps in by_stage]
        grouped = _Grouping(sums, params, early, ties)
    schedule = config.lr_schedule_at()
    losses, seconds, fingerprints = [], [], []
    for step in range(config.first_step, config.steps):
        start = time.perf_counter()
        run.begin_step(step)
        if grouped is None:
            for mb in range(n):
                for chunk in _chunks(program):
                    run.backward((mb, chunk))
            if config.clip_grad is not None:
                nn.utils.clip_grad_norm_(trained, config.clip_grad)
        else:
            grouped.gradients(trained, run.backward, config.clip_grad)
        run.optimizer.set_lr(schedule.lr(step))
        run.optimizer.step()
        run.optimizer.zero_grad()
        if run.masters is not None:
            copy_back(run.params, run.masters)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(sum(run.losses[mb] for mb in range(n)) / n)
        fingerprints.append([fingerprint(ps) for ps in by_stage])
    return Reference(losses, run.weights(), seconds, fingerprints if by_stage else [])


def _chunks(program: Program | None) -> list[int | None]:
    """A micro-batch's backwards, in the order they can run: its chunks last first."""
    if program is None or program.chunks is None:
        return [None]
    return list(reversed(range(program.chunks.count)))


class _Grouping:
    """One step's gradients summed as the run sums them (`summation`): per stage, each
    copy's micro-batches in its order, then the copies by `tree_sum`; `--clip-grad`'s
    norm in the processes' parts, also by `tree_sum`.

    A copy whose W's run in another order than its B's adds in two lanes: the parameters
    its B adds (`early`, per stage: `reference_runs.added_by_backward`) in the B's order,
    the rest in the W's."""

    def __init__(
        self,
        sums: SumPlan,
        stage_params: list[list[nn.Parameter]],
        early: list[frozenset[int]] | None = None,
        ties: TiedSums | None = None,
    ) -> None:
        self.sums = sums
        self.params = stage_params
        self.ties = ties
        """Weights tied across stages, a tensor per stage, summed as the run sums them."""
        self.lanes: list[tuple[int, int, tuple[Unit, ...], list[nn.Parameter]]] = []
        """(stage, member, the order it adds in, the parameters it adds so)."""
        for stage, members in sums.stages.items():
            params = list(enumerate(stage_params[stage]))
            for index, m in enumerate(members):
                if m.late is None:
                    self.lanes.append((stage, index, m.units, [p for _, p in params]))
                    continue
                assert early is not None
                b_adds = [p for k, p in params if k in early[stage]]
                w_adds = [p for k, p in params if k not in early[stage]]
                for order, adds in ((m.units, b_adds), (m.late, w_adds)):
                    if adds:
                        self.lanes.append((stage, index, order, adds))
        self.uses: dict[tuple[Unit, int], int] = {}
        """How many lanes add each (backward, parameter's id) gradient: one alone may
        keep the backward's tensor as its sum, no copy (`_add`)."""
        for _, _, todo, adds in self.lanes:
            for unit in todo:
                for param in adds:
                    key = (unit, id(param))
                    self.uses[key] = self.uses.get(key, 0) + 1
        head = sums.stages[min(sums.stages)][0]
        lead = dict.fromkeys(mb for mb, _ in head.late or head.units)
        place = {mb: i for i, mb in enumerate(lead)}
        every = {u for members in sums.stages.values() for m in members for u in m.units}
        self.order = sorted(every, key=lambda u: (place.get(u[0], len(place)), u[0], -(u[1] or 0)))
        """The backwards, micro-batches in the order a copy adds them in (each gradient
        is used and dropped at once; where W's run in another order than B's, the W's,
        which add the weights), a micro-batch's chunks last first (a chunk's backward
        hands the chunks before it their keys' and values' gradients)."""

    def gradients(
        self, trained: list[nn.Parameter], backward: Callable[[Unit], None], clip: float | None
    ) -> None:
        """Run every backward and leave the grouped sums in `.grad`."""
        parts = self._fold(trained, backward)
        for stage, params in enumerate(self.params):
            members = range(len(self.sums.stages[stage]))
            for param in params:
                found = [parts.get((stage, i), {}).get(id(param)) for i in members]
                some = next((g for g in found if g is not None), None)
                if some is not None:  # a copy that added nothing sends zeros
                    param.grad = tree_sum(
                        [torch.zeros_like(some) if g is None else g for g in found]
                    )
        if self.ties:
            self.ties.apply(self.params, trained[0].device)
        if clip is not None:
            device = trained[0].device
            norms = enumerate(self.sums.norms)
            total = tree_sum([self._norm_part(stages, device, p) for p, stages in norms])
            coefficient = clip_coefficient(total, clip)
            for param in trained:
                if param.grad is not None:
                    param.grad.mul_(coefficient.to(param.grad.dtype))

    def _fold(
        self, trained: list[nn.Parameter], backward: Callable[[Unit], None]
    ) -> dict[tuple[int, int], dict[int, torch.Tensor]]:
        """Each copy's sum of its backwards' gradients, added in its lanes' orders: by
        (stage, member), by the parameter's id, its sum."""
        done = [0] * len(self.lanes)
        parts: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        pending: dict[Unit, dict[int, torch.Tensor | None]] = {}
        for unit in self.order:
            for param in trained:
                param.grad = None
            backward(unit)
            pending[unit] = {id(p): p.grad for p in trained}
            for lane, (stage, index, todo, adds) in enumerate(self.lanes):
                while done[lane] < len(todo) and todo[done[lane]] in pending:
                    grads = pending[todo[done[lane]]]
                    part = parts.setdefault((stage, index), {})
                    unit_done = todo[done[lane]]
                    for param in adds:
                        alone = self.uses[(unit_done, id(param))] == 1
                        _add(part, id(param), grads[id(param)], alone)
                    done[lane] += 1
            pending = self._still_needed(pending, done)
        return parts

    def _still_needed(
        self, pending: dict[Unit, dict[int, torch.Tensor | None]], done: list[int]
    ) -> dict[Unit, dict[int, torch.Tensor | None]]:
        """The gradients of `pending` that a lane has yet to add (a unit another lane
        wants later keeps those of its parameters only)."""
        wanted: dict[Unit, set[int]] = {}
        for lane, (_, _, todo, adds) in enumerate(self.lanes):
            for unit in todo[done[lane] :]:
                if unit in pending:
                    wanted.setdefault(unit, set()).update(id(p) for p in adds)
        return {
            unit: {k: g for k, g in grads.items() if k in wanted[unit]}
            for unit, grads in pending.items()
            if unit in wanted
        }

    def _norm_part(self, stages: list[int], device: torch.device, process: int) -> torch.Tensor:
        """One process's part of the squared norm (`RankRuntime.grad_square_sum`): under
        `--shard`, of its shard of each gradient."""
        total = torch.zeros((), dtype=torch.float32, device=device)
        shards = self.sums.shards
        copy = process // (len(self.sums.norms) // shards)  # its data-parallel copy
        for stage in stages:
            for index, param in enumerate(self.params[stage]):
                if self.ties is not None and self.ties.repeats(stage, index):
                    continue  # a tied weight counts once (`TiedGrads.repeats`)
                if param.grad is not None:
                    grad = param.grad.detach()
                    if shards > 1:
                        grad = shard_piece(grad, copy, shards)
                    total += grad.float().square().sum()
        return total


def _add(
    part: dict[int, torch.Tensor], k: int, grad: torch.Tensor | None, alone: bool = False
) -> None:
    """Add `grad` to `part[k]` as autograd accumulates a gradient; the first is kept as
    the sum itself where no other lane reads it (`alone`: a backward's new tensor, the
    rest added into it in place), else copied."""
    if grad is not None:
        if k in part:
            part[k].add_(grad)
        else:
            part[k] = grad if alone else grad.clone()


@dataclass(frozen=True, slots=True)
class Comparison:
    """How far a pipelined run is from the reference."""

    max_weight_diff: float
    worst_weight: str
    max_loss_diff: float
    tensors: int
    bitwise: bool
    ok: bool
    atol: float
    rtol: float
    diverged: bool = False
    """The reference's own loss is not finite: there is nothing sound to compare with."""
    first_difference: str | None = None
    """The first step after which some copy's parameters differ from the reference's in
    any bit, and where (None: none differ, or no fingerprints)."""
    first_step: int = 0
    """The number of the first step compared (after `--resume`'s checkpoint)."""
    losses: list[tuple[float, float]] = field(default_factory=list)
    """Per step: (the run's loss, the reference's)."""

    def render(self) -> str:
        if self.diverged:
            return (
                "check FAILED: the single-process reference itself diverged (its loss is not "
                "finite); try --dtype bfloat16 or float32, or a smaller --lr"
            )
        verdict = "OK" if self.ok else "FAILED"
        exact = " (bitwise equal)" if self.bitwise else ""
        line = (
            f"check {verdict}: {self.tensors} parameter tensors compared with a single-process "
            f"reference{exact}; largest parameter difference {self.max_weight_diff:.3g} "
            f"({self.worst_weight}), largest loss difference {self.max_loss_diff:.3g}; "
            f"tolerance atol {self.atol:g} + rtol {self.rtol:g} x |reference|"
        )
        if self.first_difference is not None:
            line += f"\n  parameters first differ (in any bit) after {self.first_difference}"
        if not self.ok:
            line += "\n" + self._loss_table()
        return line

    def _loss_table(self) -> str:
        """The per-step losses around the first step whose loss leaves the tolerance (or
        differs at all), and the last step."""
        within = [
            abs(a - b) <= self.atol + self.rtol * abs(b) if math.isfinite(a - b) else False
            for a, b in self.losses
        ]
        out = next((i for i, w in enumerate(within) if not w), None)
        differs = next((i for i, (a, b) in enumerate(self.losses) if a != b), None)
        lines = []
        if out is not None:
            lines.append(f"  the loss first leaves the tolerance at step {self.first_step + out}")
        start = max(0, (differs if differs is not None else len(self.losses)) - 1)
        shown = [*range(start, min(start + 8, len(self.losses)))]
        if out is not None and out not in shown:
            shown += [i for i in range(max(out - 1, 0), out + 2) if i < len(self.losses)]
        if len(self.losses) - 1 not in shown:
            shown.append(len(self.losses) - 1)
        lines.append(f"  {'step':>6}  {'run loss':>14}  {'reference':>14}  {'difference':>11}")
        previous = None
        for i in sorted(set(shown)):
            if previous is not None and i > previous + 1:
                lines.append(f"  {'...':>6}")
            run, ref = self.losses[i]
            lines.append(
                f"  {self.first_step + i:>6}  {run:>14.9g}  {ref:>14.9g}  {abs(run - ref):>11.3g}"
            )
            previous = i
        return "\n".join(lines)


def compare(
    reference: Reference, results: list[RankResult], losses: list[float], config: RunConfig
) -> Comparison:
    """Compare every stage copy's weights and the per-step losses with the reference.

    A NaN anywhere counts as a difference (it never passes the tolerance).
    """
    atol, rtol = tolerance(config)
    worst, worst_name, ok, bitwise, count = 0.0, "-", True, True, 0
    for result in results:
        for (stage, pipeline, _), weights in zip(result.copies, result.copy_weights, strict=True):
            for name, tensor in weights.items():
                count += 1
                if torch.equal(tensor, reference.weights[name]):  # the common case, cheaply
                    # within any tolerance; inf - inf, NaN, counts as an infinite difference
                    largest = 0.0 if _finite(tensor) else math.inf
                else:
                    bitwise = False
                    expected = reference.weights[name].double()
                    diff = (tensor.double() - expected).abs().nan_to_num(math.inf)
                    ok = ok and bool((diff <= atol + rtol * expected.abs()).all())
                    largest = float(diff.max())
                if largest >= worst:
                    worst = largest
                    worst_name = f"stage {stage}/{pipeline} `{name}` on rank {result.rank}"
    pairs = list(zip(losses, reference.losses, strict=True))
    loss_diffs = [abs(a - b) if math.isfinite(a - b) else math.inf for a, b in pairs]
    loss_diff = max(loss_diffs, default=0.0)
    ok = ok and all(d <= atol + rtol * abs(b) for d, (_, b) in zip(loss_diffs, pairs, strict=True))
    bitwise = bitwise and loss_diff == 0.0
    diverged = not all(math.isfinite(b) for b in reference.losses)
    return Comparison(
        worst,
        worst_name,
        loss_diff,
        count,
        bitwise,
        ok and not diverged,
        atol,
        rtol,
        diverged,
        first_difference(reference, results, config.first_step),
        config.first_step,
        pairs,
    )


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every element of `tensor` is finite: its sum is, unless it overflowed
    (one pass, no tensor of flags), else each is checked."""
    return math.isfinite(float(tensor.sum())) or bool(tensor.isfinite().all())


def first_difference(
    reference: Reference, results: list[RankResult], first_step: int
) -> str | None:
    """ "step K (stage S/P on rank R)": the first step after which a copy's parameters
    differ from the reference's in any bit; None when none does, or when either side has
    no fingerprints."""
    if not reference.fingerprints:
        return None
    for index, expected in enumerate(reference.fingerprints):
        for result in results:
            if len(result.fingerprints) <= index:
                return None
            found = zip(result.copies, result.fingerprints[index], strict=True)
            for (stage, pipeline, _), value in found:
                if value != expected[stage]:
                    where = f"stage {stage}/{pipeline} on rank {result.rank}"
                    return f"step {first_step + index} ({where})"
    return None
