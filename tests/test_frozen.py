"""Frozen work (DiffusionPipe): `frozen on ranks ...`, the op kind `P`, the stdlib
`diffusionpipe` schedule, and the runtime's frozen layers.

Oracles: with the frozen part up front, shared by h ranks, the makespan is
ceil(N/h)·P + (N+D-1)(F+B) (the frozen forwards in ceil(N/h) rounds, then 1F1B, whose
makespan the 1f1b tests check against GPipe's paper formula); no placement of P beats
1F1B alone; every micro-batch's P ends before its stage-0 forward starts; a run with
`--check` equals one process training the model with its first layers frozen
(`requires_grad=False`, torch's own way to freeze).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipelang import api
from pipelang.ir import Kind, Program
from pipelang.sim.timeline import Timeline
from tests.helpers import at, errors, run, stdlib, timeline

GREEDY = """\
schedule t(D: int = 4, N: int = 8, h: int = 2) {{
    cost F = 1, B = 2, P = {p}
    frozen on ranks 0..h
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order greedy {{ prefer B, F  priority mb  cap D - rank }}
}}
"""


def diffusionpipe(p: float, **params: int | bool) -> Timeline:
    """The stdlib schedule with `cost F = 1, B = 2, P = p` (its greedy order chosen with
    those costs)."""
    head, brace, body = api.find_schedule("diffusionpipe")[0].read_text().partition("{\n")
    return timeline(f"{head}{brace}    cost F = 1, B = 2, P = {p}\n{body}", **params)


# ---- the language ----------------------------------------------------------------------------


def source(decl: str, order: str) -> str:
    return f"""\
schedule t(D: int = 2, N: int = 2) {{
    {decl}
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {{
        {order}
    }}
}}
"""


GPIPE = "for i in 0..N { F(i) } for i in 0..N { B(i) }"


@pytest.mark.parametrize(
    ("decl", "order", "code", "where"),
    [
        ("frozen on rank 0", f"if r == 1 {{ P(0) P(1) }} {GPIPE}", "E0317", "P(0)"),
        (
            "frozen on rank 0",
            "if r == 0 { F(0) P(0) P(1) F(1) B(0) B(1) } else { " + GPIPE + " }",
            "E0318",
            "F(0)",
        ),
        ("frozen on ranks 0..3", GPIPE, "E0210", "0..3"),
        ("frozen on ranks 1..1", GPIPE, "E0210", "frozen on ranks 1..1"),
        ("frozen on rank 0 weights stash", GPIPE, "E0210", "frozen on rank 0"),
        ("", f"if r == 0 {{ P(0) P(1) }} {GPIPE}", "E0309", "P(0)"),
        ("ops F, B, P", GPIPE, "E0309", "ops F, B, P"),
        ("frozen on rank 0", f"if r == 0 {{ P(0) & F(0) }} {GPIPE}", "E0103", "P(0)"),
        ("frozen on rank 0", f"if r == 0 {{ P(0, 1) P(1) }} {GPIPE}", "E0103", "P(0, 1)"),
        ("frozen on rank 0", f"if r == 0 {{ P(0) P(5) }} {GPIPE}", "E0103", "P(5)"),
        ("frozen on rank 0", f"if r == 0 {{ P(0) }} {GPIPE}", "E0303", "order rank r {"),
        ("frozen on ranks 0..2", f"P(0) if r == 0 {{ P(1) }} {GPIPE}", "E0302", "P(0)"),
    ],
)
def test_bad_frozen_work_is_an_error_at_its_source(
    decl: str, order: str, code: str, where: str
) -> None:
    text = source(decl, order)
    found = errors(text)
    assert found[0].code == code, found[0].render() if hasattr(found[0], "render") else found
    assert at(text, found[0]).startswith(where)


@pytest.mark.parametrize(
    ("clause", "code", "where", "says"),
    [
        ("frozen last", "E0001", "last", "`fill`, `first` or `best`"),
        ("frozen fill  frozen best", "E0207", "frozen best", "given twice"),
    ],
)
def test_bad_frozen_clause_is_an_error_at_its_source(
    clause: str, code: str, where: str, says: str
) -> None:
    text = GREEDY.format(p=1).replace("cap D - rank", f"cap D - rank  {clause}")
    found = errors(text)
    assert found[0].code == code and at(text, found[0]).startswith(where)
    assert says in found[0].render()


def test_frozen_work_needs_rank_or_greedy_orders() -> None:
    repeat = """\
