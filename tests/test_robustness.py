"""Every input gets a clear answer (issue 16): exit statuses, strict JSON with errors too,
costs that cannot take effect, and an export that replays exactly."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from pipelang.api import compile_schedule, stdlib_names
from pipelang.export import to_json
from pipelang.ir import Action, Kind, Program
from pipelang.ir.graph import op_graph
from pipelang.sim.timeline import simulate
from tests.helpers import GOOD, run_in_process


def strict(text: str) -> object:
    """JSON as the standard has it: no NaN, no Infinity."""

    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# ---- exit statuses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "1f1b", "--max-activations", "-5"],
        ["check", "1f1b", "--max-activations", "0"],
        ["check", ""],
        ["simulate", " ", "--json"],
        ["viz", ""],
        ["run", "1f1b", "--timeout", "0"],
        ["run", "1f1b", "--timeout", "nan"],
        ["viz", "1f1b", "--trace", "x.json", "--step", "-1"],
        [
            "plan",
            "--profile",
            "p",
            "--topology",
            "t",
            "--micro-batches",
            "4",
            "-o",
            "x",
            "--time-budget",
            "-1",
        ],
        ["simulate", "1f1b", "--cost", "F=" + "9" * 400],
        ["simulate", "1f1b", "--cost", "F[99]=5"],
        ["viz", "1f1b", "--cost", "B[4]=1"],
    ],
)
def test_a_bad_command_line_value_exits_2(argv: list[str]) -> None:
    status, _, err = run_in_process(argv)
    assert status == 2, err
    assert "error" in err


def test_a_cost_for_a_missing_stage_says_which() -> None:
    status, _, err = run_in_process(["simulate", "1f1b", "-p", "D=4", "--cost", "F[99]=5"])
    assert status == 2
    assert "no stage 99 (its stages are 0..3)" in err
    status, _, err = run_in_process(["simulate", "1f1b", "-p", "D=4", "--cost", "C[3]=5"])
    assert status == 2
    assert "`C[3]` names no stage boundary" in err and "boundaries are 0..2" in err


def test_a_cost_line_for_a_missing_stage_is_an_error_at_its_position(tmp_path: Path) -> None:
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("{\n", "{\n  cost F[99] = 2\n", 1))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1
    assert "error[E0209]" in err and "no stage 99" in err
    assert f"{path}:2:" in err


def test_a_huge_cost_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("{\n", "{\n  cost F = 1" + "0" * 30 + "\n", 1))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1 and "error[E0209]" in err


# ---- JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "status", "code"),
    [
        (["simulate", "nope", "--json"], 1, "E0003"),
        (["check", "1f1b", "-p", "D=x", "--format", "json"], 1, "E0203"),
        (["simulate", "1f1b", "--json", "--cost", "F[9]=1"], 2, "usage"),
        (["simulate", "1f1b", "--json", "--bogus"], 2, "usage"),
        (["export", "1f1b", "--format", "json", "-p", "Q=1"], 1, "E0202"),
    ],
)
def test_an_error_under_json_is_a_json_object_as_well_as_text(
    argv: list[str], status: int, code: str
) -> None:
    got, out, err = run_in_process(argv)
    assert got == status
    doc = strict(out)
    assert isinstance(doc, dict) and doc["ok"] is False
    (first, *_) = doc["diagnostics"]
    assert first["code"] == code and first["message"]
    assert {"file", "line", "column"} <= first.keys()
    assert err.strip()  # the usual text too


def test_a_json_diagnostic_names_file_line_and_column() -> None:
    _, out, _ = run_in_process(["check", "1f1b", "-p", "D=x", "--format", "json"])
    (diag,) = strict(out)["diagnostics"]  # type: ignore[index]
    assert diag["file"] == "<stdlib>/1f1b.pipe"
    assert (diag["line"], diag["column"]) == (diag["location"]["line"], diag["location"]["column"])


def test_simulate_json_is_strict_at_the_largest_costs() -> None:
    status, out, _ = run_in_process(
        ["simulate", "chimera", "--json", "--cost", "F=1000000000000000,B=1000000000000000"]
    )
    assert status == 0
    assert strict(out)["makespan"] > 1e15  # type: ignore[index]


# ---- export replays ---------------------------------------------------------------------


def replayed(program: Program, text: str) -> Program:
    """`program` with its ranks' orders read back from `export --format json`."""
    ranks = []
    for entry in json.loads(text)["ranks"]:
        actions = []
        for op in entry["ops"]:
            kind = Kind(op["op"])
            mb = op["update"] if kind is Kind.U else op["mb"]
            fused = op.get("fused", False)
            where = (op["stage"], op["pipeline"], op.get("to"))
            actions.append(Action(kind, mb, *where, chunk=op.get("chunk"), fused=fused))
        ranks.append(tuple(actions))
    return dataclasses.replace(program, ranks=tuple(ranks))


