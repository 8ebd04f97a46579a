"""BPipe (Kim et al., ICML'23): 1F1B plus evicting activations to a partner rank.

Oracles: 1F1B compiled from `schedules/1f1b.pipe` (compute order, makespan), the 1F1B
facts of reference/dsl_and_schedules.md section 3 (rank r keeps D - r activations, so a
pair (r, D-1-r) keeps D + 1, about ceil((D+1)/2) each), and timelines worked out by hand
for a two-rank program. The expected peaks are derived below from those facts alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipelang import api
from pipelang.cli.args import parse_cost
from pipelang.diagnostics import PipelangError
from pipelang.ir import COMPUTE_KINDS, CostModel, Kind, Program
from pipelang.passes.validate.lowered import check_lowered
from pipelang.sim import memory
from pipelang.sim.timeline import Timeline
from tests.helpers import replay, run_in_process

SIZES = [(D, N) for D in (4, 6, 8) for N in (D, D + 1, 2 * D, 3 * D + 1)]


def compiled(name: str, **params: int) -> Program:
    return api.load_program(name, {k: str(v) for k, v in params.items()})


def run(prog: Program, spec: str = "") -> Timeline:
    return replay(prog, prog.costs.merged(parse_cost(spec)))


def keep(D: int) -> int:
    """ceil((D + 1) / 2): what each rank of a pair keeps when the pair's D + 1 is split."""
    return -(-(D + 1) // 2)


def expected_peaks(D: int) -> list[int]:
    """Rank r keeps D - r under 1F1B. A rank over `keep` sheds the excess to its partner
    D - 1 - r and keeps exactly `keep`; that partner keeps its own D - p plus the excess
    of its heavy partner, (p + 1) - keep, which is D + 1 - keep; any other rank keeps its
    own."""
    peaks = []
    for r in range(D):
        heavy_partner_excess = (r + 1) - keep(D)  # D - (D - 1 - r) = r + 1
        if D - r > keep(D):
            peaks.append(keep(D))
        elif heavy_partner_excess > 0:
            peaks.append(D - r + heavy_partner_excess)
        else:
            peaks.append(D - r)
    return peaks


@pytest.mark.parametrize(("D", "N"), SIZES)
def test_peak_activations_are_balanced(D: int, N: int) -> None:
    bpipe, one_f_one_b = run(compiled("bpipe", D=D, N=N)), run(compiled("1f1b", D=D, N=N))
    assert [one_f_one_b.peak_activations(r) for r in range(D)] == [D - r for r in range(D)]
    peaks = [bpipe.peak_activations(r) for r in range(D)]
    assert peaks == expected_peaks(D)
    assert max(peaks) == keep(D)


def test_expected_peaks_by_hand() -> None:
    """The derivation above, spelled out for the three sizes."""
    assert expected_peaks(4) == [3, 3, 2, 2]
    assert expected_peaks(6) == [4, 4, 4, 3, 3, 3]
    assert expected_peaks(8) == [5, 5, 5, 5, 4, 4, 4, 4]


def compute_order(prog: Program) -> list[list[str]]:
    return [[a.text() for a in acts if a.kind in COMPUTE_KINDS] for acts in prog.ranks]


@pytest.mark.parametrize(("D", "N"), SIZES)
def test_compute_order_is_1f1b(D: int, N: int) -> None:
    assert compute_order(compiled("bpipe", D=D, N=N)) == compute_order(compiled("1f1b", D=D, N=N))


@pytest.mark.parametrize(("D", "N"), SIZES)
@pytest.mark.parametrize("spec", ["", "F=1,B=2", "F=1,B=2,C=0.25"])
def test_makespan_is_1f1b_when_transfers_are_free(D: int, N: int, spec: str) -> None:
    bpipe = run(compiled("bpipe", D=D, N=N), spec)
    assert bpipe.makespan == run(compiled("1f1b", D=D, N=N), spec).makespan
    if "C" not in spec:
        F, B = (1, 2) if spec else (1, 1)
        assert bpipe.makespan == (N + D - 1) * (F + B)


@pytest.mark.parametrize(("D", "N"), SIZES)
def test_evictions_go_to_the_partner_and_hold_there(D: int, N: int) -> None:
    """Each heavy rank r evicts micro-batch k iff k % w >= w - e (w = D - r - 1 warm-up
    forwards, e = its excess), each once, to D - 1 - r, which holds each once; the
    lowered channels match one to one."""
    prog = compiled("bpipe", D=D, N=N)
    for r, acts in enumerate(prog.ranks):
        w, e = D - r - 1, max(0, D - r - keep(D))
        want = [k for k in range(N) if e > 0 and k % w >= w - e]
        assert [a.mb for a in acts if a.kind is Kind.E] == want
        assert {a.peer for a in acts if a.kind is Kind.E} <= {D - 1 - r}
        assert sorted(a.mb for a in acts if a.kind is Kind.L) == want
        held = [a.mb for a in prog.ranks[D - 1 - r] if a.kind is Kind.H and a.stage == r]
        assert sorted(held) == want
    assert check_lowered(prog) == []


@pytest.mark.parametrize("D", range(1, 10))
def test_check_sweep(D: int) -> None:
    """Every size passes every pass (deadlock, channel order, sync) and no rank keeps
    more than ceil((D+1)/2)."""
    for N in (D, D + 1, 2 * D + 3):
        prog = compiled("bpipe", D=D, N=N)
        assert check_lowered(prog) == []
        timeline = run(prog)
        assert max(timeline.peak_activations(r) for r in range(D)) == min(keep(D), D)


TWO_RANKS = """
schedule two(D: int = 2, N: int = 2) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        if r == 0 { F(0) E(0) -> rank 1 F(1) L(0) B(0) B(1) }
        else { F(0) B(0) F(1) B(1) }
    }
}
"""


def test_transfer_costs_by_hand(tmp_path: Path) -> None:
    """F = B = 1. Rank 1 holds E0 right before F1@1 (its first op after the eviction).
    With E = L = x the hold starts at max(3, 1 + x) (after B0@1; the stash arrives at
    1 + x), F1@1 after it, L0 at max(2, hold + x), then B0@0 and B1@0. x = 0: makespan 6,
    as without eviction; x = 3: hold at 4, F1@1 4-5, B1@1 5-6, L0 at 7, B0@0 7-8, B1@0
    8-9. Rank 1 holds micro-batch 0 from 1 to 7 besides its own one: peak 2."""
    path = tmp_path / "two.pipe"
    path.write_text(TWO_RANKS)
    prog = api.load_program(str(path))
    assert [a.text() for a in prog.ranks[1] if a.kind in COMPUTE_KINDS | {Kind.H}] == [
        "F0@1/main",
        "B0@1/main",
        "H0@0/main",
        "F1@1/main",
        "B1@1/main",
    ]
    assert run(prog).makespan == 6
    slow = run(prog, "E=3,L=3")
    assert slow.makespan == 9
    starts = {e.action.text(): e.start for e in slow.events}
    assert (starts["H0@0/main"], starts["L0@0/main"], starts["B1@0/main"]) == (4, 7, 8)
    assert [slow.peak_activations(r) for r in range(2)] == [2, 2]


def test_evictions_over_time_count_what_w_keeps(tmp_path: Path) -> None:
    """With W split off, the count over time (evictions) holds W's share from B to W, as
    the count along the order does (`check --max-activations`, the runtime): rank 0
    holds F1 and, from L0 on, F0 too, so after B1 (W1 still to run) it holds 0.5 + 1 at
    L0. Counted to B, as before, it was 1."""
    path = tmp_path / "split.pipe"
    path.write_text(
        TWO_RANKS.replace("schedule two", "schedule split")
        .replace("    pipeline", "    ops F, B, W\n    cost MW = 0.5\n    pipeline")
        .replace("F(1) L(0) B(0) B(1)", "F(1) B(1) L(0) B(0) W(1) W(0)")
        .replace("F(1) B(1) }", "F(1) B(1) W(0) W(1) }")
    )
    prog = api.load_program(str(path))
    timeline = run(prog)
    w = memory.w_share(prog)
    assert timeline.peak_activations(0) == memory.peak(prog.ranks[0], w) == 1.5
    assert run(prog, "MW=0").peak_activations(0) == 1  # the papers' count to B


def bad(tmp_path: Path, order: str, D: int = 2) -> list[tuple[str, int, str]]:
    path = tmp_path / "bad.pipe"
    path.write_text(
        f"schedule bad(D: int = {D}, N: int = 2) {{\n"
        "    pipeline main: stage s in 0..D -> rank s\n"
        "    microbatches 0..N -> main\n"
        f"    order rank r {{\n{order}\n    }}\n}}\n"
    )
    with pytest.raises(PipelangError) as err:
        api.load_program(str(path))
    return [
        (d.code, d.span.line, d.span.source.text[d.span.start : d.span.end])
        for d in err.value.diagnostics
        if d.span is not None
    ]


GOOD_RANK1 = "        if r == 1 { F(0) B(0) F(1) B(1) }"


@pytest.mark.parametrize(
    ("rank0", "expected"),
    [
        # load missing
        ("F(0) E(0) -> rank 1 F(1) B(0) B(1)", [("E0315", 5, "E(0)")]),
        # B before load
        ("F(0) E(0) -> rank 1 F(1) B(0) L(0) B(1)", [("E0315", 5, "L(0)")]),
        # load with no eviction
        ("F(0) F(1) L(1) B(0) B(1)", [("E0315", 5, "L(1)")]),
        # evict before the forward
        ("E(0) -> rank 1 F(0) F(1) L(0) B(0) B(1)", [("E0315", 5, "E(0)")]),
        # load before the eviction
        ("F(0) L(0) E(0) -> rank 1 F(1) B(0) B(1)", [("E0315", 5, "L(0)")]),
        # evict to self, and to no rank
        ("F(0) E(0) -> rank 0 F(1) L(0) B(0) B(1)", [("E0316", 5, "E(0)")]),
        ("F(0) E(0) -> rank 7 F(1) L(0) B(0) B(1)", [("E0316", 5, "E(0)")]),
        # evicted twice
        ("F(0) E(0) -> rank 1 E(0) -> rank 1 L(0) F(1) B(0) B(1)", [("E0302", 5, "E(0)")]),
    ],
)
def test_bad_evictions_are_rejected_with_spans(
    tmp_path: Path, rank0: str, expected: list[tuple[str, int, str]]
) -> None:
    order = f"        if r == 0 {{ {rank0} }}\n{GOOD_RANK1}"
    found = bad(tmp_path, order)
    assert [(code, line) for code, line, _ in found] == [(c, ln) for c, ln, _ in expected]
    # The caret is on the offending op (the last one with that text on the line).
    assert [text for *_, text in found] == [text for *_, text in expected]


def test_eviction_on_the_wrong_rank(tmp_path: Path) -> None:
    order = (
        "        if r == 0 { F(0) F(1) B(0) B(1) }\n"
        "        if r == 1 { F(0) E(0, 0) -> rank 0 B(0) F(1) B(1) L(0, 0) }"
    )
    assert [code for code, *_ in bad(tmp_path, order)] == ["E0301", "E0301"]


@pytest.mark.parametrize(
    ("order", "message"),
    [
        ("        F(0) E(0) F(1) L(0) B(0) B(1)", "`E` needs the rank to evict to"),
        ("        F(0) L(0) -> rank 1 B(0) F(1) B(1)", "only `E` does"),
        ("        F(0) & E(0) F(1) B(0) B(1)", "cannot be part of an overlapped pair"),
    ],
)
def test_malformed_evictions(tmp_path: Path, order: str, message: str) -> None:
    path = tmp_path / "m.pipe"
    path.write_text(
        "schedule m(D: int = 2, N: int = 2) {\n"
        "    pipeline main: stage s in 0..D -> rank s\n"
        "    microbatches 0..N -> main\n"
        f"    order rank r {{\n{order}\n    }}\n}}\n"
    )
    with pytest.raises(PipelangError) as err:
        api.load_program(str(path))
    (diagnostic,) = err.value.diagnostics
    assert diagnostic.code == "E0103"
    assert message in diagnostic.message


def test_repeat_orders_refuse_evictions(tmp_path: Path) -> None:
    path = tmp_path / "rep.pipe"
    path.write_text(
        "schedule rep(D: int = 2, N: int = 2) {\n"
        "    pipeline main: stage s in 0..D -> rank s\n"
        "    microbatches 0..N -> main\n"
        "    order repeat k every 2 { F(stage=0) @ 0 L(stage=0) @ 1 B(stage=0) @ 3 }\n"
        "}\n"
    )
    with pytest.raises(PipelangError) as err:
        api.load_program(str(path))
    assert [d.code for d in err.value.diagnostics] == ["E0103"]


def test_max_activations_counts_evictions() -> None:
    """`check --max-activations` counts along the order: an evicted forward does not
    count on its rank between its E and its L."""
    api.compile_schedule("bpipe", {"D": "4", "N": "8"}, max_activations=3)
    with pytest.raises(PipelangError) as err:
        api.compile_schedule("1f1b", {"D": "4", "N": "8"}, max_activations=3)
    assert {d.code for d in err.value.diagnostics} == {"E0308"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`pipelang ARGS` in this process (tests/test_cli.py runs the command as a process)."""
    status, out, err = run_in_process(list(args))
    return subprocess.CompletedProcess(list(args), status, out, err)


@pytest.mark.slow
def test_cli_explain_and_cost_keys() -> None:
    for code in ("E0315", "E0316"):
        explained = cli("explain", code)
        assert explained.returncode == 0 and "rank" in explained.stdout
    simulated = cli("simulate", "bpipe", "-p", "D=4", "-p", "N=8", "--cost", "E=0.5,L=0.5")
    assert simulated.returncode == 0, simulated.stderr
    assert "makespan 22" in simulated.stdout


@pytest.mark.slow
def test_run_refuses_evictions_on_cuda_before_any_rank_starts() -> None:
    """Evictions run on the CPU (tests/test_runtime_bpipe.py); the untested CUDA path is
    refused with a message, never run as no-ops."""
    result = cli(
        "run", "bpipe", "-p", "D=4", "-p", "N=8", "--model", "gpt:tiny", "--backend", "nccl"
    )
    assert result.returncode == 1
    assert "evictions have run only on the CPU" in result.stderr
    assert "Traceback" not in result.stderr


def test_action_text_round_trips() -> None:
    prog = compiled("bpipe", D=4, N=8)
    assert Program.from_json(prog.to_json()).ranks == prog.ranks
    costs = CostModel((("E", None, 2.0), ("L", 0, 3.0)))
    assert (costs.of("E", 0), costs.of("L", 0), costs.of("L", 1)) == (2.0, 3.0, 0.0)
