"""The simulator against closed forms and the papers' numbers (DESIGN.md section 4)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from pipelang.diagnostics import PipelangError
from pipelang.grid import op_labeler
from pipelang.ir import Action, CostModel
from pipelang.passes.insert_sync import insert_sync
from tests.helpers import (
    chimera_4,
    costs,
    gpipe,
    interleaved,
    one_f_one_b,
    program_from_dump,
    replay,
    with_comms,
)

SIZES = [(1, 1), (2, 1), (2, 5), (3, 3), (4, 4), (4, 8), (5, 2), (8, 16)]
COSTS = [(1, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize(("d", "n"), SIZES)
@pytest.mark.parametrize(("f", "b"), COSTS)
@pytest.mark.parametrize("schedule", [one_f_one_b, gpipe])
def test_1f1b_and_gpipe_closed_forms(schedule: object, d: int, n: int, f: int, b: int) -> None:
    timeline = replay(program_from_dump(schedule(d, n)), costs(F=f, B=b))  # type: ignore[operator]
    assert timeline.makespan == (n + d - 1) * (f + b)
    expected = Fraction(d - 1, n + d - 1)
    assert abs(timeline.bubble_ratio - float(expected)) < 1e-12
    for r in range(d):
        assert timeline.busy(r) == n * (f + b)
        assert timeline.idle(r) == (d - 1) * (f + b)


@pytest.mark.parametrize(("d", "n"), SIZES)
def test_peak_activations(d: int, n: int) -> None:
    one = replay(program_from_dump(one_f_one_b(d, n)), costs())
    assert [one.peak_activations(r) for r in range(d)] == [min(d - r, n) for r in range(d)]
    pipe = replay(program_from_dump(gpipe(d, n)), costs())
    assert [pipe.peak_activations(r) for r in range(d)] == [n] * d


def test_1f1b_d4_n8_design_numbers() -> None:
    timeline = replay(program_from_dump(one_f_one_b(4, 8)), costs(F=1, B=2))
    assert timeline.makespan == 33
    assert timeline.bubble_ratio == pytest.approx(3 / 11)
    assert timeline.metrics()["bubble_ratio"] == 0.272727


def test_chimera_d4_n4_equal_costs() -> None:
    timeline = replay(chimera_4(), costs(F=1, B=1))
    assert timeline.makespan == 10  # 2N + D - 2
    assert timeline.bubble_ratio == pytest.approx(2 / 10)  # (D-2)/(2N+D-2)


def test_chimera_d4_n4_backward_twice_forward() -> None:
    timeline = replay(chimera_4(), costs(F=1, B=2))
    assert timeline.makespan == 16  # N*F + (N+D-2)*B
    assert json.dumps(timeline.metrics()) == json.dumps(
        {
            "schedule": "chimera",
            "params": {"D": 4, "N": 4},
            "makespan": 16,
            "bubble_ratio": 0.25,
            "ranks": [
                {
                    "rank": r,
                    "busy": 12,
                    "idle": 4,
                    "peak_activations": p,
                    "weight_copies": 2,
                    "peak_weight_versions": 2,
                    "weight_delay": 0,
                }
                for r, p in enumerate([3, 4, 4, 3])
            ],
        }
    )


def test_chimera_grid_matches_the_paper_table() -> None:
    # papers.md section 1.1, D = 4, N = 4, equal-cost slots.
    assert replay(chimera_4(), costs(F=1, B=1)).text_grid() == (
        "rank 0 | F0d F1d .   F2u B2u F3u B3u B0d .   B1d\n"
        "rank 1 | .   F0d F2u F1d F3u B2u B0d B3u B1d .\n"
        "rank 2 | .   F2u F0d F3u F1d B0d B2u B1d B3u .\n"
        "rank 3 | F2u F3u .   F0d B0d F1d B1d B2u .   B3u"
    )


GRID_1F1B_D4_N4 = """\
rank 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 -  .  B1 -  .  B2 -  .  B3 -
rank 1 | .  F0 F1 F2 .  .  .  .  B0 -  F3 B1 -  .  B2 -  .  B3 -  .  .
rank 2 | .  .  F0 F1 .  .  B0 -  F2 B1 -  F3 B2 -  .  B3 -  .  .  .  .
rank 3 | .  .  .  F0 B0 -  F1 B1 -  F2 B2 -  F3 B3 -  .  .  .  .  .  ."""


def test_text_grid_1f1b_d4_n4_golden() -> None:
    timeline = replay(program_from_dump(one_f_one_b(4, 4)), costs(F=1, B=2))
    assert timeline.text_grid() == GRID_1F1B_D4_N4


def test_text_grid_width_limit_and_stage_labels() -> None:
    program = program_from_dump(interleaved(2, 2, 2), pipelines={"main": (0, 1, 0, 1)})
    grid = replay(program, costs()).text_grid(width_limit=30)
    lines = grid.splitlines()
    assert lines[0].startswith("rank 0 | F0.s0 F1.s0 F0.s2")
    assert all(len(line) <= 30 for line in lines)
    assert lines[0].endswith("...")


def test_transfer_cost_on_cross_rank_edges_only() -> None:
    program = program_from_dump(one_f_one_b(2, 1))
    # F0 | C | F0 B0 | C | B0: two transfers.
    assert replay(program, costs(F=1, B=1, C=0.5)).makespan == 5
    # All on one rank: no transfer at all.
    local = program_from_dump(
        ["F0@0/main F0@1/main B0@1/main B0@0/main"], pipelines={"main": (0, 0)}
    )
    assert replay(local, costs(F=1, B=1, C=0.5)).makespan == 4


def test_a_link_cost_times_both_directions_of_its_boundary_only() -> None:
    """`C[b]` is the link between stages b and b + 1: the activation that crosses it going
    down and the gradient coming back take it; the other boundaries take `C`."""
    program = program_from_dump(one_f_one_b(3, 1))
    model = costs(F=1, B=1, C=0.5).merged(CostModel((("C", 1, 4.0),)))
    timeline = replay(program, model)
    starts = {e.action.text(): e.start for e in timeline.events}
    # F0@0 | 0.5 | F0@1 | 4 | F0@2 B0@2 | 4 | B0@1 | 0.5 | B0@0
    assert [starts[f"F0@{s}/main"] for s in range(3)] == [0, 1.5, 6.5]
    assert [starts[f"B0@{s}/main"] for s in range(3)] == [14, 12.5, 7.5]
    assert timeline.makespan == 15


def test_each_result_crosses_the_boundary_deps_names() -> None:
    """A forward's output crosses its stage's boundary, a backward's its stage's input
    boundary, and the frozen part's output (stage 0's input) no stage boundary: it takes
    `C`, never `C[0]` (the link between stages 0 and 1)."""
    model = costs(C=0.5).merged(CostModel((("C", 0, 4.0), ("C", 1, 2.0))))
    assert model.transfer(Action.parse("F0@0/main")) == 4
    assert model.transfer(Action.parse("R0@1/main")) == 2
    assert model.transfer(Action.parse("B0@1/main")) == 4
    assert model.transfer(Action.parse("B0@2/main")) == 2
    assert model.transfer(Action.parse("P0@0/main")) == 0.5


def test_per_stage_costs() -> None:
    program = program_from_dump(gpipe(2, 1))
    model = costs(F=1, B=1).merged(CostModel((("F", 1, 3.0),)))
    timeline = replay(program, model)
    assert [(e.action.text(), e.start, e.end) for e in timeline.events] == [
        ("F0@0/main", 0, 1),
        ("B0@0/main", 5, 6),
        ("F0@1/main", 1, 4),
        ("B0@1/main", 4, 5),
    ]


def test_comm_and_sync_actions_are_not_replayed() -> None:
    program = chimera_4()
    compiled = insert_sync(with_comms(program))
    plain, full = replay(program, costs(F=1, B=2)), replay(compiled, costs(F=1, B=2))
    assert full.makespan == plain.makespan == 16
    assert full.metrics()["ranks"] == plain.metrics()["ranks"]


def test_metrics_numbers_are_json_friendly() -> None:
    metrics = replay(program_from_dump(one_f_one_b(2, 2)), costs(F=1, B=1.5)).metrics()
    assert metrics["makespan"] == 7.5
    assert isinstance(replay(chimera_4(), costs()).metrics()["makespan"], int)


def test_deadlocked_program_cannot_be_simulated() -> None:
    program = program_from_dump(
        ["F0@0/main B0@0/main F1@0/main B1@0/main", "F1@1/main F0@1/main B0@1/main B1@1/main"]
    )
    with pytest.raises(PipelangError) as error:
        replay(program, costs())
    assert [d.code for d in error.value.diagnostics] == ["E0306"]


def test_empty_timeline() -> None:
    timeline = replay(program_from_dump(["", ""]), costs())
    assert (timeline.makespan, timeline.bubble_ratio) == (0, 0.0)
    assert timeline.text_grid() == "rank 0 |\nrank 1 |"


def test_grid_labels_tell_pipeline_families_apart() -> None:
    program = program_from_dump(
        ["F0@0/down0 F1@0/down1", "F0@1/down0 F1@1/down1"],
        pipelines={"down0": (0, 1), "down1": (1, 0)},
        assignment=("down0", "down1"),
    )
    label = op_labeler(program)
    assert [label(0, a) for a in program.ranks[0]] == ["F0d0", "F1d1"]
    assert label(0, Action.parse("send:F0@0/down0>1")) == "send:F0@0/down0>1"
    assert op_labeler(chimera_4())(0, Action.parse("B2@3/up")) == "B2u"
