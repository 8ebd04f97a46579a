"""What a split backward costs beyond one backward (backends/weight_split.py): the walk
of the graph finds each shape's weight ops once (`_PLANS`), and W computes the linear
layers' gradients itself and goes straight to autograd's engine, once for those and once
per other weight op; each stays bitwise one backward's."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipelang.backends import stash as stash_module
from pipelang.backends import weight_split
from pipelang.backends.models import ModelSpec, plan_stages
from pipelang.backends.stash import Stash
from pipelang.backends.weight_split import split_backward, weight_pass

KEY = (0, 0, "main", None)


def split_then_w(
    stage: nn.Module, x: torch.Tensor, run: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> tuple[object, list[torch.Tensor | None], torch.Tensor]:
    """F under a stash, B split off W with the release, then W: the work B kept (None: not
    split), B's input gradients and the output gradient."""
    inp = x.detach().requires_grad_(x.is_floating_point())
    stash = Stash()
    with stash.recording(KEY, "F0", stage):
        y = run(stage, inp)
    grad = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
    needed: set[int] = set()
    probe = stash.prober(KEY, needed)
    params = list(stage.parameters())
    found, work = split_backward([y], [grad], [inp] if inp.requires_grad else [], params, probe)
    if work is not None:
        stash.keep(KEY, needed, work.gradients())
    weight_pass(work, [y], [grad], params)  # not split: from the whole graph B kept
    stash.forget(KEY)
    return work, found, grad


