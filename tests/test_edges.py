"""Inputs at the edges (issue 29): text from inputs in written files, limits checked before
the work they limit, numbers at the ends of the float range, readers that validate whole,
a user's model that exits, the API's one error class. One test (or one table) per class;
each case failed before its fix."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

import pipelang
from tests.helpers import GOOD, run_in_process

# ---- text from inputs in written files ----------------------------------------------------


def test_a_file_name_cannot_add_lines_to_a_rank_program(tmp_path: Path) -> None:
    source = tmp_path / 'a\nimport os\r"""x.pipe'
    source.write_text(GOOD)
    status, _, err = run_in_process(["compile", str(source), "-o", str(tmp_path / "out")])
    assert status == 0, err
    text = (tmp_path / "out" / "rank0.py").read_text()
    assert "\\nimport os\\r" in text.splitlines()[0]
    module = ast.parse(text)
    assert not [
        n for n in ast.walk(module) if isinstance(n, ast.Import) and n.names[0].name == "os"
    ]


# ---- limits checked before the work they limit ---------------------------------------------

PROFILE = (
    '{"format": "pipelang-profile/1", "model": "m", "device": "cpu", "micro_batch_size": 1, '
    '"seq_len": 1, "layers": [LAYERS]}'
)
LAYER = (
    '{"name": "l", "forward_ms": 1, "backward_input_ms": 1, "backward_weight_ms": 1, '
    '"activation_bytes": 1000, "weight_bytes": 1000, "output_bytes": 100}'
)


def plan(tmp_path: Path, topology: str, profile: str | None = None) -> tuple[int, str]:
    (tmp_path / "t.yaml").write_text(topology)
    (tmp_path / "p.json").write_text(profile or PROFILE.replace("LAYERS", ",".join([LAYER] * 4)))
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--topology", str(tmp_path / "t.yaml")]
    status, _, err = run_in_process([*args, "--micro-batches", "4", "-o", str(tmp_path / "o.pipe")])
    return status, err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("topology", "message", "line"),
    [
        ("nodes: 1000000000\ngpus_per_node: 1\nmemory: 1GiB\n", "`nodes` must be 1 to 4,096", 1),
        ("nodes: 1\ngpus_per_node: 1000000000\nmemory: 1GiB\n", "`gpus_per_node` must be", 2),
        (
            "memory: 1GiB\ngpus_per_node: 1\nnodes:\n  - &a {count: 4000}\n  - *a\n",
            "8,000 devices; the planner takes at most 4096",
            4,
        ),
        (
            "devices:\n"
            + "".join(f"  - {{name: d{i}, memory: 1GiB}}\n" for i in range(5000))
            + "default_link: {bandwidth: 1GB/s}\n",
            "5,000 devices",
            2,
        ),
        ("nodes: 2\ngpus_per_node: 1\nmemory: 1GiB\nbogus: 1\n", "unknown key `bogus`", 4),
        ("# only a comment\n", "the topology", 0),
        ("[" * 100000, "nests too deep", 0),
        ("nodes: ²\ngpus_per_node: 1\nmemory: 1GiB\n", "expected a whole number, not `²`", 1),
        (
            "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nintra_node: {bandwidth: 1e999GB/s}\n",
            "a bandwidth (bytes per second) is between 0 and 1e+15",
            4,
        ),
        ("nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nspeed: 1e999\n", "a speed is between", 4),
        (
            "nodes: 2\ngpus_per_node: 1\nmemory: 1GiB\ninter_node: {bandwidth: 1GB/s, "
            "latency: 1e999s}\n",
            "a latency (s) is between",
            4,
        ),
    ],
)
def test_a_topology_past_its_limits_is_one_error_at_its_line(
    tmp_path: Path, topology: str, message: str, line: int
) -> None:
    status, err = plan(tmp_path, topology)
    assert status == 1 and "E0402" in err and message in err, err
    if line:
        assert f"t.yaml:{line}:" in err


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (",".join([LAYER] * 1025), "1,025 layers; the planner takes 1024"),
        (LAYER.replace('"forward_ms": 1', '"forward_ms": 1e308'), "must be between 0 and 1e+09"),
        (LAYER.replace('"forward_ms": 1', '"forward_ms": 1' + "0" * 5000), "more than 18 digits"),
        (LAYER.replace("1,", "0,").replace("1000", "0").replace("100}", "0}"), "takes 0 ms"),
        ("[" * 50000, "nests arrays and objects too deep"),
    ],
)
def test_a_profile_past_its_limits_is_one_error(tmp_path: Path, layers: str, message: str) -> None:
    topology = "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nintra_node: {bandwidth: 1GB/s}\n"
    status, err = plan(tmp_path, topology, PROFILE.replace("LAYERS", layers))
    assert status == 1 and "E0401" in err and message in err, err


