"""`pipelang profile`'s measuring half: a model's layers timed into a `Profile`
(`pipelang.profile` holds the data and reads it back).

The model is built as `pipelang run` builds it, one micro-batch is pushed through the
layers once to get every layer's input, then each layer is timed on its own input,
`repeats` runs at a time after `warmup` runs, until the runs are steady (the middle half
of them within `STEADY` of their median, or `STEADY_MS`) or `max_repeats` runs are
timed, and the median is kept, with the middle half's range as the layer's spread
(`LayerCost.spread_ms`). A busy machine (other processes, threads shared) shows as
unsteady runs, or as identical layers measured far apart, which `pipelang profile`
warns of (`Profile.disagreements`). The whole backward is one
`torch.autograd.grad` with respect to the input and the weights; split as the runtime
splits it, the input gradient is taken first keeping the graph, then the weight gradient
on that graph (the two cost more than the one pass). The last layer's forward and
backward include the loss, as the runtime's last stage does. Saved activations are the
distinct tensor storages autograd packs during the forward
(`torch.autograd.graph.saved_tensors_hooks`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipelang.backends.config import SGD_MOMENTUM
from pipelang.backends.model_error import ModelError
from pipelang.backends.models import ModelSpec, plan_stages
from pipelang.backends.optim import SGD, Adam
from pipelang.backends.stash import Stash
from pipelang.backends.weight_split import WeightWork, split_backward, weight_pass
from pipelang.diagnostics import quote
from pipelang.ir import CostModel, Kind, Program
from pipelang.profile import LayerCost, Profile
from pipelang.sim import memory
from pipelang.source import one_line


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """What `pipelang profile` was asked to measure."""

    model: str
    micro_batch_size: int = 4
    seq_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    repeats: int = 5
    warmup: int = 2
    seed: int = 0
    max_repeats: int = 0
    """The most timed runs of one measurement while its runs are unsteady (0: 4 x
    `repeats`)."""

    @property
    def most_runs(self) -> int:
        return max(self.repeats, self.max_repeats or 4 * self.repeats)


STEADY = 0.1
"""Runs are steady when the middle half of them lies within this share of their median..."""
STEADY_MS = 0.02
"""... or within this many milliseconds (the timer's jitter on a layer this quick)."""


def measure(
    options: ProfileOptions, progress: Callable[[int, int, str], None] | None = None
) -> Profile:
    """Build the model and time every layer (see the module docstring)."""

    if options.threads:
        torch.set_num_threads(options.threads)
    device = torch.device(options.device)
    spec = ModelSpec(
        options.model, options.seq_len, options.micro_batch_size, options.dtype, options.seed
    )
    with device:
        model = spec.build()
    ids, targets = model.batch(0, 0, device)
    inputs: list[torch.Tensor] = [ids]
    with torch.no_grad():
        for layer in model.layers[:-1]:
            inputs.append(layer(inputs[-1]))
    costs = []
    last = len(model.layers) - 1
    for index, layer in enumerate(model.layers):
        if progress is not None:
            progress(index, len(model.layers), type(layer).__name__)

        def run(
            x: torch.Tensor, layer: torch.nn.Module = layer, index: int = index
        ) -> torch.Tensor:
            y = layer(x)
            return model.loss(y, targets) if index == last else y

        costs.append(
            _measure_layer(type(layer).__name__, layer, inputs[index], run, options, device)
        )
    return Profile(
        model=options.model,
        device=str(device),
        dtype=options.dtype,
        micro_batch_size=options.micro_batch_size,
        seq_len=model.seq_len,
        layers=tuple(costs),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        repeats=options.repeats,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )


def stage_activation_bytes(
    spec: ModelSpec, num_stages: int, partition: Sequence[int] | None, tp: int = 1
) -> list[tuple[int, int]]:
    """Per stage of `spec` cut into `num_stages`, the bytes of activations one
    micro-batch's forward saves, and what a split backward keeps of them after B for W,
    measured on the CPU as the runtime counts them (`saved_bytes`); under `--tp` (`tp`
    above 1) one tensor rank's, its split parameters cut to their part
    (`tensor_parallel.localize`). Sizes past what torch can allocate here are a
    ModelError naming them."""
    plan = plan_stages(spec, num_stages, partition)
    try:
        return _stage_activation_bytes(spec, num_stages, plan.bounds, tp)
    except (RuntimeError, MemoryError) as err:  # torch's: a storage size that overflows
        sizes = f"--micro-batch-size {spec.micro_batch_size:,}" + (
            "" if spec.seq_len is None else f" and --seq-len {spec.seq_len:,}"
        )
        why = one_line(str(err))
        raise ModelError(
            f"cannot measure {quote(spec.name)}'s activations with {sizes}: "
            f"{why if len(why) <= 120 else why[:117] + '...'}"
        ) from None


def _stage_activation_bytes(
    spec: ModelSpec, num_stages: int, bounds: Sequence[Sequence[int]], tp: int
) -> list[tuple[int, int]]:
    from pipelang.backends.tensor_parallel import block_plans, localize

    model = spec.build()
    plans = block_plans(spec.name) if tp > 1 else None
    for layer in model.layers if plans is not None else ():
        localize(layer, plans, tp)
    x, targets = model.batch(0, 0, torch.device("cpu"))
    with torch.no_grad():
        for i in model.frozen_bounds if spec.frozen_layers else ():
            x = model.layers[i](x)
    found = []
    for index, layers in enumerate(bounds):
        stage = model.stage_module(layers)
        last = index == num_stages - 1

        def fresh(
            stage: torch.nn.Module = stage, x_in: torch.Tensor = x, last: bool = last
        ) -> tuple[torch.Tensor, torch.Tensor]:
            inp = x_in.detach().requires_grad_(x_in.is_floating_point())
            y = stage(inp)
            return inp, model.loss(y, targets) if last else y

        params = [p for p in stage.parameters() if p.requires_grad]
        found.append(saved_bytes(fresh, stage, params))
        with torch.no_grad():
            x = stage(x)
    return found


def activation_peaks(
    spec: ModelSpec,
    program: Program,
    costs: CostModel,
    stages: Sequence[tuple[int, int]] | None = None,
) -> list[float]:
    """Per rank of `program`, the most bytes of saved activations it holds at once
    running `spec`: each stage's bytes for one micro-batch, and what a split backward
    keeps of them for W, measured as the runtime counts them (`stage_activation_bytes`,
    unless `stages` gives them for this cut already), held along the rank's order by the
    one counter (`memory.peak_bytes`; `costs` for the chunks' and shapes' shares). What
    `simulate --model` gives."""
    if stages is None:
        stages = stage_activation_bytes(spec, program.num_stages, program.partition)
    whole = [float(saved) for saved, _ in stages]
    shares = [kept / saved if saved else 0.0 for saved, kept in stages]
    w = None if Kind.W not in program.kinds else (lambda stage: shares[stage or 0])
    kept, recomputed = whole, None
    if Kind.R in program.kinds:  # F keeps no saved tensors; R makes them
        kept, recomputed = [0.0] * len(whole), whole
    share = memory.shares(program, costs)
    return [memory.peak_bytes(actions, w, kept, recomputed, share) for actions in program.ranks]


def _measure_layer(
    name: str,
    layer: torch.nn.Module,
    x_in: torch.Tensor,
    run: Callable[[torch.Tensor], torch.Tensor],
    options: ProfileOptions,
    device: torch.device,
) -> LayerCost:

    params = [p for p in layer.parameters() if p.requires_grad]
    differentiable = x_in.is_floating_point()

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        x = x_in.detach().requires_grad_(differentiable)
        return x, run(x)

    (forward,) = _timed(options, device, lambda: [fresh], warmups=options.warmup)
    (full,) = _backward(fresh, options, device, lambda x, y, grad: [_whole(x, y, grad, params)])
    stashes: list[Stash] = []

    def recorded() -> tuple[torch.Tensor, torch.Tensor]:
        stashes[:] = [Stash()]
        with stashes[0].recording(_KEY, name, layer):
            return fresh()

    # As the runtime splits it (`weight_split`): B, then W from what B kept.
    input_grad, weight_grad = _backward(
        recorded,
        options,
        device,
        lambda x, y, grad: list(split_passes(x, y, grad, layer, params, stashes[0])[:2]),
    )
    with torch.no_grad():
        out = layer(x_in.detach())
    saved, kept_for_w = saved_bytes(fresh, layer, params)
    sgd_step, adam_step = (_step_ms(params, kind, options, device) for kind in ("sgd", "adam"))
    low, high = (forward.quartiles[i] + full.quartiles[i] for i in (0, 1))
    return LayerCost(
        name=name,
        forward_ms=round(forward.median, 6),
        backward_input_ms=round(input_grad.median, 6),
        backward_weight_ms=round(weight_grad.median, 6),
        backward_ms=round(full.median, 6),
        activation_bytes=float(saved),
        w_activation_bytes=float(kept_for_w),
        weight_bytes=float(sum(p.numel() * p.element_size() for p in layer.parameters())),
        output_bytes=float(out.numel() * out.element_size()),
        sgd_step_ms=round(sgd_step, 6),
        adam_step_ms=round(adam_step, 6),
        spread_ms=(round(low, 6), round(high, 6)),
        runs=max(len(forward.runs), len(full.runs)),
    )


@dataclass(frozen=True, slots=True)
class Runs:
    """The times of one measurement's timed runs, in ms."""

    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def quartiles(self) -> tuple[float, float]:
        """The range of the middle half of the runs (the spread)."""
        if len(self.runs) < 2:
            return self.runs[0], self.runs[0]
        low, _, high = statistics.quantiles(self.runs, n=4, method="inclusive")
        return low, high

    @property
    def steady(self) -> bool:
        low, high = self.quartiles
        return high - low <= max(STEADY * self.median, STEADY_MS)


def _timed(
    options: ProfileOptions,
    device: torch.device,
    passes: Callable[[], Sequence[Callable[[], object]]],
    warmups: int = 0,
) -> list[Runs]:
    """Each of the actions `passes()` gives, run one after the other and timed, over
    `warmups` untimed rounds and then `options.repeats` runs at a time until every
    action's runs are steady or `options.most_runs` are timed."""
    for _ in range(warmups):
        for action in passes():
            action()
            _sync(device)
    samples: list[list[float]] = []
    while True:
        for _ in range(options.repeats):
            actions = passes()
            samples = samples or [[] for _ in actions]
            for index, action in enumerate(actions):
                _sync(device)
                start = time.perf_counter()
                action()
                _sync(device)
                samples[index].append((time.perf_counter() - start) * 1e3)
        found = [Runs(tuple(s)) for s in samples]
        if all(r.steady for r in found) or len(samples[0]) >= options.most_runs:
            return found


def _backward(
    fresh: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    options: ProfileOptions,
    device: torch.device,
    passes: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], list[Callable[[], object]]],
) -> list[Runs]:
    """The runs of backward passes run one after the other on one graph (`fresh` makes
    it; `passes(x, y, grad)` gives them)."""

    def graph() -> list[Callable[[], object]]:
        x, y = fresh()
        grad = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
        return passes(x, y, grad)

    return _timed(options, device, graph, warmups=options.warmup)


