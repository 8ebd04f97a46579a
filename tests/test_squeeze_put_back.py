"""Step 3 of `order repeat ... squeeze` re-places only the loose W's a move can reach
(`_Loose.shift` in pipelang/orders/squeeze.py). Oracle: the plain greedy the module
docstring describes, written out here from scratch: each W, in the order its inputs are
ready (ties by plain start order), in the earliest stretch after its ready that the rank's
other ops, at their current places, and the W's put back before it leave free."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from pipelang import api
from pipelang.compiler import Options, run_passes
from pipelang.orders import squeeze as sq
from pipelang.orders import timed
from pipelang.parser import stdlib_dir
from tests.helpers import replay

REPEAT = re.compile(r"(order repeat \w+(?: every [^{]+?)?) (squeeze )?\{")


def variant(tmp_path: Path, name: str, squeeze: bool, extra: str) -> Path:
    """A stdlib `order repeat` schedule with or without `squeeze`, plus `extra` lines."""
    text = (stdlib_dir() / f"{name}.pipe").read_text()
    text, count = REPEAT.subn(r"\1 squeeze {" if squeeze else r"\1 {", text)
    assert count == 1
    text = text.replace("    microbatches", f"    {extra}\n    microbatches", 1)
    path = tmp_path / f"{name}-{'squeezed' if squeeze else 'plain'}.pipe"
    path.write_text(text)
    return path


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two runs of one rank overlap (a zero-length run only inside the other)."""
    return a[0] < b[1] and b[0] < a[1]


def greedy(ws: list[timed.Op], others: list[tuple[float, float]]) -> dict[timed.Op, float]:
    """The oracle: where the W's go among `others`, one by one."""
    placed = list(others)
    starts = {}
    for w in sorted(ws, key=lambda w: (w.ready(), w.seq)):
        candidates = sorted({w.ready()} | {end for _, end in placed if end > w.ready()})
        at = next(
            x for x in candidates if not any(overlap((x, x + w.length), run) for run in placed)
        )
        starts[w] = at
        placed.append((at, at + w.length))
    return starts


CASES = [
    # The cool-down case where a W's inputs can end before the W's searched from.
    ("v-half", dict(D=6, N=13), "cost F = 2, B = 1, W = 1, C = 3"),
    ("v-half", dict(D=5, N=8), "cost F = 1.5, B = 2.25, W = 0.75, C = 0.5"),
    ("v-min", dict(D=6, N=13), "cost B = 2, W = 0"),
    ("v-half", dict(D=6, N=9), "W(i, 0) after B(i, 1) for i in 0..N\n    cost W = 1"),
    ("v-min", dict(D=6, N=13), "cost F = 1, B = 1, W = 2.5, C = 0.25"),
]


@pytest.mark.parametrize(("name", "params", "extra"), CASES)
def test_each_move_puts_the_ws_where_the_plain_greedy_does(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    params: dict[str, int],
    extra: str,
) -> None:
    """After every move step 3 tries, the W's stand where the greedy over all of the
    rank's ops puts them, and no two ops of the rank overlap; the squeezed schedule then
    passes `check` and is no slower than the plain one under its own costs."""
    lines: dict[sq._Loose, timed.Line] = {}
    moved = []
    early = []
    init, shift = sq._Loose.__init__, sq._Loose.shift

    def record_init(self: sq._Loose, ws: list[timed.Op], line: timed.Line) -> None:
        lines[self] = line
        init(self, ws, line)

    def checked_shift(self: sq._Loose, op: timed.Op, own: float, waiting: list[int]) -> object:
        start = op.start
        op.place(own)
        floor = min(w.ready() for w in self.ws)  # the W's readies before the move
        op.place(start)
        before = {w: w.start for w in self.ws}
        result = shift(self, op, own, waiting)
        ops = lines[self].ops
        others = [(o.start, o.end) for o in ops if o not in self.index]
        assert {w: w.start for w in self.ws} == greedy(self.ws, others)
        runs = [(o.start, o.end) for o in ops]
        assert not any(overlap(a, b) for a, b in itertools.combinations(runs, 2))
        moved.append(sum(w.start != before[w] for w in self.ws))
        early.append(any(w.ready() < floor for w in self.ws))
        return result

    monkeypatch.setattr(sq._Loose, "__init__", record_init)
    monkeypatch.setattr(sq._Loose, "shift", checked_shift)
    options = Options({k: str(v) for k, v in params.items()})
    squeezed_path = variant(tmp_path, name, True, extra)
    squeezed = run_passes(api.load_file(str(squeezed_path)), options, "validate")
    assert moved  # the check above ran
    if "C = 3" in extra:
        assert any(early)  # and a W become ready before the W's were searched from
    plain_path = variant(tmp_path, name, False, extra)
    plain = run_passes(api.load_file(str(plain_path)), options, "validate").need_program()
    program = squeezed.need_program()
    slow, fast = replay(plain, plain.costs), replay(program, program.costs)
    assert fast.makespan <= slow.makespan
