"""A backward split into B and W keeps, between them, exactly what W reads
(backends/weight_split.py), and W's gradients are bitwise those of one backward; where
W comes right after its B, the runtime runs one whole backward at B instead
(`whole_backwards`), and the memory count knows it."""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import warnings
from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn
from torch.autograd.graph import Node

from pipelang.backends import stage as stage_module
from pipelang.backends.config import RunConfig
from pipelang.backends.local import run_local
from pipelang.backends.measure import activation_peaks, stage_activation_bytes
from pipelang.backends.models import ModelSpec, plan_stages
from pipelang.backends.stash import ReleasedError, Stash
from pipelang.backends.weight_split import (
    Product,
    split_backward,
    weight_backward,
    weight_pass,
)
from pipelang.ir import Action, CostModel, Kind
from pipelang.ir.program import whole_backwards
from tests.helpers import replay, run, stdlib

KEY = (0, 0, "main", None)


def split(
    stage: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[Stash, list[torch.Tensor | None], object, torch.Tensor, torch.Tensor]:
    """F under the stash, then B split off W with the release; the stash, B's input
    gradients, the work kept for W, the stage input and the output gradient."""
    inp = x.detach().requires_grad_(x.is_floating_point())
    stash = Stash()
    with stash.recording(KEY, "F0", stage):
        y = run(stage, inp)
    grad = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
    needed: set[int] = set()

    def probe(nodes: Iterable[Node]) -> bool:
        found = stash.probe(KEY, nodes)
        needed.update(found or ())
        return found is not None

    params = list(stage.parameters())
    found, work = split_backward([y], [grad], [inp] if inp.requires_grad else [], params, probe)
    if work is not None:
        stash.keep(KEY, needed, work.gradients())
    return stash, found, work, inp, grad


def whole(
    stage: nn.Module,
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    grad: torch.Tensor,
) -> torch.Tensor | None:
    """One plain backward on `stage`; the input's gradient."""
    inp = x.detach().requires_grad_(x.is_floating_point())
    torch.autograd.backward(run(stage, inp), grad)
    return inp.grad


def _where(t: torch.Tensor | None) -> tuple[int, int, tuple[int, ...]]:
    """Where a tensor's values are (the same tensor may come back as another object)."""
    assert t is not None
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)


@pytest.mark.parametrize("model", ["gpt:tiny", "llama:tiny"])
def test_w_reads_every_tensor_b_kept_and_gets_the_whole_backwards_gradients(model: str) -> None:
    """For every stage of a built-in model: the saved tensors that survive B are exactly
    those W reads (an old runtime that kept the whole graph fails here), fewer than the
    forward saved, and the weight and input gradients equal one backward's, bit for bit."""
    spec = ModelSpec(model, None, 2, "float32", 0)
    plan = plan_stages(spec, 4, None)
    built = spec.build()
    x, targets = built.batch(0, 0, torch.device("cpu"))
    for index, layers in enumerate(plan.bounds):
        stage = built.stage_module(layers)
        twin = copy.deepcopy(stage)
        last = index == len(plan.bounds) - 1

        def run(module: nn.Module, inp: torch.Tensor, last: bool = last) -> torch.Tensor:
            y = module(inp)
            return built.loss(y, targets) if last else y

        stash, found, work, inp, grad = split(stage, run, x)
        assert work is not None
        entry = stash.entries[KEY]
        kept = {i for i, t in enumerate(entry.tensors) if t is not None}
        assert 0 < len(kept) < len(entry.tensors)
        entry.reads = set()
        weight_backward(work)  # type: ignore[arg-type]
        # W reads a linear layer's input and an embedding's indices from what B kept
        # (`Product.x`, `Lookup.indices`), any other op's saved values through the stash
        read = {_where(t) for t in [entry.tensors[i] for i in entry.reads]}
        own = work.products  # type: ignore[attr-defined]
        read |= {_where(p.x if isinstance(p, Product) else p.indices) for p in own}
        assert {_where(entry.tensors[i]) for i in kept} == read, (
            f"stage {index} keeps tensors its W does not read"
        )
        reference = whole(twin, run, x, grad)
        for ours, theirs in zip(stage.parameters(), twin.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)  # type: ignore[arg-type]
        if inp.requires_grad:
            assert torch.equal(found[0], reference)  # type: ignore[arg-type]
        with torch.no_grad():
            x = stage(x)


