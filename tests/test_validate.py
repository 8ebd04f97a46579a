"""validate: each kind of mistake in an order, alone and all at once; and E0307, the
check of a lowered program's channels."""

from __future__ import annotations

import dataclasses

import pytest

from pipelang.diagnostics import Diagnostic, PipelangError
from pipelang.grid import step_grid
from pipelang.ir import Program
from pipelang.ir.graph import op_graph
from pipelang.passes.insert_sync import _deadlocks, insert_sync
from pipelang.passes.validate import validate
from pipelang.passes.validate.lowered import check_lowered
from tests.helpers import chimera_4, gpipe, interleaved, one_f_one_b, program_from_dump, with_comms


def check(program: Program, max_activations: int | None = None) -> list[Diagnostic]:
    return validate(program, op_graph(program), max_activations)


def where(diagnostic: Diagnostic) -> tuple[int, int] | None:
    span = diagnostic.span
    return None if span is None else (span.line, span.column)


VALID = {
    "1f1b D=4 N=8": program_from_dump(one_f_one_b(4, 8)),
    "gpipe D=4 N=8": program_from_dump(gpipe(4, 8)),
    "chimera D=4 N=4": chimera_4(),
    "interleaved D=4 N=8 v=2": program_from_dump(
        interleaved(4, 8, 2), pipelines={"main": [s % 4 for s in range(8)]}
    ),
}


@pytest.mark.parametrize("program", VALID.values(), ids=VALID.keys())
def test_known_schedules_are_valid(program: Program) -> None:
    assert check(program) == []


# ---- E0306 deadlock ------------------------------------------------------------------------

DEADLOCK = [
    "F0@0/main B0@0/main F1@0/main B1@0/main",
    "F1@1/main F0@1/main B0@1/main B1@1/main",
]

DEADLOCK_RENDERED = """\
error[E0306]: the schedule deadlocks: 5 ops wait on each other in a cycle
 --> <dump>:1:11
  |
1 | F0@0/main B0@0/main F1@0/main B1@0/main
  |           ^^^^^^^^^
 ::: <dump>:1:21
  |
1 | F0@0/main B0@0/main F1@0/main B1@0/main
  |                     --------- `F1@0/main` on rank 0 waits for `B0@0/main`
 ::: <dump>:2:1
  |
2 | F1@1/main F0@1/main B0@1/main B1@1/main
  | --------- `F1@1/main` on rank 1 waits for `F1@0/main`
 ::: <dump>:2:11
  |
2 | F1@1/main F0@1/main B0@1/main B1@1/main
  |           --------- `F0@1/main` on rank 1 waits for `F1@1/main`
 ::: <dump>:2:21
  |
2 | F1@1/main F0@1/main B0@1/main B1@1/main
  |                     --------- `B0@1/main` on rank 1 waits for `F0@1/main`
  |
  = note: each op waits for the one before it:
      B0@0/main  (rank 0, step 1)
      -> F1@0/main  (rank 0, step 2; listed after)
      -> F1@1/main  (rank 1, step 0; needs its result)
      -> F0@1/main  (rank 1, step 1; listed after)
      -> B0@1/main  (rank 1, step 2; needs its result)
      -> B0@0/main  (rank 0, step 1; needs its result)
  = note: rank x step grid, the cycle in [brackets]:
    step   |  0    1    2    3
    rank 0 |  F0  [B0] [F1]  B1
    rank 1 | [F1] [F0] [B0]  B1
  = help: reorder a rank so that each op comes after what it waits for; only the waits \
marked `listed after` come from the order"""


def test_deadlock_is_one_diagnostic_with_the_cycle() -> None:
    found = check(program_from_dump(DEADLOCK))
    assert [d.code for d in found] == ["E0306"]
    assert found[0].render() == DEADLOCK_RENDERED


