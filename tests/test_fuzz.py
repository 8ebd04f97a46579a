"""Random and mutated `.pipe` files: every run ends in success or a clean diagnostic.

Hypothesis throws three kinds of input at the compiler (every pass up to `insert-sync`):
token soup built from the grammar's words, raw bytes, and the standard-library and
golden files with tokens and characters deleted, inserted, duplicated and swapped and
numbers changed to 0, -1 or something huge, and the shapes of hostile inputs (issue 16):
numbers multiplied past 2^63, nested hundreds of brackets deep or chained into long
sums, CRLF, CR and a BOM, and declarations that cannot take effect (a cost for a missing
stage, an `after` naming an undeclared kind, a `let` a greedy order would shadow). Each
run must either succeed or raise `PipelangError` whose diagnostics all carry a known
code and render as `error[E....]`, within the deadline. Under `CI=true` the examples are
derandomized and no database is kept, so a CI run is reproducible."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelang import api
from pipelang.codes import CODES
from pipelang.diagnostics import PipelangError

ROOT = Path(__file__).resolve().parent.parent
SEEDS = sorted((ROOT / "schedules").glob("*.pipe")) + sorted(
    (ROOT / "tests" / "golden").rglob("*.pipe")
)
SEED_TEXTS = [path.read_text() for path in SEEDS]

TOKEN = re.compile(
    r'\s+|#[^\n]*|"[^"\n]*"|[A-Za-z_][A-Za-z0-9_]*|[0-9]+(?:\.[0-9]+)?|\.\.|->|//|==|!=|<=|>=|\S'
)
KEYWORDS = (  # noqa: SIM905 - a word list reads best as words
    "schedule fn import require let ops cost pipeline stage in rank microbatches after "
    "order greedy repeat every prefer priority cap for if then else and or not true false "
    "int bool F B W R C min max mb D N r s k i"
).split()
PUNCTUATION = '{ } ( ) [ ] , : = -> .. @ + - * // % / < <= == != >= > # "'.split()  # noqa: SIM905
VOCAB = sorted(
    {t for text in SEED_TEXTS for t in TOKEN.findall(text) if not t.isspace()}
    | set(KEYWORDS)
    | set(PUNCTUATION)
)
NUMBERS = ["0", "-1", "1", "2", "99999999999", "1" * 30, "4000001"]

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
EXAMPLES = int(os.environ.get("PIPELANG_FUZZ_EXAMPLES", "150"))
"""Examples per property; raise it for a longer hunt (`PIPELANG_FUZZ_EXAMPLES=20000`)."""
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=CI,
    **({"database": None} if CI else {}),
)


STOP_AFTER = "insert-sync"
"""What `check` runs, and the lowering passes after it: every pass a Program goes through."""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pipelang-fuzz-") as name:
        yield Path(name)


def check_clean(path: Path, params: dict[str, str] | None = None) -> None:
    """`pipelang check PATH`: success, or only diagnostics with known codes."""
    try:
        api.compile_schedule(str(path), params or {}, stop_after=STOP_AFTER)
    except PipelangError as err:
        assert err.diagnostics
        for diag in err.diagnostics:
            assert diag.code in CODES, diag
        assert err.render().startswith("error[E")
        assert json.loads(err.to_json())["diagnostics"]


def write(workdir: Path, data: str | bytes) -> Path:
    path = workdir / "fuzz.pipe"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8", errors="surrogatepass")
    return path


# ---- random input -----------------------------------------------------------------------

soup = st.lists(
    st.one_of(st.sampled_from(VOCAB), st.sampled_from(NUMBERS), st.text(max_size=3)),
    max_size=80,
).map(" ".join)


@SETTINGS
@given(text=soup)
def test_token_soup(workdir: Path, text: str) -> None:
    check_clean(write(workdir, text.encode("utf-8", errors="surrogatepass")))


@SETTINGS
@given(data=st.binary(max_size=400))
def test_random_bytes(workdir: Path, data: bytes) -> None:
    check_clean(write(workdir, data))


# ---- mutated stdlib and golden files ---------------------------------------------------------

MUTATIONS = (
    "delete",
    "insert",
    "duplicate",
    "swap",
    "number",
    "char-delete",
    "char-insert",
    "char-duplicate",
    # the shapes of issue 16's hostile inputs: growth, depth, line endings, ignored input
    "grow",
    "nest",
    "chain",
    "endings",
    "declare",
    "char-swap",
)


DECLARATIONS = (
    "cost F[{k}] = 2",
    "cost B = {big}",
    "F(mb=0, stage=0) after W(mb=0, stage=0)",
    "W(mb={k}, stage=0) after B(mb=0, stage=0) for m in 0..0",
    "let mb = {k}",
    "let rank = 1",
    "let x = {big} * {big}",
)


def mutate(text: str, data: st.DataObject) -> str:
    """Apply one mutation, drawing its kind and positions from `data`."""
    kind = data.draw(st.sampled_from(MUTATIONS))
    if kind in ("grow", "nest", "chain", "endings", "declare"):
        return _hostile(kind, text, data)
    if kind.startswith("char-"):
        chars = list(text)
        if not chars:
            return data.draw(st.sampled_from(VOCAB))
        i = data.draw(st.integers(0, len(chars) - 1))
        j = data.draw(st.integers(0, len(chars) - 1))
        if kind == "char-delete":
            del chars[i]
        elif kind == "char-insert":
            chars.insert(i, data.draw(st.characters(codec="utf-8")))
        elif kind == "char-duplicate":
            chars.insert(i, chars[i])
        else:
            chars[i], chars[j] = chars[j], chars[i]
        return "".join(chars)
    tokens = TOKEN.findall(text) or [""]
    i = data.draw(st.integers(0, len(tokens) - 1))
    j = data.draw(st.integers(0, len(tokens) - 1))
    if kind == "delete":
        del tokens[i]
    elif kind == "insert":
        tokens.insert(i, " " + data.draw(st.sampled_from(VOCAB)) + " ")
    elif kind == "duplicate":
        lo, hi = min(i, j), max(i, j)
        tokens[lo:lo] = tokens[lo : min(hi + 1, lo + 20)]
    elif kind == "swap":
        tokens[i], tokens[j] = tokens[j], tokens[i]
    else:
        numbers = [n for n, t in enumerate(tokens) if t[:1].isdigit()]
        if numbers:
            tokens[data.draw(st.sampled_from(numbers))] = data.draw(st.sampled_from(NUMBERS))
    return "".join(tokens)


def _hostile(kind: str, text: str, data: st.DataObject) -> str:
    """A number squared over and over, nested in brackets, or a long chain of one
    operator; other line endings or a BOM; or a declaration that cannot take effect."""
    if kind == "endings":
        ending = data.draw(st.sampled_from(["\r\n", "\r"]))
        bom = data.draw(st.sampled_from(["", "\ufeff"]))
        return bom + text.replace("\n", ending)
    if kind == "declare":
        line = data.draw(st.sampled_from(DECLARATIONS)).format(
            k=data.draw(st.integers(0, 200)), big="9" * 18
        )
        return text.replace("{", "{\n    " + line + "\n", 1)
    tokens = TOKEN.findall(text) or [""]
    numbers = [n for n, t in enumerate(tokens) if t[:1].isdigit()] or [0]
    at = data.draw(st.sampled_from(numbers))
    count = data.draw(st.integers(1, 300))
    if kind == "grow":
        tokens[at] = "(" + " * ".join(["999999999"] * min(count, 12)) + ")"
    elif kind == "nest":
        tokens[at] = "(" * count + (tokens[at] or "1") + ")" * count
    else:
        tokens[at] = "(" + " + ".join([tokens[at] or "1"] * count) + ")"
    return "".join(tokens)


@pytest.mark.slow
@SETTINGS
@given(data=st.data())
def test_mutated_schedules(workdir: Path, data: st.DataObject) -> None:
    text = data.draw(st.sampled_from(SEED_TEXTS))
    for _ in range(data.draw(st.integers(1, 4))):
        text = mutate(text, data)
    params = data.draw(
        st.dictionaries(
            st.sampled_from(["D", "N", "v", "f", "k"]),
            st.sampled_from(["0", "-1", "1", "2", "3", "abc", "9" * 12]),
            max_size=2,
        )
    )
    check_clean(write(workdir, text), params)


@pytest.mark.parametrize("path", SEEDS, ids=[p.stem for p in SEEDS])
def test_seeds_themselves(path: Path) -> None:
    check_clean(path)


@pytest.mark.slow
@SETTINGS
@given(
    name=st.sampled_from(api.stdlib_names()),
    d=st.integers(12, 62).map(lambda k: 2**k),
    n=st.integers(12, 62).map(lambda k: 2**k),
)
def test_huge_parameters_are_refused_at_once(name: str, d: int, n: int) -> None:
    """Every stdlib schedule with D and N of 4096 and more (millions of ops and up) is a
    diagnostic within the deadline: the limits apply before anything that size is built."""
    with pytest.raises(PipelangError) as caught:
        api.compile_schedule(name, {"D": str(d), "N": str(n)}, stop_after=STOP_AFTER)
    assert all(diag.code in CODES for diag in caught.value.diagnostics)
