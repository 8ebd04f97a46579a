"""`pipelang synthesize`: the order it writes checks, simulates to the makespan it reports,
is never slower than a stdlib schedule on the placement, is optimal where an exhaustive
search can tell, runs with `--check`, and loads in torch's own runtime."""

from __future__ import annotations

import itertools
import json
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
from helpers import make_profile, run, run_in_process, two_nodes

from pipelang import api
from pipelang.cli.args import parse_cost
from pipelang.diagnostics import PipelangError
from pipelang.export import to_torch_csv
from pipelang.import_torch import check_pipe
from pipelang.ir import Kind
from pipelang.synthesis import problem_of, synthesize

pytest.importorskip("ortools", reason="the solver is the `synth` extra")

CASES = [
    # (placement, params, costs, cap)
    ("1f1b", {"D": "4", "N": "8"}, "F=1,B=1,W=1,C=0.5", 6),
    ("1f1b", {"D": "4", "N": "8"}, "F=1,B=2,W=0,C=0.5", 4),
    ("zbv", {"D": "2", "N": "4"}, "F=1,B=1,W=1,F[3]=2,C=0.5,C[1]=1", 4),
    ("chimera", {"D": "4", "N": "4"}, "F=1,B=2,W=1,C=0.25", 4),
    ("interleaved-1f1b", {"D": "2", "N": "4"}, "F=1,B=2,C=0.5", None),
]


def solve(sched: str, params: dict[str, str], cost: str, cap: float | None, **kw: object):
    split = True if sched == "1f1b" else None
    return synthesize(
        sched, params, costs=parse_cost(cost), max_activations=cap, split=split, time_limit=20, **kw
    )


@pytest.mark.parametrize(("sched", "params", "cost", "cap"), CASES)
def test_the_written_order_checks_and_simulates_to_what_was_reported(
    sched: str, params: dict[str, str], cost: str, cap: int | None
) -> None:
    found = solve(sched, params, cost, cap)
    compiled = check_pipe(found.text, "synth.pipe")  # as `pipelang check` reads it
    timeline = compiled.timeline()  # under the file's own `cost` lines
    assert timeline.makespan == pytest.approx(found.makespan)
    program = compiled.need_program()
    peaks = [timeline.peak_activations(r) for r in range(program.num_ranks)]
    assert max(peaks) == found.peak
    if cap is not None:
        assert found.peak <= cap
    assert found.bound <= found.makespan + 1e-9
    # The placement is kept: every op on the rank the schedule puts it.
    original = api.compile_schedule(sched, params, stop_after="validate").need_program()
    assert [p.placement for p in program.pipelines] == [p.placement for p in original.pipelines]
    assert found.best_stdlib is not None
    assert found.makespan <= found.best_stdlib.makespan + 1e-9
    assert f"makespan {timeline.makespan:g}" in found.text.splitlines()[2]


def test_uneven_costs_give_a_strictly_faster_order_than_every_stdlib_one() -> None:
    """With transfers and room for 1.5x 1F1B's activations, ZB-H1 (33) is the best
    stdlib schedule that fits; the solver proves 28.5 optimal."""
    found = solve("1f1b", {"D": "4", "N": "8"}, "F=1,B=1,W=1,C=0.5", 6)
    assert found.best_stdlib is not None and found.best_stdlib.name == "stdlib zb-h1"
    assert found.best_stdlib.makespan == 33
    assert (found.makespan, found.bound, found.status) == (28.5, 28.5, "optimal")


def test_the_bound_is_below_every_stdlib_order_on_the_placement() -> None:
    """Without a cap, no stdlib schedule on the placement may beat the proven bound."""
    cost = parse_cost("F=1,B=1,W=1,F[3]=2,B[3]=2,C=0.3,C[1]=1")
    found = synthesize("1f1b", {"D": "4", "N": "8"}, costs=cost, split=True, time_limit=20)
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        compiled = api.compile_schedule(
            name, {"D": "4", "N": "8"}, costs=cost, stop_after="validate"
        )
        assert compiled.timeline().makespan >= found.bound - 1e-9, name
    assert found.status == "optimal" and found.bound == found.makespan