def test_deadlock_on_one_rank_holding_two_stages() -> None:
    program = program_from_dump(
        ["F0@1/main F0@0/main B0@1/main B0@0/main"], pipelines={"main": (0, 0)}
    )
    (found,) = check(program)
    assert found.code == "E0306"
    assert found.message == "the schedule deadlocks: 2 ops wait on each other in a cycle"
    assert "[F0.s1] [F0.s0]  B0.s1" in found.notes[1]


def test_deadlock_through_an_after_dependency() -> None:
    program = program_from_dump(one_f_one_b(2, 2), after=[("B1@1/main", "F1@0/main")])
    (found,) = check(program)
    assert found.code == "E0306"
    assert "an `after` dependency" in found.notes[0]


def test_step_grid_marks_ops_and_skips_steps() -> None:
    program = program_from_dump(one_f_one_b(2, 4))
    grid = step_grid(program, [1, 0], [0, 1, 5, 6], marked={(0, 1), (1, 6)})
    assert grid == (
        "step   |  0    1    ...  5    6\n"
        "rank 0 |  F0  [F1]  ...  F3   B2\n"
        "rank 1 |  F0   B0   ...  B2  [F3]"
    )


# ---- consuming in another order than sent is fine; E0307 is for lowered programs -----------

CROSSING = [
    "F0@0/main F1@0/main B0@0/main B1@0/main",
    "F1@1/main F0@1/main B0@1/main B1@1/main",  # needs F1 first, but rank 0 sends F0 first
]

# `recv:F0@0/main<0` is hoisted from before F0@1 to before F1@1, ahead of F1's own recv.
CROSSING_LOWERED = """\
rank 0: F0@0/main send:F0@0/main>1 F1@0/main send:F1@0/main>1 recv:B0@1/main<1 B0@0/main \
recv:B1@1/main<1 B1@0/main
rank 1: recv:F0@0/main<0 recv:F1@0/main<0 F1@1/main F0@1/main B0@1/main send:B0@1/main>0 \
B1@1/main send:B1@1/main>0"""


def test_consuming_out_of_send_order_compiles_with_the_recv_hoisted() -> None:
    program = program_from_dump(CROSSING)
    assert check(program) == []
    lowered = with_comms(program)
    assert lowered.dump() == CROSSING_LOWERED
    assert check_lowered(lowered) == []
    assert not _deadlocks(insert_sync(lowered).ranks)


OUT_OF_ORDER = [
    "F0@0/main send:F0@0/main>1 F1@0/main send:F1@0/main>1",
    "recv:F1@0/main<0 recv:F0@0/main<0 F1@1/main F0@1/main",
]


def test_lowered_program_received_out_of_channel_order() -> None:
    (found,) = check_lowered(program_from_dump(OUT_OF_ORDER))
    assert found.code == "E0307"
    assert found.message == (
        "transfers from rank 0 to rank 1 do not match: rank 0 sends `send:F0@0/main>1` "
        "(step 1) where rank 1 receives `recv:F1@0/main<0` (step 0)"
    )
    assert where(found) == (2, 1)
    assert [(lb.span.line, lb.span.column, lb.message) for lb in found.labels] == [
        (1, 11, "sent here")
    ]
    assert found.help == (
        "on rank 1, receive what rank 0 sends in the order it sends it: `recv:F0@0/main<0` here"
    )


def test_lowered_program_from_json_unmatched_and_wrong_kind() -> None:
    program = program_from_dump(
        [
            "F0@0/main send:F0@0/main>1 F1@0/main signal:F1@0/main>1 send:F1@0/main>2",
            "recv:F0@0/main<0 F0@1/main recv:F1@0/main<0 F1@1/main",
            "recv:F1@0/main<0 recv:F0@0/main<0",
        ],
        pipelines={"main": (0, 1, 2)},
    )
    found = check_lowered(Program.from_json(program.to_json()))
    assert [(d.code, d.span, d.message) for d in found] == [
        (
            "E0307",
            None,
            "transfers from rank 0 to rank 1 do not match: rank 0 sends `signal:F1@0/main>1` "
            "(step 3) where rank 1 receives `recv:F1@0/main<0` (step 2)",
        ),
        (
            "E0307",
            None,
            "transfers from rank 0 to rank 2 do not match: rank 2 lists `recv:F0@0/main<0` "
            "(step 1), but rank 0 never sends it",
        ),
    ]
    assert found[1].help == "add `send:F0@0/main>2` to rank 0, or remove `recv:F0@0/main<0`"


