"""A backward split into B and W that keeps, between them, only what W reads.

Zero-bubble schedules run the activation gradient (B) and the weight gradient (W) of a
micro-batch apart. Kept whole until W, the forward's graph would hold all its
activations; the paper's memory (arXiv 2401.10241, Table 2: ZB-H1 at 1F1B's peak)
assumes that after B a stage keeps only each weighted op's input and its output
gradient. So:

- The *weight ops* of a forward's graph are its nodes that are not themselves on a
  chain to one parameter but have such a chain below them: a chain is a parameter's
  gradient accumulator, or a node whose single input is a chain that no other node
  uses (a transpose, an embedding's lookup). A linear layer's `addmm`, a norm's scaling
  are weight ops; the transpose of a linear's weight is part of its chain. A chain that
  several nodes use (an embedding whose output feeds a residual and a norm) is its own
  weight op: W starts at its top with the gradient they summed.
- B differentiates the outputs with respect to the stage input (and a sequence chunk's
  earlier keys and values) *and* the gradient edges into the weight ops: one backward
  that stops where the weight branches begin, and hands back the gradient each weight op
  receives.
- W runs each weight op with the gradient B gave it, toward its own parameters only,
  and accumulates into `.grad` as a whole backward would: the same ops on the same
  values, so the gradients are bitwise those of one `backward`. A weight op whose
  parameters are all vectors (a layer norm, a bias alone) is cheap: B runs it at once,
  as zero-bubble implementations do, instead of keeping its input and gradient.
- A linear layer's product (`addmm` with a bias, `mm` without, over the weight's
  transpose: `Product`) is most weight ops of a transformer. B takes its input from
  the graph before it runs, and W computes the weight's and bias's gradients with the
  formulas autograd's backward of that product uses (`product_grads`), as Megatron's
  deferred weight gradients do, and adds them all with one call into the engine. An
  op over embedding lookups (a token and a position embedding summed: `Lookup`) is
  done alike: B takes the gradient into each lookup, W runs autograd's embedding
  backward on it and the indices. Where every weight op is a product or such lookups,
  W needs no graph: B lets it go as it runs (no `retain_graph`), and the stage's later
  forwards need not file their saved tensors (`Stage.graph_free`).
- Any other weight op W runs on the graph B kept. What it reads is known before it
  runs: the saved tensors of the weight ops and of their chains, found by reading each
  node's saved values while the stash records which it hands out (`Stash.probe`).
  Everything else the forward saved is released right after B (`Stash.keep`); a W
  that read a released tensor would raise.

Every micro-batch of a stage makes a graph of one shape, so which nodes are weight ops
is found once per shape (`_plan`): each B walks its graph (about 40 us for two of
gpt:tiny's blocks) and looks its shape up; the analysis runs on a shape not met
before. The shape holds all that the analysis reads (each node's type
and the places of the nodes below it, which parameter each accumulator adds into), so
a graph gets the plan it would have got alone. W calls autograd's engine as
`torch.autograd.backward` would, without its checks of the arguments (`_backward`).

A graph where a parameter is used twice (weights tied inside a stage), whose
output is itself a chain to a parameter (a stage that is one embedding: all its backward
is W), with a node whose saved values cannot be read, or with a weight op W must run on
the graph while its forward filed nothing in the stash (a recomputed one) is not split:
it keeps its whole graph until W. A graph that reaches no parameter keeps nothing for W.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.overrides import has_torch_function

Group = tuple[tuple[GradientEdge, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
"""One weight op's work in W: its gradient edges, the gradients B left there, and the
parameters its chains reach."""


@dataclass(slots=True)
class Product:
    """A linear layer's product (`addmm` with a bias, `mm` without; `_product`), kept for
    W without its graph: its left factor (the layer's input, folded to two dimensions),
    the gradient of its output, and its parameters."""

    x: torch.Tensor
    grad: torch.Tensor | None
    weight: torch.Tensor
    bias: torch.Tensor | None
    column_major: bool
    """Whether the product's right factor (the weight's transpose) is column-major, as
    a linear layer's is: autograd's formula then takes its other branch."""
    params: tuple[torch.Tensor, ...]
    """The op's parameters in the plan's order (`weight` and `bias` among them)."""


@dataclass(slots=True)
class Lookup:
    """An embedding's lookup (`_lookups`), kept for W without its graph: the indices it
    read, the gradient of its output, and its weight."""

    indices: torch.Tensor
    grad: torch.Tensor | None
    weight: torch.Tensor
    padding_idx: int
    scale_grad_by_freq: bool

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)


@dataclass(slots=True)
class WeightWork:
    """What W does once B has run: the linear layers' products (`Product`), computed
    without the graph, and for any other weight op its gradient edges, the gradients B
    left there, and the parameters its chains reach (`Group`: the engine runs it, on the
    graph B kept)."""

    products: list[Product | Lookup]
    """The products and lookups W computes itself (`own_grads`)."""
    groups: list[Group]

    def gradients(self) -> list[torch.Tensor]:
        """The gradients kept for W (counted with the activations W keeps)."""
        kept = [p.grad for p in self.products if p.grad is not None]
        return kept + [g for _, grads, _ in self.groups for g in grads]


Probe = Callable[[Iterable[Node]], bool]
"""Reads every saved value of the given nodes while the stash records which it hands
out; False when some node's saved values cannot be read."""


