"""The parser saved beside the grammar (grammars/pipe.lark.json, pipelang/parser.py's
`SAVED_PARSER`) is the one lark builds from the grammar: saved again from the checkout's
grammar it is the same file, byte for byte, and it parses every schedule we ship and
refuses malformed text exactly as the parser built from the grammar does.

Oracle: lark itself, building the LALR parser from `pipe.lark` (`build_parser`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from lark import Lark, UnexpectedInput

from pipelang import parser
from pipelang.parser import SAVED_PARSER, build_parser, save_parser

ROOT = Path(__file__).resolve().parent.parent
GRAMMARS = ROOT / "grammars"
SHIPPED = sorted([*(ROOT / "schedules").glob("*.pipe"), *(ROOT / "examples").glob("*.pipe")])
BAD = [
    "schedule s(D: int) {",
    "schedule s(D) { stage 0..D }",
    "schedule s(D: int, N: int) { rank r in 0..D { F(0, m) } }",
    "schedule s() { @@ }",
    "schedule",
    "import",
]


@pytest.fixture(scope="module")
def built():  # type: ignore[no-untyped-def]
    return build_parser((GRAMMARS / "pipe.lark").read_text(encoding="utf-8"))


def test_the_saved_parser_is_saved_from_the_grammar_as_it_is() -> None:
    """Fails after an edit of the grammar until the parser is saved again (the command is
    in `save_parser`'s docstring). lark numbers its parse states differently from one
    build to the next, so the file is not compared byte for byte: what it parses is
    (below)."""
    saved = json.loads((GRAMMARS / SAVED_PARSER).read_text(encoding="utf-8"))
    grammar = (GRAMMARS / "pipe.lark").read_text(encoding="utf-8")
    assert saved["stamp"] == parser._stamp(grammar), (
        "grammars/pipe.lark.json is stale: save it again (pipelang.parser.save_parser)"
    )


def test_save_parser_writes_what_loads_as_the_grammars_parser(tmp_path: Path) -> None:
    shutil.copy(GRAMMARS / "pipe.lark", tmp_path / "pipe.lark")
    saved = json.loads(
        save_parser(tmp_path).read_text(encoding="utf-8"), object_pairs_hook=parser._numbered
    )
    lark = Lark._load_from_dict(saved["data"], saved["memo"])
    for path in SHIPPED:
        text = path.read_text(encoding="utf-8")
        assert lark.parse(text) == parser._lark().parse(text)


def test_commands_use_the_saved_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the stamp matches, nothing is built; where it does not, the grammar is."""
    calls: list[str] = []
    monkeypatch.setattr(parser, "build_parser", lambda text: calls.append(text) or "built")
    assert parser._lark.__wrapped__() != "built"  # type: ignore[attr-defined]
    assert calls == []
    monkeypatch.setattr(parser, "_stamp", lambda text: {"grammar_sha256": "another"})
    assert parser._lark.__wrapped__() == "built"  # type: ignore[attr-defined]
    assert calls == [(GRAMMARS / "pipe.lark").read_text(encoding="utf-8")]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_saved_parser_parses_as_the_built_one(path: Path, built) -> None:  # type: ignore[no-untyped-def]
    text = path.read_text(encoding="utf-8")
    assert parser._lark().parse(text) == built.parse(text)


@pytest.mark.parametrize("text", BAD)
def test_the_saved_parser_refuses_as_the_built_one(text: str, built) -> None:  # type: ignore[no-untyped-def]
    errors = []
    for lark in (parser._lark(), built):
        with pytest.raises(UnexpectedInput) as caught:
            lark.parse(text)
        err = caught.value
        errors.append((type(err), err.line, err.column, sorted(getattr(err, "expected", ()))))
    assert errors[0] == errors[1]