# ---- E0301..E0305, E0309: one at a time ----------------------------------------------------


def test_wrong_rank() -> None:
    program = program_from_dump(
        ["F0@0/main F0@1/main B0@0/main", "B0@1/main"]  # F0@1 belongs on rank 1
    )
    found = check(program)
    assert [d.code for d in found] == ["E0301"]
    assert found[0].message == (
        "`F0@1/main` is listed on rank 0, but pipeline `main` places stage 1 on rank 1"
    )
    assert where(found[0]) == (1, 11)


def test_not_an_op_of_the_schedule() -> None:
    program = program_from_dump(
        ["F0@0/down B0@0/down F1@0/down B1@0/down", "F0@1/down B0@1/down F1@1/up B1@1/down"],
        pipelines={"down": (0, 1), "up": (1, 0)},
        assignment=("down", "down"),
    )
    codes = [(d.code, d.message) for d in check(program)]
    assert (
        "E0301",
        "`F1@1/up` is not an op of this schedule: micro-batch 1 travels through pipeline `down`",
    ) in codes


def test_duplicate_labels_the_first_occurrence() -> None:
    program = program_from_dump(["F0@0/main B0@0/main B0@0/main", "F0@1/main B0@1/main"])
    (found,) = check(program)
    assert found.code == "E0302"
    assert found.message == "`B0@0/main` is listed twice: rank 0 step 1 and rank 0 step 2"
    assert where(found) == (1, 21)
    assert [(lb.span.column, lb.message) for lb in found.labels] == [(11, "first listed here")]


def test_missing_ops_collapse_per_rank() -> None:
    program = program_from_dump(
        ["F0@0/main F1@0/main F2@0/main F3@0/main B0@0/main", "F0@1/main B0@1/main"]
    )
    found = check(program)
    assert [(d.code, d.message) for d in found] == [
        ("E0303", "rank 0 never runs 3 required ops: `B1@0/main`, `B2@0/main`, `B3@0/main`"),
        (
            "E0303",
            "rank 1 never runs 6 required ops: `F1@1/main`, `B1@1/main`, `F2@1/main` and 3 more",
        ),
    ]
    assert all(where(d) == (1, 1) for d in found)  # the order's span


def test_missing_ops_without_an_order_span() -> None:
    program = dataclasses.replace(program_from_dump(["F0@0/main"]), order_span=None)
    (found,) = check(program)
    assert (found.code, found.span) == ("E0303", None)
    assert found.message == "rank 0 never runs `B0@0/main`"


def test_backward_before_forward_is_not_also_a_deadlock() -> None:
    program = program_from_dump(["F0@0/main B0@0/main", "B0@1/main F0@1/main"])
    (found,) = check(program)
    assert found.code == "E0304"
    assert found.message == "`B0@1/main` runs before its forward `F0@1/main` on rank 1"
    assert where(found) == (2, 1)
    assert found.labels[0].message == "the forward is listed here"