@pytest.mark.parametrize("name", stdlib_names())
def test_a_replay_of_the_export_equals_simulate(name: str) -> None:
    compiled = compile_schedule(name, stop_after="validate")
    program = compiled.need_program()
    expected = compiled.timeline()
    again = replayed(program, to_json(program))
    got = simulate(again, op_graph(again), program.costs)
    assert got.makespan == expected.makespan
    assert [(e.rank, e.action, e.start, e.end) for e in got.events] == [
        (e.rank, e.action, e.start, e.end) for e in expected.events
    ]


# ---- text --------------------------------------------------------------------------------

BAD_LINE_4 = GOOD.replace("0..N {", "0..M {")  # `M` unknown, line 4 column 32


@pytest.mark.parametrize(
    ("name", "encode"),
    [
        ("bom", lambda text: "\ufeff" + text),
        ("crlf", lambda text: text.replace("\n", "\r\n")),
        ("cr", lambda text: text.replace("\n", "\r")),
        ("bom-crlf", lambda text: "\ufeff" + text.replace("\n", "\r\n")),
    ],
)
def test_a_bom_and_any_line_ending_read_alike(name: str, encode: object, tmp_path: Path) -> None:
    good, bad = tmp_path / "good.pipe", tmp_path / "bad.pipe"
    good.write_bytes(encode(GOOD).encode())  # type: ignore[operator]
    bad.write_bytes(encode(BAD_LINE_4).encode())  # type: ignore[operator]
    assert run_in_process(["check", str(good)])[0] == 0
    status, _, err = run_in_process(["check", str(bad)])
    assert status == 1
    assert f"{bad}:4:32" in err
    assert "4 |     order rank r { for i in 0..M { F(i) B(i) } }" in err


# ---- nothing silently ignored -----------------------------------------------------------

GREEDY = """\
schedule g(D: int = 2, N: int = 4) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    AFTER
    order greedy { prefer B, F priority mb }
}
"""


@pytest.mark.parametrize(
    "after",
    [
        "F(mb=m + 1, stage=0) after W(mb=m, stage=0) for m in 0..N - 1",
        "W(mb=m + 1, stage=0) after B(mb=m, stage=0) for m in 0..N - 1",
        "F(mb=m + 1, stage=0) after R(mb=m, stage=0) for m in 0..0",  # an empty range too
    ],
)
def test_an_after_naming_an_undeclared_kind_is_an_error_at_it(after: str, tmp_path: Path) -> None:
    path = tmp_path / "g.pipe"
    path.write_text(GREEDY.replace("AFTER", after))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1, err
    assert "error[E0309]: an `after` names" in err
    assert f"{path}:4:" in err


@pytest.mark.parametrize(
    "decl",
    [
        "let mb = 1",  # `priority mb` means the op's micro-batch
        "let rank = 0",
    ],
)
def test_a_name_a_greedy_order_binds_cannot_be_defined_before(decl: str, tmp_path: Path) -> None:
    path = tmp_path / "g.pipe"
    path.write_text(GREEDY.replace("AFTER", decl))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1, err
    assert "error[E0102]" in err and "would shadow" in err and "greedy" in err


def test_a_loop_variable_that_shadows_a_parameter_is_reported_as_shadowing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("for i in 0..N", "for N in 0..2"))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1
    assert "error[E0102]: `N` would shadow the `N` already defined" in err


