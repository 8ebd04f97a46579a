"""The stream program: lowering (`streams`), its text form, and the happens-before checker.

The checker's oracle is deletion: every `wait` the lowering emits guards something, so
deleting any one of them must make the checker fail, naming the racy read, its slot and
the write it races with (or, for the fork/join waits, the stream left unjoined).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelang import api
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.ir import Kind
from pipelang.ir.streams import StreamProgram
from pipelang.passes.check_streams import check_streams
from pipelang.sim import memory
from tests.helpers import pipelang_here

LOWERED = [name for name in api.stdlib_names() if name != "bpipe"]


def lowered(name: str, dp: int = 1, **params: int) -> Compilation:
    options = Options({k: str(v) for k, v in params.items()}, dp=dp)
    return run_passes(api.load_file(name), options, "check-streams")


@pytest.mark.parametrize("name", LOWERED)
def test_every_stdlib_schedule_lowers_checks_and_parses_back(name: str) -> None:
    program = lowered(name).streams
    assert program is not None
    assert StreamProgram.parse(program.dump()) == program


@pytest.mark.parametrize("name", LOWERED)
def test_saved_slots_are_the_activations_a_rank_holds(name: str) -> None:
    """Saved slots per rank = the micro-batches in flight, counted to B (to W when the
    backward is split, as the runtime holds them): slots reused as tightly as possible."""
    c = lowered(name)
    assert c.streams is not None and c.program is not None
    to_w = (lambda stage: 1.0) if Kind.W in c.program.kinds else None  # whole until W
    held = [memory.peak(actions, to_w) for actions in c.program.ranks]
    assert [len(c.streams.slots(r)["saved"]) for r in range(c.streams.ranks)] == held


def test_data_slots_are_reused() -> None:
    """1F1B, D=4, N=8: rank 0 sends 8 activations and receives 8 gradients, and needs 4
    slots for all 16 (one per micro-batch in flight); without reuse it would need 16."""
    program = lowered("1f1b", D=4, N=8).streams
    assert program is not None
    assert len(program.slots(0)["data"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("1f1b", {"D": 2, "N": 3}),
        ("chimera", {"D": 4, "N": 4}),
        ("interleaved-1f1b", {"D": 2, "N": 4}),
        ("zbv", {"D": 2, "N": 4}),
        ("pipedream", {"D": 3, "N": 4}),
    ],
)
def test_deleting_any_wait_fails_the_check(name: str, params: dict[str, int]) -> None:
    program = lowered(name, **params).streams
    assert program is not None
    lines = program.dump().split("\n")
    waits = [n for n, line in enumerate(lines) if re.search(r"\swait e\d+$", line)]
    assert waits
    for n in waits:
        edited = StreamProgram.parse("\n".join(lines[:n] + lines[n + 1 :]))
        with pytest.raises(PipelangError) as caught:
            check_streams(edited)
        codes = {d.code for d in caught.value.diagnostics}
        assert codes <= {"E0502", "E0507"}, (lines[n], codes)


@pytest.mark.slow
def test_a_race_names_the_read_the_slot_and_the_write(tmp_path: Path) -> None:
    """Rank 1 of 1F1B waits for its receive before the forward that reads it; without
    that wait, the forward races with the receive."""
    dump = pipelang_here(
        "compile", "1f1b", "-p", "D=2", "-p", "N=2", "--dump-after", "streams", cwd=tmp_path
    ).stdout
    lines = dump.split("\n")
    read = next(n for n, line in enumerate(lines) if line.startswith("r1.compute  F0@1/main"))
    assert lines[read - 1].startswith("r1.compute  wait")
    write = next(n for n, line in enumerate(lines) if "recv:F0@0/main<0" in line)
    (tmp_path / "ok.txt").write_text(dump)
    (tmp_path / "racy.txt").write_text("\n".join(lines[: read - 1] + lines[read:]))

    ok = pipelang_here("check-streams", "ok.txt", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: ")
    racy = pipelang_here("check-streams", "racy.txt", cwd=tmp_path)
    assert racy.returncode == 1
    # (the same missing wait also breaks the chain that let rank 0 reuse a slot: that
    # race is reported too, first, as diagnostics are sorted by line)
    errors = racy.stderr.split("\n\n")
    head = "error[E0502]: race on slot d0 of rank 1: `F0@1/main` on r1.compute reads"
    first = next(e for e in errors if e.startswith(head))
    assert f"racy.txt:{read}:1" in first  # the read's line, one up: its wait is gone
    assert f"{write + 1} | r1.recv0" in first  # the write it races with


def test_channel_order_and_deadlock_are_reported(tmp_path: Path) -> None:
    program = lowered("1f1b", D=2, N=2).streams
    assert program is not None
    lines = program.dump().split("\n")
    sends = [n for n, line in enumerate(lines) if "r0.send1    send:" in line]
    swapped = list(lines)
    swapped[sends[0]], swapped[sends[1]] = lines[sends[1]], lines[sends[0]]
    with pytest.raises(PipelangError) as caught:
        check_streams(StreamProgram.parse("\n".join(swapped)))
    assert caught.value.diagnostics[0].code in ("E0504", "E0502")

    recv = next(n for n, line in enumerate(lines) if "recv:F0@0/main<0" in line)
    stuck = lines[:recv] + lines[recv + 1 :]  # the send of F0 never meets its receive
    with pytest.raises(PipelangError) as caught:
        check_streams(StreamProgram.parse("\n".join(stuck)))
    assert caught.value.diagnostics[0].code in ("E0504", "E0503")


def test_wait_before_record_and_unreadable_lines(tmp_path: Path) -> None:
    program = lowered("1f1b", D=2, N=2).streams
    assert program is not None
    lines = program.dump().split("\n")
    n = next(i for i, line in enumerate(lines) if line.endswith("record e1"))
    moved = lines[:n] + lines[n + 1 :] + [lines[n]]
    with pytest.raises(PipelangError) as caught:
        check_streams(StreamProgram.parse("\n".join(moved)))
    assert caught.value.diagnostics[0].code == "E0505"

    (tmp_path / "bad.txt").write_text("r0.compute  F0@0\n")
    bad = pipelang_here("check-streams", "bad.txt", cwd=tmp_path)
    assert bad.returncode == 1
    assert bad.stderr.startswith("error[E0501]: not a stream program line")
    assert "bad.txt:1:1" in bad.stderr


def test_data_parallel_copies_reduce_across_copies() -> None:
    """1F1B has no replicas: with --dp 2 every stage is summed over the two copies at
    `step`, on a reduce stream of each of the four processes."""
    program = lowered("1f1b", dp=2, D=2, N=2).streams
    assert program is not None
    assert program.ranks == 4
    reduces = [op for op in program.ops if op.what.startswith("allreduce")]
    assert sorted((op.rank, op.stream) for op in reduces) == [
        (0, "reduce0"),
        (1, "reduce1"),
        (2, "reduce0"),
        (3, "reduce1"),
    ]


def test_evictions_are_refused_with_a_position() -> None:
    with pytest.raises(PipelangError) as caught:
        lowered("bpipe")
    diagnostic = caught.value.diagnostics[0]
    assert diagnostic.code == "E0506" and diagnostic.span is not None


def test_simulate_reports_the_slots(tmp_path: Path) -> None:
    """`simulate --json --slots`: each rank's slots by class, the saved ones equal to its
    peak activations (Chimera has no split backward)."""
    import json

    out = pipelang_here("simulate", "chimera", "--json", "--slots", cwd=tmp_path)
    assert out.returncode == 0
    ranks = json.loads(out.stdout)["ranks"]
    assert [r["slots"]["saved"] for r in ranks] == [r["peak_activations"] for r in ranks]
    assert ranks[0]["slots"] == {"data": 2, "saved": 3, "grads": 2}