def split_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    probe: Probe | None,
    unfiled: bool = False,
) -> tuple[list[torch.Tensor | None], WeightWork | None]:
    """B: the gradients of `inputs`, and what W needs (see the module docstring); None
    for the latter when the graph is not split, and then the whole graph is kept for a
    plain `backward(outputs, grads, inputs=params)`. Where every weight op W runs is a
    linear layer's product, W needs no graph and B lets it go. Without `probe` (the
    forward filed nothing in the stash) the graph is split only then, and only where
    `unfiled` says its owner left it unfiled for that reason (`Stage.graph_free`): a
    recomputed forward is never split (all its weight gradients come at W, which the
    one-process reference replays)."""
    found_plan = _plan(outputs, params)
    owns: list[Product | list[tuple[Node, Lookup]] | None] = []
    if found_plan is not None:
        nodes, plan = found_plan
        for i, at_params in plan.later:
            op, theirs = nodes[i], [params[p] for p in at_params]
            owns.append(_product(op, theirs) or _lookups(op, theirs))
        graph_kept = None in owns
        if not (probe([nodes[i] for i in plan.read]) if probe else unfiled and not graph_kept):
            found_plan = None
    if found_plan is None:  # not split: the input gradients alone, the whole graph kept for W
        if not inputs:
            return [], None
        alone = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
        return list(alone), None
    # One pass: the input gradients, the gradients into the weight ops W runs later (into
    # each lookup, for an op of embedding lookups), and the cheap weight ops' own
    # parameter gradients (they are on B's way anyway).
    later = [nodes[i] for i, _ in plan.later]
    edges_of = [
        [GradientEdge(node, 0) for node, _ in own]
        if isinstance(own, list)
        else [GradientEdge(op, i) for i in range(len(op._input_metadata))]
        for op, own in zip(later, owns, strict=True)
    ]
    edges = [edge for op_edges in edges_of for edge in op_edges]
    cheap = [params[p] for p in plan.cheap]
    wrt: list[Any] = [*inputs, *edges, *cheap]
    found: Sequence[torch.Tensor | None] = ()
    if wrt:
        found = torch.autograd.grad(outputs, wrt, grads, retain_graph=graph_kept, allow_unused=True)
    _accumulate(cheap, found[len(inputs) + len(edges) :])
    work = WeightWork([], [])
    at = len(inputs)
    for op_edges, own, (_, owned) in zip(edges_of, owns, plan.later, strict=True):
        given = found[at : at + len(op_edges)]
        at += len(op_edges)
        if isinstance(own, Product):
            own.grad = given[0]
            work.products.append(own)
            continue
        if isinstance(own, list):
            for (_, lookup), grad in zip(own, given, strict=True):
                lookup.grad = grad
                work.products.append(lookup)
            continue
        kept = [(edge, g) for edge, g in zip(op_edges, given, strict=True) if g is not None]
        if kept:
            mine = tuple(params[p] for p in owned)
            work.groups.append((tuple(e for e, _ in kept), tuple(g for _, g in kept), mine))
    return list(found[: len(inputs)]), work


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add `grads` into the parameters' `.grad` through their gradient accumulators, as
    `backward` does (so hooks on them run: `--mixed-precision` moves them to fp32)."""
    pairs = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    if pairs:
        leaves = tuple(p for p, _ in pairs)
        _backward(leaves, tuple(g for _, g in pairs), leaves)


def _cheap(params: Sequence[torch.Tensor]) -> bool:
    """Whether a weight op's parameters are all vectors (a norm's scale and shift, a
    bias alone): its weight gradient is cheap, and runs in B rather than keep its input
    and output gradient until W."""
    return all(p.dim() <= 1 for p in params)


def weight_pass(
    work: WeightWork | None,
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    params: Sequence[torch.Tensor],
) -> None:
    """W: from what B kept (`weight_backward`), or where the graph was not split, the
    parameters' gradients from the whole graph B kept."""
    if work is not None:
        weight_backward(work)
    elif params:  # a stage without weights (an activation alone) has no W to do
        torch.autograd.backward(outputs, grads, inputs=list(params))