schedule t(D: int = 2, N: int = 2) {
    frozen on ranks 0..D
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order repeat k { F(stage=0) @ 0  F(stage=1) @ 1  B(stage=1) @ 2  B(stage=0) @ 3 }
}
"""
    found = errors(repeat)
    assert found[0].code == "E0210" and at(repeat, found[0]).startswith("order repeat")


def test_every_micro_batch_runs_one_p_on_a_holder_before_its_first_forward() -> None:
    program = stdlib("diffusionpipe", D=4, N=8, h=2)
    assert program.frozen == (0, 1)
    placed = {
        a.mb: rank for rank, acts in enumerate(program.ranks) for a in acts if a.kind is Kind.P
    }
    assert sorted(placed) == list(range(8)) and set(placed.values()) <= {0, 1}
    sends = [a for acts in program.ranks for a in acts if a.kind is Kind.SEND and a.of is Kind.P]
    # every P made off rank 0 is sent to rank 0, which runs stage 0
    assert sorted(a.mb for a in sends) == sorted(m for m, r in placed.items() if r != 0)
    assert {a.peer for a in sends} == {0}


def test_program_json_keeps_the_frozen_ranks() -> None:
    program = stdlib("diffusionpipe", D=3, N=4, h=2)
    back = Program.from_json(program.to_json())
    assert back.frozen == (0, 1) and back.ranks == program.ranks


# ---- the simulator ---------------------------------------------------------------------------


@pytest.mark.parametrize(("D", "N"), [(2, 4), (4, 8), (4, 5), (6, 12)])
@pytest.mark.parametrize("p", [0.25, 1.0, 3.0])
@pytest.mark.parametrize("share", ["all", "one", "half"])
def test_up_front_costs_the_rounds_of_p_then_1f1b(D: int, N: int, p: float, share: str) -> None:
    h = {"all": D, "one": 1, "half": max(1, D // 2)}[share]
    t = diffusionpipe(p, D=D, N=N, h=h, upfront=True)
    assert t.makespan == pytest.approx(math.ceil(N / h) * p + (N + D - 1) * 3)


@pytest.mark.parametrize(("D", "N", "h"), [(2, 4, 2), (4, 8, 4), (4, 8, 1), (8, 16, 8), (4, 3, 2)])
@pytest.mark.parametrize("p", [0.25, 1.0, 4.0])
def test_in_bubbles_every_p_ends_before_its_forward(D: int, N: int, h: int, p: float) -> None:
    t = diffusionpipe(p, D=D, N=N, h=h)
    ends = {e.action.mb: e.end for e in t.events if e.action.kind is Kind.P}
    starts = {
        e.action.mb: e.start for e in t.events if e.action.kind is Kind.F and e.action.stage == 0
    }
    assert all(ends[m] <= starts[m] for m in range(N))
    assert {e.rank for e in t.events if e.action.kind is Kind.P} <= set(range(h))
    assert t.makespan >= (N + D - 1) * 3  # 1F1B alone is the bound


@pytest.mark.parametrize(("D", "N", "h"), [(4, 8, 4), (4, 8, 1), (8, 16, 8), (8, 16, 1)])
def test_short_frozen_work_hides_in_the_bubbles(D: int, N: int, h: int) -> None:
    """With a frozen forward of a quarter stage-forward, the bubbles take it all but the
    first micro-batch's: within one P of 1F1B alone, and ahead of running it up front."""
    bubbles, upfront = (
        diffusionpipe(0.25, D=D, N=N, h=h),
        diffusionpipe(0.25, D=D, N=N, h=h, upfront=True),
    )
    assert bubbles.makespan == pytest.approx((N + D - 1) * 3 + 0.25)
    assert bubbles.makespan < upfront.makespan


@pytest.mark.parametrize(("D", "N", "h"), [(2, 4, 1), (4, 8, 2), (8, 8, 4), (8, 16, 8), (6, 5, 3)])
@pytest.mark.parametrize("p", [0.25, 1.0, 2.0, 4.0])
def test_the_stdlib_order_never_loses_to_up_front(D: int, N: int, h: int, p: float) -> None:
    """`frozen best` (the default) keeps the faster of filling bubbles and running the
    frozen part first. At D = 8, N = 8, h = 4, P = 4 filling alone takes 55 and up
    front 53: a holder that starts a long P in a short bubble delays the forward that
    arrives meanwhile."""
    best = diffusionpipe(p, D=D, N=N, h=h).makespan
    upfront = diffusionpipe(p, D=D, N=N, h=h, upfront=True).makespan
    fill = timeline(FILL.format(p=p), D=D, N=N, h=h).makespan
    assert best <= upfront + 1e-9
    assert best == pytest.approx(min(fill, upfront))