def test_the_plan_search_stops_at_its_time_budget() -> None:
    """A budget shorter than one candidate's screening leaves candidates out for time,
    said as such, instead of running past it."""
    from pipelang.planner.plans import Inputs
    from pipelang.planner.search import Planner
    from pipelang.planner.topology import Link, Topology
    from pipelang.profile import LayerCost, Profile

    layers = tuple(LayerCost(f"l{i}", 1.0, 1.0, 1.0, 1e3, 1e3, 1e2) for i in range(256))
    size = 64
    link = Link(1e9, 0.0)
    topology = Topology(
        tuple(f"d{i}" for i in range(size)),
        (1e12,) * size,
        tuple(tuple(None if a == b else link for b in range(size)) for a in range(size)),
    )
    profile = Profile("m", "cpu", "float32", 1, 1, layers)
    result = Planner(Inputs(profile, topology, 64), time_budget=0.05).search()
    assert any(r.time for r in result.rejected)
    assert all("time budget" in r.reason for r in result.rejected if r.time)


def test_import_torch_finds_a_hole_without_counting_to_a_huge_id(tmp_path: Path) -> None:
    (tmp_path / "s.csv").write_text("0F0,0F999999999,0B0,0B999999999\n")
    status, _, err = run_in_process(["import-torch", str(tmp_path / "s.csv")])
    assert status == 1 and "micro-batch 1 never appears, but micro-batch 999999999 does" in err
    (tmp_path / "s.csv").write_text("0F0,0F١\n")  # an Arabic-Indic digit is no id
    status, _, err = run_in_process(["import-torch", str(tmp_path / "s.csv")])
    assert status == 1 and "E0007" in err


# ---- readers and exit statuses ------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "status", "message"),
    [
        (b"\xef\xbb\xbf4\n4\n", 0, ""),  # a BOM, as .pipe, CSV and YAML accept
        (b"4\r\n4\r\n", 0, ""),
        (b"4\n\xb2\n", 1, "E0003"),  # Latin-1 superscript two: not UTF-8
        ("4\n²\n".encode(), 1, "expected a whole number, not `²`"),
        (b"4\n" + b"1" * 5000 + b"\n", 1, "has more than 18 digits"),
        (b"\x00\x01\x02", 1, "it is not text"),
        (b"0\n4\n", 1, "must be 1 to"),
        (b"# nothing\n", 1, "lists no micro-batch"),
    ],
)
def test_lengths_files_are_read_whole_and_bad_contents_are_exit_1(
    tmp_path: Path, content: bytes, status: int, message: str
) -> None:
    (tmp_path / "l.txt").write_bytes(content)
    args = ["simulate", "1f1b", "-p", "D=2", "-p", "N=2", "--lengths", str(tmp_path / "l.txt")]
    found, _, err = run_in_process(args)
    assert found == status, err
    assert message in err
    pack = ["pack", "1f1b", "-p", "D=2", "--sequences", str(tmp_path / "l.txt")]
    found, _, err = run_in_process([*pack, "--max-tokens", "100"])
    assert found == status, err  # the same reader, the same answer


