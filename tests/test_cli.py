"""The `pipelang` command as users see it: exit status, messages, and no tracebacks.

Each table below runs some of its cases as the real command in a subprocess
(`python -m pipelang.cli`, about a second each) and the rest through `pipelang.cli.main`
in this process, which takes the same path from argv to exit status.

Exit status: 0 success, 1 diagnostics, 2 usage errors. Whatever the input, neither stream
may hold a Python traceback, an `internal error`, or a path inside the installed package.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from pipelang import api
from pipelang.cli.app import COMMANDS
from pipelang.codes import CODES
from tests.helpers import GOOD, pipelang_cmd, run_in_process


def cli(args: list[str], cwd: Path, real: bool) -> tuple[int, str, str]:
    """`pipelang ARGS` in `cwd`, in a subprocess if `real`: (status, stdout, stderr)."""
    if real:
        proc = pipelang_cmd(*args, cwd=cwd)
        return proc.returncode, proc.stdout, proc.stderr
    here = Path.cwd()
    os.chdir(cwd)
    try:
        return run_in_process(args)
    finally:
        os.chdir(here)


# ---- exit status ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "status", "expect", "real"),
    [
        (["check", "good.pipe"], 0, "ok: good(D=2, N=2): 2 ranks", True),
        (["check", "1f1b", "-p", "D=2", "-p", "N=+3"], 0, "ok: one_f_one_b(D=2, N=3)", False),
        (
            ["compile", "good.pipe", "--dump-after", "expand-orders"],
            0,
            "rank 0: F0@0/main B0@0/main F1@0/main B1@0/main",
            True,
        ),
        (["--version"], 0, "pipelang ", False),
        (["explain", "e0306"], 0, "E0306: deadlock", True),
        (["frob"], 2, "invalid choice: 'frob'", True),
        ([], 2, "usage: pipelang", False),
        (["check"], 2, "the following arguments are required: SCHED", False),
        (["compile", "good.pipe"], 2, "pipelang compile: error: give -o DIR", True),
        (["check", "good.pipe", "-p", "D"], 2, "`-p D`: expected NAME=VALUE", True),
        (["check", "good.pipe", "-p", "=3"], 2, "expected NAME=VALUE", False),
        (["simulate", "good.pipe", "--cost", "F=fast"], 2, "cannot read `F=fast`", True),
        (["simulate", "good.pipe", "--cost", "X=1"], 2, "cannot read `X=1`", False),
        (["simulate", "good.pipe", "--cost", "F[" + "9" * 30 + "]=1"], 2, "cannot read", False),
        (["check", "good.pipe", "--format", "xml"], 2, "invalid choice: 'xml'", False),
        (["compile", "good.pipe", "--dump-after", "nope"], 2, "invalid choice: 'nope'", False),
        (
            ["check", "good.pipe", "--max-activations", "many"],
            2,
            "expected a whole number, not `many`",
            False,
        ),
        (["explain", "E9999"], 2, "no diagnostic code `E9999`", True),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_exit_status(tmp_path: Path, args: list[str], status: int, expect: str, real: bool) -> None:
    (tmp_path / "good.pipe").write_text(GOOD)
    got, out, err = cli(args, tmp_path, real)
    assert got == status, err
    assert expect in out + err


# ---- bad input: exit 1 and one clean diagnostic --------------------------------------------


def _garbage() -> bytes:
    rng = random.Random(1234)
    return bytes(rng.randrange(256) for _ in range(300)) + b"\x00\xff\xfe"


@pytest.mark.parametrize(
    ("mw", "held"), [(None, [4, 4, 4, 4]), ("0", [4, 3, 2, 1]), ("0.5", [4, 3.5, 3, 2.5])]
)
def test_simulate_counts_what_w_holds_after_b(mw: str | None, held: list[float]) -> None:
    """ZB-H1 worker i holds (p - i + 1) M_B + (i - 1) M_W (zero-bubble paper): `MW` is
    M_W / M_B, 1 by default (what the runtime keeps of its built-in models), 0 the
    papers' count to B."""
    cost = [] if mw is None else ["--cost", f"MW={mw}"]
    status, out, _ = run_in_process(
        ["simulate", "zb-h1", "-p", "D=4", "-p", "N=8", "--json", *cost]
    )
    assert status == 0
    assert [r["peak_activations"] for r in json.loads(out)["ranks"]] == held