def weight_backward(work: WeightWork) -> None:
    """W: each weight op's parameter gradients from the gradient B left it, added into
    `.grad` by their gradient accumulators, as one `backward` adds them. A linear
    layer's are computed here (`product_grads`) and added by one call into the engine
    for all; any other op runs its own backward (one per op: from all of them at once,
    an op's input gradient would run on down into the ops below, whose parameters are
    wanted too, and add to their gradients)."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor | None] = []
    for product in work.products:
        params += product.params
        grads += own_grads(product)
    _accumulate(params, grads)
    for group in work.groups:
        _backward(*group)


def _product(op: Node, params: list[torch.Tensor]) -> Product | None:
    """`op` as a linear layer's product, read while its graph holds its saved values:
    an `addmm` (bias, input, weight's transpose; alpha and beta 1) or `mm` (input,
    weight's transpose) whose parameters are `params` exactly, in a real floating type,
    plain tensors; else None (the engine runs it in W)."""
    addmm = type(op) is _ADDMM
    if not addmm and type(op) is not _MM:
        return None
    if addmm and (op._saved_alpha != 1 or op._saved_beta != 1):  # type: ignore[attr-defined]
        return None
    below = op.next_functions
    transpose = below[-1][0]
    if transpose is None or type(transpose) is not _TRANSPOSE:
        return None
    leaf = transpose.next_functions[0][0]
    if leaf is None or type(leaf) is not _ACCUMULATOR:
        return None
    weight: torch.Tensor = leaf.variable  # type: ignore[attr-defined]
    bias_node = below[0][0] if addmm else None
    bias = None
    if bias_node is not None:
        if type(bias_node) is not _ACCUMULATOR:
            return None
        bias = bias_node.variable  # type: ignore[attr-defined]
    mine = [weight] if bias is None else [weight, bias]
    if len(params) != len(mine) or {id(p) for p in params} != {id(p) for p in mine}:
        return None
    if not weight.dtype.is_floating_point or has_torch_function(mine):
        return None
    x = op._saved_mat1 if addmm else op._saved_self  # type: ignore[attr-defined]
    sizes = op._saved_mat2_sym_sizes  # type: ignore[attr-defined]
    strides = op._saved_mat2_sym_strides  # type: ignore[attr-defined]
    column_major = strides[0] == 1 and strides[1] == sizes[0]
    return Product(x, None, weight, bias, column_major, tuple(params))


def product_grads(product: Product) -> list[torch.Tensor | None]:
    """The gradients of a linear layer's parameters (in `product.params`' order), as
    autograd's `addmm`/`mm` backward and the weight's transpose compute them, so bitwise
    the same: mm_mat2_backward gives a column-major right factor the transpose of
    grad^T x, which the transpose node turns back; the engine sums a broadcast bias's
    gradient to its shape (`at::sum_to`)."""
    grad, x = product.grad, product.x
    if grad is None:
        return [None] * len(product.params)
    found = {id(product.weight): grad.t().mm(x) if product.column_major else x.t().mm(grad).t()}
    if product.bias is not None:
        found[id(product.bias)] = grad.sum([0], keepdim=True).view(product.bias.shape)
    return [found[id(p)] for p in product.params]


def _lookups(op: Node, params: list[torch.Tensor]) -> list[tuple[Node, Lookup]] | None:
    """`op`'s parameters as embedding lookups, each straight over its weight's
    accumulator (a token and a position embedding summed, say), each with its node (B
    takes its output gradient there) and what W reads; None unless every parameter of
    `op` is the weight of one such dense lookup, in a real floating type, a plain
    tensor."""
    found = []
    for node, _ in op.next_functions:
        if node is None or type(node) is not _EMBEDDING:
            continue
        leaf = node.next_functions[0][0]
        if leaf is None or type(leaf) is not _ACCUMULATOR or node._saved_sparse:  # type: ignore[attr-defined]
            return None
        padding: int = node._saved_padding_idx  # type: ignore[attr-defined]
        if padding >= 1 << 63:  # a negative index (none: -1) reads back as unsigned
            padding -= 1 << 64
        lookup = Lookup(
            node._saved_indices,  # type: ignore[attr-defined]
            None,
            leaf.variable,  # type: ignore[attr-defined]
            padding,
            node._saved_scale_grad_by_freq,  # type: ignore[attr-defined]
        )
        found.append((node, lookup))
    weights = [lookup.weight for _, lookup in found]
    if sorted(map(id, weights)) != sorted(map(id, params)) or has_torch_function(weights):
        return None
    return found if all(w.dtype.is_floating_point for w in weights) else None


def own_grads(own: Product | Lookup) -> list[torch.Tensor | None]:
    """The gradients of a product's or a lookup's parameters, in `own.params`' order:
    `product_grads`, or autograd's backward of an embedding (`embedding_backward`, the
    same kernel, so bitwise the same)."""
    if isinstance(own, Product):
        return product_grads(own)
    if own.grad is None:
        return [None]
    rows = own.weight.shape[0]
    grad = torch.ops.aten.embedding_backward(
        own.grad, own.indices, rows, own.padding_idx, own.scale_grad_by_freq, False
    )
    return [grad]


_run_backward: Callable[..., object] | None = getattr(
    torch.autograd.graph, "_engine_run_backward", None
)
"""What `torch.autograd.backward` calls once it has checked its arguments (torch 2.4 on)."""


def _backward(
    roots: tuple[Any, ...], grads: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]
) -> None:
    """`torch.autograd.backward(roots, grads, inputs=inputs)` without its checks of the
    arguments (about 20 us, and a W makes one call per weight op): each gradient is what
    B found for its root, so they have nothing to find. Parameters that override torch
    functions (`__torch_function__`) go the public way."""
    if _run_backward is None or has_torch_function(inputs):
        torch.autograd.backward(roots, grads, inputs=inputs)
        return
    _run_backward(roots, grads, False, False, inputs, allow_unreachable=True, accumulate_grad=True)


@dataclass(frozen=True, slots=True)
class _Plan:
    """The weight ops of one shape of graph, by their nodes' places in `_walk`'s order and
    their parameters' in the stage's list (`_analyse`)."""

    later: tuple[tuple[int, tuple[int, ...]], ...]
    """The weight ops W runs: each op's node and its parameters."""
    read: tuple[int, ...]
    """The nodes whose saved values W reads: those ops and their chains."""
    cheap: tuple[int, ...]
    """The parameters of the weight ops B runs at once (`_cheap`)."""


