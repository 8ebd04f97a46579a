"""The standard library against independent oracles.

(a) torch's own generators (`_schedule_visualizer.get_schedule_ops`): each rank's compute
    actions, in order, for a sweep of sizes;
(b) the papers' formulas and figures, each test naming its paper and how that paper counts
    bubbles (ours, DESIGN.md section 4: bubble_ratio = 1 - busy / (R * makespan));
(c) every stdlib file passes `check` for valid parameters and fails with its own
    `require` message (E0204) for invalid ones;
(d) `import-torch`: torch CSV -> .pipe -> torch CSV round trips, and clean errors.

Evidence tags follow reference/papers.md: [P] primary text, [S] our own slot simulation
(reproduces the papers' figures). Only [P] and [S] facts are asserted exactly.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import subprocess
import warnings
from pathlib import Path
from unittest import mock

import pytest

from pipelang import api, ast
from pipelang.compiler import Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.export import to_torch_csv
from pipelang.import_torch import check_pipe, import_torch, schedule_name
from pipelang.ir import CostModel, Kind, Program
from pipelang.sim.timeline import Timeline
from tests.helpers import replay, run_in_process

torch_pipelining = pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402


@functools.cache
def load(name: str) -> ast.File:
    """A stdlib file, parsed once per test session."""
    return api.load_file(name)


def program(
    name: str,
    *,
    validate: bool = True,
    costs: tuple[float, float, float] | None = None,
    **params: int,
) -> Program:
    """The stdlib schedule `name` with `params`, expanded (and validated by default); an
    order that depends on the costs is expanded under `costs` (F, B, W; free transfers),
    by default `run`'s: F = B = 1, and W = 1 where the schedule splits it off."""
    given = {k: str(v) for k, v in params.items()}
    if costs is None:
        kinds = run_passes(load(name), Options(given), "expand-orders").need_program().kinds
        costs = (1, 1, 1 if Kind.W in kinds else 0)
    options = Options(given, costs=unit_costs(*costs))
    stop = "validate" if validate else "expand-orders"
    return run_passes(load(name), options, stop).need_program()


def unit_costs(F: float = 1, B: float = 1, W: float = 1) -> CostModel:
    """The op times F, B, W and free transfers."""
    return CostModel((("F", None, F), ("B", None, B), ("W", None, W), ("C", None, 0.0)))


def run(prog: Program, F: float = 1, B: float = 1, W: float | None = None) -> Timeline:
    """Simulate with the given op times and free transfers; W is 1 by default where the
    schedule splits it off, else 0 (a backward that is not split takes B + W)."""
    if W is None:
        W = 1 if Kind.W in prog.kinds else 0
    return replay(prog, prog.costs.merged(unit_costs(F, B, W)))


def span_idle(timeline: Timeline, rank: int) -> float:
    """Idle time inside `rank`'s own span (first start to last end): the ZB papers' bubble."""
    events = [e for e in timeline.events if e.rank == rank]
    span = max(e.end for e in events) - min(e.start for e in events)
    return span - timeline.busy(rank)


# ---- (a) torch agreement ----------------------------------------------------------------

_COMPUTE = re.compile(r"\d+[FIBW]\d+|\(\d+F\d+;\d+[IB]\d+\)OVERLAP_F_B")


def torch_rows(schedule: str, D: int, N: int, v: int | None = None) -> list[list[str]]:
    """torch's per-rank compute actions (idle steps and REDUCE_GRAD dropped)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = get_schedule_ops(schedule, D, N, num_stages_per_rank=v)
    return [[str(a) for a in row if a is not None and _COMPUTE.fullmatch(str(a))] for row in ops]


def torch_zb_one_stage(D: int, N: int) -> list[list[str]]:
    """ScheduleInterleavedZeroBubble with one stage per rank (get_schedule_ops wants >= 2)."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, D, None, D
    order = torch_schedules.ScheduleInterleavedZeroBubble([stage], N).pipeline_order
    return [[str(a) for a in order[r] if a is not None] for r in range(D)]