BAD_FILES: dict[str, tuple[bytes | str, str, bool]] = {
    # name: (contents, expected code, run in a subprocess)
    "empty": ("", "E0006", False),
    "garbage": (_garbage(), "E0003", True),
    "nul": ("schedule t() {\x00}\n", "E0003", False),
    "latin1": ("schedule caf\xe9() {}\n".encode("latin-1"), "E0003", False),
    "truncated": (GOOD[: GOOD.index("order rank r {") + len("order rank r {")], "E0002", True),
    "missing-brace": (GOOD.rstrip().rstrip("}"), "E0002", False),
    "extra-brace": (GOOD + "}\n", "E0001", False),
    "unknown-name": (GOOD.replace("0..N {", "0..M {"), "E0101", False),
    "div-zero": (GOOD.replace("for i in 0..N", "for i in 0..N // (D - 2)"), "E0104", True),
    "slash": (GOOD.replace("0..D ->", "0..D / 1 ->"), "E0001", False),
    "not-an-op": (GOOD.replace("B(i)", "Q(i)"), "E0103", False),
    "self-import": ('import "self.pipe"\n' + GOOD, "E0005", True),
    "deep": ("schedule t(D: int = " + "-" * 5000 + "1) {}\n", "E0106", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", BAD_FILES)
def test_bad_files(tmp_path: Path, name: str) -> None:
    contents, code, real = BAD_FILES[name]
    path = tmp_path / ("self.pipe" if name == "self-import" else "bad.pipe")
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(contents)
    status, out, err = cli(["check", path.name], tmp_path, real)
    assert status == 1
    assert err.startswith(f"error[{code}]"), err
    assert out == ""


def test_import_cycle_of_two_files(tmp_path: Path) -> None:
    (tmp_path / "a.pipe").write_text('import "b.pipe"\nfn a() = 1\n')
    (tmp_path / "b.pipe").write_text('import "a.pipe"\nfn b() = 2\n')
    (tmp_path / "main.pipe").write_text('import "a.pipe"\n' + GOOD)
    proc = pipelang_cmd("check", "main.pipe", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        "error[E0005]: import cycle: main.pipe -> a.pipe -> b.pipe -> a.pipe"
    )
    assert "--> b.pipe:1:1" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sched", "message", "real"),
    [
        (".", "error[E0003]: cannot read `.`: it is a directory", True),
        ("missing.pipe", "error[E0003]: cannot read `missing.pipe`: no such file", True),
        ("no-such-schedule", "error[E0003]: no schedule `no-such-schedule`", False),
    ],
)
def test_missing_inputs(tmp_path: Path, sched: str, message: str, real: bool) -> None:
    status, _, err = cli(["check", sched], tmp_path, real)
    assert status == 1
    assert err.startswith(message)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "real"),
    [
        (["check", "1f1b", "-p", "D=abc"], "E0203", True),
        (["check", "chimera", "-p", "D=abc"], "E0203", False),
        (["check", "1f1b", "-p", "D=0"], "E0204", False),
        (["check", "chimera", "-p", "N=-4"], "E0204", True),
        (["check", "1f1b", "-p", "X=1"], "E0202", False),
        (["check", "1f1b", "-p", "N=" + "9" * 5000], "E0106", False),
    ],
)
def test_bad_parameters(tmp_path: Path, args: list[str], code: str, real: bool) -> None:
    status, _, err = cli(args, tmp_path, real)
    assert status == 1
    assert err.startswith(f"error[{code}]"), err
    assert "<stdlib>/" in err


@pytest.mark.parametrize(
    ("param", "real"),
    [
        ("N=100000000000", True),
        ("D=100000000000", False),
        ("N=999999999999999999", False),
        ("N=5000000", False),
    ],
)
def test_huge_parameters_end_quickly(tmp_path: Path, param: str, real: bool) -> None:
    start = time.monotonic()
    status, _, err = cli(["check", "1f1b", "-p", param], tmp_path, real)
    assert time.monotonic() - start < 10
    assert status == 1
    assert err.startswith("error[E0106]")


@pytest.mark.slow
@pytest.mark.parametrize("name", api.stdlib_names())
def test_stdlib_schedules_refuse_zero_and_negative_sizes(name: str) -> None:
    params = [p.name for p in api.load_file(name).schedule.params]
    for param in ("D", "N"):
        if param not in params:
            continue
        for value in ("0", "-1", "-8"):
            status, _, err = run_in_process(["check", name, "-p", f"{param}={value}"])
            assert status == 1, err
            assert err.startswith("error[E0"), err


# ---- output formats ---------------------------------------------------------------------