_PLANS: dict[tuple[object, ...], _Plan | None] = {}
"""The plan of each shape of graph met (None: not split). Every micro-batch of a stage
makes a graph of one shape: its plan is found once."""
_PLANS_HELD = 256
"""How many shapes `_PLANS` holds before it starts again."""


def _plan(
    outputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[list[Node], _Plan] | None:
    """The nodes of the graph below `outputs` in `_walk`'s order, and the plan of its
    weight ops (found once per shape: `_PLANS`); None when it is not split (`_analyse`)."""
    nodes, edges, shape = _walk(outputs, params)
    if shape in _PLANS:
        plan = _PLANS[shape]
    else:
        place = {node: at for at, node in enumerate(nodes)}
        below = [[None if n is None else place[n] for n, _ in out] for out in edges]
        roots = [place[t.grad_fn] for t in outputs if t.grad_fn is not None]
        which = {id(p): i for i, p in enumerate(params) if p.requires_grad}
        owned = {
            at: which[_leaf(node)]
            for at, node in enumerate(nodes)
            if type(node) is _ACCUMULATOR and _leaf(node) in which
        }
        plan = _analyse(below, roots, owned, [p.dim() <= 1 for p in params])
        if len(_PLANS) >= _PLANS_HELD:
            _PLANS.clear()
        _PLANS[shape] = plan
    return None if plan is None else (nodes, plan)


def _walk(
    outputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[list[Node], list[tuple[tuple[Node | None, int], ...]], tuple[object, ...]]:
    """Every node below `outputs`, depth first, and each one's `next_functions`; and the
    graph's shape, all that `_analyse` reads: the roots' places in that order, each
    node's type and the places of the nodes below it (None for none), and for a
    parameter's accumulator which parameter it is and whether a vector (`_cheap`). One
    shape, one plan."""
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    place: dict[Node, int] = {}
    nodes: list[Node] = []
    edges: list[tuple[tuple[Node | None, int], ...]] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in place:
            continue
        place[node] = len(nodes)
        nodes.append(node)
        out = node.next_functions
        edges.append(out)
        for n, _ in out:
            if n is not None:
                stack.append(n)
    which = {id(p): (i, p.dim() <= 1) for i, p in enumerate(params) if p.requires_grad}
    shape: list[object] = [len(roots)]
    shape.extend(place[r] for r in roots)
    for node, out in zip(nodes, edges, strict=True):
        kind = type(node)
        shape.append(kind)
        shape.append(len(out))
        for n, _ in out:
            shape.append(None if n is None else place[n])
        if kind is _ACCUMULATOR:
            shape.append(which.get(_leaf(node)))
    return nodes, edges, tuple(shape)


def _analyse(
    below: list[list[int | None]], roots: list[int], owned: dict[int, int], vector: list[bool]
) -> _Plan | None:
    """The weight ops of a walked graph (`_walk`: nodes by place, `below` each one's
    edges, `owned` maps a parameter's accumulator to the parameter), each with the
    parameters and the chain nodes below it; None when an output is itself a chain to a
    parameter (all the backward is W's) or a parameter is used twice (no one op owns
    it). `vector`: which parameters are vectors (`_cheap`)."""
    parents: list[set[int]] = [set() for _ in below]
    for at, kids in enumerate(below):
        for n in kids:
            if n is not None:
                parents[n].add(at)
    chain: dict[int, int | None] = {}

    def param_of(node: int) -> int | None:
        """The parameter `node` is a chain to (a line of nodes no other node joins),
        or None."""
        if node not in chain:
            if node in owned:
                chain[node] = owned[node]
            else:
                kids = [n for n in below[node] if n is not None]
                alone = len(kids) == 1 and len(parents[kids[0]]) == 1
                chain[node] = param_of(kids[0]) if alone else None
        return chain[node]

    def chain_nodes(node: int) -> list[int]:
        """The nodes of a chain, from `node` down to its parameter's accumulator
        (excluded)."""
        nodes = []
        while node not in owned:
            nodes.append(node)
            node = next(n for n in below[node] if n is not None)  # a chain: one below
        return nodes

    if any(param_of(root) is not None for root in roots):
        return None
    ops: list[tuple[int, list[int], list[int]]] = []  # node, its parameters, its chains
    for node in range(len(below)):
        param = param_of(node)
        if param is not None:
            if len(parents[node]) > 1 and node not in owned:
                ops.append((node, [param], chain_nodes(node)))  # W starts at its top
            continue
        mine: list[int] = []
        nodes: list[int] = []
        for n in below[node]:
            owner = None if n is None else param_of(n)
            if n is not None and owner is not None and len(parents[n]) == 1:
                mine.append(owner)
                nodes.extend(chain_nodes(n))
        if mine:
            ops.append((node, mine, nodes))
    owners = [p for _, mine, _ in ops for p in mine]
    if len(owners) != len(set(owners)) or set(owners) != set(owned.values()):
        return None  # a parameter used twice (tied weights): no op owns it alone
    later = [(node, mine, nodes) for node, mine, nodes in ops if not all(vector[p] for p in mine)]
    read = [node for node, _, _ in later] + sorted({n for _, _, nodes in later for n in nodes})
    cheap = [p for _, mine, _ in ops if all(vector[p] for p in mine) for p in mine]
    return _Plan(tuple((node, tuple(mine)) for node, mine, _ in later), tuple(read), tuple(cheap))


def _leaf(accumulator: Node) -> int:
    """The id of the leaf a gradient accumulator adds into."""
    leaf: torch.Tensor = accumulator.variable  # type: ignore[attr-defined]
    return id(leaf)


def _node_types() -> tuple[type, type, type, type, type]:
    """The node types of a linear layer's product, folded to two dimensions: `addmm`
    (with a bias), `mm` (without), the weight's transpose below either; a leaf's
    gradient accumulator (the node that adds into `.grad`); and an embedding's lookup,
    read off a sample graph."""
    weight = torch.zeros(2, 2, requires_grad=True)
    x = torch.zeros(1, 2)
    addmm = torch.addmm(torch.zeros(2), x, weight.t()).grad_fn
    mm = torch.mm(x, weight.t()).grad_fn
    assert addmm is not None and mm is not None
    transpose = mm.next_functions[1][0]
    assert transpose is not None and transpose.next_functions[0][0] is not None
    lookup = torch.nn.functional.embedding(torch.zeros(1, dtype=torch.long), weight).grad_fn
    accumulator = type(transpose.next_functions[0][0])
    return type(addmm), type(mm), type(transpose), accumulator, type(lookup)


_ADDMM, _MM, _TRANSPOSE, _ACCUMULATOR, _EMBEDDING = _node_types()
"""Read as this module loads, before any dispatch mode is on: read on first use, the
sample's products ran inside whatever mode was on then (a FLOP counter counted 16
FLOPs more for the first B of a process: tests/test_planner_split_w.py)."""