def our_rows(name: str, **params: int) -> list[list[str]]:
    """Our per-rank compute actions in torch's spelling (via `export --format torch-csv`)."""
    text = to_torch_csv(program(name, validate=False, **params))
    return [line.split(",") if line else [] for line in text.splitlines()]


def fix_torch_1f1b(rows: list[list[str]], N: int) -> list[list[str]]:
    """torch 2.x's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1
    (F1..FN instead of F0..F(N-1)); its runtime is right. Undo that off-by-one only."""
    last = rows[-1]
    if not any(a == f"{len(rows) - 1}F{N}" for a in last):
        return rows
    shifted = [re.sub(r"F(\d+)$", lambda m: f"F{int(m[1]) - 1}", a) for a in last]
    return [*rows[:-1], shifted]


TORCH_SWEEPS = [
    # (stdlib name, torch's name, D values, N values, v values or (None,) for one stage/rank)
    ("gpipe", "GPipe", (1, 2, 4, 5), (1, 3, 8), (None,)),
    ("1f1b", "1F1B", (1, 2, 4, 5), (1, 3, 4, 8, 9), (None,)),
    ("interleaved-1f1b", "Interleaved1F1B", (1, 2, 3, 4), (1, 2, 3, 4, 6, 8, 16), (2, 3)),
    ("looped-bfs", "LoopedBFS", (1, 2, 4), (1, 3, 8), (2, 3)),
    ("interleaved-zb", "InterleavedZeroBubble", (1, 2, 3, 4), (1, 2, 4, 6, 8), (2, 3)),
    ("zbv", "ZBVZeroBubble", (1, 2, 3, 4, 5), (1, 3, 4, 7, 8, 9), (2,)),
    # Compound cells compared whole: `(0F3;7B0)OVERLAP_F_B`, and B (full) beside I and W.
    ("dualpipev", "DualPipeV", (1, 2, 3, 4, 5), (1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 15), (None,)),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "torch_name", "Ds", "Ns", "vs"), TORCH_SWEEPS, ids=[s[0] for s in TORCH_SWEEPS]
)
def test_same_order_as_torch(
    name: str, torch_name: str, Ds: tuple[int, ...], Ns: tuple[int, ...], vs: tuple[int | None, ...]
) -> None:
    """Every size torch accepts gives the same per-rank compute order; where torch refuses
    a size, so does our `require` (E0204) unless ours is the more general schedule."""
    takes_v = any(p.name == "v" for p in load(name).schedule.params)
    compared = 0
    for D in Ds:
        for N in Ns:
            for v in vs:
                params = {"D": D, "N": N, **({"v": v} if takes_v else {})}
                try:
                    expected = torch_rows(torch_name, D, N, v)
                except ValueError:
                    if name == "dualpipev":  # torch: N >= 2D, and so our `require`
                        with pytest.raises(PipelangError, match="N >= 2D"):
                            program(name, validate=False, **params)
                    if takes_v:  # torch's interleaved schedules: N must split into rounds
                        with pytest.raises(PipelangError, match="rounds"):
                            program(name, validate=False, **params)
                    continue
                if torch_name == "1F1B":
                    expected = fix_torch_1f1b(expected, N)
                assert our_rows(name, **params) == expected, f"{name} {params}"
                compared += 1
    assert compared >= 10


@pytest.mark.parametrize("D", [1, 2, 3, 4, 8])
def test_zb_h1_is_torchs_interleaved_zero_bubble_with_one_stage(D: int) -> None:
    for N in (1, 2, 4, 8, 12):
        assert our_rows("zb-h1", D=D, N=N) == torch_zb_one_stage(D, N), (D, N)


def test_torch_1f1b_off_by_one_is_only_on_the_last_rank() -> None:
    """Guards `fix_torch_1f1b`: when torch fixes its visualiser, this fails; drop the fix."""
    rows = torch_rows("1F1B", 4, 8)
    assert rows[3][0] == "3F1" and "3F8" in rows[3]
    assert rows[:3] == our_rows("1f1b", D=4, N=8)[:3]


# ---- (b) paper formulas -----------------------------------------------------------------