def _whole(
    x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor, params: list[torch.nn.Parameter]
) -> Callable[[], object]:
    """The whole backward of one graph, to its input and weights, as one pass."""
    wrt = [x, *params] if x.requires_grad else list(params)
    return lambda: torch.autograd.grad(y, wrt, grad, allow_unused=True) if wrt else None


def split_passes(
    x: torch.Tensor,
    y: torch.Tensor,
    grad: torch.Tensor,
    layer: torch.nn.Module,
    params: list[torch.nn.Parameter],
    stash: Stash | None = None,
) -> tuple[Callable[[], None], Callable[[], None], Callable[[], int]]:
    """B and W of one graph as the runtime runs them (`weight_split`: B releases all
    that W does not read, found through `stash`, which recorded the forward), and the
    bytes `stash` holds after B; without a stash, the graph is kept whole for W."""
    inputs = [x] if x.requires_grad else []
    state: list[WeightWork | None] = [None]

    needed: set[int] = set()
    probe = None if stash is None else stash.prober(_KEY, needed)

    def b() -> None:
        _, work = split_backward([y], [grad], inputs, params, probe)
        state[0] = work
        if stash is not None and work is not None:
            stash.keep(_KEY, needed, work.gradients())

    def w() -> None:
        weight_pass(state[0], [y], [grad], params)
        if stash is not None:
            stash.forget(_KEY)  # as the runtime does after W: the graph can go

    def held() -> int:
        return 0 if stash is None else stash.resident_bytes({_KEY})

    return b, w, held