def _exhaustive_best(sched: str, params: dict[str, str], cost: str, cap: float) -> float:
    """The fastest order under the cap by trying every per-rank permutation that keeps
    each rank's own dependencies (an oracle independent of the solver)."""
    problem, _ = problem_of(sched, params, parse_cost(cost))
    mine = [
        [i for i in range(problem.size) if problem.ranks[i] == r] for r in range(problem.num_ranks)
    ]
    best = float("inf")
    for orders in itertools.product(*(itertools.permutations(ops) for ops in mine)):
        if problem.peak(orders) > cap:
            continue
        start, timed = problem.engine(problem.times).fixed(orders)
        if len(timed) == problem.size:
            best = min(best, max(s + t for s, t in zip(start, problem.times, strict=True)))
    return best


@pytest.mark.parametrize(
    ("cost", "cap"), [("F=1,B=2,C=0.5", 2), ("F=1,B=1,F[2]=2,B[0]=3,C=1,C[0]=0.25", 1)]
)
def test_the_order_is_as_fast_as_an_exhaustive_search_finds(cost: str, cap: float) -> None:
    params = {"D": "3", "N": "2"}
    found = solve("gpipe", params, cost, cap)
    assert found.status == "optimal"
    assert found.makespan == pytest.approx(_exhaustive_best("gpipe", params, cost, cap))


def test_a_file_of_placement_lines_alone_is_a_placement(tmp_path: Path) -> None:
    """No order, and costs on its own `cost` line: the stdlib orders on the placement are
    timed under those costs too."""
    path = tmp_path / "v.pipe"
    path.write_text(
        "schedule v(D: int = 2, N: int = 4) {\n"
        "    ops F, B, W\n"
        "    cost F = 1, B = 1, W = 1, C = 0.5\n"
        "    pipeline main: stage s in 0..2 * D -> rank if s < D then s else 2 * D - 1 - s\n"
        "    microbatches 0..N -> main\n"
        "}\n"
    )
    found = synthesize(str(path), time_limit=20)
    zbv = api.compile_schedule("zbv", {"D": "2", "N": "4"}, costs=parse_cost("C=0.5,W=1"))
    assert found.best_stdlib is not None and found.best_stdlib.name == "stdlib zbv"
    assert found.best_stdlib.makespan == zbv.timeline().makespan == 26.5
    assert found.makespan <= 26.5
    assert found.program.name == "v_synth"


def test_a_cap_below_what_any_order_meets_names_the_least(tmp_path: Path) -> None:
    status, _, err = run_in_process(
        ["synthesize", "zbv", "-p", "D=2", "-p", "N=4", "--max-activations", "1.5"]
    )
    assert status == 1 and "error[E0601]" in err, err
    assert "rank 0 holds 2 stage(s) of pipeline `main`" in err
    assert "the least cap any order meets here is 2" in err


def test_what_synthesize_cannot_order_is_an_error_at_the_schedule() -> None:
    status, _, err = run_in_process(["synthesize", "seq1f1b", "-p", "D=2", "-p", "N=2"])
    assert status == 1 and "error[E0602]" in err and "sequence chunks" in err, err
    assert "seq1f1b.pipe:" in err
    status, _, err = run_in_process(["synthesize", "1f1b", "-p", "D=4", "--cost", "F[9]=2"])
    assert (status, err) == (
        2,
        "pipelang synthesize: error: `--cost F[9]`: one_f_one_b: the schedule has no stage 9 "
        "(its stages are 0..3)\n",
    )


def test_a_missing_solver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    status, _, err = run_in_process(["synthesize", "1f1b", "-p", "D=2", "-p", "N=2"])
    assert status == 1 and "error[E0603]" in err and "pipelang[synth]" in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-activations", "0"], "--max-activations"),
        (["--time-limit", "-1"], "--time-limit"),
        (["--name", "a b"], "--name 'a b'"),
        (["--name", "schedule"], "not a word of the language"),
        (["--ops", "F"], "--ops"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], message: str) -> None:
    status, _, err = run_in_process(["synthesize", "1f1b", "-p", "D=4", *args])
    assert status == 2 and message in err, err


def test_the_command_writes_the_file_and_prints_the_comparison(tmp_path: Path) -> None:
    out = tmp_path / "zb.pipe"
    status, text, err = run_in_process(
        ["synthesize", "1f1b", "-p", "D=4", "-p", "N=8", "--ops", "F,B,W",
         "--cost", "F=1,B=1,W=1,C=0.5", "--max-activations", "6", "--time-limit", "20",
         "-o", str(out)]
    )  # fmt: skip
    assert status == 0, err
    assert "stdlib zb-h1" in text and "28.5" in text and "optimal" in text
    status, text, err = run_in_process(["simulate", str(out), "--json"])
    assert status == 0 and '"makespan": 28.5' in text, err


