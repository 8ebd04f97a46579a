"""`pipelang synthesize` at its edges (issue 44): activations counted exactly against the
cap, overlapped pairs timed as the written file runs them, the written file for any
parameter names, rank count and placement, and bad input answered as such. Over random
small problems: the reported makespan is `simulate`'s of the written file, within the
cap, never slower than its start, and `optimal` only at a bound no order beats."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

import pipelang
from pipelang import api
from pipelang.cli.args import parse_cost
from pipelang.diagnostics import PipelangError
from pipelang.import_torch import check_pipe
from pipelang.synthesis import problem_of, synthesize
from tests.helpers import run_in_process

pytest.importorskip("ortools", reason="the solver is the `synth` extra")

TWO = {"D": "2", "N": "2"}


def test_activations_are_counted_exactly_against_the_cap() -> None:
    """W's share of a thousandth and less is counted as it is: 1F1B's 12 holds 1.0004
    and does not fit a cap of 1; 12 fits a cap of 1.0019 holding 1.0015."""
    found = synthesize("1f1b", TWO, costs=parse_cost("F=1,B=1,W=3,MW=0.0004"),
                       max_activations=1, split=True, time_limit=20)  # fmt: skip
    assert (found.makespan, found.bound, found.status, found.peak) == (14, 14, "optimal", 1)
    found = synthesize("1f1b", TWO, costs=parse_cost("F=1,B=1,W=3,MW=0.0015"),
                       max_activations=1.0019, split=True, time_limit=20)  # fmt: skip
    assert (found.makespan, found.bound, found.status) == (12, 12, "optimal")
    assert found.peak == pytest.approx(1.0015) and found.peak <= 1.0019


def test_overlapped_pairs_are_timed_as_the_written_file_runs_them() -> None:
    """DualPipeV's pairs at FB = 1.5 give 28; the written file keeps them (`&`, `FB`),
    and the solver, which does not pair ops, claims no optimum it cannot prove."""
    costs = parse_cost("F=1,B=2,W=1,FB=1.5")
    found = synthesize("zbv", {"D": "2", "N": "4"}, costs=costs, split=True, time_limit=20)
    assert found.start.name == "stdlib dualpipev" and found.start.makespan == 28
    assert found.makespan <= 28 and found.bound <= found.makespan
    assert check_pipe(found.text, "s.pipe").timeline().makespan == found.makespan
    assert found.status != "optimal" and "`FB`" in found.note and "FB = 1.5" in found.text
    # A pair no faster than its ops gains nothing: the solver's optimum stands.
    costs = parse_cost("F=1,B=2,W=1,FB=4")
    found = synthesize("zbv", {"D": "2", "N": "4"}, costs=costs, split=True, time_limit=20)
    assert (found.makespan, found.bound, found.status, found.note) == (33, 33, "optimal", "")


def _simulated(text: str, tmp_path: Path) -> tuple[float, float]:
    """`pipelang simulate`'s makespan and peak activations of a written file."""
    path = tmp_path / "written.pipe"
    path.write_text(text)
    status, out, err = run_in_process(["simulate", str(path), "--json"])
    assert status == 0, err
    report = json.loads(out)
    return report["makespan"], max(row["peak_activations"] for row in report["ranks"])


def _best_of_all_orders(sched: str, cost: str, cap: float | None) -> float:
    """The fastest order of a D = 3, N = 2 problem without W under the cap, by trying
    every per-rank permutation (an oracle independent of the solver)."""
    problem, _ = problem_of(sched, {"D": "3", "N": "2"}, parse_cost(cost), split=False)
    mine = [[i for i in range(problem.size) if problem.ranks[i] == r] for r in range(3)]
    every = itertools.product(*(itertools.permutations(ops) for ops in mine))
    times = [problem.makespan(orders) for orders in every if problem.fits(orders, cap)]
    return min(t for t in times if t is not None)


