"""The front end, construct by construct: small `.pipe` texts through `compile_schedule`.

Each test writes a schedule to `tmp_path` and runs the passes up to `expand-orders` (or
`resolve-params` where only values matter), then checks the values, the per-rank op
lists, or the diagnostic's code and line. A line marked `# <-` is where the diagnostic
must point. The examples of docs/language.md are compiled here too.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from helpers import CHIMERA_4, gpipe, one_f_one_b

from pipelang import api
from pipelang.cli.args import UsageError, parse_params
from pipelang.codes import CODES
from pipelang.diagnostics import Diagnostic, PipelangError
from pipelang.ir import Action, Kind, Program

ROOT = Path(__file__).resolve().parent.parent
MARK = "# <-"


def write(tmp_path: Path, text: str, name: str = "t.pipe") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def compile_text(
    tmp_path: Path, text: str, params: dict[str, str] | None = None, stop: str = "expand-orders"
) -> Program:
    path = write(tmp_path, text)
    program = api.compile_schedule(str(path), params or {}, stop_after=stop).program
    assert program is not None
    return program


def ranks(program: Program) -> list[str]:
    """One line of action tokens per rank."""
    return [" ".join(str(a) for a in actions) for actions in program.ranks]


def expect_error(
    tmp_path: Path,
    text: str,
    code: str,
    params: dict[str, str] | None = None,
    line: int | None = None,
) -> Diagnostic:
    """Compile `text`; it must fail with `code` at the line marked `# <-` (or `line`)."""
    path = write(tmp_path, text)
    if line is None:
        marked = [i for i, t in enumerate(path.read_text().splitlines(), 1) if MARK in t]
        line = marked[0] if marked else None
    with pytest.raises(PipelangError) as info:
        api.compile_schedule(str(path), params or {}, stop_after="expand-orders")
    diag = info.value.diagnostics[0]
    assert diag.code == code, info.value.render()
    assert code in CODES
    assert (diag.span.line if diag.span else None) == line, info.value.render()
    assert info.value.render().startswith(f"error[{code}]")
    return diag


def schedule(body: str, params: str = "D: int = 2, N: int = 2", order: str = "") -> str:
    """A one-pipeline schedule (`main`, stage s on rank s) around `body` and `order`."""
    return (
        f"schedule t({params}) {{\n"
        f"    pipeline main: stage s in 0..D -> rank s\n"
        f"    microbatches 0..N -> main\n"
        f"{textwrap.indent(textwrap.dedent(body).strip(), '    ')}\n"
        f"{textwrap.indent(textwrap.dedent(order).strip(), '    ')}\n"
        f"}}\n"
    )


# ---- expressions ------------------------------------------------------------------------


def values(
    tmp_path: Path,
    exprs: dict[str, str],
    params: str = "",
    given: dict[str, str] | None = None,
    fns: str = "",
) -> dict[str, int | bool]:
    """Each expression as a schedule-level `let` (evaluated at run time by resolve-params)."""
    lets = "\n".join(f"    let {name} = {expr}" for name, expr in exprs.items())
    text = (
        f"{fns}\nschedule t({params}) {{\n{lets}\n    pipeline main: stage s in 0..1 -> rank s\n"
        "    microbatches 0..1 -> main\n    order rank r { F(0) B(0) }\n}\n"
    )
    path = write(tmp_path, text)
    c = api.compile_schedule(str(path), given or {}, stop_after="resolve-params")
    assert c.params is not None
    return {name: c.params[name] for name in exprs}


def folded(tmp_path: Path, expr: str, params: str = "", fns: str = "") -> int:
    """`expr` evaluated inside `order rank`, where parameters are constants and fold: the
    rank emits `expr + 100` forwards."""
    text = (
        f"{fns}\nschedule t({params}) {{\n    pipeline main: stage s in 0..1 -> rank s\n"
        "    microbatches 0..200 -> main\n"
        f"    order rank r {{ let v = {expr}\n for i in 0..v + 100 {{ F(i) }} }}\n}}\n"
    )
    program = compile_text(tmp_path, text)
    return len(program.ranks[0]) - 100


FLOOR_CASES = [(-7, 2), (7, -2), (-7, -2), (7, 2), (-8, 2), (0, -3), (-1, 5), (1, -5)]


@pytest.mark.parametrize(("a", "b"), FLOOR_CASES)
def test_floor_division_and_remainder_follow_python(tmp_path: Path, a: int, b: int) -> None:
    got = values(
        tmp_path,
        {"q": "a // b", "m": "a % b", "ql": f"{a} // {b}", "ml": f"{a} % {b}"},
        params="a: int = 0, b: int = 1",
        given={"a": str(a), "b": str(b)},
    )
    assert got == {"q": a // b, "m": a % b, "ql": a // b, "ml": a % b}
    assert folded(tmp_path, "a // b * 10 + a % b", params=f"a: int = {a}, b: int = {b}") == (
        a // b * 10 + a % b
    )


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("10 - 4 - 3", 3),
        ("100 // 10 // 5", 2),
        ("2 * 3 % 4", 2),
        ("-2 * 3", -6),
        ("2 * -3", -6),
        ("- 7 // 2", -4),
        ("-(7 // 2)", -3),
        ("7 - -2", 9),
        ("--3", 3),
        ("not 1 == 2", True),
        ("true or false and false", True),
        ("(true or false) and false", False),
        ("not true or true", True),
        ("1 + 2 < 2 * 2", True),
        ("3 >= 3 and 2 != 2", False),
        ("true == (1 < 2)", True),
        ("if 1 > 2 then 10 else 20", 20),
        ("if true then 1 else 2 + 3", 1),
        ("if false then 1 else 2 + 3", 5),
        ("if true then if false then 1 else 2 else 3", 2),
        ("1 + (if false then 1 else 2)", 3),
        ("min(3, -1, 2)", -1),
        ("max(3)", 3),
        ("max(min(4, 9), 2 * 3)", 6),
        ("if 1 < 2 then true else false", True),
    ],
)
def test_precedence_and_operators(tmp_path: Path, expr: str, value: int | bool) -> None:
    assert values(tmp_path, {"x": expr}) == {"x": value}
    if not isinstance(value, bool):
        assert folded(tmp_path, expr) == value


def test_and_or_conditional_short_circuit(tmp_path: Path) -> None:
    got = values(
        tmp_path,
        {
            "a": "false and 1 // z == 0",
            "b": "true or 1 // z == 0",
            "c": "z == 0 or N // z > 0",
            "d": "if z == 0 then 0 else N // z",
            "e": "if z != 0 then N % z else -1",
        },
        params="z: int = 0, N: int = 4",
    )
    assert got == {"a": False, "b": True, "c": True, "d": 0, "e": -1}
    assert folded(tmp_path, "if z == 0 then 7 else N // z", params="z: int = 0, N: int = 4") == 7


def test_the_branch_taken_is_still_evaluated(tmp_path: Path) -> None:
    text = schedule(
        "let x = true and 1 // z == 0  " + MARK, params="D: int = 2, N: int = 2, z: int = 0"
    )
    diag = expect_error(tmp_path, text, "E0104")
    assert "`1 // z`" in diag.message


def test_division_by_zero_in_an_order_points_at_the_division(tmp_path: Path) -> None:
    text = schedule(
        "",
        order=f"""
        order rank r {{
            for i in 0..N {{ F(i // r) B(i) }}  {MARK}
        }}""",
    )
    expect_error(tmp_path, text, "E0104")


FNS = """
fn sq(x) = x * x
fn add(a, b) = a + b
fn three() = 3
fn even(x) = x % 2 == 0
fn clamp(x, lo, hi) = max(lo, min(x, hi))
"""


def test_fns_nest_and_compose(tmp_path: Path) -> None:
    got = values(
        tmp_path,
        {
            "a": "sq(3)",
            "b": "add(sq(2), add(1, three()))",
            "c": "sq(sq(sq(2)))",
            "d": "even(sq(3))",
            "e": "clamp(-7 // 2, 0, 5)",
            "f": "if even(N) then add(N, 1) else N",
        },
        params="N: int = 4",
        fns=FNS,
    )
    assert got == {"a": 9, "b": 8, "c": 256, "d": False, "e": 0, "f": 5}
    assert folded(tmp_path, "add(sq(N), three())", params="N: int = 4", fns=FNS) == 19


def test_a_user_fn_replaces_min(tmp_path: Path) -> None:
    assert values(tmp_path, {"x": "min(2, 3)"}, fns="fn min(a, b) = a + b") == {"x": 5}


@pytest.mark.parametrize(
    ("fns", "expr", "code"),
    [
        ("fn f(x) = f(x - 1)  " + MARK, "f(3)", "E0103"),  # recursion
        ("fn f(x) = g(x)\nfn g(x) = f(x)  " + MARK, "f(3)", "E0103"),  # mutual recursion
        ("fn f(x) = x", "f(1, 2)  " + MARK, "E0103"),  # arity
        ("fn f(x) = x", "g(1)  " + MARK, "E0101"),  # unknown fn
        ("fn f(x) = x + N  " + MARK, "f(1)", "E0101"),  # fn bodies do not see parameters
        ("fn f(x, x) = x  " + MARK, "f(1, 2)", "E0102"),  # a parameter twice
        ("fn f(x) = x\nfn f(y) = y  " + MARK, "f(1)", "E0102"),  # a fn twice
        ("", "min()  " + MARK, "E0103"),
        ("", "max(true, 1)  " + MARK, "E0105"),
    ],
)
def test_fn_errors(tmp_path: Path, fns: str, expr: str, code: str) -> None:
    text = fns + "\n" + schedule(f"let x = {expr}", params="D: int = 2, N: int = 2")
    expect_error(tmp_path, text, code)


def test_recursion_that_is_never_called_is_not_an_error(tmp_path: Path) -> None:
    text = "fn f(x) = f(x)\n" + schedule("", order="order rank r { F(0) B(0) F(1) B(1) }")
    assert ranks(compile_text(tmp_path, text)) == [
        f"F0@{r}/main B0@{r}/main F1@{r}/main B1@{r}/main" for r in range(2)
    ]


@pytest.mark.parametrize(
    ("expr", "code"),
    [
        ("1 + true", "E0105"),
        ("true < false", "E0105"),
        ("1 == true", "E0105"),
        ("not 3", "E0105"),
        ("-true", "E0105"),
        ("if 1 then 2 else 3", "E0105"),
        ("if true then 1 else false", "E0105"),
        ("3 / 2", "E0001"),
        ("1 < 2 < 3", "E0001"),
        ("1 + if true then 1 else 2", "E0001"),
        ("2 ** 3", "E0001"),
        ("nope + 1", "E0101"),
    ],
)
def test_expression_errors(tmp_path: Path, expr: str, code: str) -> None:
    expect_error(tmp_path, schedule(f"let x = {expr}  {MARK}"), code)


def test_slash_suggests_floor_division(tmp_path: Path) -> None:
    diag = expect_error(tmp_path, schedule(f"let x = N / 2  {MARK}"), "E0001")
    assert diag.help == "use `//` for integer division"


def test_unknown_name_on_a_branch_never_taken(tmp_path: Path) -> None:
    text = schedule(
        "",
        order=f"""
        order rank r {{
            if false {{ F(nope) }}  {MARK}
            F(0) B(0) F(1) B(1)
        }}""",
    )
    diag = expect_error(tmp_path, text, "E0101")
    assert diag.message == "unknown name `nope`"


# ---- scoping ----------------------------------------------------------------------------


def test_sibling_loops_reuse_a_name_and_lets_follow_their_block(tmp_path: Path) -> None:
    text = schedule(
        "let half = N // 2",
        params="D: int = 2, N: int = 4",
        order="""
        order rank r {
            for i in 0..half { F(i) }
            for i in 0..half {
                let j = half + i
                F(j)
                B(i)
            }
            for i in half..N { B(i) }
            let i = 0
        }""",
    )
    assert ranks(compile_text(tmp_path, text)) == [
        f"F0@{r}/main F1@{r}/main F2@{r}/main B0@{r}/main F3@{r}/main B1@{r}/main "
        f"B2@{r}/main B3@{r}/main"
        for r in range(2)
    ]


def test_if_branches_are_separate_scopes(tmp_path: Path) -> None:
    text = schedule(
        "",
        order="""
        order rank r {
            if r == 0 { let x = 0  F(x) } else { let x = 0  F(x) }
            let x = 1
            F(x) B(0) B(1)
        }""",
    )
    assert ranks(compile_text(tmp_path, text))[0] == "F0@0/main F1@0/main B0@0/main B1@0/main"


@pytest.mark.parametrize(
    ("order", "code"),
    [
        (f"order rank r {{ for i in 0..N {{ for i in 0..N {{ F(i) }} }}  {MARK}\n}}", "E0102"),
        (f"order rank r {{ for i in 0..N {{ let i = 1  {MARK}\n}} }}", "E0102"),
        (f"order rank r {{ let N = 1  {MARK}\n}}", "E0102"),
        (f"order rank r {{ let x = 1\n let x = 2  {MARK}\n}}", "E0102"),
        (f"order rank r {{ for r in 0..N {{ F(r) }}  {MARK}\n}}", "E0102"),
        (f"order rank D {{ F(0) }}  {MARK}", "E0102"),
        (f"order repeat N every 2 {{ F(stage=0) @ 0 }}  {MARK}", "E0102"),
        (f"order rank r {{ F(x)  {MARK}\n let x = 0 }}", "E0101"),
        (f"order rank r {{ for i in 0..N {{ let x = i }}\n F(x)  {MARK}\n}}", "E0101"),
        (f"order rank r {{ if true {{ let x = 0 }} else {{ F(x) }}  {MARK}\n}}", "E0101"),
        (f"order rank r {{ for i in 0..N {{ F(i) }}\n B(i)  {MARK}\n}}", "E0101"),
    ],
)
def test_scope_errors(tmp_path: Path, order: str, code: str) -> None:
    expect_error(tmp_path, schedule("", order=order), code)


def test_schedule_lets_and_requires_run_in_order(tmp_path: Path) -> None:
    text = schedule(f'require x > 0 : "x"  {MARK}\nlet x = 1', order="order rank r { F(0) }")
    expect_error(tmp_path, text, "E0101")
    text = schedule(f"let N = 3  {MARK}", order="order rank r { F(0) }")
    expect_error(tmp_path, text, "E0102")


def test_parameter_defaults_see_earlier_parameters_only(tmp_path: Path) -> None:
    text = schedule(
        "", params="D: int = 2, N: int = 3 * D, k: bool = N > 5", order="order rank r { F(0) }"
    )
    program = compile_text(tmp_path, text, {"D": "1"})
    assert program.params == (("D", 1), ("N", 3), ("k", False))
    expect_error(tmp_path, f"schedule t(N: int = D,  {MARK}\n D: int = 2) {{}}", "E0101")
    expect_error(tmp_path, f"schedule t(N: int = N + 1  {MARK}\n) {{}}", "E0101")


def test_a_default_that_uses_a_rejected_parameter_is_not_reported_again(tmp_path: Path) -> None:
    path = write(tmp_path, schedule("", params="D: int = 2, N: int = D", order="order rank r {}"))
    with pytest.raises(PipelangError) as info:
        api.compile_schedule(str(path), {"D": "abc"}, stop_after="expand-orders")
    assert [d.code for d in info.value.diagnostics] == ["E0203"]


# ---- -p parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"a": "8"}, (8, False)),
        ({"a": "+8"}, (8, False)),
        ({"a": "-3"}, (-3, False)),
        ({"a": " 12 "}, (12, False)),
        ({"a": "-0"}, (0, False)),
        ({"a": "007"}, (7, False)),
        ({"b": "true"}, (1, True)),
        ({"b": "false", "a": "999999999999999999"}, (999999999999999999, False)),
    ],
)
def test_p_values(tmp_path: Path, given: dict[str, str], expected: tuple[int, bool]) -> None:
    text = schedule(
        "",
        params="D: int = 2, N: int = 2, a: int = 1, b: bool = false",
        order="order rank r { F(0) }",
    )
    program = compile_text(tmp_path, text, given)
    assert dict(program.params)["a"] == expected[0]
    assert dict(program.params)["b"] is expected[1]


@pytest.mark.parametrize(
    ("given", "code"),
    [
        ({"a": "abc"}, "E0203"),
        ({"a": "4.0"}, "E0203"),
        ({"a": "1_000"}, "E0203"),
        ({"a": ""}, "E0203"),
        ({"a": "--1"}, "E0203"),
        ({"b": "True"}, "E0203"),
        ({"b": "1"}, "E0203"),
        ({"a": "1" * 19}, "E0106"),
        ({"zzz": "1"}, "E0202"),
    ],
)
def test_bad_p_values(tmp_path: Path, given: dict[str, str], code: str) -> None:
    text = schedule(
        "",
        params="D: int = 2, N: int = 2, a: int = 1, b: bool = false",
        order="order rank r { F(0) }",
    )
    expect_error(tmp_path, text, code, given, line=1)


def test_every_parameter_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "schedule t(D: int = 2, N: int, b: bool = true) {}")
    with pytest.raises(PipelangError) as info:
        api.compile_schedule(str(path), {"D": "x", "b": "2", "Q": "1"}, stop_after="expand-orders")
    assert sorted(d.code for d in info.value.diagnostics) == ["E0201", "E0202", "E0203", "E0203"]


@pytest.mark.parametrize("pair", ["D", "=4", " =4", ""])
def test_malformed_p_is_a_usage_error(pair: str) -> None:
    with pytest.raises(UsageError):
        parse_params([pair])


def test_p_parsing_keeps_the_last_value() -> None:
    assert parse_params(["D=4", "N=x=y", "D=5"]) == {"D": "5", "N": "x=y"}


# ---- order rank -------------------------------------------------------------------------


@pytest.mark.parametrize(("d", "n"), [(1, 1), (2, 1), (3, 5), (4, 8), (5, 3), (8, 16)])
def test_stdlib_1f1b_is_1f1b(d: int, n: int) -> None:
    program = api.compile_schedule("1f1b", {"D": str(d), "N": str(n)}, stop_after="expand-orders")
    assert ranks(program.need_program()) == one_f_one_b(d, n)


def test_op_arguments(tmp_path: Path) -> None:
    text = schedule(
        "",
        order="""
        order rank r {
            F(0)  F(mb=1)  B(0, r)  B(stage=r, mb=1)
        }""",
    )
    assert ranks(compile_text(tmp_path, text)) == [
        f"F0@{r}/main F1@{r}/main B0@{r}/main B1@{r}/main" for r in range(2)
    ]


def test_stage_is_required_where_a_rank_holds_several(tmp_path: Path) -> None:
    text = f"""
        schedule t(D: int = 2, N: int = 1) {{
            pipeline main: stage s in 0..2 * D -> rank s % D
            microbatches 0..N -> main
            order rank r {{
                F(0, r) F(0, r + D) B(0, r + D)
                B(0)  {MARK}
            }}
        }}"""
    diag = expect_error(tmp_path, text, "E0103")
    assert diag.message == "`B` needs a stage: rank 0 holds stages 0, 2 of pipeline `main`"


def test_an_op_on_a_rank_without_its_pipeline(tmp_path: Path) -> None:
    text = f"""
        schedule t(D: int = 2, N: int = 2) {{
            pipeline a: stage s in 0..D -> rank s
            pipeline b: stage s in 0..D -> rank 0
            microbatches 0..1 -> a, 1..2 -> b
            order rank r {{
                if r == 1 {{ F(1) }}  {MARK}
            }}
        }}"""
    expect_error(tmp_path, text, "E0301")


def test_a_stage_held_by_another_rank_is_left_to_validate(tmp_path: Path) -> None:
    text = schedule("", params="D: int = 2, N: int = 1", order="order rank r { F(0, 1 - r) }")
    assert ranks(compile_text(tmp_path, text)) == ["F0@1/main", "F0@0/main"]


@pytest.mark.parametrize(
    "op",
    [
        "F()",
        "F(0, 1, 0)",
        "F(0, mb=1)",
        "F(stage=0, 1)",
        "F(mb=0, mb=0)",
        "F(slot=1)",
        "G(0)",
        "F(0) @ 1",
        "F(5)",
        "F(-1)",
        "F(0, 7)",
        "F(0, -1)",
        "F(stage=0)",
    ],
)
def test_bad_ops_in_order_rank(tmp_path: Path, op: str) -> None:
    expect_error(tmp_path, schedule("", order=f"order rank r {{\n {op}  {MARK}\n}}"), "E0103")


def test_if_else_if_chain(tmp_path: Path) -> None:
    text = schedule(
        "",
        params="D: int = 3, N: int = 1",
        order="""
        order rank r {
            if r == 0 { F(0) B(0) }
            else if r == 1 { F(0) B(mb=0) }
            else { F(mb=0) B(0, 2) }
        }""",
    )
    assert ranks(compile_text(tmp_path, text)) == gpipe(3, 1)


# ---- order repeat -----------------------------------------------------------------------

REPEAT_1F1B = """
schedule repeat_1f1b(D: int = 4, N: int = 8) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order repeat k every 2 {
        for s in 0..D {
            F(stage=s) @ s
            B(stage=s) @ 2 * D - 1 - s
        }
    }
}
"""


@pytest.mark.parametrize(
    ("d", "n"), [(1, 1), (1, 4), (2, 1), (2, 2), (3, 7), (4, 4), (4, 8), (5, 2), (6, 12)]
)
def test_repeat_form_of_1f1b_equals_the_explicit_one(tmp_path: Path, d: int, n: int) -> None:
    params = {"D": str(d), "N": str(n)}
    repeat = compile_text(tmp_path, REPEAT_1F1B, params)
    explicit = api.compile_schedule("1f1b", params, stop_after="expand-orders").need_program()
    assert ranks(repeat) == ranks(explicit) == one_f_one_b(d, n)


def test_repeat_over_two_pipelines_is_chimera(tmp_path: Path) -> None:
    text = """
        schedule two(D: int = 4, N: int = 4) {
            pipeline down: stage s in 0..D -> rank s
            pipeline up: stage s in 0..D -> rank D - 1 - s
            microbatches 0..N // 2 -> down, N // 2..N -> up
            order repeat k every 2 {
                for s in 0..D { F(stage=s) @ s  B(stage=s) @ 2 * D - 1 - s }
            }
        }"""
    assert ranks(compile_text(tmp_path, text)) == CHIMERA_4


def test_repeat_slots_may_be_negative_and_every_may_be_left_out(tmp_path: Path) -> None:
    backwards = schedule(
        "",
        params="D: int = 1, N: int = 3",
        order="order repeat k every -2 { F(stage=0) @ 0  B(stage=0) @ 1 }",
    )
    assert ranks(compile_text(tmp_path, backwards)) == [
        "F2@0/main B2@0/main F1@0/main B1@0/main F0@0/main B0@0/main"
    ]
    spaced = schedule(
        "",
        params="D: int = 1, N: int = 2",
        order="order repeat k { F(stage=0) @ 10 * k  B(stage=0) @ 10 * k + 7 }",
    )
    assert ranks(compile_text(tmp_path, spaced)) == ["F0@0/main B0@0/main F1@0/main B1@0/main"]


def test_repeat_collision(tmp_path: Path) -> None:
    text = schedule(
        "",
        order=f"""
        order repeat k every 1 {{
            for s in 0..D {{
                F(stage=s) @ s  {MARK}
                B(stage=s) @ 2 * D - 1 - s
            }}
        }}""",
    )
    diag = expect_error(tmp_path, text, "E0310")
    assert diag.message == "`F1@1/main` and `B0@1/main` both land in slot 2 of their rank"
    assert diag.labels[0].span.line == diag.span.line + 1


def test_repeat_collision_across_pipelines(tmp_path: Path) -> None:
    text = f"""
        schedule t(D: int = 1, N: int = 2) {{
            pipeline a: stage s in 0..D -> rank 0
            pipeline b: stage s in 0..D -> rank 0
            microbatches 0..1 -> a, 1..2 -> b
            order repeat k every 2 {{ F(stage=0) @ 0  {MARK}
                B(stage=0) @ 1 }}
        }}"""
    expect_error(tmp_path, text, "E0310")


@pytest.mark.parametrize(
    "op", ["F(0, 0) @ 1", "F(stage=0)", "F(0) @ 0", "F(stage=9) @ 0", "F(mb=0, stage=0) @ 0"]
)
def test_bad_ops_in_order_repeat(tmp_path: Path, op: str) -> None:
    order = f"order repeat k every 2 {{\n {op}  {MARK}\n}}"
    expect_error(tmp_path, schedule("", order=order), "E0103")


# ---- order greedy -----------------------------------------------------------------------


def greedy(policy: str, params: str = "D: int = 2, N: int = 3", body: str = "") -> str:
    return schedule(body, params=params, order=f"order greedy {{ {policy} }}")


@pytest.mark.parametrize(("d", "n"), [(1, 3), (2, 3), (3, 3), (4, 8), (5, 2), (3, 9)])
def test_greedy_with_cap_d_minus_rank_is_1f1b(tmp_path: Path, d: int, n: int) -> None:
    text = greedy("prefer B, F  priority mb  cap D - rank", params=f"D: int = {d}, N: int = {n}")
    assert ranks(compile_text(tmp_path, text)) == one_f_one_b(d, n)


def test_greedy_cap_one_runs_one_micro_batch_at_a_time(tmp_path: Path) -> None:
    line = " ".join(f"F{i}@{{r}}/main B{i}@{{r}}/main" for i in range(3))
    assert ranks(compile_text(tmp_path, greedy("cap 1"))) == [line.format(r=r) for r in range(2)]


def test_greedy_without_cap_prefers_and_prioritises(tmp_path: Path) -> None:
    youngest = greedy("prefer F  priority -mb", params="D: int = 1, N: int = 3")
    assert ranks(compile_text(tmp_path, youngest)) == [
        "F2@0/main F1@0/main F0@0/main B2@0/main B1@0/main B0@0/main"
    ]
    default = greedy("", params="D: int = 1, N: int = 2")
    assert ranks(compile_text(tmp_path, default)) == ["F0@0/main B0@0/main F1@0/main B1@0/main"]
    gpipe_like = greedy("prefer F, B", params="D: int = 3, N: int = 4")
    assert ranks(compile_text(tmp_path, gpipe_like)) == gpipe(3, 4)


def test_greedy_replays_with_the_schedules_costs(tmp_path: Path) -> None:
    unit = greedy("prefer F, B", params="D: int = 2, N: int = 2")
    assert ranks(compile_text(tmp_path, unit))[1] == "F0@1/main F1@1/main B0@1/main B1@1/main"
    slow_first_stage = greedy("prefer F, B", params="D: int = 2, N: int = 2", body="cost F[0] = 5")
    assert ranks(compile_text(tmp_path, slow_first_stage)) == [
        "F0@0/main F1@0/main B0@0/main B1@0/main",
        "F0@1/main B0@1/main F1@1/main B1@1/main",
    ]


def test_greedy_with_split_backward(tmp_path: Path) -> None:
    late_w = greedy("prefer B, F, W  cap 1", params="D: int = 1, N: int = 2", body="ops F, B, W")
    assert ranks(compile_text(tmp_path, late_w)) == [
        "F0@0/main B0@0/main F1@0/main B1@0/main W0@0/main W1@0/main"
    ]
    early_w = greedy("prefer B, W, F  cap 1", params="D: int = 1, N: int = 2", body="ops F, B, W")
    assert ranks(compile_text(tmp_path, early_w)) == [
        "F0@0/main B0@0/main W0@0/main F1@0/main B1@0/main W1@0/main"
    ]


@pytest.mark.parametrize(("d", "cap"), [(2, 1), (4, 1), (4, 2), (4, 3), (6, 2)])
def test_greedy_cap_counts_micro_batches_on_a_v_placement(tmp_path: Path, d: int, cap: int) -> None:
    """Rank r holds stages r and 2D-1-r; the cap holds back only a forward of stage r (a
    new micro-batch), so the second chunk of one in flight never stalls the policy."""
    text = f"""schedule v(D: int = {d}, N: int = 8) {{
        ops F, B, W
        pipeline main: stage s in 0..2 * D -> rank if s < D then s else 2 * D - 1 - s
        microbatches 0..N -> main
        order greedy {{ prefer B, F, W  priority mb  cap {cap} }}
    }}"""
    program = compile_text(tmp_path, text, stop="insert-sync")
    for rank, actions in enumerate(program.ranks):
        in_flight, peak = set(), 0
        for a in actions:
            if a.stage == rank and a.kind in (Kind.F, Kind.B):
                (in_flight.add if a.kind is Kind.F else in_flight.remove)(a.mb)
                peak = max(peak, len(in_flight))
        assert peak == min(cap, 8), f"rank {rank}"


@pytest.mark.parametrize(
    ("policy", "code", "line"),
    [
        ("cap 0", "E0311", 6),
        ("cap rank - 1", "E0311", 6),
        ("cap 1\n cap 2", "E0207", 7),
        ("prefer F\n prefer B", "E0207", 7),
        ("priority mb\n priority stage", "E0207", 7),
        ("prefer F, F", "E0102", 5),
        ("priority nope", "E0101", 6),
        ("priority mb > 1", "E0105", 6),
        ("cap mb", "E0101", 6),
    ],
)
def test_greedy_errors(tmp_path: Path, policy: str, code: str, line: int) -> None:
    text = schedule("", order=f"order greedy {{\n {policy}\n}}")
    expect_error(tmp_path, text, code, line=line)


def test_greedy_stuck_on_an_after_cycle(tmp_path: Path) -> None:
    text = schedule(f"F(0, 0) after B(0, 0)  {MARK}", order="order greedy { }")
    diag = expect_error(tmp_path, text, "E0311")  # at the `after`, the cause
    assert "stuck" in diag.message and "cap" not in (diag.help or "")


# ---- pipelines and micro-batches ----------------------------------------------------------


def test_pipeline_family_and_round_robin(tmp_path: Path) -> None:
    text = """
        schedule fam(D: int = 2, N: int = 4, f: int = 2) {
            pipeline p[j in 0..f]: stage s in 0..D -> rank (s + j) % D
            microbatches m in 0..N -> p[m % f]
            order greedy { }
        }"""
    program = compile_text(tmp_path, text)
    assert [(p.name, p.placement) for p in program.pipelines] == [("p0", (0, 1)), ("p1", (1, 0))]
    assert program.assignment == ("p0", "p1", "p0", "p1")
    one = compile_text(tmp_path, text, {"f": "1"})
    assert [(p.name, p.placement) for p in one.pipelines] == [("p", (0, 1))]
    assert one.assignment == ("p",) * 4


def test_family_range_may_start_anywhere(tmp_path: Path) -> None:
    text = """
        schedule fam(D: int = 2, N: int = 2) {
            pipeline p[j in 1..3]: stage s in 0..D -> rank (s + j) % D
            microbatches 0..1 -> p[1], 1..2 -> p2
            order greedy { }
        }"""
    program = compile_text(tmp_path, text)
    assert [p.name for p in program.pipelines] == ["p1", "p2"]
    assert program.assignment == ("p1", "p2")


def test_interleaved_placement(tmp_path: Path) -> None:
    text = """
        schedule t(D: int = 2, N: int = 1, v: int = 2) {
            pipeline main: stage s in 0..D * v -> rank s % D
            microbatches 0..N -> main
            order rank r {
                for c in 0..v { F(0, c * D + r) }
                for c in 0..v { B(0, (v - 1 - c) * D + r) }
            }
        }"""
    program = compile_text(tmp_path, text)
    assert program.pipelines[0].placement == (0, 1, 0, 1)
    assert ranks(program) == [
        "F0@0/main F0@2/main B0@2/main B0@0/main",
        "F0@1/main F0@3/main B0@3/main B0@1/main",
    ]


PLACEMENT_ERRORS = [
    ("pipeline main: stage s in 1..D -> rank s", "microbatches 0..N -> main", "E0205", 2),
    ("pipeline main: stage s in 0..0 -> rank s", "microbatches 0..N -> main", "E0205", 2),
    ("pipeline main: stage s in 0..D -> rank 2 * s", "microbatches 0..N -> main", "E0205", 2),
    ("pipeline main: stage s in 0..D -> rank s - 1", "microbatches 0..N -> main", "E0205", 2),
    (
        "pipeline main: stage s in 0..D -> rank s\n    pipeline b: stage s in 0..D + 1 -> rank s",
        "microbatches 0..N -> main",
        "E0205",
        3,
    ),
    (
        "pipeline main: stage s in 0..D -> rank s\n    pipeline main: stage s in 0..D -> rank s",
        "microbatches 0..N -> main",
        "E0102",
        3,
    ),
    (
        "pipeline p0: stage s in 0..D -> rank s\n"
        "    pipeline p[j in 0..2]: stage s in 0..D -> rank s",
        "microbatches 0..N -> p0",
        "E0102",
        3,
    ),
    ("pipeline p[j in 0..f]: stage s in 0..D -> rank s", "microbatches 0..N -> p", "E0207", 2),
    ("pipeline main: stage s in 0..D -> rank s", "microbatches 0..N -> nope", "E0107", 3),
    (
        "pipeline p[j in 0..2]: stage s in 0..D -> rank s",
        "microbatches m in 0..N -> p[m + 1]",
        "E0107",
        3,
    ),
    ("pipeline p[j in 0..2]: stage s in 0..D -> rank s", "microbatches 0..N -> p", "E0107", 3),
    (
        "pipeline main: stage s in 0..D -> rank s",
        "microbatches 0..N -> main, 0..1 -> main",
        "E0206",
        3,
    ),
    (
        "pipeline main: stage s in 0..D -> rank s",
        "microbatches 0..1 -> main, 2..3 -> main",
        "E0206",
        3,
    ),
    ("pipeline main: stage s in 0..D -> rank s", "microbatches 0..0 -> main", "E0206", 3),
    ("pipeline main: stage s in 0..D -> rank s", "microbatches -1..N -> main", "E0206", 3),
    (
        "pipeline main: stage s in 0..D -> rank s",
        "microbatches 1000000000000..1000000000001 -> main",
        "E0206",
        3,
    ),
    (
        "pipeline main: stage s in 0..D -> rank s",
        "microbatches 0..N -> main\n    microbatches 0..N -> main",
        "E0207",
        4,
    ),
]


@pytest.mark.parametrize(("pipelines", "mbs", "code", "line"), PLACEMENT_ERRORS)
def test_placement_and_assignment_errors(
    tmp_path: Path, pipelines: str, mbs: str, code: str, line: int
) -> None:
    text = (
        f"schedule t(D: int = 2, N: int = 2, f: int = 0) {{\n    {pipelines}\n    {mbs}\n"
        "    order rank r { F(0) }\n}\n"
    )
    expect_error(tmp_path, text, code, line=line)


# ---- ops and costs ------------------------------------------------------------------------


def test_ops_and_cost_lines(tmp_path: Path) -> None:
    text = schedule(
        "ops W, R, B, F\ncost F = 1.5, B = 2, C = 0.25\ncost F[1] = 3, B = 4",
        params="D: int = 2, N: int = 1",
        order="order rank r { F(0) R(0) B(0) W(0) }",
    )
    program = compile_text(tmp_path, text)
    assert [k.value for k in program.kinds] == ["F", "B", "W", "R"]
    costs = program.costs
    assert (costs.of("F", 0), costs.of("F", 1), costs.of("B"), costs.of("W"), costs.of("C")) == (
        1.5,
        3.0,
        4.0,
        0.0,  # W is free unless given
        0.25,
    )


@pytest.mark.parametrize(
    ("decl", "code"),
    [
        ("ops F, W", "E0309"),
        ("ops F, B, F", "E0309"),
        ("ops F, B\n    ops F, B", "E0207"),
        ("ops F, B, X", "E0001"),
        ("cost X = 1", "E0209"),
        ("cost F = -1", "E0001"),
        ("cost F = " + "9" * 400, "E0209"),
    ],
)
def test_ops_and_cost_errors(tmp_path: Path, decl: str, code: str) -> None:
    line = 5 if "\n" in decl else 4
    text = schedule(decl, order="order rank r { F(0) }")
    expect_error(tmp_path, text, code, line=line)


# ---- after ------------------------------------------------------------------------------


def test_after_dependencies_are_recorded(tmp_path: Path) -> None:
    text = schedule(
        "B(0, 0) after F(1, 1)\nF(mb=i + 1, stage=0) after B(stage=0, mb=i) for i in 0..N - 1",
        params="D: int = 2, N: int = 3",
        order="order rank r { for i in 0..N { F(i) B(i) } }",
    )
    program = compile_text(tmp_path, text)
    assert [(str(d.earlier), str(d.later)) for d in program.after] == [
        ("F1@1/main", "B0@0/main"),
        ("B0@0/main", "F1@0/main"),
        ("B1@0/main", "F2@0/main"),
    ]
    assert all(d.span is not None and d.span.line in (4, 5) for d in program.after)


def test_greedy_honours_after(tmp_path: Path) -> None:
    text = greedy(
        "prefer F, B",
        params="D: int = 2, N: int = 4",
        body="F(i + 2, 0) after B(i, 0) for i in 0..N - 2",
    )
    assert ranks(compile_text(tmp_path, text))[0] == (
        "F0@0/main F1@0/main B0@0/main F2@0/main B1@0/main F3@0/main B2@0/main B3@0/main"
    )


@pytest.mark.parametrize(
    ("dep", "code"),
    [
        ("B(0) after F(0, 0)", "E0103"),
        ("B(0, 0) after F(0, 0) @ 1", "E0103"),
        ("B(9, 0) after F(0, 0)", "E0103"),
        ("B(0, 5) after F(0, 0)", "E0103"),
        ("G(0, 0) after F(0, 0)", "E0103"),
        ("B(0, 0) after F(i, 0) for i in 0..N + x", "E0101"),
    ],
)
def test_after_errors(tmp_path: Path, dep: str, code: str) -> None:
    expect_error(tmp_path, schedule(f"{dep}  {MARK}", order="order rank r { F(0) }"), code)


# ---- imports ----------------------------------------------------------------------------

MAIN = schedule("", order="order rank r { for i in 0..N { F(i) B(i) } }")


def test_imports_are_relative_and_transitive_and_may_repeat(tmp_path: Path) -> None:
    write(tmp_path, "fn one() = 1", "lib/base.pipe")
    write(tmp_path, 'import "base.pipe"\nfn two() = one() + one()', "lib/two.pipe")
    write(tmp_path, 'import "base.pipe"\nfn three() = one() + 2', "lib/three.pipe")
    text = 'import "lib/two.pipe"\nimport "lib/three.pipe"\nimport "lib/two.pipe"\n' + schedule(
        "let x = two() + three() + one()", order="order rank r { F(0) }"
    )
    path = write(tmp_path, text, "main.pipe")
    c = api.compile_schedule(str(path), {}, stop_after="resolve-params")
    assert c.params is not None and c.params["x"] == 6


def test_import_from_the_stdlib(tmp_path: Path) -> None:
    text = 'import "1f1b"\nimport "gpipe.pipe"\n' + MAIN
    assert ranks(compile_text(tmp_path, text)) == [
        f"F0@{r}/main B0@{r}/main F1@{r}/main B1@{r}/main" for r in range(2)
    ]


def test_import_errors(tmp_path: Path) -> None:
    expect_error(tmp_path, f'import "missing.pipe"  {MARK}\n' + MAIN, "E0004")
    expect_error(tmp_path, f'import "t.pipe"  {MARK}\n' + MAIN, "E0005")
    (tmp_path / "sub").mkdir()
    diag = expect_error(tmp_path, f'import "sub"  {MARK}\n' + MAIN, "E0004")
    assert "directory" in diag.message


def test_two_file_import_cycle(tmp_path: Path) -> None:
    write(tmp_path, 'import "a.pipe"\nfn b() = 1', "b.pipe")
    write(tmp_path, 'import "b.pipe"\nfn a() = 1', "a.pipe")
    path = write(tmp_path, 'import "a.pipe"\n' + MAIN, "main.pipe")
    with pytest.raises(PipelangError) as info:
        api.compile_schedule(str(path), {}, stop_after="expand-orders")
    diag = info.value.diagnostics[0]
    assert diag.code == "E0005"
    assert diag.message == "import cycle: main.pipe -> a.pipe -> b.pipe -> a.pipe"
    assert diag.span is not None and diag.span.source.path == "b.pipe" and diag.span.line == 1


def test_an_imported_fn_may_not_clash(tmp_path: Path) -> None:
    write(tmp_path, "fn f(x) = x", "lib.pipe")
    expect_error(tmp_path, f'import "lib.pipe"\nfn f(y) = y  {MARK}\n' + MAIN, "E0102")


def test_syntax_errors_in_an_imported_file_point_into_it(tmp_path: Path) -> None:
    write(tmp_path, "fn f(x) = x +\n", "lib.pipe")
    path = write(tmp_path, 'import "lib.pipe"\n' + MAIN)
    with pytest.raises(PipelangError) as info:
        api.compile_schedule(str(path), {})
    diag = info.value.diagnostics[0]
    assert diag.code == "E0002" and diag.span is not None and diag.span.source.path == "lib.pipe"


# ---- reading and parsing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "code", "line"),
    [
        ("", "E0006", None),
        ("# only a comment\n", "E0006", None),
        ("fn f(x) = x\n", "E0006", None),
        ("schedule a() {}\nschedule b() {}\n", "E0006", 2),
        ("schedule a() {\n    pipeline main: stage s in 0..2 -> rank s\n", "E0002", 2),
        ("schedule a(D: int = 2) {\n  let x = D +\n", "E0002", 2),
        ("schedule a() {}\n}\n", "E0001", 2),
        ("schedule a() {\n  let x = 1 $ 2\n}\n", "E0001", 2),
        ("schedule a() {\n  let x = 1 2\n}\n", "E0001", 2),
        ("schedule a(D: float = 1) {}\n", "E0001", 1),
        ('schedule a() {\n  require true : "no end\n}\n', "E0001", 2),
        ("schedule a() {\n  let x = 1234567890123456789\n}\n", "E0106", 2),
        ("schedule a() {\n  let é = 1\n}\n", "E0001", 2),
    ],
)
def test_parse_errors(tmp_path: Path, text: str, code: str, line: int | None) -> None:
    expect_error(tmp_path, text, code, line=line)


def test_unclosed_brace_is_labelled(tmp_path: Path) -> None:
    text = schedule("", order="order rank r {\n    for i in 0..N { F(i) B(i)\n}")
    diag = expect_error(tmp_path, text.rstrip().rstrip("}") + "\n", "E0002", line=7)
    assert diag.labels[0].message == "this `{` is not closed"
    assert diag.labels[0].span.line == 6


@pytest.mark.parametrize(
    "data",
    [b"\x00\x01\x02", b"schedule t() {\x00}", b"\xff\xfe\xfd", "schedule é() {}".encode("latin-1")],
)
def test_unreadable_files(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bin.pipe"
    path.write_bytes(data)
    with pytest.raises(PipelangError) as info:
        api.compile_schedule(str(path), {})
    assert info.value.diagnostics[0].code == "E0003"


def test_missing_file_and_directory(tmp_path: Path) -> None:
    for sched in (str(tmp_path / "nope.pipe"), str(tmp_path), "no-such-stdlib-schedule"):
        with pytest.raises(PipelangError) as info:
            api.compile_schedule(sched, {})
        assert info.value.diagnostics[0].code == "E0003"


def test_a_file_that_cannot_be_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, MAIN)

    def refuse(self: Path, *args: object, **kwargs: object) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)  # how readers.read_text opens every file
    with pytest.raises(PipelangError) as info:
        api.compile_schedule(str(path), {})
    diag = info.value.diagnostics[0]
    assert (diag.code, diag.message) == ("E0003", f"cannot read `{path}`: Permission denied")


def test_comments_crlf_and_tabs(tmp_path: Path) -> None:
    text = (
        "# header\r\nschedule\tt(D: int = 2, N: int = 2) { # trailing\r\n"
        "\tpipeline main: stage s in 0..D -> rank s # here\r\n"
        "\tmicrobatches 0..N -> main\r\n\torder rank r { F(0) B(0) F(1) B(1) }\r\n}\r\n"
    )
    path = tmp_path / "crlf.pipe"
    path.write_bytes(text.encode())
    program = api.compile_schedule(str(path), {}, stop_after="expand-orders").need_program()
    assert ranks(program) == [f"F0@{r}/main B0@{r}/main F1@{r}/main B1@{r}/main" for r in range(2)]


def test_keywords_are_names_where_no_keyword_fits(tmp_path: Path) -> None:
    text = schedule(
        "",
        params="D: int = 2, N: int = 2, order: int = 1",
        order="""
        order rank r {
            let stage = r
            for rank in 0..N { F(rank, stage) B(mb=rank) }
        }""",
    )
    assert ranks(compile_text(tmp_path, text)) == [
        f"F0@{r}/main B0@{r}/main F1@{r}/main B1@{r}/main" for r in range(2)
    ]


# ---- limits (E0106) -----------------------------------------------------------------------

FN_TOWER = "fn f0(x) = x\n" + "\n".join(
    f"fn f{i}(x) = f{i - 1}(x) + f{i - 1}(x)" for i in range(1, 30)
)
FN_CHAIN = "fn g0(x) = x\n" + "\n".join(f"fn g{i}(x) = g{i - 1}(x) + 1" for i in range(1, 600))


@pytest.mark.parametrize(
    ("fns", "body", "order", "where"),
    [
        # Nested deeper than the parser allows, or a chain of more than 100 terms: at
        # the node too deep, or (deeper still) at the bracket that goes too deep.
        ("", f"let x = {'+'.join(['1'] * 150)}  {MARK}", "order rank r { F(0) }", "mark"),
        ("", f"let x = {'- x' * 150}  {MARK}", "order rank r { F(0) }", "mark"),
        ("", f"let x = {'not ' * 400}true  {MARK}", "order rank r { F(0) }", "mark"),
        (
            "",
            "",
            "order rank r { " + "if true { " * 150 + "F(0)" + " }" * 150 + " }  " + MARK,
            "mark",
        ),
        (
            "",
            "",
            "order rank r { " + "if true { " * 500 + "F(0)" + " }" * 500 + " }  " + MARK,
            "mark",
        ),
        # Too many loop iterations: at the loop that goes over.
        ("", "", f"order rank r {{ for i in 0..5000000 {{ F(0) }} }}  {MARK}", "mark"),
        (
            "",
            "",
            f"order rank r {{ for i in 0..3000 {{ for j in 0..3000 {{ }} }} }}  {MARK}",
            "mark",
        ),
        # fns: exponentially many inlined bodies, or calls nested too deep to evaluate.
        (FN_TOWER, "let x = f29(1)", "order rank r { F(0) }", "fns"),
        (FN_CHAIN, "let x = g599(1)", "order rank r { F(0) }", "schedule"),
    ],
    ids=[
        "long-sum",
        "many-minus",
        "many-not",
        "nested-ifs",
        "very-nested-ifs",
        "long-loop",
        "nested-loops",
        "fn-tower",
        "fn-chain",
    ],
)
def test_size_and_nesting_limits(
    tmp_path: Path, fns: str, body: str, order: str, where: str
) -> None:
    text = (fns + "\n" + schedule(body, order=order)).lstrip("\n")
    lines = text.splitlines()
    line = {
        "mark": next((i for i, t in enumerate(lines, 1) if MARK in t), 0),
        "start": 1,
        "fns": 2,
        "schedule": next(i for i, t in enumerate(lines, 1) if t.startswith("schedule")),
    }[where]
    expect_error(tmp_path, text, "E0106", line=line)


@pytest.mark.parametrize(
    ("params", "mbs", "pipeline", "line"),
    [
        ({"N": "5000000"}, "0..N", "stage s in 0..D -> rank s", 3),  # one range
        ({"D": "8", "N": "600000"}, "0..N", "stage s in 0..D -> rank s", 1),  # ops in all
        ({"D": "5000000"}, "0..N", "stage s in 0..D -> rank s", 2),
        ({"D": "2"}, "0..N", "stage s in 0..D -> rank s * 5000000", 2),  # ranks
        ({"N": "100000000000"}, "0..N", "stage s in 0..D -> rank s", 3),
        ({"N": "-100000000000"}, "N..0", "stage s in 0..D -> rank s", 3),
    ],
)
def test_huge_parameters_are_refused(
    tmp_path: Path, params: dict[str, str], mbs: str, pipeline: str, line: int
) -> None:
    text = (
        f"schedule t(D: int = 2, N: int = 2) {{\n    pipeline main: {pipeline}\n"
        f"    microbatches {mbs} -> main\n    order rank r {{ F(0) }}\n}}\n"
    )
    expect_error(tmp_path, text, "E0106", params, line=line)


def test_family_placements_are_bounded_in_all(tmp_path: Path) -> None:
    text = f"""
        schedule t(N: int = 1) {{
            pipeline p[j in 0..1000000]: stage s in 0..5 -> rank 0  {MARK}
            microbatches 0..N -> p[0]
            order greedy {{ }}
        }}"""
    expect_error(tmp_path, text, "E0106")


# ---- every front-end code ------------------------------------------------------------------

FRONT_END_CODES = {
    "E0001",
    "E0002",
    "E0003",
    "E0004",
    "E0005",
    "E0006",
    "E0101",
    "E0102",
    "E0103",
    "E0104",
    "E0105",
    "E0106",
    "E0107",
    "E0201",
    "E0202",
    "E0203",
    "E0204",
    "E0205",
    "E0206",
    "E0207",
    "E0301",
    "E0309",
    "E0310",
    "E0311",
}


def test_front_end_codes_are_known() -> None:
    assert set(CODES) >= FRONT_END_CODES


def test_failed_require_gives_the_schedules_message(tmp_path: Path) -> None:
    text = schedule(f'require N % 2 == 0 : "N must be even"  {MARK}', order="order rank r { }")
    diag = expect_error(tmp_path, text, "E0204", {"N": "3"})
    assert diag.message == "N must be even"
    assert diag.notes == ("with D = 2, N = 3",)


def test_missing_parameter(tmp_path: Path) -> None:
    expect_error(tmp_path, "schedule t(D: int) {}", "E0201", line=1)


# ---- the reference's examples --------------------------------------------------------------


def doc_examples() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "language.md").read_text()
    blocks = re.findall(r"```pipe\n(.*?)```", text, re.S)
    examples = []
    for index, block in enumerate(blocks):
        named = re.match(r"# file: (\S+)\n", block)
        examples.append((named.group(1) if named else f"example{index}.pipe", block))
    return examples


def test_the_language_reference_examples_compile(tmp_path: Path) -> None:
    examples = doc_examples()
    assert len(examples) >= 10
    for name, block in examples:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block)
    for name, block in examples:
        if "schedule" not in block:
            continue
        error = re.search(r"^# error: (E\d{4})", block, re.M)
        if error is None:
            api.compile_schedule(str(tmp_path / name), {}, stop_after="expand-orders")
            continue
        with pytest.raises(PipelangError) as info:
            api.compile_schedule(str(tmp_path / name), {}, stop_after="expand-orders")
        assert info.value.diagnostics[0].code == error.group(1), name


# ---- overlapped pairs and full backwards ------------------------------------------------

PAIRED = """
schedule paired(D: int = 1, N: int = 2) {
    ops F, B, W
    pipeline main: stage s in 0..2 -> rank 0
    microbatches 0..N -> main
    cost FB = 2
    order rank r {
        F(0, 0) F(0, 1) F(1, 0) BW(0, 1)
        F(1, 1) & BW(0, 0)
        B(1, 1) W(1, 1) BW(1, 0)
    }
}
"""


def test_pair_and_full_backward_are_fused_actions(tmp_path: Path) -> None:
    program = compile_text(tmp_path, PAIRED, stop="validate")
    assert ranks(program) == [
        "F0@0/main F0@1/main F1@0/main B0@1/main &W0@1/main F1@1/main &B0@0/main "
        "&W0@0/main B1@1/main W1@1/main B1@0/main &W1@0/main"
    ]
    assert [Action.parse(a.text()).fused for a in program.ranks[0]] == [
        a.fused for a in program.ranks[0]
    ]


def test_pair_in_a_repeat_order_is_an_error(tmp_path: Path) -> None:
    text = """
    schedule t(D: int = 2, N: int = 2) {
        pipeline main: stage s in 0..D -> rank s
        microbatches 0..N -> main
        order repeat k every 2 {
            F(stage=0) @ 0 & F(stage=1) @ 1  # <-
            B(stage=1) @ 2 B(stage=0) @ 3
        }
    }
    """
    expect_error(tmp_path, text, "E0103")