def _torch_loads(csv_text: str, path: Path, ranks: int, stages: int, mbs: int) -> dict[int, int]:
    """torch's runtime reads the CSV (`_load_csv` validates it and adds its own sends and
    receives) and its simulator runs the result to the end; returns each rank's count
    of compute and transfer actions (its UNSHARD, RESHARD and REDUCE_GRAD bookkeeping
    left out: its simulator knows none of them)."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    from torch.distributed.pipelining.stage import PipelineStage

    path.write_text(csv_text)
    local = []
    for index in range(stages):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = 0, ranks, None
        stage.num_stages, stage.stage_index = stages, index
        local.append(stage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runtime = ts._PipelineScheduleRuntime(local, mbs)
        runtime._load_csv(str(path))
    ordered = {
        r: [
            a
            for a in actions
            if a.computation_type.name not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")
        ]
        for r, actions in runtime.pipeline_order_with_comms.items()
    }
    mapping = runtime.stage_index_to_group_rank
    done = ts._simulate_comms_compute(ordered, lambda s: mapping[s], stages)
    return {r: sum(a is not None for a in row) for r, row in done.items()}


@pytest.mark.parametrize(("sched", "params", "cost", "cap"), [CASES[0], CASES[2]])
def test_torch_runs_the_exported_order(
    sched: str, params: dict[str, str], cost: str, cap: int, tmp_path: Path
) -> None:
    found = solve(sched, params, cost, cap)
    program = found.program
    counts = _torch_loads(
        to_torch_csv(program), tmp_path / "s.csv", program.num_ranks, program.num_stages,
        program.num_microbatches,
    )  # fmt: skip
    for rank, actions in enumerate(program.ranks):
        compute = sum(a.kind in (Kind.F, Kind.B, Kind.W) for a in actions)
        assert counts[rank] > compute  # every compute op, and torch's transfers


@pytest.mark.slow
@pytest.mark.parametrize(("sched", "params", "cost", "cap"), [CASES[0], CASES[2]])
def test_the_synthesized_order_trains_as_the_reference_does(
    sched: str, params: dict[str, str], cost: str, cap: int, tmp_path: Path
) -> None:
    path = tmp_path / "synth.pipe"
    path.write_text(solve(sched, params, cost, cap).text)
    program = api.load_program(str(path))
    assert run(program, "--model", "gpt:tiny", "--backend", "gloo", "--steps", "2", "--check") == 0


def test_a_profile_gives_each_stage_its_layers_times_and_a_topology_its_links(
    tmp_path: Path,
) -> None:
    """Eight layers on four stages (two each, the last two layers twice as slow), the
    middle boundary between two nodes: the written costs are the layers' sums and the
    link's time, and the order is timed under them."""
    profile = make_profile([1.0] * 6 + [2.0, 2.0], output=4e6)
    (tmp_path / "p.json").write_text(profile.to_json())
    (tmp_path / "t.yaml").write_text(
        "nodes: 2\ngpus_per_node: 2\nmemory: 80GiB\n"
        "intra_node: {bandwidth: 400GB/s}\ninter_node: {bandwidth: 1GB/s}\n"
    )
    out = tmp_path / "s.pipe"
    status, _, err = run_in_process(
        ["synthesize", "1f1b", "-p", "D=4", "-p", "N=4", "--ops", "F,B,W",
         "--profile", str(tmp_path / "p.json"), "--topology", str(tmp_path / "t.yaml"),
         "-o", str(out)]
    )  # fmt: skip
    assert status == 0, err
    text = out.read_text()
    assert "cost F[0] = 2, F[1] = 2, F[2] = 2, F[3] = 4" in text  # ms, summed per stage
    assert "cost B[0] = 4, B[1] = 4, B[2] = 4, B[3] = 8" in text
    assert "C[0] = 0.01, C[1] = 4, C[2] = 0.01" in text  # 4 MB at 400 GB/s and at 1 GB/s
    compiled = check_pipe(text, "s.pipe")
    assert f"makespan {compiled.timeline().makespan:g};" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-p", "D=4"], "the profile of synthetic has 3 layers, and one_f_one_b's placement "
         "has 4 stages"),
        (["-p", "D=2", "--topology", "t.yaml"], "the topology has 1 devices"),
    ],
)  # fmt: skip
def test_a_profile_or_topology_that_does_not_fit_the_placement(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_text(make_profile([1.0] * 3).to_json())
    (tmp_path / "t.yaml").write_text("nodes: 1\ngpus_per_node: 1\nmemory: 80GiB\n")
    status, _, err = run_in_process(["synthesize", "1f1b", "--profile", "p.json", *args])
    assert status == 1 and "error[E0604]" in err and message in err, err


def test_a_cap_in_bytes_holds_as_simulate_measures_the_model(tmp_path: Path) -> None:
    """Capped at the bytes 1F1B's fullest rank holds for gpt:tiny: `simulate --model`
    (its own measurement, another path) finds every rank of the answer within the cap,
    and its largest rank at the peak the synthesizer reported."""
    one_f_one_b = ["1f1b", "-p", "D=4", "-p", "N=8", "--model", "gpt:tiny", "--json"]
    status, text, err = run_in_process(["simulate", *one_f_one_b])
    assert status == 0, err
    cap = max(row["peak_activation_bytes"] for row in json.loads(text)["ranks"])
    out = tmp_path / "s.pipe"
    status, text, err = run_in_process(
        ["synthesize", "1f1b", "-p", "D=4", "-p", "N=8", "--ops", "F,B,W",
         "--cost", "F=1,B=1,W=1,C=0.5", "--model", "gpt:tiny",
         "--max-activation-bytes", str(cap), "--time-limit", "20", "-o", str(out), "--json"]
    )  # fmt: skip
    assert status == 0, err
    found = json.loads(text)
    assert f"at most {cap:,} bytes of activations per rank" in out.read_text()
    status, text, err = run_in_process(["simulate", str(out), "--model", "gpt:tiny", "--json"])
    assert status == 0, err
    peaks = [row["peak_activation_bytes"] for row in json.loads(text)["ranks"]]
    assert max(peaks) <= cap and max(peaks) == found["peak_activations"]
    assert found["makespan"] < found["best_stdlib"]["makespan"]  # bytes, not counts, bind


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-activation-bytes", "1MiB"], "--max-activation-bytes and --model go together"),
        (["--model", "gpt:tiny"], "--max-activation-bytes and --model go together"),
        (["--max-activation-bytes", "1MiB", "--model", "gpt:tiny", "--max-activations", "4"],
         "give the cap once"),
        (["--max-activation-bytes", "lots", "--model", "gpt:tiny"], "cannot read `lots`"),
    ],
)  # fmt: skip
def test_bad_byte_caps_are_usage_errors(args: list[str], message: str) -> None:
    status, _, err = run_in_process(["synthesize", "1f1b", "-p", "D=4", *args])
    assert status == 2 and message in err, err