class Scale(torch.autograd.Function):
    """A custom op with a weight: y = x * w, saving both."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return dy * w, (dy * x).sum(0)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(Scale.apply(torch.relu(x), self.w)))


def test_a_custom_autograd_function_is_split_too() -> None:
    """A user's `autograd.Function` with a weight is a weight op: its saved input
    survives B (read through `ctx.saved_tensors`), W gives the same gradients."""
    torch.manual_seed(0)
    stage = Custom()
    twin = copy.deepcopy(stage)
    x = torch.randn(4, 8)
    _, _, work, _, grad = split(stage, lambda m, inp: m(inp), x)
    assert work is not None
    weight_backward(work)  # type: ignore[arg-type]
    whole(twin, lambda m, inp: m(inp), x, grad)
    for ours, theirs in zip(stage.parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)  # type: ignore[arg-type]


def test_weights_tied_inside_a_stage_keep_the_whole_graph() -> None:
    """Two weight ops reach one parameter: not split, every saved tensor kept for a
    whole backward in W."""
    fc = nn.Linear(8, 8)
    stage = nn.Sequential(fc, nn.Tanh(), fc)
    stash, _, work, _, _ = split(stage, lambda m, inp: m(inp), torch.randn(4, 8))
    assert work is None
    assert all(t is not None for t in stash.entries[KEY].tensors)


def test_a_stage_without_weights_keeps_nothing_for_w() -> None:
    stash, found, work, _, _ = split(
        nn.Sequential(nn.GELU(), nn.Tanh()), lambda m, inp: m(inp), torch.randn(4, 8)
    )
    assert work is not None and not work.groups  # type: ignore[attr-defined]
    assert all(t is None for t in stash.entries[KEY].tensors)
    assert found[0] is not None


class Elementwise(nn.Module):
    """y = tanh(x * w) with a matrix w: a weight op that is no linear layer's product, so
    W runs it on the graph B kept (reading its saved input through the stash)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x) * self.w)


def test_reading_a_released_tensor_is_an_error() -> None:
    stash, _, work, _, _ = split(Elementwise(), lambda m, x: m(x), torch.randn(4, 8))
    assert work is not None and len(work.groups) == 1  # type: ignore[attr-defined]
    entry = stash.entries[KEY]
    released = [i for i, t in enumerate(entry.tensors) if t is None]
    assert released
    entry.tensors[:] = [None] * len(entry.tensors)
    with pytest.raises(ReleasedError, match="released after its B"):
        weight_backward(work)  # type: ignore[arg-type]


def test_a_stage_that_is_one_embedding_keeps_its_graph_for_w() -> None:
    """All of its backward is W's (its output is a chain to its weight): B has nothing
    to do, W does the whole backward, as a ZBV rank's first stage needs."""
    stage = nn.Embedding(16, 8)
    twin = copy.deepcopy(stage)
    ids = torch.randint(0, 16, (4, 5))
    _, found, work, _, grad = split(stage, lambda m, x: m(x), ids)
    assert work is None and found == []
    y = stage(ids)
    weight_pass(None, [y], [grad], list(stage.parameters()))
    whole(twin, lambda m, x: m(x), ids, grad)
    assert torch.equal(stage.weight.grad, twin.weight.grad)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("options", [(), ("--mixed-precision", "bfloat16"), ("--graphs",)])
def test_split_schedules_train_as_one_process(options: tuple[str, ...]) -> None:
    """zb-h1, zbv and v-half under `--check`, also with bf16 compute and fp32 masters
    (whose gradients arrive through hooks on the bf16 parameters' accumulators) and on
    the CPU's stream executor (`--graphs`): bitwise, their whole backwards too (the
    weight gradients added where the W would add them)."""
    for name in ("zb-h1", "zbv", "v-half"):
        program = stdlib(name, D=4, N=8)
        assert whole_backwards(program.ranks[0])  # some pairs run whole
        args = ("--backend", "local", "--model", "gpt:tiny", "--steps", "2", "--check")
        assert run(program, *args, *options) == 0