@pytest.mark.slow
def test_chimera_fig3_per_rank_order() -> None:
    """Chimera (Li & Hoefler, SC'21) Fig. 3, D = 4, N = 4 [P]: each worker's order."""
    status, out, err = run_in_process(
        ["export", "chimera", "-p", "D=4", "-p", "N=4", "--format", "json"]
    )
    assert status == 0, err
    ranks = json.loads(out)["ranks"]
    shown = [" ".join(f"{o['op']}{o['mb']}{o['pipeline'][0]}" for o in r["ops"]) for r in ranks]
    assert shown == [
        "F0d F1d F2u B2u F3u B3u B0d B1d",
        "F0d F2u F1d F3u B2u B0d B3u B1d",
        "F2u F0d F3u F1d B0d B2u B1d B3u",
        "F2u F3u F0d B0d F1d B1d B2u B3u",
    ]


@pytest.mark.parametrize("D", range(4, 34, 2))
def test_chimera_unit_makespan_and_bubble(D: int) -> None:
    """Chimera, N = D. Bubble (D-2)/(2N+D-2) [P, comparison table], counted as idle over
    the whole iteration, which is our bubble_ratio. Makespan 2N+D-2 with F = B = 1 and
    N*F + (N+D-2)*B with B = 2F [S]. Peaks per rank in [D/2+1, D], both ends attained [P]."""
    prog = program("chimera", D=D, N=D)
    unit = run(prog)
    N = D
    assert unit.makespan == 2 * N + D - 2
    assert unit.bubble_ratio == pytest.approx((D - 2) / (2 * N + D - 2))
    assert run(prog, F=1, B=2).makespan == N + 2 * (N + D - 2)
    peaks = [unit.peak_activations(r) for r in range(D)]
    assert min(peaks) == D // 2 + 1 and max(peaks) == D
    assert {unit.weight_copies(r) for r in range(D)} == {2}