def test_over_random_problems_the_answer_is_what_the_written_file_runs(tmp_path: Path) -> None:
    rng = random.Random(44)
    for case in range(18):
        sched = rng.choice(["1f1b", "zbv", "gpipe", "1f1b"])
        d, n = rng.choice([2, 3]), rng.choice([2, 3, 4])
        parts = [f"{k}={rng.choice(['0.5', '1', '1.5', '2', '3', '0.25'])}" for k in "FBW"]
        parts.append(f"C={rng.choice(['0', '0.1', '0.5', '1'])}")
        parts.append(f"MW={rng.choice(['0.0004', '0.0015', '0.1', '0.3333', '1'])}")
        if rng.random() < 0.3:
            parts.append(f"FB={rng.choice(['1', '1.5', '2.5', '6'])}")
        cost = ",".join(parts)
        problem, _ = problem_of(sched, {"D": str(d), "N": str(n)}, parse_cost(cost), True)
        least, _ = problem.least_cap()
        cap = rng.choice([None, least, least + float(rng.choice(["0.0004", "0.0019", "0.5"]))])
        found = synthesize(sched, {"D": str(d), "N": str(n)}, costs=parse_cost(cost),
                           max_activations=cap, split=True, time_limit=10, workers=2)  # fmt: skip
        where = f"case {case}: {sched} D={d} N={n} {cost} cap {cap}: {found.summary()}"
        makespan, peak = _simulated(found.text, tmp_path)
        assert makespan == pytest.approx(found.makespan, rel=1e-12, abs=1e-12), where
        assert cap is None or (found.peak <= cap and peak <= cap + 1e-9), where
        assert found.bound <= found.makespan, where
        assert found.status != "optimal" or found.bound == found.makespan, where
        assert found.makespan <= found.start.makespan, where
        stdlib = found.best_stdlib
        assert stdlib is None or found.makespan <= stdlib.makespan, where
    for cost, cap in (("F=1,B=2,C=0.5", 2.0), ("F=1.5,B=1,C=0.25,FB=1", 3.0), ("F=1,B=1", 1.0)):
        found = synthesize("gpipe", {"D": "3", "N": "2"}, costs=parse_cost(cost),
                           max_activations=cap, split=False, time_limit=10)  # fmt: skip
        best = _best_of_all_orders("gpipe", cost, cap)
        assert found.bound <= best + 1e-9 and found.makespan >= best - 1e-9, (cost, found)
        assert found.status != "optimal" or found.makespan == pytest.approx(best), (cost, found)


def _synthesize(*args: str) -> tuple[int, str, str]:
    return run_in_process(["synthesize", *args, "--time-limit", "10", "--json"])


def test_a_pipeline_no_micro_batch_takes_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "p.pipe"
    path.write_text(
        "schedule p(D: int = 2, N: int = 2) {\n    ops F, B, W\n"
        "    pipeline main: stage s in 0..D -> rank s\n"
        "    pipeline other: stage s in 0..D -> rank s + 1\n"
        "    microbatches 0..N -> main\n}\n"
    )
    status, out, err = _synthesize(str(path), "-o", str(tmp_path / "s.pipe"))
    assert status == 0, err
    assert json.loads(out)["makespan"] == _simulated((tmp_path / "s.pipe").read_text(), tmp_path)[0]


def test_costs_near_the_largest_are_rounded_down_and_say_so() -> None:
    status, out, err = _synthesize("1f1b", "-p", "D=4", "-p", "N=8", "--cost",
                                   "F=999999999999999,B=0.001")  # fmt: skip
    assert status == 0, err
    report = json.loads(out)
    assert report["exact_times"] is False and report["bound"] <= report["makespan"]
    assert report["status"] in ("optimal", "kept", "feasible")


def test_parameters_named_as_the_writer_s_names(tmp_path: Path) -> None:
    path = tmp_path / "p.pipe"
    path.write_text(
        "schedule p(r: int = 2, s: int = 3, m: int = 2, _r: int = 0) {\n    ops F, B, W\n"
        "    pipeline main: stage x in 0..r -> rank x\n    microbatches 0..m -> main\n}\n"
    )
    status, _, err = _synthesize(str(path), "-o", str(tmp_path / "s.pipe"))
    assert status == 0, err
    text = (tmp_path / "s.pipe").read_text()
    assert "order rank __r {" in text and "stage _s in 0..2" in text and "_m in 0..2" in text


def test_a_hundred_ranks_and_more(tmp_path: Path) -> None:
    status, out, err = _synthesize("1f1b", "-p", "D=120", "-p", "N=2")
    assert status == 0 and json.loads(out)["makespan"] == 242, err
    path = tmp_path / "p.pipe"  # a placement no pattern writes: a chain of functions
    path.write_text(
        "schedule p(D: int = 120, N: int = 1) {\n    ops F, B\n"
        "    pipeline main: stage s in 0..D -> rank (s * 7) % D\n"
        "    microbatches 0..N -> main\n}\n"
    )
    status, out, err = _synthesize(str(path), "-o", str(tmp_path / "s.pipe"))
    assert status == 0, err
    written = api.compile_schedule(str(tmp_path / "s.pipe")).need_program()
    assert written.pipelines[0].placement == tuple((s * 7) % 120 for s in range(120))


def test_ranks_alike_but_for_their_stage_share_a_block() -> None:
    found = synthesize("1f1b", {"D": "20", "N": "2"}, time_limit=5)
    assert (
        "        if r >= 0 and r < 19 {\n            F(0, r) F(1, r) B(0, r) B(1, r)\n"
        in found.text
    )
    assert "        if r == 19 {\n            F(0, 19) B(0, 19) F(1, 19) B(1, 19)\n" in found.text


