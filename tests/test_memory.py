"""`pipelang.sim.memory`: the one count of held activations, against hand counts and the
papers' peaks."""

from __future__ import annotations

import pytest

from pipelang.api import load_program
from pipelang.ir import Action, Kind
from pipelang.sim import memory


def ops(text: str) -> list[Action]:
    """`F0 F1 B0 W0 R1` on stage 0 of pipeline main."""
    return [Action(Kind(t[0]), int(t[1:]), 0, "main") for t in text.split()]


def test_held_counts_forwards_until_the_op_that_frees_them() -> None:
    order = ops("F0 F1 B0 F2 W0 B1 W1 B2 W2")
    assert list(memory.held(order)) == [1, 2, 1, 2, 2, 1, 1, 0, 0]
    whole = list(memory.held(order, lambda stage: 1.0))  # W reads all: held until W,
    assert whole == [1, 2, 2, 3, 2, 1, 1, 0, 0]  # but B1 W1, B2 W2 run whole at B
    assert memory.peak(order) == 2 and memory.peak(order, lambda stage: 1.0) == 3
    assert memory.holding(order[:4]) == [order[1], order[3]]
    assert memory.holding(order[:4], lambda stage: 1.0) == [order[0], order[1], order[3]]


def test_the_w_share_is_held_from_b_to_w() -> None:
    """B frees all but W's share (`MW`), W frees that: the zero-bubble paper's deltas
    (F +M_B, B M_W - M_B, W -M_W), and its ZB-H1 worker holds p - i + 1 + (i - 1) MW."""
    order = ops("F0 F1 B0 B1 W0 W1")
    assert list(memory.held(order, lambda stage: 0.4)) == pytest.approx([1, 2, 1.4, 0.8, 0.4, 0])
    # a W right after its B: the runtime runs one whole backward, B frees everything
    assert list(memory.held(ops("F0 F1 B0 W0 B1 W1"), lambda stage: 0.4)) == [1, 2, 1, 1, 0, 0]
    program = load_program("zb-h1", {"D": "4", "N": "8"})
    for mw in (0.0, 0.43, 1.0):
        peaks = [memory.peak(actions, lambda stage, mw=mw: mw) for actions in program.ranks]
        assert peaks == pytest.approx([4 - i + i * mw for i in range(4)])


def test_an_eviction_hands_a_forward_over_and_its_load_brings_it_back() -> None:
    order = ops("F0 E0 F1 L0 B0 B1")
    assert list(memory.held(order)) == [1, 0, 1, 2, 1, 0]


def test_peak_bytes_with_recomputation_keeps_the_input_then_the_activations() -> None:
    # kept (the stage input) 1 byte from F; recomputed 10 bytes from R; both to B
    order = ops("F0 F1 R0 B0 R1 B1")
    assert memory.peak_bytes(order, None, [1.0], [10.0]) == 12.0
    assert memory.peak_bytes(order, None, [10.0]) == 20.0


@pytest.mark.parametrize(("name", "d", "n"), [("1f1b", 4, 8), ("gpipe", 4, 8)])
def test_peak_is_the_papers_in_flight_count(name: str, d: int, n: int) -> None:
    """1F1B holds D - r forwards on rank r; GPipe all N (papers.md)."""
    program = load_program(name, {"D": str(d), "N": str(n)})
    peaks = [memory.peak(actions) for actions in program.ranks]
    assert peaks == ([d - r for r in range(d)] if name == "1f1b" else [n] * d)