@pytest.mark.parametrize("D", [4, 6, 8, 12, 16])
def test_chimera_more_pipelines(D: int) -> None:
    """Chimera with 2f pipelines, f | D/2 (Table 3 [P]): bubble (D-2f)/(2fN+D-2f) at
    N = D with equal F and B; weights 2f stage copies per rank; activations per rank in
    [D - D/(2f) + 1, D] (our ratio = the paper's: idle over the iteration)."""
    for f in (f for f in range(1, D // 2 + 1) if (D // 2) % f == 0):
        timeline = run(program("chimera", D=D, N=D, f=f))
        assert timeline.bubble_ratio == pytest.approx((D - 2 * f) / (2 * f * D + D - 2 * f))
        assert timeline.makespan == 2 * D + D // f - 2  # [S]
        peaks = [timeline.peak_activations(r) for r in range(D)]
        assert D - D // (2 * f) + 1 <= min(peaks) and max(peaks) == D
        assert {timeline.weight_copies(r) for r in range(D)} == {2 * f}


def test_chimera_fig8_and_known_peaks() -> None:
    """[S] reproductions: Fig. 8's P0 row (D = 8, f = 2) and the per-rank peaks."""
    prog = program("chimera", D=8, N=8, f=2)
    assert [a.mb for a in prog.ranks[0]] == [0, 1, 6, 2, 7, 3, 4, 4, 5, 5, 2, 6, 3, 7, 0, 1]
    peaks = [run(prog).peak_activations(r) for r in range(8)]
    assert peaks == [7, 8, 8, 7, 7, 8, 8, 7]
    unit = run(program("chimera", D=8, N=8))
    assert [unit.peak_activations(r) for r in range(8)] == [5, 6, 7, 8, 8, 7, 6, 5]


@pytest.mark.parametrize(
    ("D", "N", "makespan"),
    [(4, 4, 16), (4, 8, 30), (4, 16, 58), (8, 8, 36), (8, 16, 66), (8, 32, 126)],
)
def test_chimera_direct_concatenation(D: int, N: int, makespan: int) -> None:
    """Chimera section 3.5, direct concatenation of N/D basic units, F = 1, B = 2 [S]."""
    assert run(program("chimera", D=D, N=N), F=1, B=2).makespan == makespan


@pytest.mark.parametrize("D", [4, 8])
def test_chimera_concatenation_keeps_bubble_with_equal_costs(D: int) -> None:
    """With F = B the units interlock: still (D-2f)/(2fN+D-2f) for N = kD [S]."""
    for f in (1, 2):
        for k in (2, 3):
            N = k * D
            timeline = run(program("chimera", D=D, N=N, f=f))
            assert timeline.bubble_ratio == pytest.approx((D - 2 * f) / (2 * f * N + D - 2 * f))


@pytest.mark.parametrize(("D", "N"), [(2, 2), (4, 4), (4, 8), (8, 16), (5, 12)])
def test_1f1b_and_gpipe_bubble(D: int, N: int) -> None:
    """GPipe (Huang et al., NeurIPS'19) and 1F1B/DAPPLE: bubble (D-1)/(N+D-1), idle over
    the whole iteration as in Chimera's comparison table [P], for any F and B. GPipe
    holds N activations on every rank [P]; 1F1B at most min(D, N), on rank 0."""
    for name in ("gpipe", "1f1b"):
        for F, B in ((1, 1), (1, 2)):
            timeline = run(program(name, D=D, N=N), F=F, B=B)
            assert timeline.makespan == (N + D - 1) * (F + B)
            assert timeline.bubble_ratio == pytest.approx((D - 1) / (N + D - 1))
    assert run(program("gpipe", D=D, N=N)).peak_activations(0) == N
    assert run(program("1f1b", D=D, N=N)).peak_activations(0) == min(D, N)


@pytest.mark.parametrize(("D", "v"), [(2, 2), (4, 2), (4, 3), (8, 2), (8, 4)])
def test_interleaved_bubble_over_ideal(D: int, v: int) -> None:
    """Megatron (Narayanan et al., SC'21, section 2.2) [P]: bubble over the *ideal* time
    N*(t_f + t_b) is (1/v)(D-1)/N, for N a multiple of D. Our chunk costs are per virtual
    stage, so the ideal is N*v*(F+B) per rank."""
    for N in (D, 2 * D, 4 * D):
        for F, B in ((1, 1), (1, 2)):
            timeline = run(program("interleaved-1f1b", D=D, N=N, v=v), F=F, B=B)
            ideal = N * v * (F + B)
            assert (timeline.makespan - ideal) / ideal == pytest.approx((D - 1) / (v * N))


ZB_COSTS = [(1, 1, 1), (2, 3, 1), (3, 4, 2)]


@pytest.mark.parametrize("D", [2, 3, 4, 8])
def test_zb_h1(D: int) -> None:
    """Zero Bubble (Qi et al., ICLR'24) Table 2 [P]: ZB-H1's bubble (D-1)(F+B-W), counted
    per rank over its own span (first op to last op), and peak D activations (rank 0)."""
    for N in (D, 2 * D, 3 * D):
        for F, B, W in ZB_COSTS:
            timeline = run(program("zb-h1", D=D, N=N), F=F, B=B, W=W)
            assert span_idle(timeline, 0) == pytest.approx((D - 1) * (F + B - W))
            assert timeline.peak_activations(0) == D


@pytest.mark.parametrize("D", [2, 3, 4, 8])
def test_zb_h2(D: int) -> None:
    """Zero Bubble Table 2 [P]: ZB-H2's per-rank-span bubble (D-1)(F+B-2W), zero when
    F = B = W, with 2D-1 activations on rank 0 counted to B (`MW = 0`), as the paper
    counts (N >= 2D-1 so the warm-up fits). Counted whole until W (`MW = 1`, the
    default) it holds more: this order defers W's to fill the cool-down."""
    for N in (2 * D - 1, 2 * D, 3 * D):
        for F, B, W in ZB_COSTS:
            formula = (D - 1) * (F + B - 2 * W)
            prog = program("zb-h2", D=D, N=N)
            timeline = run(prog, F=F, B=B, W=W)  # the F = B = W order
            assert span_idle(timeline, 0) == pytest.approx(formula)
            to_b = unit_costs(F, B, W).merged(CostModel((("MW", None, 0.0),)))
            assert replay(prog, prog.costs.merged(to_b)).peak_activations(0) == 2 * D - 1
            # expanded under these costs (`--cost`), the greedy order is no worse
            timeline = run(program("zb-h2", D=D, N=N, costs=(F, B, W)), F=F, B=B, W=W)
            assert span_idle(timeline, 0) <= formula + 1e-9


@pytest.mark.parametrize("D", [2, 4, 6, 8])
def test_zbv(D: int) -> None:
    """Zero Bubble section 6 [P]: ZB-V has no bubble in any rank's span when F = B = W,
    and peaks at D micro-batches of activations, i.e. 2D chunk activations (each chunk
    is half a rank's layers)."""
    for N in (2 * D, 4 * D):
        timeline = run(program("zbv", D=D, N=N))
        assert all(span_idle(timeline, r) == 0 for r in range(D))
        assert timeline.peak_activations(0) == 2 * D


def test_dualpipev_makespan_and_peak() -> None:
    """DualPipeV with P = 4 ranks, N = 8, F = B = W = 1 (reference section 4, the Victarry
    emulator): makespan 54 when an overlapped pair takes 3 (no overlap: F plus a full
    backward) and 44 when it takes 2, both (P-1)(F&B + B - 3W) beyond the ideal; the
    pair must start atomically for that. Peak PP + 1 = 9 chunk activations per rank."""
    prog = program("dualpipev", D=4, N=8)
    for pair, makespan in ((None, 54), (3, 54), (2, 44)):
        extra = () if pair is None else (("FB", None, float(pair)),)
        timeline = replay(prog, CostModel((*unit_costs().entries, *extra)))
        assert timeline.makespan == makespan
    assert [timeline.peak_activations(r) for r in range(4)] == [9] * 4


@pytest.mark.parametrize("D", [4, 6, 8, 12, 16])
def test_v_schedules_memory(D: int) -> None:
    """Controllable Memory (Qi et al., arXiv 2405.15362) [P, project summary]: V-Half
    holds floor((D+2)/2) micro-batches of activations, V-Min about floor((D+4)/3), ZB-V D.
    Peaks are counted in chunk activations (half a micro-batch each on a V placement)."""
    N = 4 * D
    half = run(program("v-half", D=D, N=N))
    assert max(math.ceil(half.peak_activations(r) / 2) for r in range(D)) == (D + 2) // 2
    vmin = run(program("v-min", D=D, N=N))
    peak = max(math.ceil(vmin.peak_activations(r) / 2) for r in range(D))
    assert (D + 4) // 3 - 1 <= peak <= (D + 4) // 3


@pytest.mark.parametrize("D", [2, 4, 8, 16])
def test_gems(D: int) -> None:
    """GEMS (Jain et al., SC'20) as compared in Chimera's table [P]: one activation and two
    weight copies per rank; bubble about (D-1)/(D+1/2) over the iteration (the table's
    "≈", so only approximately; B = 2F, many micro-batches)."""
    timeline = run(program("gems", D=D, N=16 * D), F=1, B=2)
    assert timeline.bubble_ratio == pytest.approx((D - 1) / (D + 0.5), abs=0.01)
    assert {timeline.peak_activations(r) for r in range(D)} == {1}
    assert {timeline.weight_copies(r) for r in range(D)} == {2}


@pytest.mark.parametrize("w", [1, 2, 3])
def test_hanayo_wave_bubble(w: int) -> None:
    """Hanayo (Liu et al., SC'23): the paper's formula is unverified [U]; this checks our
    derivation [S] of the wave order: (D-1)/(2wN+D-1) with F = B, one weight copy."""
    for D, N in ((2, 4), (4, 8), (3, 6)):
        timeline = run(program("hanayo", D=D, N=N, w=w))
        assert timeline.bubble_ratio == pytest.approx((D - 1) / (2 * w * N + D - 1))
        assert {timeline.weight_copies(r) for r in range(D)} == {2 * w}


# ---- (c) every file checks, and refuses bad parameters with its own message -------------

VALID = {
    "gpipe": [dict(D=1, N=1), dict(D=4, N=8), dict(D=3, N=2)],
    "1f1b": [dict(D=1, N=1), dict(D=4, N=8), dict(D=4, N=2), dict(D=7, N=9)],
    "interleaved-1f1b": [dict(D=4, N=8, v=2), dict(D=4, N=2, v=3), dict(D=3, N=6, v=1)],
    "looped-bfs": [dict(D=4, N=8, v=2), dict(D=4, N=2, v=3), dict(D=1, N=3, v=1)],
    "interleaved-zb": [
        dict(D=4, N=8, v=2),
        dict(D=3, N=6, v=3),
        dict(D=4, N=3, v=2),
        dict(D=2, N=4, v=2),  # consumes out of send order: recvs are hoisted
    ],
    "chimera": [
        dict(D=4, N=4),
        dict(D=2, N=2),
        dict(D=8, N=16, f=2),
        dict(D=12, N=12, f=3),
        dict(D=8, N=8, f=4),
    ],
    "zb-h1": [dict(D=4, N=8), dict(D=1, N=1), dict(D=8, N=3)],
    "zb-h2": [dict(D=4, N=8), dict(D=1, N=1), dict(D=8, N=3)],
    "zbv": [
        dict(D=4, N=4),
        dict(D=2, N=2),
        dict(D=1, N=5),
        dict(D=4, N=8),  # consumes out of send order: recvs are hoisted
    ],
    "v-min": [dict(D=4, N=8), dict(D=2, N=1), dict(D=6, N=13)],
    "v-half": [dict(D=4, N=8), dict(D=3, N=1), dict(D=6, N=13)],
    "hanayo": [dict(D=4, N=8), dict(D=1, N=1), dict(D=3, N=7, w=2)],
    "gems": [dict(D=4, N=8), dict(D=1, N=1), dict(D=5, N=7)],
    "dualpipev": [dict(D=4, N=8), dict(D=1, N=2), dict(D=3, N=7), dict(D=5, N=16)],
    "chimera-fwd-double": [dict(D=4, N=8), dict(D=2, N=4), dict(D=6, N=24)],
    "chimera-bwd-half": [dict(D=4, N=8), dict(D=2, N=4), dict(D=8, N=32)],
    "pipedream": [dict(D=4, N=8), dict(D=1, N=1), dict(D=5, N=3)],
    "pipedream-2bw": [dict(D=4, N=8), dict(D=1, N=1), dict(D=4, N=10, m=3)],
    "pipemare": [dict(D=4, N=8), dict(D=1, N=1), dict(D=5, N=3)],
    "bpipe": [dict(D=4, N=8), dict(D=1, N=1), dict(D=5, N=7)],
    "diffusionpipe": [dict(D=4, N=8), dict(D=1, N=1), dict(D=5, N=7, h=2), dict(D=3, N=6, h=1)],
    "seq1f1b": [dict(D=4, N=8), dict(D=1, N=1), dict(D=3, N=5, C=3), dict(D=6, N=2, C=1)],
}

INVALID = [
    ("gpipe", dict(D=0), "GPipe needs at least one rank"),
    ("gpipe", dict(N=0), "GPipe needs at least one micro-batch"),
    ("1f1b", dict(N=0), "1F1B needs at least one micro-batch"),
    ("interleaved-1f1b", dict(v=0), "interleaved 1F1B needs at least one stage per rank"),
    ("interleaved-1f1b", dict(D=4, N=9), "multiple of its number of rounds"),
    ("looped-bfs", dict(v=0), "looped BFS needs at least one stage per rank"),
    ("interleaved-zb", dict(D=0), "interleaved zero bubble needs at least one rank"),
    ("interleaved-zb", dict(D=3, N=16), "multiple of its number of rounds"),
    ("chimera", dict(D=5, N=5), "Chimera needs an even number of stages"),
    ("chimera", dict(D=6, N=6, f=2), "Chimera needs f (pipelines per direction) to divide D/2"),
    ("chimera", dict(D=4, N=6), "Chimera needs N to be a positive multiple of D"),
    ("chimera", dict(D=0), "Chimera needs an even number of stages"),
    ("chimera", dict(f=0), "Chimera needs f (pipelines per direction) to divide D/2"),
    ("zb-h1", dict(N=0), "ZB-H1 needs at least one micro-batch"),
    ("zb-h2", dict(D=0), "ZB-H2 needs at least one rank"),
    ("zbv", dict(N=0), "ZB-V needs at least one micro-batch"),
    ("v-min", dict(D=1), "V-Min needs at least two ranks"),
    ("v-half", dict(D=1), "V-Half needs at least two ranks"),
    ("hanayo", dict(w=0), "Hanayo needs at least one wave"),
    ("gems", dict(N=0), "GEMS needs at least one micro-batch"),
    ("dualpipev", dict(D=4, N=7), "DualPipeV needs at least as many micro-batches as stages"),
    ("dualpipev", dict(D=0, N=2), "DualPipeV needs at least one rank"),
    *(
        (name, params, message)
        for name in ("chimera-fwd-double", "chimera-bwd-half")
        for params, message in [
            (dict(D=3, N=12), "Chimera needs an even number of stages"),
            (dict(D=0, N=4), "Chimera needs an even number of stages"),
            (dict(D=-2, N=4), "Chimera needs an even number of stages"),
            (dict(D=4, N=4), "needs N to be a positive multiple of 2D"),
            (dict(D=4, N=12), "needs N to be a positive multiple of 2D"),
            (dict(D=4, N=0), "needs N to be a positive multiple of 2D"),
            (dict(D=4, N=-8), "needs N to be a positive multiple of 2D"),
        ]
    ),
    ("pipedream", dict(N=0), "PipeDream needs at least one micro-batch"),
    ("pipedream-2bw", dict(m=0), "PipeDream-2BW needs at least one micro-batch per update"),
    ("pipemare", dict(D=0), "PipeMare needs at least one rank"),
    ("bpipe", dict(D=4, N=3), "BPipe balances 1F1B's steady phase: it needs N >= D"),
    ("diffusionpipe", dict(D=4, h=5), "DiffusionPipe needs 1 <= h <= D"),
    ("diffusionpipe", dict(N=0), "DiffusionPipe needs at least one micro-batch"),
    ("seq1f1b", dict(C=0), "Seq1F1B needs at least one chunk per micro-batch"),
    ("seq1f1b", dict(N=0), "Seq1F1B needs at least one micro-batch"),
]


def test_every_stdlib_file_is_covered() -> None:
    assert sorted(VALID) == api.stdlib_names()
    assert {name for name, _, _ in INVALID} == set(api.stdlib_names())


def _valid_cases() -> list[object]:
    return [
        pytest.param(name, case, id=f"{name}-{i}")
        for name, params in VALID.items()
        for i, case in enumerate(params)
    ]


@pytest.mark.parametrize(("name", "params"), _valid_cases())
def test_stdlib_checks(name: str, params: dict[str, int]) -> None:
    """What `pipelang check` runs: every pass, comms and sync included."""
    api.compile_schedule(name, {k: str(v) for k, v in params.items()})


@pytest.mark.parametrize(
    ("name", "params", "message"), INVALID, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(INVALID)]
)
def test_stdlib_requires(name: str, params: dict[str, int], message: str) -> None:
    """A bad parameter is refused by the file's own `require`, and by that alone."""
    own = {d.message for d in load(name).schedule.body if isinstance(d, ast.Require)}
    with pytest.raises(PipelangError) as err:
        api.compile_schedule(name, {k: str(v) for k, v in params.items()})
    diagnostics = err.value.diagnostics
    assert {d.code for d in diagnostics} == {"E0204"}
    assert any(message in d.message for d in diagnostics)
    assert {d.message for d in diagnostics} <= own


def test_list_shows_every_schedule_with_a_summary() -> None:
    status, out, err = run_in_process(["list", "--format", "json"])
    assert status == 0, err
    rows = {row["name"]: row for row in json.loads(out)}
    assert sorted(rows) == api.stdlib_names()
    for row in rows.values():
        assert row["summary"] and "D=" in row["params"] and "N=" in row["params"]


# ---- (d) import-torch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("gpipe", dict(D=3, N=4)),
        ("1f1b", dict(D=4, N=8)),
        ("interleaved-1f1b", dict(D=4, N=8)),
        ("looped-bfs", dict(D=2, N=3, v=3)),
        ("interleaved-zb", dict(D=4, N=8)),
        ("interleaved-zb", dict(D=2, N=4)),
        ("zb-h2", dict(D=4, N=8)),
        ("zbv", dict(D=4, N=8)),
        ("v-half", dict(D=4, N=8)),
        ("hanayo", dict(D=3, N=6, w=2)),
        ("dualpipev", dict(D=3, N=7)),
    ],
)
def test_import_torch_round_trip(tmp_path: Path, name: str, params: dict[str, int]) -> None:
    """export torch-csv -> import-torch -> (checked) -> export torch-csv: the same CSV."""
    exported = to_torch_csv(program(name, **params))
    path = tmp_path / f"{name}.csv"
    path.write_text(exported)
    text = import_torch(path).text
    assert to_torch_csv(check_pipe(text, "roundtrip.pipe").need_program()) == exported


