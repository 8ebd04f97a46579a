"""`order repeat ... squeeze` (pipelang/orders/squeeze.py) against the paper's numbers.

Oracles: Controllable Memory (Qi et al., arXiv 2405.15362) as summarised in
reference/dsl_and_schedules.md section 4 ("V schedules": per-stage span and peak with
F = B = W = 1, and an extra time that does not change with N) and reference/papers.md
section 5.2 (V-Half holds floor((D+2)/2) micro-batches); the plain (unsqueezed) order of
the same block for everything squeeze promises not to make worse.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelang import api, ast
from pipelang.compiler import Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.ir import CostModel, Kind, Program
from pipelang.parser import stdlib_dir
from pipelang.sim.timeline import Timeline
from tests.helpers import replay

UNIT = CostModel((("F", None, 1.0), ("B", None, 1.0), ("W", None, 1.0), ("C", None, 0.0)))
REPEAT = re.compile(r"(order repeat \w+(?: every [^{]+?)?) (squeeze )?\{")


def compiled(path: Path | str, **params: int) -> Program:
    """The schedule at `path` with `params`, through `validate`; its order expanded under
    the papers' unit costs (F = B = W = 1, free transfers), as it is simulated here."""
    options = Options({k: str(v) for k, v in params.items()}, costs=UNIT)
    return run_passes(api.load_file(str(path)), options, "validate").need_program()


def variant(tmp_path: Path, name: str, squeeze: bool, cost: str = "") -> Path:
    """A stdlib `order repeat` schedule with or without `squeeze`, and an extra `cost`
    line when given."""
    text = (stdlib_dir() / f"{name}.pipe").read_text()
    text, count = REPEAT.subn(r"\1 squeeze {" if squeeze else r"\1 {", text)
    assert count == 1
    if cost:
        text = text.replace("    microbatches", f"    cost {cost}\n    microbatches", 1)
    path = tmp_path / f"{name}-{'squeezed' if squeeze else 'plain'}.pipe"
    path.write_text(text)
    return path


def span(timeline: Timeline) -> float:
    """The longest per-rank span (first start to last end): the paper's measure, which
    leaves out the start skew that `makespan` includes."""
    spans = []
    for rank in range(timeline.program.num_ranks):
        events = [e for e in timeline.events if e.rank == rank]
        spans.append(max(e.end for e in events) - min(e.start for e in events))
    return max(spans)


def held_to_w(actions: tuple[object, ...]) -> int:
    """Peak activations counted from F to W (the authors' count; W reads the inputs)."""
    held = peak = 0
    for action in actions:
        kind = getattr(action, "kind", None)
        held += 1 if kind is Kind.F else -1 if kind is Kind.W else 0
        peak = max(peak, held)
    return peak


# ---- v-half against the paper ---------------------------------------------------------


@pytest.mark.parametrize(("D", "N", "paper_span"), [(4, 8, 53), (8, 16, 113)])
def test_v_half_matches_the_papers_span(D: int, N: int, paper_span: int) -> None:
    """Reference section 4, V schedules: with F = B = W = 1, V-Half's per-stage span is
    53 (D = 4, N = 8) and 113 (D = 8, N = 16), at peaks of 6 and 10 chunk activations.
    Without squeeze the same block takes 60 and 122."""
    timeline = replay(compiled("v-half", D=D, N=N), UNIT)
    assert span(timeline) == paper_span
    assert max(timeline.peak_activations(r) for r in range(D)) == D + 2 - D % 2


@pytest.mark.parametrize(("D", "extra"), [(4, 5), (8, 17)])
def test_v_half_extra_time_does_not_grow_with_n(D: int, extra: int) -> None:
    """Reference section 4: V-Half's time beyond the work (6N with unit costs: F, B and W
    of two chunks per micro-batch) is 5 at D = 4 and 17 at D = 8, whatever N."""
    for N in (2 * D, 4 * D, 8 * D):
        assert span(replay(compiled("v-half", D=D, N=N), UNIT)) - 6 * N == extra