def test_json_diagnostics(tmp_path: Path) -> None:
    (tmp_path / "bad.pipe").write_text(GOOD.replace("0..N {", "0..M {"))
    proc = pipelang_cmd("check", "bad.pipe", "--format", "json", cwd=tmp_path)
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    (diag,) = doc["diagnostics"]
    assert diag["code"] == "E0101"
    assert diag["message"] == "unknown name `M`"
    assert diag["location"] == {
        "file": "bad.pipe",
        "line": 4,
        "column": 32,
        "end_line": 4,
        "end_column": 33,
    }


def test_json_success_and_several_diagnostics(tmp_path: Path) -> None:
    status, out, _ = run_in_process(["check", "1f1b", "--format", "json"])
    assert status == 0 and json.loads(out)["ok"] is True
    status, out, _ = run_in_process(["check", "1f1b", "--format", "json", "-p", "D=x", "-p", "Q=1"])
    assert status == 1
    codes = [d["code"] for d in json.loads(out)["diagnostics"]]
    assert sorted(codes) == ["E0202", "E0203"]
    assert all(d["location"]["line"] == 5 for d in json.loads(out)["diagnostics"])


def test_text_diagnostic_shape(tmp_path: Path) -> None:
    (tmp_path / "bad.pipe").write_text(GOOD.replace("0..N {", "0..M {"))
    status, _, err = run_in_process(["check", str(tmp_path / "bad.pipe")])
    assert status == 1
    lines = err.splitlines()
    assert lines[0] == "error[E0101]: unknown name `M`"
    assert lines[1].endswith("bad.pipe:4:32")
    assert lines[3] == "4 |     order rank r { for i in 0..M { F(i) B(i) } }"
    assert lines[4] == "  |                                ^"


# ---- explain and help -------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(CODES))
def test_explain_every_code(code: str) -> None:
    status, out, err = run_in_process(["explain", code])
    assert status == 0, err
    assert out.startswith(f"{code}: {CODES[code].title}\n\n")
    assert CODES[code].explanation in out


@pytest.mark.parametrize("code", ["E9999", "X", "", "e00001"])
def test_explain_unknown_code(code: str) -> None:
    status, _, err = run_in_process(["explain", code])
    assert status == 2
    assert err.startswith("pipelang explain: error: no diagnostic code")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_of_every_subcommand(command: str) -> None:
    status, out, _ = run_in_process([command, "--help"])
    assert status == 0
    assert out.startswith(f"usage: pipelang {command}")