def test_pack_finds_the_packing_that_fits_when_one_exists(tmp_path: Path) -> None:
    """The issue's case: one sequence per micro-batch in file order fits the cap (peak 1663
    tokens); pack refused it before it tried that."""
    (tmp_path / "s.txt").write_text("143 38 353 286 906 118 136 353".replace(" ", "\n"))
    args = ["pack", "1f1b", "-p", "D=4", "--sequences", str(tmp_path / "s.txt")]
    status, out, err = run_in_process(
        [*args, "--max-tokens", "1812", "--cost", "F=1,B=2,A=0.3,O=0.05"]
    )
    assert status == 0, err
    assert "dynamic (pack)" in out


def test_pack_refuses_more_sequences_than_its_limit_before_working(tmp_path: Path) -> None:
    (tmp_path / "s.txt").write_text("1\n" * 2049)
    args = ["pack", "1f1b", "--sequences", str(tmp_path / "s.txt"), "--max-tokens", "10"]
    status, _, err = run_in_process(args)
    assert status == 2 and "2,049 sequences; pack takes at most 2,048" in err


# ---- numbers at the ends of the float range -------------------------------------------------


def test_times_that_add_up_past_the_limit_are_an_error_not_inf(tmp_path: Path) -> None:
    text = GOOD.replace("{\n", "{\n    lengths 100000000000000000, 1\n", 1)
    (tmp_path / "s.pipe").write_text(text)
    status, out, err = run_in_process(["simulate", str(tmp_path / "s.pipe"), "--cost", "S=1"])
    assert status == 1 and "E0209" in err and "past the 10^15 an op may take" in err
    assert "inf" not in out
    status, _, err = run_in_process(["simulate", "1f1b", "--cost", "S=0.5"])
    assert status == 2 and "`S` is the reference's tokens" in err


@pytest.mark.parametrize("kind", pipelang.ir.COST_KINDS)
def test_every_cost_name_is_read_by_the_file_the_command_line_and_the_api(
    tmp_path: Path, kind: str
) -> None:
    """One list of cost names (`ir.COST_KINDS`): a `cost` line, `--cost` and the API's
    costs take each, and refuse it past its range with the same words."""
    value, bad = ("1", "10000000000000000") if kind not in ("A", "O", "KV") else ("0.5", "2")
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("{\n", f"{{\n    cost {kind} = {value}\n", 1))
    assert run_in_process(["simulate", str(path)])[0] == 0
    assert run_in_process(["simulate", "1f1b", "--cost", f"{kind}={value}"])[0] == 0
    pipelang.load("1f1b").simulate({kind: float(value)})
    path.write_text(GOOD.replace("{\n", f"{{\n    cost {kind} = {bad}\n", 1))
    status, _, err = run_in_process(["simulate", str(path)])
    status_cli, _, err_cli = run_in_process(["simulate", "1f1b", "--cost", f"{kind}={bad}"])
    with pytest.raises(pipelang.PipelangError) as api_error:
        pipelang.load("1f1b").simulate({kind: float(bad)})
    problem = pipelang.ir.cost_problem(kind, float(bad))
    assert problem is not None and (status, status_cli) == (1, 2)
    assert problem in err and problem in err_cli and problem in str(api_error.value)


def test_an_unknown_cost_name_is_refused_with_the_same_words_everywhere(tmp_path: Path) -> None:
    """The grammar takes any name in a `cost` line and `ir.cost_name_problem` judges it,
    as it judges the API's keys: one list of names, one message, at the name."""
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("{\n", "{\n    cost Q = 1\n", 1))
    status, _, err = run_in_process(["check", str(path)])
    with pytest.raises(pipelang.PipelangError) as api_error:
        pipelang.load("1f1b").simulate({"Q": 1})
    problem = pipelang.ir.cost_name_problem("Q")
    assert problem == "no cost `Q`; costs are " + ", ".join(pipelang.ir.COST_KINDS)
    assert status == 1 and f"error[E0209]: {problem}" in err and ":2:10" in err, err
    assert problem in str(api_error.value)


# ---- a user's model that exits or raises ----------------------------------------------------