@pytest.mark.slow
def test_the_most_ranks_are_written_in_a_file_check_reads() -> None:
    """4,096 ranks of 2 ops (8,192): one `if` per rank was past the parser's tokens."""
    found = synthesize("1f1b", {"D": "4096", "N": "1"}, time_limit=5)
    assert found.makespan == 8192 and found.status == "optimal"


def test_max_ops_is_the_limit_and_names_the_solver_s() -> None:
    status, out, err = _synthesize("1f1b", "-p", "D=4", "-p", "N=8", "--max-ops", "20")
    assert status == 1 and "error[E0605]: one_f_one_b has 64 ops to order here, more " in err
    assert "than 20: `--max-ops` (at most 8,192:" in err and json.loads(out)["ok"] is False
    status, out, err = _synthesize("1f1b", "--max-ops", "20000")
    assert status == 2 and "--max-ops: must be 1 to 8,192, not 20,000 (synthesize orders" in err
    with pytest.raises(PipelangError, match=r"max_ops=9000: expected a whole number of ops"):
        synthesize("1f1b", TWO, max_ops=9000)


@pytest.mark.parametrize("command", ["synthesize", "simulate", "compile"])
def test_a_partition_of_huge_numbers_is_refused_at_once(command: str) -> None:
    args = [command, "1f1b", "-p", "D=2", "--partition", "999999999999999999999999,1"]
    status, _, err = run_in_process(
        args + (["--model", "gpt:tiny"] if command != "synthesize" else [])
    )
    assert (
        status == 2 and "a stage has at most 1,000,000 layers, not 999999999999999999999999" in err
    )


def test_a_model_too_large_to_measure_is_a_usage_error() -> None:
    """Measured where the bytes are measured (`measure.stage_activation_bytes`), so that
    synthesize and simulate --model say the same (simulate's was an internal error)."""
    status, out, err = _synthesize("1f1b", "-p", "D=2", "-p", "N=2", "--model", "gpt:tiny",
                                   "--max-activation-bytes", "1GB",
                                   "--seq-len", "999999999999999999")  # fmt: skip
    said = "cannot measure `gpt:tiny`'s activations with --micro-batch-size 4 "
    assert status == 2 and said in err, err
    assert "--seq-len 999,999,999,999,999,999:" in err and json.loads(out)["ok"] is False
    status, _, err = run_in_process(
        ["simulate", "1f1b", "--model", "gpt:tiny", "--seq-len", "999999999999999999"]
    )
    assert status == 2 and said in err and "--seq-len 999,999,999,999,999,999:" in err, err


PLACEMENT = (
    "schedule p(D: int = 2, N: int = 2) {{\n    ops F, B\n"
    "    pipeline main: stage s in 0..D -> rank s\n    microbatches 0..N -> main\n"
    "    {after}\n}}\n"
)


def test_after_edges_of_a_placement_are_kept_or_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.pipe"
    path.write_text(PLACEMENT.format(after="F(1, 0) after B(1, 0)"))
    status, _, err = _synthesize(str(path))
    assert status == 1 and "error[E0306]: no order runs these ops: they wait on each other" in err
    assert "`F1@0/main` -> `B1@0/main` -> `F1@0/main`" in err and ":5:5" in err, err
    path.write_text(PLACEMENT.format(after="F(1, 0) after B(0, 0)"))
    status, _, err = _synthesize(str(path), "-o", str(tmp_path / "s.pipe"))
    assert status == 0, err
    text = (tmp_path / "s.pipe").read_text()
    assert "    F(1, 0) after B(0, 0)\n" in text and "F(0, r) B(0, r) F(1, r) B(1, r)" in text


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"max_activations": True},
            r"max_activations=True: expected a finite number of micro-batches more than 0, "
            "not a bool",
        ),
        ({"max_activations": "6"}, r"max_activations='6': expected a finite number"),
        ({"max_activations": float("nan")}, r"max_activations=nan: expected a finite number"),
        ({"time_limit": -1}, r"time_limit=-1: expected a finite number of seconds more than 0"),
        ({"time_limit": float("nan")}, r"time_limit=nan: expected"),
        ({"time_limit": None}, r"time_limit=None: expected"),
        ({"split": "no"}, r"split='no': expected True \(B and W\), False"),
        ({"name": 5}, r"the schedule's name 5 is not a name a \.pipe allows"),
        ({"costs": {"F": 10**400}}, r"cost `F` is past 10\^308"),
    ],
)
def test_the_api_s_arguments_are_checked(given: dict[str, object], message: str) -> None:
    with pytest.raises(PipelangError, match=message):
        pipelang.synthesize("1f1b", D=2, N=2, **given)  # type: ignore[arg-type]
