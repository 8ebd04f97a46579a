"""The docs' claims about what the commands do, checked against the commands themselves:
which schedules the standard library has, the exit status of a `--cost` for a stage the
schedule does not have (docs/language.md's exit table), and Seq1F1B's activation count
with `KV` (docs/schedules/seq1f1b.md) over ranks where the warm-up spans several
micro-batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import run_in_process

from pipelang.api import stdlib_names

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def test_no_page_says_a_stdlib_schedule_is_missing_from_the_stdlib() -> None:
    """docs/visualize.md said "DualPipeV is not in the standard library yet" while
    `pipelang list` names it."""
    stdlib = {_key(name) for name in stdlib_names()}
    assert "dualpipev" in stdlib
    said = [
        (page.name, match.group(1))
        for page in PAGES
        for match in re.finditer(
            r"([\w-]+) (?:is|are) not (?:yet )?in the (?:standard library|stdlib)",
            _words(page.read_text(encoding="utf-8")),
        )
    ]
    assert [(page, name) for page, name in said if _key(name) in stdlib] == []


def _exit_rows() -> dict[int, str]:
    text = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    table = text[text.index("| exit status | meaning |") :]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d) \| (.*) \|$", table, re.M)}


MISSING_STAGE = {
    "simulate": ["simulate", "1f1b", "-p", "D=2", "--cost", "F[5]=2"],
    "viz": ["viz", "1f1b", "-p", "D=2", "--cost", "F[5]=2", "-o", "{tmp}/v.svg"],
    "synthesize": ["synthesize", "1f1b", "-p", "D=2", "-p", "N=2", "--cost", "F[5]=2"],
    "pack": [
        "pack",
        "1f1b",
        "-p",
        "D=2",
        "--sequences",
        "{tmp}/lengths.txt",
        "--max-tokens",
        "100",
        "--cost",
        "F[5]=2",
    ],
}


@pytest.mark.parametrize("command", sorted(MISSING_STAGE))
def test_the_exit_table_says_how_each_command_answers_a_cost_for_a_missing_stage(
    command: str, tmp_path: Path
) -> None:
    """Every command that takes `--cost` answers an entry for a stage the schedule does
    not have alike: exit 2 with one message (`synthesize` said E0209, exit 1), and the
    exit table's row 2 names it where it speaks of such a `--cost`."""
    (tmp_path / "lengths.txt").write_text("10\n20\n30\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in MISSING_STAGE[command]]
    status, out, err = run_in_process(args)
    assert (status, out) == (2, "")
    assert err == (
        f"pipelang {command}: error: `--cost F[5]`: one_f_one_b: the schedule has no "
        "stage 5 (its stages are 0..1)\n"
    )
    row = _exit_rows()[2]
    clause = row[row.index("a `--cost` for a stage") :].split("(")[0]
    assert f"`{command}`" in clause, clause


def test_every_command_that_takes_cost_takes_the_one_option() -> None:
    """`--cost` was declared by four commands with four help texts: each command that
    takes it has the one from `add_cost_argument` (a command's own words after it) and
    is checked above."""
    import argparse

    from pipelang.cli.app import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {
        name: action.help
        for name, parser in sub.choices.items()
        for action in parser._actions
        if "--cost" in action.option_strings
    }
    assert set(helps) == set(MISSING_STAGE)
    common = helps["simulate"]
    assert common.startswith("cost entries over the schedule's `cost` line")
    assert all(text.startswith(common) for text in helps.values()), helps


def _t(m: int) -> int:
    """2 + 3 + ... + m (0 for m < 2)."""
    return m * (m + 1) // 2 - 1 if m > 0 else 0


@pytest.mark.parametrize("D", range(1, 10))
@pytest.mark.parametrize("C", range(1, 5))
def test_seq1f1b_holds_what_its_page_counts_with_kv(D: int, C: int) -> None:
    """docs/schedules/seq1f1b.md gave rank r (C+D-1-r)/C + KV (T(C) + T(D-1-r))/C, which
    counts too much once D-1-r > C (the warm-up then spans whole micro-batches past the
    first, each with T(C)): at D = 6, C = 2, KV = 0.5 rank 0 holds 5, not 7.5. The page's
    count, m = D-1-r: (C+m)/C + KV ((1 + m // C) T(C) + T(m % C))/C, wherever the warm-up
    fills (N C >= C+D-1-r)."""
    kv = 0.5
    page = _words((ROOT / "docs" / "schedules" / "seq1f1b.md").read_text(encoding="utf-8"))
    assert "(C+m)/C + KV·((1 + ⌊m/C⌋)·T(C) + T(m mod C))/C" in page
    for n in (2, 8):
        args = ["simulate", "seq1f1b", "-p", f"D={D}", "-p", f"N={n}", "-p", f"C={C}"]
        status, out, _ = run_in_process([*args, "--cost", f"F=1,B=2,KV={kv}", "--json"])
        assert status == 0
        peaks = [rank["peak_activations"] for rank in json.loads(out)["ranks"]]
        for r, peak in enumerate(peaks):
            m = D - 1 - r
            if n * C < C + m:
                continue
            count = (C + m) / C + kv * ((1 + m // C) * _t(C) + _t(m % C)) / C
            assert peak == pytest.approx(count, abs=1e-5), (D, C, n, r)
    if (D, C) == (6, 2):
        assert peaks[0] == 5 and "rank 0 holds 5, not 7.5" in page