@pytest.mark.parametrize(
    ("rank0", "message"),
    [
        (
            "F0@0/main W0@0/main B0@0/main",
            "`W0@0/main` runs before its backward `B0@0/main` on rank 0",
        ),
        (
            "F0@0/main B0@0/main R0@0/main W0@0/main",
            "`R0@0/main` runs after the backward `B0@0/main` that needs it, on rank 0",
        ),
        (
            "R0@0/main F0@0/main B0@0/main W0@0/main",
            "`R0@0/main` runs before the forward `F0@0/main` it recomputes, on rank 0",
        ),
    ],
)
def test_split_backward_and_recompute_order(rank0: str, message: str) -> None:
    program = program_from_dump([rank0], kinds="FBWR" if "R" in rank0 else "FBW")
    found = [d for d in check(program) if d.code != "E0303"]  # R0 missing in the first case
    assert [(d.code, d.message) for d in found] == [("E0305", message)]


def test_undeclared_kind() -> None:
    program = program_from_dump(["F0@0/main B0@0/main W0@0/main"])
    (found,) = check(program)
    assert found.code == "E0309"
    assert found.message == ("`W0@0/main` uses op kind `W`, which the schedule does not declare")
    assert found.help == "declare it: `ops F, B, W`"


def test_ops_from_one_source_position_collapse() -> None:
    program = program_from_dump(one_f_one_b(2, 4))
    # As if one loop statement listed rank 1's forwards on rank 0 too.
    span = program.ranks[0][0].span
    extra = tuple(a._replace(span=span) for a in program.ranks[1] if a.kind.value == "F")
    program = dataclasses.replace(program, ranks=(program.ranks[0] + extra, program.ranks[1]))
    (found,) = [d for d in check(program) if d.code == "E0301"]
    assert found.message == (
        "4 ops are listed on the wrong rank: `F0@1/main`, `F1@1/main`, `F2@1/main` and 1 more"
    )
    assert found.notes[0].startswith("`F0@1/main` is listed on rank 0")


# ---- all at once ---------------------------------------------------------------------------


def test_every_problem_at_once_sorted_by_position() -> None:
    program = program_from_dump(
        [
            "F0@0/main F1@1/main B0@0/main B0@0/main",  # wrong rank, duplicate
            "B1@1/main F0@1/main F1@1/main B0@1/main",  # B before F
        ]
    )
    found = check(program)
    assert [(d.code, where(d)) for d in found] == [
        ("E0303", (1, 1)),  # F1@0 and B1@0 missing: at the order's span
        ("E0301", (1, 11)),
        ("E0302", (1, 31)),
        ("E0304", (2, 1)),
    ]
    text = PipelangError(found).render()
    assert text.index("E0301") < text.index("E0302") < text.index("E0304")


# ---- E0308 activations ---------------------------------------------------------------------


def test_activation_cap() -> None:
    found = check(program_from_dump(gpipe(2, 4)), max_activations=3)
    assert [(d.code, where(d)) for d in found] == [("E0308", (1, 31)), ("E0308", (2, 31))]
    assert found[0].message == (
        "rank 0 holds 4 activations after `F3@0/main`, more than the cap of 3"
    )


def test_activation_cap_met_by_1f1b() -> None:
    assert check(program_from_dump(one_f_one_b(2, 4)), max_activations=2) == []
    (found,) = check(program_from_dump(one_f_one_b(2, 4)), max_activations=1)
    assert found.message == "rank 0 holds 2 activations after `F1@0/main`, more than the cap of 1"


def test_long_cycle_is_summarised() -> None:
    stages = 30
    ops = [f"F0@{stages - 1}/main"] + [f"F0@{s}/main" for s in range(stages - 1)]
    ops += [f"B0@{s}/main" for s in reversed(range(stages))]
    (found,) = check(program_from_dump([" ".join(ops)], pipelines={"main": (0,) * stages}))
    assert found.message == "the schedule deadlocks: 30 ops wait on each other in a cycle"
    walk = found.notes[0].splitlines()
    assert walk[-2:] == [
        "  -> ... 7 more ops",
        "  -> F0@29/main  (rank 0, step 0; needs its result)",
    ]
    assert len(found.labels) == 8
    assert all(len(line) <= 100 for line in found.notes[1].splitlines())