_KEY = (0, 0, "", None)
"""The one forward a measurement's stash records."""


def _step_ms(
    params: list[torch.nn.Parameter],
    optimizer: str,
    options: ProfileOptions,
    device: torch.device,
) -> float:
    """The median time of the runtime's optimizer step on `params` (its own SGD with
    momentum, or Adam): the update from fresh gradients, then clearing them. It changes
    the weights (by a learning rate of 1e-6), so it runs after the layer's other
    measurements."""

    if not params:
        return 0.0
    grads = [torch.randn_like(p) for p in params]
    step = SGD(params, 1e-6, SGD_MOMENTUM) if optimizer == "sgd" else Adam(params, 1e-6)

    def update() -> None:
        step.step()
        step.zero_grad()

    def passes() -> list[Callable[[], object]]:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()  # the runtime's step finds new gradients each time
        return [update]

    (runs,) = _timed(options, device, passes, warmups=options.warmup)
    return runs.median


def saved_bytes(
    fresh: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    layer: torch.nn.Module,
    params: list[torch.nn.Parameter],
) -> tuple[int, int]:
    """Bytes of the distinct storages autograd saves for the backward during a forward
    (the layer's own parameters and buffers left out: they are weights, counted apart),
    and of what a split backward keeps of them after B for W: the saved tensors W reads
    and the gradients it starts from. Both counted as the runtime counts them (`Stash`,
    `weight_split`)."""

    stash = Stash()
    with stash.recording(_KEY, type(layer).__name__, layer):
        x, y = fresh()
    whole = stash.resident_bytes({_KEY})
    grad = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
    b, _, held = split_passes(x, y, grad, layer, params, stash)
    b()
    kept = held()
    stash.forget(_KEY)  # no W follows: the graph can go (`Stash.forget`)
    return whole, kept


def _sync(device: torch.device) -> None:

    if device.type == "cuda":
        torch.cuda.synchronize(device)
