"""The public Python API (`pipelang.load`, `Schedule`): docs/api.md is its contract and
runs here as a doctest; the tests below cover what the page does not show."""

from __future__ import annotations

import doctest
import subprocess
import sys
from pathlib import Path

import pytest

import pipelang
from tests.helpers import replay

ROOT = Path(__file__).resolve().parent.parent


def test_the_api_page_runs_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # its examples name files relative to the repository
    result = doctest.testfile(
        str(ROOT / "docs" / "api.md"), module_relative=False, optionflags=doctest.ELLIPSIS
    )
    assert result.attempted > 10 and result.failed == 0


def test_the_api_simulates_as_the_cli_does() -> None:
    """`Schedule.simulate` is the CLI's simulation: the same timeline as the simulator on
    the compiled Program with the CLI's cost parser."""
    from pipelang.cli.args import parse_cost

    prog = pipelang.load("zb-h1", D=4, N=8)
    ours = prog.simulate({"F": 1, "B": 1, "W": 1, "C": 0.5})
    theirs = replay(prog.program, prog.program.costs.merged(parse_cost("F=1,B=1,W=1,C=0.5")))
    assert ours.events == theirs.events


def test_params_take_ints_and_bools() -> None:
    assert pipelang.load("interleaved-1f1b", D=2, N=4, v=2).stages == 4
    with pytest.raises(pipelang.PipelangError) as caught:
        pipelang.load("1f1b", D=True)
    assert caught.value.diagnostics[0].code == "E0203"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.ops(7), "rank 7 is not one of the schedule's 0..3"),
        (lambda p: p.export("yaml"), "no export format 'yaml'"),
        (lambda p: p.draw("out.pdf"), "cannot draw to out.pdf"),
        (lambda p: p.simulate({"F": -1}), "cost `F` is -1; a time is between 0 and 10^15"),
        (lambda p: p.simulate({"B": [1, "x"]}), "cost `B`: `'x'` is not a number"),
        (lambda p: p.export("torch-csv"), "torch's CSV format holds one pipeline"),
    ],
)
def test_bad_arguments_are_pipelang_errors(call: object, message: str) -> None:
    prog = pipelang.load("chimera", D=2, N=2)
    with pytest.raises(pipelang.PipelangError) as raised:
        call(prog)  # type: ignore[operator]
    assert message.replace("0..3", "0..1") in raised.value.diagnostics[0].message


def test_importing_pipelang_does_not_import_torch() -> None:
    """The compiler's API is light: torch loads only for runs."""
    code = "import sys, pipelang; pipelang.load('1f1b'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_real_number_is_a_cost_and_a_bool_is_not() -> None:
    """numpy's integers were refused while its floats were taken (issue 44): any
    `numbers.Real` is a time, the same time as the plain int or float."""
    from fractions import Fraction

    import numpy as np

    prog = pipelang.load("1f1b", D=4, N=4)
    want = prog.simulate({"F": 2, "B": 3}).makespan
    for kind in (np.int8, np.int64, np.uint16, np.float16, np.float32, np.float64, Fraction):
        assert prog.simulate({"F": kind(2), "B": kind(3)}).makespan == want, kind
    assert prog.simulate({"F": np.array([2, 2, 2, 2]), "B": (3, 3, 3, 3)}).makespan == want
    for bad in (True, np.bool_(True), np.array(2.0), 1j, 10**400, "2"):
        with pytest.raises(pipelang.PipelangError) as raised:
            prog.simulate({"F": bad})
        assert raised.value.diagnostics[0].code == "E0209", bad
    # and a parameter any integer, numpy's too, not a bool's numpy twin or a float
    assert pipelang.load("1f1b", D=np.int64(4), N=np.uint8(4)).program == prog.program
    for bad in (np.bool_(True), np.float64(4), 4.0):
        with pytest.raises(pipelang.PipelangError) as raised:
            pipelang.load("1f1b", D=bad)
        assert raised.value.diagnostics[0].code == "E0203", bad


@pytest.mark.parametrize(
    ("costs", "message"),
    [
        ({"C": [1, 2, 3, 4]}, "cost `C` lists 4 times; the schedule has 3 stage boundaries"),
        ({"C": [1, 2]}, "cost `C` lists 2 times; the schedule has 3 stage boundaries"),
        ({"F": [1, 2, 3]}, "cost `F` lists 3 times; the schedule has 4 stages"),
    ],
)
def test_a_per_stage_list_of_the_wrong_length_is_refused(
    costs: dict[str, list[int]], message: str
) -> None:
    """`C` lists one time per stage boundary: on 4 stages `C[3]` was dropped in silence
    (synthesize refused it)."""
    prog = pipelang.load("1f1b", D=4, N=4)
    with pytest.raises(pipelang.PipelangError) as raised:
        prog.simulate(costs)
    assert raised.value.diagnostics[0].message.startswith(message)
    assert prog.simulate({"C": [3, 3, 3]}).makespan == prog.simulate({"C": 3}).makespan
    with pytest.raises(pipelang.PipelangError) as raised:  # synthesize took a short list
        pipelang.synthesize("1f1b", D=4, N=4, costs=costs)
    assert raised.value.diagnostics[0].message.startswith(message)


@pytest.mark.parametrize("path", [None, 3, b"x.svg"])
def test_draw_to_what_is_no_file_name_is_a_pipelang_error(path: object) -> None:
    with pytest.raises(pipelang.PipelangError) as raised:
        pipelang.load("1f1b", D=2, N=2).draw(path)  # type: ignore[arg-type]
    assert raised.value.diagnostics[0].message.startswith("draw takes a file name")