# ---- limits ------------------------------------------------------------------------------


def check_let(tmp_path: Path, let: str) -> tuple[int, str]:
    """`pipelang check` of GOOD with one schedule-level `let` on line 2."""
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("{\n", "{\n    " + let + "\n", 1))
    status, _, err = run_in_process(["check", str(path)])
    return status, err


def test_a_flat_sum_of_99_terms_is_not_nesting(tmp_path: Path) -> None:
    assert check_let(tmp_path, "let x = " + " + ".join(["1"] * 99))[0] == 0
    status, err = check_let(tmp_path, "let x = " + " - ".join(["1"] * 101))
    assert status == 1 and "more than 100 terms joined by `-`" in err
    assert "s.pipe:2:" in err


def test_nesting_in_parentheses_is_refused_at_the_bracket(tmp_path: Path) -> None:
    status, err = check_let(tmp_path, "let x = " + "(" * 5000 + "1" + ")" * 5000)
    assert status == 1 and "error[E0106]" in err and "more than 100 deep" in err
    # the bracket 101 deep: the schedule's `{` is the first, so the 100th `(`, at column
    # 13 + 99 of line 2 (`    let x = (((...`)
    assert "s.pipe:2:112" in err


@pytest.mark.parametrize(
    "let",
    [
        "let x = 999999999999999999 * 999999999999999999",
        "let x = sq(sq(sq(sq(sq(sq(sq(99)))))))",
        "let x = 999999999999999999 * 9 + 999999999999999999 * 9",
    ],
)
def test_integers_are_bounded_where_they_grow(let: str, tmp_path: Path) -> None:
    path = tmp_path / "s.pipe"
    path.write_text("fn sq(x) = x * x\n" + GOOD.replace("{\n", "{\n    " + let + "\n", 1))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1
    assert "error[E0106]" in err and "at most 2^63 - 1" in err
    assert len(err) < 4000


def test_a_file_over_the_size_limit_says_so(tmp_path: Path) -> None:
    path = tmp_path / "big.pipe"
    path.write_text(GOOD + "#" * (1 << 20))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1 and "larger than the 1 MiB a `.pipe` file may be" in err


@pytest.mark.slow
def test_many_lets_in_one_block_each_see_the_ones_before(tmp_path: Path) -> None:
    lets = "\n".join(f"        let y{i} = y{i - 1} + 1" for i in range(1, 2000))
    body = "order rank r {\n        let y0 = r\n" + lets + "\n        for i in 0..N { F(i) B(i) } }"
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("order rank r { for i in 0..N { F(i) B(i) } }", body))
    assert run_in_process(["check", str(path)])[0] == 0
    clash = path.read_text().replace("let y7 =", "let y3 =")
    path.write_text(clash)
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1 and "`y3` would shadow" in err


# ---- messages ------------------------------------------------------------------------------


@pytest.mark.slow
def test_syntax_errors_never_name_grammar_tokens() -> None:
    """Every prefix of a stdlib file with an op pair (`&`): the expected tokens are
    written as a user types them, never lark's names (`AMPERSAND`, `__ANON_0`)."""
    from pipelang.diagnostics import PipelangError
    from pipelang.parser import parse_text, stdlib_dir
    from pipelang.source import SourceFile

    text = (stdlib_dir() / "dualpipev.pipe").read_text()
    seen = set()
    for cut in range(1, len(text), 3):
        try:
            parse_text(SourceFile.of("x.pipe", text[:cut] + " @ "))
        except PipelangError as err:
            rendered = err.render()
            seen.add(rendered.splitlines()[-1])
            assert not re.search(r"\b[A-Z][A-Z_]{3,}\b|__ANON", rendered), rendered
    assert any("`&`" in line for line in seen)


@pytest.mark.parametrize(
    ("line", "hint"),
    [
        ("order rank r { for i in range(N) { F(i) B(i) } }", "not `range(N)`"),
        ("order rank r { for i in 0..N { F(i); B(i) } }", "drop the `;`"),
    ],
)
def test_common_mistakes_get_a_hint(line: str, hint: str, tmp_path: Path) -> None:
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("order rank r { for i in 0..N { F(i) B(i) } }", line))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1 and hint in err