FILL = GREEDY.replace("cap D - rank", "cap D - rank  frozen fill")


def test_frozen_fill_and_first_are_the_two_policies() -> None:
    fill = timeline(FILL.format(p=4), D=8, N=8, h=4)
    first = timeline(FILL.replace("fill", "first").format(p=4), D=8, N=8, h=4)
    assert (fill.makespan, first.makespan) == (55, 53)
    p_end = max(e.end for e in first.events if e.action.kind is Kind.P)
    assert min(e.start for e in first.events if e.action.kind is Kind.F) >= p_end


def test_greedy_pool_hands_p_to_the_idle_holders_first() -> None:
    """D=4, h=2, P=1: rank 0 starts with P0 and rank 1 with P1 (both idle at 0), and the
    ranks that do not hold the frozen part never run a P."""
    t = timeline(GREEDY.format(p=1))
    first = {e.rank: e.action for e in t.events if e.start == 0}
    assert (first[0].kind, first[0].mb) == (Kind.P, 0)
    assert (first[1].kind, first[1].mb) == (Kind.P, 1)
    assert 2 not in first and 3 not in first


# ---- the runtime -----------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "params", "options"),
    [
        ("local", dict(D=2, N=4), ()),
        ("local", dict(D=3, N=4, h=1), ("--frozen-layers", "2")),
        ("gloo", dict(D=2, N=4, h=1), ()),
        ("local", dict(D=2, N=3), ("--graphs",)),
    ],
)
def test_check_equals_training_with_frozen_layers(
    backend: str,
    params: dict[str, int],
    options: tuple[str, ...],
    capsys: pytest.CaptureFixture[str],
) -> None:
    program = stdlib("diffusionpipe", **params)
    status = run(program, "--backend", backend, "--steps", "2", "--check", *options)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out and "(bitwise equal)" in out


def test_frozen_layers_are_left_out_of_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt:tiny has 8 layers; with 3 frozen, two stages hold layers 3..5 and 6..7, so the
    report names layer 3 as stage 0's first and no stage holds layers 0..2."""
    from pipelang.backends.models import ModelSpec, plan_stages

    spec = ModelSpec("gpt:tiny", frozen_layers=3)
    plan = plan_stages(spec, 2, None)
    assert plan.bounds == [range(3, 6), range(6, 8)]
    assert -1 in plan.shapes and plan.shapes[-1] == plan.shapes[0]
    model = spec.build()
    assert not any(p.requires_grad for layer in model.layers[:3] for p in layer.parameters())
    assert all(p.requires_grad for layer in model.layers[3:] for p in layer.parameters())


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("1f1b", ("--frozen-layers", "1"), "has no frozen part"),
        ("diffusionpipe", ("--frozen-layers", "7"), "needs at least one"),
    ],
)
def test_frozen_layers_that_cannot_be_are_refused(
    name: str, options: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = run(stdlib(name, D=2, N=2), "--backend", "local", "--steps", "1", *options)
    err = capsys.readouterr().err
    assert status == 1 and message in err, err


BIDIRECTIONAL = """\
schedule bidir(D: int = 4, N: int = 4) {
    frozen on ranks 0..D
    cost F = 1, B = 2, P = 1
    pipeline down: stage s in 0..D -> rank s
    pipeline up: stage s in 0..D -> rank D - 1 - s
    microbatches i in 0..N // 2 -> down, i in N // 2..N -> up
    order greedy { prefer B, F  priority mb }
}
"""


@pytest.mark.slow
def test_two_directions_each_feed_their_own_stage_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Chimera-style replicas: `up`'s frozen outputs go to rank D-1 (its stage 0), and
    the replicated stages' gradients are still summed: --check over gloo."""
    path = tmp_path / "bidir.pipe"
    path.write_text(BIDIRECTIONAL)
    program = api.load_program(str(path))
    sends = {
        (a.pipeline, a.peer)
        for acts in program.ranks
        for a in acts
        if a.kind is Kind.SEND and a.of is Kind.P
    }
    assert {peer for pipe, peer in sends if pipe == "up"} <= {3}
    assert {peer for pipe, peer in sends if pipe == "down"} <= {0}
    status = run(program, "--backend", "gloo", "--steps", "2", "--check")
    out = capsys.readouterr().out
    assert status == 0 and "check OK" in out, out
