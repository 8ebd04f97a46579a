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
- What W reads is known before it runs: the saved tensors of the weight ops and of
  their chains, found by reading each node's saved values while the stash records
  which it hands out (`Stash.probe`). Everything else the forward saved is released
  right after B (`Stash.keep`); a W that read a released tensor would raise.

A graph where a parameter is used twice (weights tied inside a stage), whose
output is itself a chain to a parameter (a stage that is one embedding: all its backward
is W), with a node whose saved values cannot be read, or a forward that saved nothing
through the stash (a recomputed one) is not split: it keeps its whole graph until W.
A graph that reaches no parameter keeps nothing for W.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass(slots=True)
class WeightWork:
    """What W does once B has run: per weight op, its gradient edges, the gradients B
    left there, and the parameters its chains reach."""

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]]

    def gradients(self) -> list[torch.Tensor]:
        """The gradients kept for W (counted with the activations W keeps)."""
        return [g for _, grads, _ in self.groups for g in grads]


Probe = Callable[[Iterable[Node]], bool]
"""Reads every saved value of the given nodes while the stash records which it hands
out; False when some node's saved values cannot be read."""


def split_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    probe: Probe | None,
) -> tuple[list[torch.Tensor | None], WeightWork | None]:
    """B: the gradients of `inputs`, and what W needs (see the module docstring); None
    for the latter when the graph is not split, and then the whole graph is kept for a
    plain `backward(outputs, grads, inputs=params)`."""
    work = None if probe is None else _weight_ops(outputs, params)
    ops, reach = ([], {}) if work is None else work
    later = [op for op in ops if not _cheap(reach[op][0])]
    if work is not None:
        assert probe is not None
        if not probe([*later, *{node for op in later for node in reach[op][1]}]):
            work = None
    if work is None:  # not split: the input gradients alone, the whole graph kept for W
        if not inputs:
            return [], None
        alone = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
        return list(alone), None
    # One pass: the input gradients, the gradients into the weight ops W runs later,
    # and the cheap weight ops' own parameter gradients (they are on B's way anyway).
    edges = [GradientEdge(op, i) for op in later for i in range(len(op._input_metadata))]
    deferred = set(later)
    cheap = [p for op in ops if op not in deferred for p in reach[op][0]]
    wrt: list[Any] = [*inputs, *edges, *cheap]
    found: Sequence[torch.Tensor | None] = ()
    if wrt:
        found = torch.autograd.grad(outputs, wrt, grads, retain_graph=True, allow_unused=True)
    _accumulate(cheap, found[len(inputs) + len(edges) :])
    groups = []
    at = len(inputs)
    for op in later:
        count = len(op._input_metadata)
        given = found[at : at + count]
        at += count
        kept = [(GradientEdge(op, i), g) for i, g in enumerate(given) if g is not None]
        if kept:
            groups.append(([e for e, _ in kept], [g for _, g in kept], reach[op][0]))
    return list(found[: len(inputs)]), WeightWork(groups)


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add `grads` into the parameters' `.grad` through their gradient accumulators, as
    `backward` does (so hooks on them run: `--mixed-precision` moves them to fp32)."""
    pairs = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    if pairs:
        leaves = [p for p, _ in pairs]
        torch.autograd.backward(leaves, [g for _, g in pairs], inputs=leaves)


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
    `.grad` by their gradient accumulators, as one `backward` adds them."""
    for edges, grads, params in work.groups:
        torch.autograd.backward(edges, grads, inputs=params)


def _weight_ops(
    outputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[list[Node], dict[Node, tuple[list[torch.Tensor], list[Node]]]] | None:
    """The weight ops of the graph below `outputs`, each with the parameters and the
    chain nodes below it (none when no parameter is reached); None when an output is
    itself a chain to a parameter (all the backward is W's) or a parameter is used
    twice (no one op owns it)."""
    accumulators: dict[Node, torch.Tensor] = {}
    for param in params:
        if param.requires_grad:
            accumulators[_accumulator(param)] = param
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    parents: dict[Node, set[Node]] = {}
    order: dict[Node, None] = {}  # every node, in the order found
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in order:
            continue
        order[node] = None
        for below, _ in node.next_functions:
            if below is not None:
                parents.setdefault(below, set()).add(node)
                stack.append(below)
    chain: dict[Node, torch.Tensor | None] = {}

    def param_of(node: Node) -> torch.Tensor | None:
        """The parameter `node` is a chain to (a line of nodes no other node joins),
        or None."""
        if node not in chain:
            if node in accumulators:
                chain[node] = accumulators[node]
            else:
                below = [n for n, _ in node.next_functions if n is not None]
                alone = len(below) == 1 and len(parents[below[0]]) == 1
                chain[node] = param_of(below[0]) if alone else None
        return chain[node]

    if any(param_of(root) is not None for root in roots):
        return None
    ops: list[Node] = []
    reach: dict[Node, tuple[list[torch.Tensor], list[Node]]] = {}
    for node in order:
        if param_of(node) is not None:
            if len(parents[node]) > 1 and node not in accumulators:
                ops.append(node)  # a chain that several nodes use: W starts at its top
                reach[node] = ([chain[node]], _chain_nodes(node, accumulators))  # type: ignore[list-item]
            continue
        mine: list[torch.Tensor] = []
        nodes: list[Node] = []
        for below, _ in node.next_functions:
            owner = None if below is None else param_of(below)
            if below is not None and owner is not None and len(parents[below]) == 1:
                mine.append(owner)
                nodes.extend(_chain_nodes(below, accumulators))
        if mine:
            ops.append(node)
            reach[node] = (mine, nodes)
    owners = [id(p) for op in ops for p in reach[op][0]]
    reached = {id(accumulators[node]) for node in order if node in accumulators}
    if len(owners) != len(set(owners)) or set(owners) != reached:
        return None  # a parameter used twice (tied weights): no op owns it alone
    return ops, reach


def _chain_nodes(node: Node, accumulators: dict[Node, torch.Tensor]) -> list[Node]:
    """The nodes of a chain, from `node` down to its parameter's accumulator (excluded)."""
    nodes = []
    while node not in accumulators:
        nodes.append(node)
        node = next(n for n, _ in node.next_functions if n is not None)
    return nodes


def _accumulator(param: torch.Tensor) -> Node:
    """The gradient accumulator of a leaf (made on first use, through a view)."""
    node = param.view_as(param).grad_fn
    assert node is not None
    accumulator = node.next_functions[0][0]
    assert accumulator is not None
    return accumulator