def test_a_deadlock_through_an_after_points_at_the_after(tmp_path: Path) -> None:
    path = tmp_path / "s.pipe"
    path.write_text(GOOD.replace("{\n", "{\n    F(mb=0, stage=1) after B(mb=1, stage=1)\n", 1))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1
    assert "error[E0306]" in err and "through this `after`" in err
    assert f"{path}:2:5" in err


def test_a_greedy_order_stuck_on_an_after_cycle_does_not_blame_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "g.pipe"
    path.write_text(GREEDY.replace("AFTER", "F(mb=0, stage=0) after B(mb=0, stage=0)"))
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1
    assert "error[E0311]" in err and "wait on each other" in err
    assert f"{path}:4:5" in err
    assert "cap" not in err


# ---- the size of an answer -------------------------------------------------------------


@pytest.mark.parametrize(
    "let",
    [
        "let x = " + "1 + " * 90 + "y" + " " * 200_000,  # the error at the start of a long line
        "let x = " + " " * 200_000 + "y",  # ... at its end
        "let x = " + "y" * 300_000,  # a name longer than any message should quote
    ],
)
def test_a_diagnostic_stays_a_few_kb_whatever_the_line(let: str, tmp_path: Path) -> None:
    """A long source line is shown as a window around the error (`...` where cut); a long
    quoted name is cut in the middle with its length; the caret stays under the name."""
    status, err = check_let(tmp_path, let)
    assert status == 1 and "error[E0101]: unknown name `y" in err
    assert len(err) < 2000, err[:300]
    lines = err.splitlines()
    source = next(i for i, line in enumerate(lines) if line.startswith("2 | "))
    caret = lines[source + 1].index("^")
    assert lines[source][caret] == "y"
    if "y" * 100 in let:
        assert "(300,000 characters)" in err


def test_a_requires_own_long_message_is_cut(tmp_path: Path) -> None:
    status, err = check_let(tmp_path, 'require 1 > 2 : "' + "no " * 50_000 + '"')
    assert status == 1 and "error[E0204]: no no" in err
    assert "(cut at 1,000 of 150,000 characters)" in err and len(err) < 2000


def test_an_error_made_in_a_loop_over_many_ranks_is_shown_once_per_rank_up_to_20(
    tmp_path: Path,
) -> None:
    """64 ranks each missing their backwards: 20 diagnostics and a count of the rest,
    in the text and in the JSON."""
    path = tmp_path / "s.pipe"
    path.write_text(
        "schedule s(D: int = 64, N: int = 512) {\n"
        "    pipeline main: stage s in 0..D -> rank s\n"
        "    microbatches 0..N -> main\n"
        "    order rank r { for i in 0..N { F(i) } }\n"
        "}\n"
    )
    status, out, err = run_in_process(["check", str(path), "--format", "json"])
    assert status == 1
    assert err.count("error[E0303]") == 20
    assert err.rstrip().endswith(
        "error: 44 more errors not shown (the first 20 are above; fix those first)"
    )
    doc = strict(out)
    assert isinstance(doc, dict) and len(doc["diagnostics"]) == 20 and doc["not_shown"] == 44
    assert len(err) < 10_000


def test_a_file_of_too_many_tokens_is_refused_at_the_first_one_over(tmp_path: Path) -> None:
    """Past MAX_TOKENS the file is E0106 at the token over the limit, found before lark
    parses (which would take half a minute for a megabyte of short calls)."""
    from pipelang.parser import MAX_TOKENS

    lets = MAX_TOKENS // 4 + 1  # `let x = 1`: four tokens each
    status, err = check_let(tmp_path, "# " + "F(0) " * 50 + "\n    " + "let x = 1 " * lets)
    assert status == 1 and f"more than {MAX_TOKENS:,} tokens" in err
    line = err.splitlines()[1]
    assert re.search(r"s\.pipe:3:\d+$", line), line  # the comment does not count