def test_help_in_a_subprocess(tmp_path: Path) -> None:
    proc = pipelang_cmd("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for command in COMMANDS:
        assert command in proc.stdout


def test_simulate_model_gives_bytes_for_a_schedule_with_a_frozen_part() -> None:
    """`--model` on diffusionpipe: the frozen part's output is stage 0's input, so the
    model is cut with its first layer frozen, as `pipelang run` does (this was a
    KeyError)."""
    args = ["simulate", "diffusionpipe", "-p", "D=2", "-p", "N=2", "--model", "gpt:tiny", "--json"]
    status, out, err = run_in_process(args)
    assert status == 0, err
    ranks = json.loads(out)["ranks"]
    assert all(r["data_slot_bytes"] > 0 and r["peak_activation_bytes"] > 0 for r in ranks)


@pytest.mark.parametrize(
    ("line", "wanted"),
    [
        ("pipline main: stage s in 0..D -> rank s", "pipeline"),
        ("microbatch 0..N -> main", "microbatches"),
        ("lett x = 3", "let"),
        ("ordr rank r {", "order"),
    ],
)
def test_a_mistyped_keyword_gets_did_you_mean(line: str, wanted: str, tmp_path: Path) -> None:
    path = tmp_path / "t.pipe"
    path.write_text(f"schedule t(D: int = 2, N: int = 2) {{\n    {line}\n}}\n")
    status, _, err = run_in_process(["check", str(path)])
    assert status == 1 and "E0001" in err
    assert f"is not a keyword: did you mean `{wanted}`?" in err


def test_a_parameter_in_the_wrong_case_gets_did_you_mean() -> None:
    status, _, err = run_in_process(["check", "1f1b", "-p", "d=4"])
    assert status == 1 and "has no parameter `d`" in err and "did you mean `-p D=...`?" in err
    status, _, err = run_in_process(["check", "1f1b", "-p", "depth=4"])
    assert status == 1 and "did you mean" not in err  # nothing close: no guess


@pytest.mark.parametrize("code", ["E0306", "e0306", "306", "0306"])
def test_explain_takes_the_number_alone(code: str) -> None:
    status, out, _ = run_in_process(["explain", code])
    assert status == 0 and out.startswith("E0306: deadlock")


def test_off_a_terminal_tables_are_whole_and_no_bar_is_drawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Piped (as in CI logs), `run`'s progress prints its step lines and no bar cut into
    `0:… 0:0…`; a table wider than 80 columns is not cut either."""
    import io

    from rich.table import Table

    from pipelang.backends.report import StepProgress
    from pipelang.progress import console

    monkeypatch.delenv("COLUMNS", raising=False)
    out = console(stderr=True)
    out.file = io.StringIO()  # what a pipe is to rich: no terminal
    assert not out.is_terminal and out.width == 200
    with StepProgress(2, "1f1b on gpt:tiny (local, 2 ranks)", out, tokens_per_step=256) as bar:
        bar.step(0, 5.5, 0.01)
        bar.step(1, 5.4, 0.01)
    text = out.file.getvalue()
    assert "step 2/2  loss 5.4000" in text and "…" not in text and "━" not in text
    table = Table("schedule", "what it is")
    table.add_row("chimera", "two pipelines in opposite directions, " * 4)
    out.print(table)
    lines = out.file.getvalue().splitlines()
    assert "…" not in out.file.getvalue() and max(len(line) for line in lines) > 80


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--cost", "F=100"],
            "--cost with --trace needs --overlay: the run is drawn in its measured times, "
            "and --cost sets the model's",
        ),
        (
            ["1f1b", "-p", "D=2", "-p", "N=4", "--cost", "F=100"],
            "--cost with --trace needs --overlay: the run is drawn in its measured times, "
            "and --cost sets the model's",
        ),
        (
            ["--lengths", "LENGTHS", "--overlay"],
            "--lengths with --trace gives the micro-batch shapes of a SCHED; give the "
            "schedule the trace ran",
        ),
    ],
)
def test_viz_trace_refuses_options_it_would_ignore(
    options: list[str], message: str, tmp_path: Path
) -> None:
    """`viz --trace` took --cost and --lengths and drew the same picture (issue 44)."""
    (tmp_path / "l.txt").write_text("4\n8\n4\n8\n")
    trace = Path(__file__).parent / "data" / "trace_1f1b_D2_N4.json"
    options = [str(tmp_path / "l.txt") if o == "LENGTHS" else o for o in options]
    args = ["viz", "--trace", str(trace), *options, "-o", str(tmp_path / "o.txt")]
    status, out, err = run_in_process(args)
    assert (status, out, err) == (2, "", f"pipelang viz: error: {message}\n")
    # with --overlay the costs are the model's, and the SCHED is compiled as the run was
    sched = ["1f1b", "-p", "D=2", "-p", "N=4", "--overlay", "--cost", "F=100,B=100"]
    status, _, err = run_in_process([*args[:3], *sched, "-o", str(tmp_path / "o.txt")])
    assert status == 0, err


def test_an_internal_error_under_json_is_a_json_object_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--json` promises a JSON object on stdout for every error: a bug in pipelang too
    (synthesize printed nothing there), with its one line on stderr as ever."""
    from pipelang.cli import app

    def broken(args: object) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(COMMANDS["simulate"], "run", broken)
    assert app.main(["simulate", "1f1b", "--json"]) == 1
    out, err = capsys.readouterr()
    found = json.loads(out)
    assert found["ok"] is False and found["diagnostics"][0]["code"] == "internal"
    assert found["diagnostics"][0]["message"] == "internal error: RuntimeError: boom"
    assert err.startswith("internal error: RuntimeError: boom\nthis is a bug in pipelang")


def test_profile_and_plan_refuse_an_output_they_cannot_write_before_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o DIR` (a directory) was refused after a minute of measuring."""
    import pipelang.backends.measure as measure

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before the output was checked")

    monkeypatch.setattr(measure, "measure", measured)
    out = tmp_path / "d"
    out.mkdir()
    status, _, err = run_in_process(["profile", "--model", "gpt:tiny", "-o", str(out)])
    assert status == 2 and "cannot write `" in err and "Is a directory" in err, err
    missing = str(tmp_path / "no.json")
    plan = ["plan", "--profile", missing, "--topology", missing, "--micro-batches", "4"]
    status, _, err = run_in_process([*plan, "-o", str(out)])
    assert status == 2 and "cannot write `" in err and "Is a directory" in err, err