@pytest.mark.parametrize("D", [4, 6, 8, 12, 16])
def test_v_half_peak_stays_half_of_1f1b(D: int) -> None:
    """Controllable Memory [P, project summary]: V-Half holds floor((D+2)/2) micro-batches
    of activations (two chunk activations each on a V), squeezed or not, at any N; and
    the count to W (the authors' own) is no higher."""
    for N in (D, 2 * D, 4 * D):
        prog = compiled("v-half", D=D, N=N)
        timeline = replay(prog, UNIT)
        peaks = [timeline.peak_activations(r) for r in range(D)]
        assert max((p + 1) // 2 for p in peaks) == (D + 2) // 2
        assert max(held_to_w(rank) for rank in prog.ranks) <= 2 * ((D + 2) // 2)


def test_v_half_without_squeeze_is_slower(tmp_path: Path) -> None:
    """The plain block is the baseline the docs quote: 60 at D = 4, N = 8."""
    plain = variant(tmp_path, "v-half", squeeze=False)
    assert span(replay(compiled(plain, D=4, N=8), UNIT)) == 60


# ---- squeeze never breaks a schedule nor raises its peak ------------------------------

SWEEP = [
    ("v-half", [dict(D=2, N=1), dict(D=3, N=5), dict(D=4, N=8), dict(D=5, N=12), dict(D=6, N=6)]),
    ("v-min", [dict(D=2, N=3), dict(D=3, N=7), dict(D=4, N=8), dict(D=6, N=13)]),
    ("chimera", [dict(D=4, N=4), dict(D=4, N=12), dict(D=6, N=12)]),
    ("hanayo", [dict(D=4, N=8), dict(D=3, N=7, w=2)]),
]
COSTS = ["", "F = 1, B = 2, W = 1", "F = 3, B = 4, W = 2, C = 1", "B = 2, W = 0", "C[1] = 2"]


@pytest.mark.slow
@pytest.mark.parametrize("cost", COSTS, ids=["unit", "b2", "fig5", "w0", "link"])
@pytest.mark.parametrize(("name", "cases"), SWEEP, ids=[name for name, _ in SWEEP])
def test_squeeze_is_safe(tmp_path: Path, name: str, cases: list[dict[str, int]], cost: str) -> None:
    """Over a sweep of blocks, sizes and `cost` lines: the squeezed schedule passes every
    pass of `check`; each rank runs the same ops as without squeeze; no rank's peak
    (to B, as `simulate` counts, and to W) rises; under the schedule's own costs, by
    which squeeze times its moves, the makespan never grows."""
    plain_path = variant(tmp_path, name, squeeze=False, cost=cost)
    squeezed_path = variant(tmp_path, name, squeeze=True, cost=cost)
    for params in cases:
        api.compile_schedule(str(squeezed_path), {k: str(v) for k, v in params.items()})
        plain, squeezed = compiled(plain_path, **params), compiled(squeezed_path, **params)
        for before, after in zip(plain.ranks, squeezed.ranks, strict=True):
            assert sorted(map(str, before)) == sorted(map(str, after))
            assert held_to_w(after) <= held_to_w(before)
        slow, fast = replay(plain, plain.costs), replay(squeezed, squeezed.costs)
        for rank in range(plain.num_ranks):
            assert fast.peak_activations(rank) <= slow.peak_activations(rank)
        assert fast.makespan <= slow.makespan


def test_squeeze_closes_warm_up_idle_time(tmp_path: Path) -> None:
    """Squeeze changes the order where there is idle time to close: the plain v-half's
    rank 0 waits after its first forward; squeezed, it runs the next forwards there."""
    plain = compiled(variant(tmp_path, "v-half", squeeze=False), D=4, N=8)
    squeezed = compiled("v-half", D=4, N=8)
    assert [a.text() for a in plain.ranks[0][:3]] == ["F0@0/main", "F1@0/main", "F0@7/main"]
    assert [a.text() for a in squeezed.ranks[0][:6]] == [
        *(f"F{m}@0/main" for m in range(5)),
        "F0@7/main",
    ]


# ---- the language -----------------------------------------------------------------------

BLOCK = """
schedule tiny(D: int = 2, N: int = 3, squeeze: int = 1) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order repeat k every 2 HEAD{
        for s in 0..D {
            F(stage=s) @ s
            BODY
        }
    }
}
"""


def write(tmp_path: Path, head: str, body: str = "B(stage=s) @ 2 * D - 1 - s") -> str:
    path = tmp_path / "tiny.pipe"
    path.write_text(BLOCK.replace("HEAD", head).replace("BODY", body))
    return str(path)


def test_squeeze_is_a_keyword_only_after_every(tmp_path: Path) -> None:
    """`squeeze` sets the flag; elsewhere (a parameter here) it is still a name."""
    order = api.load_file(write(tmp_path, "squeeze ")).schedule.body[-1]
    assert isinstance(order, ast.OrderRepeat) and order.squeeze
    order = api.load_file(write(tmp_path, "")).schedule.body[-1]
    assert isinstance(order, ast.OrderRepeat) and not order.squeeze
    api.compile_schedule(write(tmp_path, "squeeze "), {})


def test_squeeze_in_the_wrong_place_is_a_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "wrong.pipe"
    path.write_text(BLOCK.replace("every 2 HEAD", "squeeze every 2 ").replace("BODY", ""))
    with pytest.raises(PipelangError) as err:
        api.load_file(str(path))
    (diagnostic,) = err.value.diagnostics
    assert diagnostic.code == "E0001"
    assert diagnostic.message == "unexpected `every`"


@pytest.mark.parametrize(
    "body",
    [
        "if s == 0 { B(stage=s) @ 2 * D - 1 - s }",  # a backward missing
        "B(stage=s) @ 2 * D - 1 - s  B(stage=s) @ 2 * D + 7",  # a backward twice
        "B(stage=s) @ (if s == 0 then 1 else 4)",  # B0 before F1 on rank 0: a deadlock
    ],
    ids=["missing", "twice", "deadlock"],
)
def test_a_broken_block_gets_the_same_diagnostics_squeezed(tmp_path: Path, body: str) -> None:
    """Squeeze leaves an order that cannot run as it is: `check` reports what it would
    report without squeeze, never a traceback."""
    reports = []
    for head in ("", "squeeze "):
        with pytest.raises(PipelangError) as err:
            api.compile_schedule(write(tmp_path, head, body), {})
        reports.append([(d.code, d.message) for d in err.value.diagnostics])
    assert reports[0] == reports[1]
    assert reports[0]


# ---- squeeze times ops as `simulate` does -------------------------------------------------


@pytest.mark.parametrize("name", ["v-half", "v-min"])
def test_squeeze_times_the_plain_order_as_simulate_does(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With micro-batches of different lengths (each op its shape's multiple of its
    kind's time), W split off and a transfer time per stage boundary (`C[b]`), squeeze's
    own timing of the plain order ends when `simulate` says it does: the order is built
    with the simulator's op and transfer times."""
    from pipelang.orders import squeeze as module

    ends: list[float] = []
    original = module.time_ops

    def recording(*args: object) -> object:
        timed = original(*args)  # type: ignore[arg-type]
        if timed is not None and not ends:
            ends.append(max(op.end for op in timed))
        return timed

    monkeypatch.setattr(module, "time_ops", recording)
    cost = "F = 1, B = 1, W = 1, A = 0.3, C[1] = 2, C[2] = 0.5"
    lengths = "    lengths 100, 400, 200, 800, 300, 100, 600, 250\n"
    programs = []
    for squeeze in (True, False):
        path = variant(tmp_path, name, squeeze=squeeze, cost=cost)
        path.write_text(
            path.read_text().replace("    microbatches", lengths + "    microbatches", 1)
        )
        programs.append(compiled(path, D=4, N=8))
    plain = programs[1]
    assert ends and ends[0] == pytest.approx(replay(plain, plain.costs).makespan)