# ---- sizes every command answers quickly ------------------------------------------------


@pytest.mark.slow
def test_the_op_limit_is_an_error_that_names_max_ops_and_max_ops_raises_it() -> None:
    status, _, err = run_in_process(["check", "1f1b", "-p", "D=4", "-p", "N=40000"])
    assert status == 1 and "320000 ops, more than the limit of 150000" in err
    assert "`--max-ops` (now 150000)" in err
    status, out, _ = run_in_process(
        ["check", "1f1b", "-p", "D=4", "-p", "N=40000", "--max-ops", "320000"]
    )
    assert status == 0 and "320000 compute ops" in out
    assert run_in_process(["check", "1f1b", "--max-ops", "0"])[0] == 2


def test_the_loop_and_range_limits_follow_max_ops(tmp_path: Path) -> None:
    """An order may run 4 iterations per allowed op: nested loops that only count are
    refused at the loop, sooner with a lower --max-ops."""
    from pipelang.evaluate import ITERATIONS_PER_OP

    path = tmp_path / "s.pipe"
    path.write_text(
        "schedule s(D: int = 2, N: int = 2) {\n"
        "    pipeline p: stage s in 0..D -> rank s\n"
        "    microbatches 0..N -> p\n"
        "    order rank r {\n"
        "        for i in 0..1000 { for j in 0..1000 { if i < 0 { F(0) } } }\n"
        "        for i in 0..N { F(i) }\n"
        "        for i in 0..N { B(i) }\n"
        "    }\n"
        "}\n"
    )
    assert run_in_process(["check", str(path), "--max-ops", "1000000"])[0] == 0
    status, _, err = run_in_process(["check", str(path), "--max-ops", "100000"])
    assert status == 1 and f"more than {100000 * ITERATIONS_PER_OP} loop iterations" in err
    assert ":5:" in err.splitlines()[1]  # at the loop that went over


def test_simulate_shows_at_most_64_ranks_and_json_lists_all() -> None:
    status, out, _ = run_in_process(["simulate", "1f1b", "-p", "D=100", "-p", "N=2"])
    assert status == 0 and "... and 36 more ranks (--json lists every rank)" in out
    assert "│   63 │" in out and "│   64 │" not in out
    status, out, _ = run_in_process(["simulate", "1f1b", "-p", "D=100", "-p", "N=2", "--json"])
    assert len(strict(out)["ranks"]) == 100  # type: ignore[index]


def test_the_grid_is_bounded_whatever_the_costs() -> None:
    """Costs of 1e-6 and 1e6 asked for a grid of 10^12 cells (MemoryError): the grid
    keeps within GRID_CELLS cells and says how long a cell is."""
    from pipelang.sim.timeline import GRID_CELLS

    status, out, _ = run_in_process(
        ["simulate", "1f1b", "--grid", "--cost", "F=0.000001,B=1000000"]
    )
    assert status == 0
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4 and all(len(row.split("|")[1].split()) <= GRID_CELLS for row in rows)
    assert "(one cell = 2200 time units" in out  # makespan 11e6 over 5000 cells
    assert all(f"B{mb}" in rows[0] for mb in range(8))  # the long ops all show


def test_the_grid_draws_at_most_grid_ranks() -> None:
    from pipelang.sim.timeline import GRID_RANKS

    timeline = compile_schedule("1f1b", {"D": str(GRID_RANKS + 3), "N": "1"}).timeline()
    grid = timeline.text_grid()
    assert grid.count("\nrank ") == GRID_RANKS - 1 and grid.endswith("... and 3 more ranks")


