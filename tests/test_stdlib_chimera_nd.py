"""Chimera for N > D (Li & Hoefler, SC'21, section 3.5): `chimera-fwd-double` and
`chimera-bwd-half` against independent oracles.

- The order: the per-rank program of the authors' SC'21 forward-doubling driver
  (Shigangli/Chimera, branch ChimeraBk, `main_with_runtime_forward_doubling.py`), rebuilt
  here from its phase lengths, and the slot rule the docs state (Chimera's, forwards
  counted in pairs), built here independently.
- The paper's claims (reference/papers.md 1.3): no intermediate bubbles once a forward of
  two micro-batches costs as much as a backward (F = 1, B = 2), twice the activations in
  flight unless recomputed, and a shorter iteration than direct concatenation (the [S]
  table of papers.md 1.3) at N = 2D and 4D, D = 4 and 8.
- Bubbles are counted in our convention (DESIGN.md section 4) and in Chimera's own, bubble
  slots per worker: Chimera's basic unit has D - 2 of them [P], and so must doubling,
  whatever the number of units.
- Every valid size checks, invalid ones fail with the file's own `require` (E0204), and
  a short gloo run per schedule matches single-process training (`--check`).
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys

import pytest

from pipelang import api, ast
from pipelang.compiler import Options, run_passes
from pipelang.ir import Action, CostModel, Kind, Program
from pipelang.sim.timeline import Timeline
from tests.helpers import replay, run, run_in_process

NAMES = ("chimera-fwd-double", "chimera-bwd-half")

# Direct concatenation (`chimera`) at F = 1, B = 2, no comms: reference/papers.md 1.3 [S].
DIRECT_CONCATENATION = {(4, 8): 30, (4, 16): 58, (8, 16): 66, (8, 32): 126}


@functools.cache
def load(name: str) -> ast.File:
    return api.load_file(name)


def program(name: str, **params: int) -> Program:
    """The expanded, validated compute program of a stdlib schedule."""
    options = Options({k: str(v) for k, v in params.items()})
    return run_passes(load(name), options, "validate").need_program()


def timeline(prog: Program, F: float = 1, B: float = 2, R: float = 0) -> Timeline:
    costs = CostModel((("F", None, F), ("B", None, B), ("R", None, R), ("C", None, 0.0)))
    return replay(prog, prog.costs.merged(costs))


def sizes(Ds: tuple[int, ...], units: tuple[int, ...]) -> list[tuple[int, int]]:
    """(D, N) with N = 2D * u: u units of D micro-batches per direction."""
    return [(D, 2 * D * u) for D in Ds for u in units]


# ---- the order --------------------------------------------------------------------------


class _Stream:
    """One rank's ops in the making: the next forward pair and backward per pipeline."""

    def __init__(self, D: int, N: int, rank: int, recompute: bool) -> None:
        self.stage = {"down": rank, "up": D - 1 - rank}
        self.next_f = {"down": 0, "up": N // 2}
        self.next_b = dict(self.next_f)
        self.recompute = recompute
        self.ops: list[str] = []

    def ff(self, pipe: str) -> None:
        m, s = self.next_f[pipe], self.stage[pipe]
        self.next_f[pipe] += 2
        self.ops += [f"F{m}@{s}/{pipe}", f"&F{m + 1}@{s}/{pipe}"]

    def b(self, pipe: str) -> None:
        m, s = self.next_b[pipe], self.stage[pipe]
        self.next_b[pipe] += 1
        self.ops += [f"R{m}@{s}/{pipe}"] * self.recompute + [f"B{m}@{s}/{pipe}"]


def authors_order(D: int, N: int, recompute: bool) -> list[list[str]]:
    """Each rank's ops as the authors' forward-doubling driver runs them.

    Rank r's own pipeline is `down` if r < D/2 else `up`; a = D/2 - r (r < D/2) or
    r - D/2 + 1, b = D/2 - a. Per unit of D micro-batches per direction:
    a x [B(own) after the first unit, FF(own)], b x [FF(other), FF(own)],
    a x [FF(other), B(other)], (b + D/2) x [B(own), B(other)]; then a x B(own).
    FF takes the next two micro-batches of its pipeline, B the next one.
    """
    h = D // 2
    rows = []
    for r in range(D):
        own, other = ("down", "up") if r < h else ("up", "down")
        a = h - r if r < h else r - h + 1
        rank = _Stream(D, N, r, recompute)
        for unit in range(N // (2 * D)):
            for _ in range(a):
                if unit > 0:
                    rank.b(own)
                rank.ff(own)
            for _ in range(h - a):
                rank.ff(other)
                rank.ff(own)
            for _ in range(a):
                rank.ff(other)
                rank.b(other)
            for _ in range(h - a + h):
                rank.b(own)
                rank.b(other)
        for _ in range(a):
            rank.b(own)
        rows.append(rank.ops)
    return rows


def slot_rule_order(D: int, N: int) -> list[list[str]]:
    """Each rank's forwards and backwards sorted by the documented slot rule: in unit u,
    pair j forwards on stage s at slot s + 2j + 3Du, micro-batch u*D + k of a direction
    backwards on stage s at 2D - 1 - s + 2k + 3Du (backwards only; compounds as `FF`)."""
    placed: list[dict[int, str]] = [{} for _ in range(D)]
    for pipe, base, rank_of in (("down", 0, lambda s: s), ("up", N // 2, lambda s: D - 1 - s)):
        for u in range(N // (2 * D)):
            for s in range(D):
                slots = placed[rank_of(s)]
                for j in range(D // 2):
                    m = base + u * D + 2 * j
                    slot = s + 2 * j + 3 * D * u
                    assert slot not in slots
                    slots[slot] = f"FF{m}@{s}/{pipe}"
                for k in range(D):
                    slot = 2 * D - 1 - s + 2 * k + 3 * D * u
                    assert slot not in slots
                    slots[slot] = f"B{base + u * D + k}@{s}/{pipe}"
    return [[slots[t] for t in sorted(slots)] for slots in placed]


def texts(prog: Program) -> list[list[str]]:
    return [[a.text() for a in row] for row in prog.ranks]


def compact(prog: Program) -> list[list[str]]:
    """Forward pairs as `FF<first>` and backwards alone: the slot rule's spelling."""
    rows = []
    for row in prog.ranks:
        out = []
        for a in row:
            if a.kind is Kind.F and not a.fused:
                out.append(f"FF{a.mb}@{a.stage}/{a.pipeline}")
            elif a.kind is Kind.B:
                out.append(a.text())
        rows.append(out)
    return rows


@pytest.mark.parametrize(("D", "N"), sizes((2, 4, 6, 8), (1, 2, 3)))
def test_fwd_double_is_the_authors_per_rank_program(D: int, N: int) -> None:
    assert texts(program("chimera-fwd-double", D=D, N=N)) == authors_order(D, N, True)


@pytest.mark.parametrize(("D", "N"), sizes((2, 4, 6, 8), (1, 2, 3)))
def test_bwd_half_is_the_same_order_without_recompute(D: int, N: int) -> None:
    assert texts(program("chimera-bwd-half", D=D, N=N)) == authors_order(D, N, False)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("D", "N"), sizes((2, 4, 8, 12), (1, 2)))
def test_order_follows_the_slot_rule(name: str, D: int, N: int) -> None:
    assert compact(program(name, D=D, N=N)) == slot_rule_order(D, N)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("D", "N"), [(4, 8), (4, 16), (6, 24)])
def test_every_forward_carries_two_micro_batches(name: str, D: int, N: int) -> None:
    """The doubling pattern: every forward is `F(2j) & F(2j+1)` on one stage of one
    pipeline; backwards run alone, one micro-batch each, each right after its R
    (forward doubling only: then a rank rebuilds one micro-batch's activations at a time)."""
    prog = program(name, D=D, N=N)
    recompute = name == "chimera-fwd-double"
    assert (Kind.R in prog.kinds) is recompute
    for row in prog.ranks:
        for i, a in enumerate(row):
            if a.kind is Kind.F and not a.fused:
                assert a.mb is not None and a.mb % 2 == 0
                assert row[i + 1] == Action(Kind.F, a.mb + 1, a.stage, a.pipeline)
                assert row[i + 1].fused
            elif a.kind is Kind.F:
                assert row[i - 1] == Action(Kind.F, a.mb - 1, a.stage, a.pipeline)  # type: ignore[operator]
            elif a.kind is Kind.B:
                assert not a.fused
                if recompute:
                    assert row[i - 1] == a._replace(kind=Kind.R)
            else:
                assert a.kind is Kind.R and row[i + 1] == a._replace(kind=Kind.B)


# ---- bubbles ----------------------------------------------------------------------------


def intermediate_gaps(tl: Timeline, rank: int) -> float:
    """Idle time between consecutive steps of `rank` once its first backward has started
    and before its last forward ends: the paper's intermediate bubbles (start-up and
    cool-down left out)."""
    events = [e for e in tl.events if e.rank == rank and not e.action.fused]
    first_b = min(e.start for e in events if e.action.kind is Kind.B)
    last_f = max(e.end for e in events if e.action.kind is Kind.F)
    return sum(
        max(0.0, later.start - earlier.end)
        for earlier, later in itertools.pairwise(events)
        if earlier.end >= first_b and later.start <= last_f
    )


@pytest.mark.parametrize("D", [4, 8])
def test_direct_concatenation_has_intermediate_bubbles(D: int) -> None:
    """The measure below sees what the paper describes for Fig. 7b (B = 2F)."""
    tl = timeline(program("chimera", D=D, N=2 * D))
    assert sum(intermediate_gaps(tl, r) for r in range(D)) > 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("D", "N"), sizes((2, 4, 6, 8), (1, 2, 4)))
def test_no_intermediate_bubbles_when_a_pair_costs_a_backward(name: str, D: int, N: int) -> None:
    """F = 1, B = 2 (recompute free): each rank's idle is Chimera's basic-unit bubble,
    D - 2 slots of one backward [P: D/2 - 1 + D/2 - 1 per worker], for any number of
    units; the iteration is 1.5N busy slots plus those, 3N + 2D - 4."""
    tl = timeline(program(name, D=D, N=N))
    assert tl.makespan == 3 * N + 2 * D - 4
    for r in range(D):
        assert intermediate_gaps(tl, r) == 0
        assert tl.idle(r) == 2 * (D - 2)
    assert tl.bubble_ratio == pytest.approx((D - 2) / (1.5 * N + D - 2))


@pytest.mark.parametrize("D", [4, 6, 8])
def test_fwd_double_with_priced_recompute(D: int) -> None:
    """With recompute priced (R = 1) the balance is 2F = R + B: at F = 1.5, B = 2, R = 1
    there are still no intermediate bubbles, and a second unit adds no idle time. Each
    rank idles at most Chimera's D - 2 slots (of 3); less, as a recompute needs only its
    forward and may run while the rank waits for the gradient."""
    idle = []
    for N in (2 * D, 4 * D):
        tl = timeline(program("chimera-fwd-double", D=D, N=N), F=1.5, B=2, R=1)
        assert all(intermediate_gaps(tl, r) == 0 for r in range(D))
        idle.append([tl.idle(r) for r in range(D)])
    assert idle[0] == idle[1]
    assert max(idle[0]) <= 3 * (D - 2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("D", "N"), sorted(DIRECT_CONCATENATION))
def test_beats_direct_concatenation(name: str, D: int, N: int) -> None:
    direct = timeline(program("chimera", D=D, N=N))
    assert direct.makespan == DIRECT_CONCATENATION[(D, N)]
    assert timeline(program(name, D=D, N=N)).makespan < direct.makespan


# ---- memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("D", [4, 6, 8, 12, 16])
def test_twice_the_activations_in_flight(name: str, D: int) -> None:
    """Chimera's per-rank peak spans D/2 + 1 .. D micro-batches [P, Table 3]; a doubled
    unit holds D more on every rank, so the largest peak is 2D, twice Chimera's."""
    for N in (2 * D, 4 * D):
        tl = timeline(program(name, D=D, N=N))
        base = timeline(program("chimera", D=D, N=D))
        peaks = [tl.peak_activations(r) for r in range(D)]
        assert peaks == [base.peak_activations(r) + D for r in range(D)]
        assert max(peaks) == 2 * D and min(peaks) == D + D // 2 + 1
        assert {tl.weight_copies(r) for r in range(D)} == {2}


# ---- every size checks, bad sizes are refused -------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("D", "N"), [(2, 4), (4, 8), (4, 24), (6, 12), (8, 16), (10, 40)])
def test_valid_sizes_pass_check(name: str, D: int, N: int) -> None:
    """Every pass, comms and sync included (what `pipelang check` runs)."""
    api.compile_schedule(name, {"D": str(D), "N": str(N)})


def test_invalid_size_on_the_command_line_is_a_diagnostic() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipelang.cli", "check", "chimera-bwd-half", "-p", "N=6"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr.startswith(
        "error[E0204]: backward halving needs N to be a positive multiple of 2D\n"
    )
    assert "= note: with D = 4, N = 6" in done.stderr
    assert "Traceback" not in done.stderr


# ---- the runtime ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("chimera-fwd-double", ("--optimizer", "sgd")),
        # Backward halving runs at half the micro-batch size (default 4).
        ("chimera-bwd-half", ("--micro-batch-size", "2")),
        ("chimera-bwd-half", ("--micro-batch-size", "2", "--optimizer", "sgd")),
    ],
)
def test_gloo_run_matches_single_process_training(
    name: str, options: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    prog = api.load_program(name, {"D": "4", "N": "8"})
    status = run(prog, "--backend", "gloo", "--steps", "2", "--check", *options)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out


RUN_OPTIONS = ["-p", "D=4", "-p", "N=8", "--model", "gpt:tiny", "--backend", "gloo"]
RUN_OPTIONS += ["--steps", "2", "--check"]


@pytest.mark.slow
def test_cli_run_fwd_double_with_adam() -> None:
    """The command of the docs page (adam is the default), in this process."""
    status, out, err = run_in_process(["run", "chimera-fwd-double", *RUN_OPTIONS])
    assert status == 0, err
    assert "check OK" in out