def test_a_byte_cap_below_what_any_order_meets_names_the_bytes() -> None:
    status, _, err = run_in_process(
        ["synthesize", "1f1b", "-p", "D=4", "--model", "gpt:tiny",
         "--max-activation-bytes", "1KiB"]
    )  # fmt: skip
    assert status == 1 and "error[E0601]: no order holds at most 1,024 bytes" in err, err
    assert "the least cap any order meets here is" in err and "bytes" in err


def test_more_ops_than_the_solver_takes_is_an_error_at_once() -> None:
    args = ["synthesize", "1f1b", "-p", "D=16", "-p", "N=200", "--ops", "F,B,W"]
    status, _, err = run_in_process(args)
    assert status == 1 and "error[E0605]: one_f_one_b has 9,600 ops to order here" in err, err
    assert "more than 8,192: the most `synthesize` orders" in err


def test_a_name_from_the_api_cannot_add_text_to_the_written_file() -> None:
    with pytest.raises(PipelangError, match=r"is not a name a \.pipe allows"):
        synthesize("1f1b", {"D": "2", "N": "2"}, name="x() {}\nschedule y")


def test_a_written_plan_is_ordered_under_its_own_costs(tmp_path: Path) -> None:
    """`pipelang plan -o BEST.pipe` writes the partition, each stage's costs and each
    boundary's link (`C[b]`, here one slow link between two nodes); `synthesize` takes
    the file as it is, times it as `simulate` does, is never slower, and keeps the
    partition its costs are for."""
    from pipelang.planner.plans import Inputs
    from pipelang.planner.search import Planner
    from pipelang.planner.write import plan_source

    topology = two_nodes()
    profile = make_profile([1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0, 2.0], output=2e6)
    planner = Planner(Inputs(profile, topology, 8, schedules=("zb-h1",)))
    plan = next(p for p in planner.search().plans if p.candidate.ranks == 4)
    path = tmp_path / "best.pipe"
    path.write_text(plan_source(plan, planner, "p.json", "t.yaml"))
    planned = api.compile_schedule(str(path)).timeline()
    found = synthesize(str(path), time_limit=5)
    assert found.exact_times  # the plan's costs have 4 decimals at most
    assert found.makespan <= planned.makespan
    check_pipe(found.text, "<synthesized>")
    assert "C[" in found.text  # the slow link is kept
    assert found.program.partition == plan.partition  # `run` cuts the model as planned