def test_clipping_pairs_quotes_left_to_right() -> None:
    """The text between two short quotes is not a quote: it was cut as one, which put
    `(75 characters)` inside an E0314 message."""
    from pipelang.diagnostics import QUOTED, clip

    between = "x " * QUOTED
    message = f"`U1@0/main` {between}`weights 2` allows 2"
    assert clip(message) == message
    assert clip(f"`a` `{'y' * (QUOTED + 1)}` `b`").endswith(f"({QUOTED + 1} characters) `b`")


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"D": 513, "N": 1}, {"D": 8, "N": 1251}])
def test_a_png_too_large_to_draw_in_seconds_is_refused_at_once(
    params: dict[str, int], tmp_path: Path
) -> None:
    """matplotlib took over a minute on 20,000 rank rows, 14 s on 40,000 ops; .svg
    takes any size."""
    pytest.importorskip("matplotlib")
    from pipelang.visualize.png import PNG_OPS, PNG_RANKS

    argv = ["viz", "1f1b", *(f"-p{k}={v}" for k, v in params.items())]
    status, _, err = run_in_process([*argv, "-o", str(tmp_path / "x.png")])
    assert status == 2 and f"at most {PNG_RANKS} rank rows and {PNG_OPS:,} ops" in err
    assert run_in_process([*argv, "-o", str(tmp_path / "x.svg")])[0] == 0


# ---- torchrun's variables and run options (issue 44 items 11 and 14) ----------------------

JOB = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
LONG = "7" * 100_000


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "abc"}, "RANK=`abc` is not a whole number (this process's rank, 0 to "
         "WORLD_SIZE - 1)"),
        ({"RANK": "5"}, "RANK=5 is not below WORLD_SIZE=2 (this process's rank, 0 to "
         "WORLD_SIZE - 1)"),
        ({"RANK": "-1"}, "RANK=`-1` is not a whole number (this process's rank, 0 to "
         "WORLD_SIZE - 1)"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set: with RANK, WORLD_SIZE, MASTER_ADDR "
         "set this process is one rank of a torchrun job, which needs MASTER_PORT too (the "
         "rendezvous port, 1 to 65535)"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not 1 to 65,535 (the rendezvous "
         "port, 1 to 65535)"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is not 1 to 1,048,576 (the number of processes "
         "of the job)"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK=`x` is not a whole number (the rank on this node, 0 "
         "to LOCAL_WORLD_SIZE - 1)"),
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=3 is not below "
         "LOCAL_WORLD_SIZE=2 (the rank on this node, 0 to LOCAL_WORLD_SIZE - 1)"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 is not at most WORLD_SIZE=2 (the "
         "processes on this node, 1 to WORLD_SIZE)"),
        ({"MASTER_ADDR": "a b"}, "MASTER_ADDR=`a b` is not a host name or address (the "
         "rendezvous host)"),
        ({"RANK": LONG}, "RANK=`777777777777777777777777777777...777777777777777` (100,000 "
         "characters) is not a whole number (this process's rank, 0 to WORLD_SIZE - 1)"),
    ],
)  # fmt: skip
def test_a_wrong_torchrun_variable_is_one_line_naming_it(
    env: dict[str, str | None], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read once, before torch.distributed (a ValueError, an IndexError past the status
    array, env://'s own error, each an internal error before): a usage error (exit 2)."""
    for name, value in {**JOB, **env}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    status, _, err = run_in_process(["run", "1f1b", "-p", "D=2", "-p", "N=2", "--steps", "1"])
    assert (status, err.strip()) == (2, f"error: {message}")


@pytest.mark.parametrize("seed", ["99999999999999999999999", "18446744073709551616", "-1", LONG])
def test_a_seed_torch_cannot_take_is_a_usage_error_naming_the_range(seed: str) -> None:
    """torch.manual_seed takes 0 to 2**64 - 1 (a negative seed wraps onto one of them);
    anything else was a traceback at the first build."""
    status, _, err = run_in_process(["run", "1f1b", "-p", "D=2", "-p", "N=2", "--seed", seed])
    shown = seed if len(seed) < 60 else "777777777777777777777777777777...777777777777777"
    assert status == 2
    assert err.strip().endswith(
        f"error: argument --seed: a seed is a whole number from 0 to 18446744073709551615 "
        f"(2**64 - 1), not `{shown}`" + (" (100,000 characters)" if seed == LONG else "")
    )


def test_the_largest_seed_is_taken() -> None:
    from pipelang.cli.args import seed

    assert seed("18446744073709551615") == 2**64 - 1 and seed(" 0 ") == 0