@pytest.mark.slow  # each case loads the model in a child process first
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("import sys\nsys.exit(0)\ndef f(): pass\n", "importing `m.py` called sys.exit(0)"),
        ("import sys\ndef f():\n    sys.exit(0)\n", "`f()` called sys.exit(0)"),
        ("raise RuntimeError('boom')\n", "importing `m.py` failed: RuntimeError: boom"),
    ],
)
def test_a_model_file_that_exits_or_raises_is_the_users_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(body)
    args = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--model", "m.py:f", "--steps", "1"]
    status, _, err = run_in_process([*args, "--backend", "local"])
    assert status == 1 and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow  # each case loads the model in a child process first
@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("nn.Sequential()", "returns an empty nn.Sequential: no layers to split into stages"),
        ("[]", "returns an empty list: no stage modules"),
        ('{"model": ()}', "returns an empty tuple: no stage modules"),
    ],
)
def test_a_model_with_no_layers_is_called_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, returned: str, message: str
) -> None:
    """An empty nn.Sequential was answered "must return an nn.Sequential ... not
    Sequential" (issue 44)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(f"from torch import nn\ndef f():\n    return {returned}\n")
    args = ["simulate", "1f1b", "-p", "D=2", "-p", "N=2", "--model", "m.py:f"]
    status, _, err = run_in_process(args)
    assert (status, err) == (2, f"pipelang simulate: error: `--model m.py:f`: `f()` {message}\n")


# ---- the Python API raises PipelangError ----------------------------------------------------


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda s: s.simulate([1, 2]), "E0209"),
        (lambda s: s.simulate({"F": [5]}), "E0209"),
        (lambda s: s.simulate({"F": float("nan")}), "E0209"),
        (lambda s: s.simulate({"S": 1e-150}), "E0209"),
        (lambda s: s.simulate({"Q": 1}), "E0209"),
        (lambda s: s.ops("0"), "usage"),
        (lambda s: pipelang.load("1f1b", N=10**5000), "E0203"),
        (lambda s: pipelang.load("nope"), "E0003"),
    ],
)
def test_every_bad_api_input_is_a_pipelang_error(call: Any, code: str) -> None:
    """More cases in test_api.py; one `except PipelangError` catches them all."""
    schedule = pipelang.load("1f1b", D=2, N=2)
    with pytest.raises(pipelang.PipelangError) as raised:
        call(schedule)
    assert raised.value.diagnostics[0].code == code


# ---- nothing a user gives is dropped in silence ---------------------------------------------


def test_exports_keep_micro_batch_shapes_or_refuse_them(tmp_path: Path) -> None:
    (tmp_path / "l.txt").write_text("2 512\n1 1024\n")
    args = ["export", "1f1b", "-p", "D=2", "-p", "N=2", "--lengths", str(tmp_path / "l.txt")]
    status, out, err = run_in_process(args)
    assert status == 0, err
    assert json.loads(out)["shapes"] == [
        {"samples": 2, "length": 512},
        {"samples": 1, "length": 1024},
    ]
    status, _, err = run_in_process([*args, "--format", "torch-csv"])
    assert status == 2 and "torch's CSV format has one micro-batch shape" in err


# ---- errors point at what the user wrote ----------------------------------------------------


def test_import_torch_errors_point_at_the_csv_cell(tmp_path: Path) -> None:
    (tmp_path / "bad.csv").write_text("0F0,0F1,0B0,0B1\n1B0,1F0,1F1,1B1\n")
    status, _, err = run_in_process(["import-torch", str(tmp_path / "bad.csv")])
    assert status == 1 and "E0304" in err
    assert "bad.csv:2:1" in err and "bad.csv:2:5" in err and "<import-torch" not in err


@pytest.mark.parametrize("out", [[], ["-o", "OUT"]], ids=["stdout", "-o"])
def test_import_torch_errors_point_at_the_csv_row(out: list[str], tmp_path: Path) -> None:
    """A missing op points at the row of the rank that lacks it, and with `-o` too (the
    written `.pipe`'s `order` line was shown: the user wrote the CSV) (issue 44)."""
    csv = tmp_path / "miss.csv"
    csv.write_text("0F0,0B0\n1F0\n")
    out = [str(tmp_path / "miss.pipe") if o == "OUT" else o for o in out]
    status, _, err = run_in_process(["import-torch", str(csv), *out])
    assert status == 1
    assert err.startswith(
        f"error[E0303]: rank 1 never runs `B0@1/main`\n --> {csv}:2:1\n  |\n2 | 1F0\n  | ^^^\n"
    ), err
    csv.write_text("0F0,0F1,0B0,0B1\n1B0,1F0,1F1,1B1\n")
    status, _, err = run_in_process(["import-torch", str(csv), *out])
    assert status == 1 and f"{csv}:2:1" in err and f"{csv}:2:5" in err and ".pipe" not in err


def test_pack_on_a_schedule_with_a_syntax_error_points_at_it(tmp_path: Path) -> None:
    (tmp_path / "s.pipe").write_text(GOOD.replace("microbatches", "microbatchez"))
    (tmp_path / "s.txt").write_text("10\n20\n")
    args = ["pack", str(tmp_path / "s.pipe"), "--sequences", str(tmp_path / "s.txt")]
    status, _, err = run_in_process([*args, "--max-tokens", "100"])
    assert status == 1 and "E0001" in err and "s.pipe:3:18" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "1f1b", "--steps", "99999999999999999999"],
        ["run", "1f1b", "--steps", "1000000001"],
        ["check", "1f1b", "--max-ops", "²"],
    ],
)
def test_numbers_on_the_command_line_are_bounded(argv: list[str]) -> None:
    status, _, err = run_in_process(argv)
    assert status == 2 and "error: argument" in err