def assert_whole(
    stage: nn.Module,
    twin: nn.Module,
    x: torch.Tensor,
    grad: torch.Tensor,
    found: list[torch.Tensor | None],
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> None:
    """`stage`'s gradients (and B's input gradient) are bitwise one backward's of `twin`."""
    inp = x.detach().requires_grad_(x.is_floating_point())
    torch.autograd.backward(run(twin, inp), grad)
    for ours, theirs in zip(stage.parameters(), twin.parameters(), strict=True):
        assert ours.grad is not None and theirs.grad is not None
        assert torch.equal(ours.grad, theirs.grad)
    if inp.requires_grad:
        assert found[0] is not None and torch.equal(found[0], inp.grad)  # type: ignore[arg-type]


def plain(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_a_stage_s_graph_is_analysed_once_for_all_its_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpt:tiny's four stages, three micro-batches each: the middle stages' graphs have one
    shape (their parameters are others: found by place), the first and last one each,
    so three analyses, not twelve; the gradients are one backward's every time."""
    monkeypatch.setattr(weight_split, "_PLANS", {})
    analysed: list[object] = []

    def counted(*args: object) -> object:
        analysed.append(args)
        return analyse(*args)

    analyse = weight_split._analyse
    monkeypatch.setattr(weight_split, "_analyse", counted)
    spec = ModelSpec("gpt:tiny", None, 2, "float32", 0)
    built = spec.build()
    x, targets = built.batch(0, 0, torch.device("cpu"))
    bounds = plan_stages(spec, 4, None).bounds
    for index, layers in enumerate(bounds):
        stage = built.stage_module(layers)
        twin = copy.deepcopy(stage)

        def run(module: nn.Module, inp: torch.Tensor, last: bool = index == 3) -> torch.Tensor:
            return built.loss(module(inp), targets) if last else module(inp)

        for _ in range(3):
            work, found, grad = split_then_w(stage, x, run)
            assert work is not None
            assert_whole(stage, twin, x, grad, found, run)
        with torch.no_grad():
            x = stage(x)
    assert len(analysed) == 3


def test_w_goes_straight_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """W computes the linear layers' gradients itself and adds them all with one engine
    call (gpt:tiny's middle stage has eight such layers: one call, not eight), without
    `torch.autograd.backward`'s checks of its arguments (about 20 us a call)."""
    from pipelang.backends import weight_split

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
    twin = copy.deepcopy(stage)
    x = torch.randn(4, 8)
    public: list[object] = []
    engine: list[object] = []
    backward, direct = torch.autograd.backward, weight_split._backward

    def counted(*args: object, **kwargs: object) -> None:
        public.append(args)
        backward(*args, **kwargs)  # type: ignore[arg-type]

    def counted_direct(*args: Any) -> None:
        engine.append(args)
        direct(*args)

    monkeypatch.setattr(torch.autograd, "backward", counted)
    monkeypatch.setattr(weight_split, "_backward", counted_direct)
    work, found, grad = split_then_w(stage, x, plain)
    monkeypatch.setattr(torch.autograd, "backward", backward)
    assert work is not None and len(work.products) == 2 and not work.groups  # type: ignore[attr-defined]
    assert public == []
    assert len(engine) == 2  # B adds the norm's (cheap) gradients, W the two layers'
    assert_whole(stage, twin, x, grad, found, plain)


class Scaled(nn.Module):
    """y = x * w (a vector w: its gradient is cheap, B's; a matrix: W's), and with `tied`
    the same weight twice (not split)."""

    def __init__(self, shape: tuple[int, ...], tied: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(shape))
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x * self.w)
        return torch.tanh(y * self.w) if self.tied else torch.tanh(y)


@pytest.mark.parametrize(
    ("shape", "tied", "groups"),
    [((8,), False, 0), ((4, 8), False, 1), ((8,), True, None), ((4, 8), False, 1)],
)
def test_a_plan_is_its_shape_s_alone(
    shape: tuple[int, ...], tied: bool, groups: int | None
) -> None:
    """Graphs alike but for what `_analyse` reads get plans of their own: a weight that is
    a vector (run at B) or a matrix (kept for W), used once or twice (not split), met in
    any order, each bitwise one backward."""
    torch.manual_seed(0)
    stage = Scaled(shape, tied)
    twin = copy.deepcopy(stage)
    x = torch.randn(4, 8)
    work, found, grad = split_then_w(stage, x, plain)
    if groups is None:
        assert work is None
    else:
        assert work is not None and len(work.groups) == groups  # type: ignore[attr-defined]
    assert_whole(stage, twin, x, grad, found, plain)


def test_the_stash_hands_autograd_a_saved_tensor_s_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """What autograd keeps for a saved activation is its index in the forward's entry, an
    int (no object per saved tensor for the garbage collector to track: a `Handle` each
    made zb-h1's collections many); a weight stays itself. The backward reads them back."""
    packed: list[object] = []
    hooks = torch.autograd.graph.saved_tensors_hooks

    class Spy(hooks):  # type: ignore[misc, valid-type]
        def __init__(self, pack: Callable[[torch.Tensor], object], unpack: object) -> None:
            def spied(tensor: torch.Tensor) -> object:
                packed.append(pack(tensor))
                return packed[-1]

            super().__init__(spied, unpack)

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", Spy)
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    twin = copy.deepcopy(stage)
    x = torch.randn(4, 8, requires_grad=True)
    stash = Stash()
    with stash.recording(KEY, "F0", stage):
        y = stage(x)
    tensors = stash.entries[KEY].tensors
    assert [p for p in packed if type(p) is int] == list(range(len(tensors)))
    weights = [p for p in packed if isinstance(p, torch.Tensor)]
    assert weights and all(w.untyped_storage().data_ptr() in _storages(stage) for w in weights)
    torch.autograd.backward(y, torch.ones_like(y))
    twin(x.detach()).backward(torch.ones_like(y))
    for ours, theirs in zip(stage.parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)  # type: ignore[arg-type]


def _storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def test_a_module_s_own_storages_are_its_parameters_and_buffers() -> None:
    """`_own_storages` reads each submodule's tables: the same storages as `parameters()`
    and `buffers()`, with a shared layer, a missing bias, a view's base and buffers that
    are not saved in the state."""
    shared = nn.Linear(4, 4, bias=False)
    module = nn.Sequential(shared, nn.BatchNorm1d(4), shared, nn.Linear(4, 4))
    module.register_buffer("mask", torch.ones(4), persistent=False)
    module.register_buffer("nothing", None)
    module.register_parameter("part", nn.Parameter(torch.zeros(8)[2:]))
    assert stash_module._own_storages(module) == _storages(module)


class Mix(torch.autograd.Function):
    """A custom op with a matrix weight and two outputs: (x w, x w^T), saving x and w."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, w)
        return x @ w, x @ w.t()

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return a @ w.t() + b @ w, x.t() @ a + b.t() @ x


def test_a_custom_function_with_a_matrix_weight_keeps_its_saved_input_for_w() -> None:
    """A user's `autograd.Function` whose weight is a matrix is a weight op W runs: the
    probe reads its `ctx.saved_tensors` (its node's type is `MixBackward`, a subclass of
    `BackwardCFunction`; matched by name, it was never read, its input was released
    after B and W raised ReleasedError), and W's gradients are one backward's."""
    torch.manual_seed(0)

    def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a, b = Mix.apply(x, module.w)
        return torch.tanh(a) * b

    stage = nn.Module()
    stage.w = nn.Parameter(torch.randn(8, 8))
    twin = copy.deepcopy(stage)
    x = torch.randn(4, 8)
    work, found, grad = split_then_w(stage, x, run)
    assert work is not None and len(work.groups) == 1  # type: ignore[attr-defined]
    assert_whole(stage, twin, x, grad, found, run)