def test_whole_backwards_are_ws_right_after_their_b_with_only_receives_between() -> None:
    """The rule: W is the rank's next action after its B but for receives. A send (B's
    input gradient to the stage before), a signal, a wait or another op keeps them
    split; so does another micro-batch's or chunk's W."""
    tokens = (
        "B0@0/main W0@0/main "  # adjacent: whole
        "B1@1/main recv:F3@0/main<0 W1@1/main "  # a receive between: whole
        "B2@1/main send:B2@1/main>0 W2@1/main "  # B's gradient leaves first: split
        "B3@1/main wait:F4@0/main<0 W3@1/main "  # an `after` wait: split
        "B4@1/main F5@1/main W4@1/main "  # an op between: split
        "B5@1/main W6@1/main W5@1/main "  # another micro-batch's W: split
        "B7.1@1/main W7.0@1/main W7.1@1/main"  # another chunk's W: split
    )
    actions = [Action.parse(t) for t in tokens.split()]
    assert whole_backwards(actions) == {(0, 0, "main", None), (1, 1, "main", None)}


def compute_adjacent(actions: tuple[Action, ...]) -> int:
    """Pairs whose W is the next compute op after its B, whatever moves between."""
    ops = [a for a in actions if a.kind.is_compute]
    pairs = itertools.pairwise(ops)
    return sum(b.kind is Kind.B and w.kind is Kind.W and b[1:4] == w[1:4] for b, w in pairs)


@pytest.mark.parametrize(
    ("name", "whole", "adjacent"),
    [("zb-h1", 8, 8), ("zbv", 13, 46), ("v-half", 13, 58), ("dualpipev", 46, 52)],
)
def test_the_pairs_that_run_whole(name: str, whole: int, adjacent: int) -> None:
    """At D = 4, N = 8: zb-h1's are rank 0's eight (stage 0 sends no gradient); zbv's
    and v-half's are those of a stage whose gradient stays on its rank (stage 0, and
    rank 3's stage 4, whose gradient goes to stage 3 on the same rank). Their other W's
    right after B (46 and 58 counting compute ops alone) have B's gradient sent between,
    and stay split: run whole, that send would wait for W. DualPipeV's `BW`'s send
    after their W anyway."""
    program = stdlib(name, D=4, N=8)
    assert sum(len(whole_backwards(actions)) for actions in program.ranks) == whole
    assert sum(compute_adjacent(actions) for actions in program.ranks) == adjacent
    ranks = [r for r, actions in enumerate(program.ranks) if whole_backwards(actions)]
    assert ranks == ([0] if name == "zb-h1" else [0, 1, 2, 3] if name == "dualpipev" else [0, 3])


def fused(
    actions: tuple[Action, ...], pairs: Callable[[tuple[Action, ...]], set[int]]
) -> tuple[Action, ...]:
    """The rank's compute ops, each W at an index of `pairs` fused to the B before it (one
    compound: its B's result leaves when the W ends)."""
    marked = pairs(actions)
    out = [a._replace(fused=i in marked) for i, a in enumerate(actions)]
    return tuple(a for a in out if a.kind.is_compute)


@pytest.mark.parametrize(("name", "split", "across"), [("zbv", 51, 57), ("v-half", 58, 72)])
def test_fusing_across_a_send_would_delay_the_rank_before(
    name: str, split: int, across: int
) -> None:
    """Why a send between B and W keeps them split: run whole, B's gradient leaves after
    W. As compounds (B and W ending together), the pairs `whole_backwards` names leave
    the simulated makespan (F = B = W = 1) as it was; all compute-adjacent pairs make it
    12% (zbv) and 24% (v-half) longer."""

    def rule(actions: tuple[Action, ...]) -> set[int]:
        whole = whole_backwards(actions)
        return {
            i
            for i, a in enumerate(actions)
            if a.kind is Kind.W and (a.mb, a.stage, a.pipeline, a.chunk) in whole
        }

    def adjacent(actions: tuple[Action, ...]) -> set[int]:
        ops = [(i, a) for i, a in enumerate(actions) if a.kind.is_compute]
        return {
            i
            for (_, b), (i, w) in itertools.pairwise(ops)
            if b.kind is Kind.B and w.kind is Kind.W and b[1:4] == w[1:4]
        }

    program = stdlib(name, D=4, N=8)
    costs = CostModel((("F", None, 1.0), ("B", None, 1.0), ("W", None, 1.0)))
    spans = []
    for how in (lambda actions: set(), rule, adjacent):
        ranks = tuple(fused(actions, how) for actions in program.ranks)
        spans.append(replay(dataclasses.replace(program, ranks=ranks), costs).makespan)
    assert spans == [split, split, across]