def test_the_written_file_keeps_the_schedule_s_after_edges() -> None:
    """GEMS holds each micro-batch's first forward back with `after` edges; the solver
    orders under them, and the written file declares them again, so the order runs (and
    simulates) under the same constraints as the one it was found under."""
    found = synthesize("gems", {"D": "4", "N": "4"}, time_limit=5)
    own = api.compile_schedule("gems", {"D": "4", "N": "4"}).need_program()
    edges = {(d.earlier.text(), d.later.text()) for d in own.after}
    assert edges and {(d.earlier.text(), d.later.text()) for d in found.program.after} == edges
    assert found.makespan <= api.compile_schedule("gems", {"D": "4", "N": "4"}).timeline().makespan


def test_a_partition_cuts_the_profile_and_the_model_and_is_written(tmp_path: Path) -> None:
    """`--partition 3,3,1,1`: the profile's eight layers are summed over that cut (the
    last two, twice as slow, a stage each), and the written file keeps the cut; with
    `--model`, the byte cap holds on that cut as `simulate --model --partition` measures
    it."""
    profile = make_profile([1.0] * 6 + [2.0, 2.0])
    (tmp_path / "p.json").write_text(profile.to_json())
    out = tmp_path / "s.pipe"
    base = ["synthesize", "zb-h1", "-p", "D=4", "-p", "N=8", "--partition", "3,3,1,1"]
    status, _, err = run_in_process([*base, "--profile", str(tmp_path / "p.json"), "-o", str(out)])
    assert status == 0, err
    text = out.read_text()
    assert "cost F[0] = 3, F[1] = 3, F[2] = 2, F[3] = 2" in text and "partition 3, 3, 1, 1" in text
    cut = ["--model", "gpt:tiny", "--partition", "3,2,1,2", "--json"]
    status, got, err = run_in_process(["simulate", "1f1b", "-p", "D=4", "-p", "N=8", *cut])
    assert status == 0, err
    cap = max(row["peak_activation_bytes"] for row in json.loads(got)["ranks"])
    status, got, err = run_in_process(
        [*base[:-1], "3,2,1,2", "--model", "gpt:tiny", "--max-activation-bytes", str(cap),
         "--cost", "F=1,B=1,W=1", "--time-limit", "10", "-o", str(out), "--json"]
    )  # fmt: skip
    assert status == 0, err
    status, text, err = run_in_process(["simulate", str(out), "--model", "gpt:tiny", "--json"])
    assert status == 0, err  # the file's own `partition` line cuts the model
    peaks = [row["peak_activation_bytes"] for row in json.loads(text)["ranks"]]
    assert max(peaks) <= cap and max(peaks) == json.loads(got)["peak_activations"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--partition", "1,2"], "the partition 1, 2 gives 2 stages; zb_h1's placement has 4"),
        (["--partition", "4,4,4,4", "--model", "gpt:tiny", "--max-activation-bytes", "1GiB"],
         "add up to the 8 layers of gpt:tiny"),
        (["--partition", "1,x"], "expected layer counts"),
        (["--partition", "0,2,3,3"], "the partition 0, 2, 3, 3 leaves a stage without layers"),
    ],
)  # fmt: skip
def test_a_partition_that_does_not_fit_is_a_usage_error(args: list[str], message: str) -> None:
    status, _, err = run_in_process(["synthesize", "zb-h1", "-p", "D=4", "-p", "N=8", *args])
    assert status == 2 and message in err, err