def test_a_memory_cap_of_zero_is_a_bad_command_line(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\n")
    (tmp_path / "p.json").write_text(PROFILE.replace("LAYERS", LAYER))
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--topology", str(tmp_path / "t.yaml")]
    status, _, err = run_in_process(
        [*args, "--micro-batches", "4", "-o", str(tmp_path / "o.pipe"), "--max-memory", "0"]
    )
    assert status == 2 and "--max-memory" in err


# ---- one table of features against consumers --------------------------------------------

FEATURED = {
    "pipelines": ("chimera", {}),
    "recompute": ("chimera-fwd-double", {}),
    "weights": ("pipedream", {}),
    "frozen": ("diffusionpipe", {}),
    "chunks": ("seq1f1b", {}),
    "evictions": ("bpipe", {}),
}


@pytest.mark.parametrize("feature", [*FEATURED, "shapes"])
def test_every_refusal_comes_from_the_feature_table(feature: str, tmp_path: Path) -> None:
    """Each feature is found where a schedule uses it (`features.USES`), and every
    consumer that cannot run it says so with the table's words (the CLI's torch CSV
    export among them); 1F1B, which uses none, is refused by nobody."""
    from pipelang.features import REFUSED, USES, refusal

    if feature == "shapes":
        program = pipelang.api.compile_schedule(
            "1f1b", {"D": "2", "N": "2"}, shapes=((1, 16), (1, 32))
        ).need_program()
        (tmp_path / "l.txt").write_text("16\n32\n")
        cli = ["export", "1f1b", "-p", "D=2", "-p", "N=2", "--lengths", str(tmp_path / "l.txt")]
    else:
        name, params = FEATURED[feature]
        program = pipelang.load(name, **params).program
        cli = ["export", name]
    assert USES[feature](program) is not None
    alone = all(USES[other](program) is None for other in USES if other != feature)
    plain = pipelang.load("1f1b").program
    for consumer, refused in REFUSED.items():
        assert refusal(plain, consumer) is None
        if alone:
            found = refusal(program, consumer)
            assert (found is not None and found.endswith(refused[feature])) == (feature in refused)
    if alone:
        status, _, err = run_in_process([*cli, "--format", "torch-csv"])
        assert status == 2 and REFUSED["torch-csv"][feature] in err


SHAPED = """schedule shaped(D: int = 2, N: int = 2) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    lengths 512, 1024
    order rank r {
        for i in 0..N { F(i) }
        for i in 0..N { B(i) }
    }
}
"""


@pytest.mark.parametrize("feature", ["frozen", "chunks", "shapes", "recompute", "weights"])
def test_synthesize_refuses_with_the_feature_table(feature: str, tmp_path: Path) -> None:
    """`synthesize` kept its own table of what it cannot order (synthesis/problem.py);
    its E0602, at the schedule, is now `features.REFUSED["synthesize"]`'s words."""
    from pipelang.features import REFUSED, USES

    if feature == "shapes":
        (tmp_path / "shaped.pipe").write_text(SHAPED)
        name, params = str(tmp_path / "shaped.pipe"), {}
    else:
        name, params = FEATURED[feature]
    status, out, err = run_in_process(["synthesize", name, "--time-limit", "1"])
    assert (status, out) == (1, "")
    first = err.splitlines()[0]
    use = USES[feature](pipelang.load(name, **params).program)
    assert first.startswith("error[E0602]: `") and first.endswith(
        f"{use}: {REFUSED['synthesize'][feature]}"
    ), first
    assert err.splitlines()[1].endswith(":1") and "| schedule " in err  # at the schedule


def test_the_stream_programs_refuse_evictions_with_the_feature_table() -> None:
    """The `streams` pass said its own words for evictions (and `worker.runs_streams`
    asks the same question): E0506 is `features.REFUSED["stream programs"]`'s, at the
    first eviction."""
    from pipelang.features import REFUSED, refusal

    program = pipelang.load("bpipe").program
    status, _, err = run_in_process(["compile", "bpipe", "--dump-after", "streams"])
    assert status == 1
    assert err.startswith(f"error[E0506]: {refusal(program, 'stream programs')}\n"), err
    assert err.splitlines()[0].endswith(REFUSED["stream programs"]["evictions"])
    first = program.first_eviction()
    assert first is not None and first.span is not None
    assert f"bpipe.pipe:{first.span.line}:{first.span.column}" in err.splitlines()[1]
    assert refusal(pipelang.load("1f1b").program, "stream programs") is None


# ---- round three (issue 44): the language, the CLI and the API under hostile input --------


@pytest.mark.parametrize("code", ["²", "٣", "３０６", "E0306\n", "E³⁰⁶", "e0306e", "E0x1"])
def test_explain_of_a_code_that_is_no_code_is_a_usage_error(code: str) -> None:
    """Unicode digits are digits to `str.isdigit` (`²` was an internal ValueError, `٣`
    explained E0003): a code is `E` and ASCII digits."""
    status, out, err = run_in_process(["explain", code])
    assert (status, out) == (2, "")
    assert err.startswith("pipelang explain: error: no diagnostic code `"), err
    assert len(err.strip().splitlines()) == 1


def test_a_long_argument_is_echoed_cut_in_the_middle() -> None:
    """A 100,000-character code (or any argument a usage error quotes) is shown as its
    two ends and its length, never whole."""
    code = "x" * 100_000
    status, _, err = run_in_process(["explain", code])
    assert status == 2
    assert err == (
        f"pipelang explain: error: no diagnostic code `{'x' * 30}...{'x' * 15}` (100,000 "
        "characters); codes are E0001..E0605 (E followed by four digits, such as E0306)\n"
    )
    status, _, err = run_in_process(["check", "1f1b", "--no-such-option", code])
    assert status == 2 and len(err) < 400 and "(100,000 characters)" in err, err


def test_did_you_mean_among_thousands_of_long_names_is_quick(tmp_path: Path) -> None:
    """A file of 4,000 parameters with 190-character names and one misspelled use took
    39 s in difflib; `diagnostics.nearest` compares few candidates of bounded length."""
    import time

    names = [f"param_{'x' * 180}{i:06d}" for i in range(4000)]
    params = ",\n    ".join(f"{n}: int = 1" for n in names)
    body = GOOD.split("\n", 1)[1].replace("}\n", f"    let z = {names[7]}q\n}}\n", 1)
    path = tmp_path / "big.pipe"
    path.write_text(f"schedule good(D: int = 2, N: int = 2,\n    {params}) {{\n{body}")
    assert path.stat().st_size > 800_000
    started = time.perf_counter()
    status, _, err = run_in_process(["check", str(path)])
    assert time.perf_counter() - started < 5
    assert status == 1 and "E0101" in err


def test_did_you_mean_is_bounded_and_still_finds_near_names() -> None:
    from pipelang.diagnostics import nearest

    assert nearest("D", ["N", "d"]) == "d"  # up to case, first
    assert nearest("pipline", ["order", "pipeline"]) == "pipeline"
    assert nearest("x" * 100, ["x" * 99]) is None  # past NEAREST_LONGEST: case only
    assert nearest("X" * 100, ["x" * 100]) == "x" * 100
    assert nearest("depth", ["D", "N"]) is None
    many = [f"v{i}" for i in range(1000, 16000)]  # all of one length: spelling order finds it
    assert nearest("v4999x", many) == "v4999"


def test_an_import_of_a_name_too_long_for_the_file_system_is_e0004(tmp_path: Path) -> None:
    path = tmp_path / "t.pipe"
    path.write_text(f'import "{"y" * 100_000}.pipe"\n{GOOD}')
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1
    assert err.startswith(
        f"error[E0004]: cannot read `{'y' * 30}...{'y' * 10}.pipe` (100,005 characters): "
        f"File name too long\n --> {path}:1:1\n"
    ), err


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("F(i, chunk=c, chunk=c)", "`F` is given `chunk` twice"),
        ("F(i, mb=i, chunk=c)", "`F` is given `mb` twice"),
        ("F(i, 0, 0)", "`F` takes at most two positional arguments, `(mb, stage)`"),
        ("F(chunk=c, i)", "a positional argument of `F` after a named one"),
        ("F(i, chunks=c)", "`F` has no argument `chunks=`"),
    ],
)
def test_a_bad_op_argument_is_named(call: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "t.pipe"
    path.write_text(
        "schedule t(D: int = 2, N: int = 2) {\n"
        "    pipeline main: stage s in 0..D -> rank s\n"
        "    microbatches 0..N -> main\n"
        "    chunks 2\n"
        f"    order rank r {{ for i in 0..N {{ for c in 0..2 {{ {call} }} }}\n"
        "        for i in 0..N { for c in 0..2 { B(i, chunk=c) } } }\n"
        "}\n"
    )
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1
    assert err.startswith(f"error[E0103]: {message}\n --> {path}:5:"), err


@pytest.mark.parametrize(
    ("sched", "code", "message"),
    [
        ("", "usage", "the schedule is an empty path"),
        ("  ", "usage", "the schedule is `  `"),
        ("x" * 5000, "E0003", "File name too long"),
        ("x" * 5000 + ".pipe", "E0003", "File name too long"),
        ("a\nb", "E0003", "no schedule `a\\nb`"),
    ],
    ids=["empty", "spaces", "long", "long.pipe", "newline"],
)
def test_load_says_what_is_wrong_with_the_path(sched: str, code: str, message: str) -> None:
    """`load('')` said "cannot read `.`: it is a directory"; a name too long for the file
    system was an OSError."""
    with pytest.raises(pipelang.PipelangError) as raised:
        pipelang.load(sched)
    found = raised.value.diagnostics[0]
    assert found.code == code and message in found.message, found.message
    assert len(found.message) < 200


@pytest.mark.parametrize("command", [["check-streams"], ["viz", "-o", "x.svg", "--trace"]])
def test_a_stream_dump_or_trace_is_read_as_every_input_file_is(
    tmp_path: Path, command: list[str]
) -> None:
    """Through `readers.read_text`, with its size limit: a name linked to /dev/zero was
    read until memory ran out."""
    link = tmp_path / "z.json"
    link.symlink_to("/dev/zero")
    status, _, err = run_in_process([*command, str(link)])
    assert status in (1, 2) and "it is larger than 64 MiB" in err, err


def test_a_dp_past_the_processes_a_job_may_have_is_refused_at_once() -> None:
    """`--dp 1000000000` ran for minutes, growing to gigabytes, before anything was said."""
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--steps", "2", "--dp", "1000000000"]
    status, _, err = run_in_process(argv)
    assert status == 2 and "the run needs 2,000,000,000 ranks (--dp 1,000,000,000 x 2 ranks)" in err