def test_a_w_right_after_its_b_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, one_torch_thread: None
) -> None:
    """zb-h1 at D = 4, N = 8 splits 24 backwards a step, not 32: rank 0's B runs one whole
    backward, its forward files nothing in the stash (no one counts the bytes), and
    its W does nothing. The other ranks' forwards file theirs only until their first B
    finds that W needs no graph (every weight op of gpt:tiny's later stages is a linear
    layer's product): rank 1's three forwards before it, rank 2's two, rank 3's one."""
    calls = {"split": 0, "weight": 0, "recorded": 0}

    def counted(name: str, function: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(stage_module, "split_backward", counted("split", split_backward))
    monkeypatch.setattr(stage_module, "weight_pass", counted("weight", weight_pass))
    monkeypatch.setattr(Stash, "recording", counted("recorded", Stash.recording))
    program = stdlib("zb-h1", D=4, N=8)
    config = RunConfig(backend="local", steps=1)
    run_local(program, config, plan_stages(config.spec, 4, None).shapes, lambda *_: None)
    assert calls == {"split": 24, "weight": 24, "recorded": 6}


def test_a_whole_backward_keeps_nothing_for_w(one_torch_thread: None) -> None:
    """gpt:tiny's first stage keeps more for W than its forward saved (the gradients W
    starts from outweigh the embedding's saved ids): split, zb-h1's rank 0 would peak
    right after a B. Its W's follow their B's, so it holds 1F1B's rank 0's four
    forwards, and `simulate --model` (`activation_peaks`) says so."""
    config = RunConfig(backend="local", steps=1, count_activations=True)
    stages = stage_activation_bytes(config.spec, 4, None)
    assert stages[0][1] > stages[0][0]  # what W would keep > what F saved
    shapes = plan_stages(config.spec, 4, None).shapes
    peaks = {}
    for name in ("1f1b", "zb-h1"):
        program = stdlib(name, D=4, N=8)
        outcome = run_local(program, config, shapes, lambda *_: None)
        peaks[name] = [r.peak_activation_bytes for r in outcome.results]
        assert peaks[name] == pytest.approx(activation_peaks(config.spec, program, program.costs))
    assert peaks["zb-h1"][0] == peaks["1f1b"][0] == 4 * stages[0][0]


def live_tensors() -> int:
    """The tensors Python's garbage collector finds alive, after a collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module objects
        warnings.simplefilter("ignore")
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_a_split_run_frees_every_step_s_graph(name: str, one_torch_thread: None) -> None:
    """B keeps the graph for W (`retain_graph`); its saved values hold the stash's entry
    and the entry's kept tensors hold their graphs: a cycle through autograd's C++ nodes
    that the garbage collector cannot see. `Stash.forget` breaks it after W; without
    it, every step's activations stayed alive (39 MiB a step for zb-h1 on gpt:tiny).
    The measurements that split a backward (`simulate --model`, `profile`) free theirs."""
    program = stdlib(name, D=4, N=8)
    config = RunConfig(backend="local", steps=3, count_activations=True)
    shapes = plan_stages(config.spec, program.num_stages, None).shapes
    before = live_tensors()
    run_local(program, config, shapes, lambda *_: None)
    assert live_tensors() == before
    activation_peaks(config.spec, program, program.costs)
    assert live_tensors() == before


class Products(nn.Module):
    """Linear layers in each form autograd folds to a 2-D product: with a bias (`addmm`),
    without (`mm`), and a weight stored column-major (its transpose, the product's right
    factor, row-major: the other branch of autograd's formula)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16, bias=False)
        self.c = nn.Parameter(torch.randn(16, 8).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.relu(self.a(x))))
        return nn.functional.linear(h, self.c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("filed", [True, False])
def test_a_linear_layers_w_is_computed_as_autograd_computes_it(
    dtype: torch.dtype, filed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W computes a linear layer's weight and bias gradients itself from what B kept (no
    graph, no engine call per layer), bit for bit those of one backward and of the
    engine's own W, in every form of the product; two micro-batches, so the second adds
    into the first's. With the forward's saved tensors filed in the stash, B keeps only
    the inputs W reads; without (`filed` False), B lets the whole graph go."""
    from pipelang.backends import weight_split

    torch.manual_seed(0)
    stage = Products().to(dtype)
    engine, whole_twin = copy.deepcopy(stage), copy.deepcopy(stage)
    product = weight_split._product

    def run(module: nn.Module, inp: torch.Tensor) -> torch.Tensor:
        return module(inp)

    for mb in range(2):
        x = torch.randn(3, 5, 8, dtype=dtype)
        torch.manual_seed(mb)  # the same output gradient for every split
        if filed:
            stash, _, work, _, grad = split(stage, run, x)
            kept = [t for t in stash.entries[KEY].tensors if t is not None]
            read = [p.x for p in work.products]  # type: ignore[attr-defined]
            assert sorted(map(_where, kept)) == sorted(map(_where, read))
        else:
            inp = x.detach().requires_grad_(True)
            y = stage(inp)
            grad = torch.randn_like(y)
            params = list(stage.parameters())
            recomputed = stage(inp)  # unfiled as a recompute leaves it: never split
            assert split_backward([recomputed], [grad], [inp], params, None)[1] is None
            _, work = split_backward([y], [grad], [inp], params, None, unfiled=True)
            assert y.grad_fn is not None
            last = y.grad_fn.next_functions[0][0]  # the last layer's mm, under its view
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                last._saved_self  # type: ignore[union-attr]  # noqa: B018 (the graph is gone)
        assert work is not None and len(work.products) == 3 and not work.groups  # type: ignore[attr-defined]
        weight_backward(work)  # type: ignore[arg-type]
        monkeypatch.setattr(weight_split, "_product", lambda op, params: None)
        torch.manual_seed(mb)
        _, _, work, _, _ = split(engine, run, x)
        assert work is not None and len(work.groups) == 3  # type: ignore[attr-defined]
        weight_backward(work)  # type: ignore[arg-type]
        monkeypatch.setattr(weight_split, "_product", product)
        whole(whole_twin, run, x, grad)
    assert stage.c.stride() == (1, 8)  # still column-major
    for ours, theirs, one in zip(
        stage.parameters(), engine.parameters(), whole_twin.parameters(), strict=True
    ):
        assert ours.grad is not None and ours.grad.dtype == dtype
        assert torch.equal(ours.grad, theirs.grad)  # type: ignore[arg-type]
        assert torch.equal(ours.grad, one.grad)  # type: ignore[arg-type]


class Lookups(nn.Module):
    """A token embedding (with a padding row) and a position embedding (scaled by
    frequency) summed, as a transformer's first stage begins."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(11, 6, padding_idx=3)
        self.places = nn.Embedding(5, 6, scale_grad_by_freq=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.places(torch.arange(ids.shape[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embeddings_w_is_computed_as_autograd_computes_it(dtype: torch.dtype) -> None:
    """W computes the lookups' weight gradients itself (`Lookup`: autograd's own
    embedding backward, from the indices and the output gradient B took at each lookup),
    so a first stage's B lets its graph go too; bit for bit one backward's, the padding
    row untouched and repeated ids counted, over two micro-batches adding up."""
    torch.manual_seed(0)
    stage = Lookups().to(dtype)
    twin = copy.deepcopy(stage)
    params = list(stage.parameters())
    for _ in range(2):
        ids = torch.randint(0, 11, (3, 5))
        ids[0, :2] = 3  # the padding row, twice
        y = stage(ids)
        grad = torch.randn_like(y)
        _, work = split_backward([y], [grad], [], params, None, unfiled=True)
        assert work is not None and not work.groups
        assert [type(own).__name__ for own in work.products] == ["Lookup", "Lookup"]
        weight_backward(work)
        twin(ids).backward(grad)
    for ours, theirs in zip(stage.parameters(), twin.parameters(), strict=True):
        assert ours.grad is not None and torch.equal(ours.grad, theirs.grad)  # type: ignore[arg-type]
    assert stage.tokens.weight.grad is not None
    assert not stage.tokens.weight.grad[3].any()