def test_import_torch_reads_torchs_own_csv(tmp_path: Path) -> None:
    """A CSV as torch writes it: idle cells, REDUCE_GRAD cells, CRLF line ends."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = get_schedule_ops("GPipe", 4, 6)
    assert any("REDUCE_GRAD" in str(a) for row in rows for a in row)
    path = tmp_path / "torch-gpipe.csv"
    path.write_text(
        "".join(
            "," * r + ",".join("" if a is None else str(a) for a in row) + "\r\n"
            for r, row in enumerate(rows)
        )
    )
    prog = check_pipe(import_torch(path).text, "torch.pipe").need_program()
    assert our_rows_of(prog) == torch_rows("GPipe", 4, 6)


def our_rows_of(prog: Program) -> list[list[str]]:
    return [line.split(",") for line in to_torch_csv(prog).splitlines()]


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    status, out, err = run_in_process([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), status, out, err)


@pytest.mark.slow
def test_import_torch_cli(tmp_path: Path) -> None:
    """Writes a checked .pipe file; a malformed cell is a diagnostic, exit 1, no traceback."""
    good = tmp_path / "zb.csv"
    good.write_text(to_torch_csv(program("zb-h1", D=2, N=3)))
    out = tmp_path / "zb.pipe"
    done = _cli("import-torch", good, "-o", out)
    assert done.returncode == 0, done.stderr
    assert "check ok" in done.stdout
    assert "schedule zb()" in out.read_text()

    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1,,0B0\n1F0,1X1\n")
    done = _cli("import-torch", bad)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(f"error[E0007]: `1X1` is not a torch action\n --> {bad}:2:5\n")
    assert "Traceback" not in done.stderr


def test_schedules_readme_table_is_generated() -> None:
    """docs/schedules/README.md holds exactly what benchmarks/stdlib_table.py prints."""
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(
        "stdlib_table", root / "benchmarks" / "stdlib_table.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = (root / "docs" / "schedules" / "README.md").read_text()
    assert f"{script.BEGIN}\n{script.table(8, 16, script.COSTS)}\n{script.END}" in readme, (
        "run `python benchmarks/stdlib_table.py --write`"
    )


def test_a_csv_named_after_a_word_of_the_language_is_imported_under_another_name(
    tmp_path: Path,
) -> None:
    """Every word of the grammar (`parser.keywords`), not a list kept beside it."""
    for word in ("order", "chunks", "frozen"):
        path = tmp_path / f"{word}.csv"
        path.write_text(to_torch_csv(program("1f1b", D=2, N=2)))
        assert schedule_name(path) == f"imported_{word}"
        check_pipe(import_torch(path).text, "t.pipe")
    assert schedule_name(tmp_path / "zbv-4x8.csv") == "zbv_4x8"
