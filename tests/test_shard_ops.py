"""A schedule's own shard ops (`gather()`, `reshard()`, issue 41): how they parse, where
`insert-shard` puts the gathers it still adds, the E0322 checks with their lines, the
simulator's times, and (slow) hand-written 1F1B orders that reshard after each forward
or keep the stages gathered, run over gloo with --dp 2 --shard --check bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelang import PipelangError, api
from pipelang.ir import Action, Kind
from tests.helpers import costs as cost_model
from tests.helpers import pipelang_here

HEAD = """schedule s(D: int = 2, N: int = 2) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
"""

AFTER_FORWARD = """# 1F1B, each stage resharded after each forward, gathered again for what follows.
schedule after_forward(D: int = 2, N: int = 4) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        let warm = min(D - r - 1, N)
        for i in 0..warm {
            if i > 0 { gather() }
            F(i)
            reshard()
        }
        for i in 0..N - warm {
            if i == 0 and warm > 0 { gather() }
            F(warm + i)
            reshard()
            gather()
            B(i)
        }
        for i in N - warm..N { B(i) }
    }
}
"""

KEPT = """# 1F1B, each stage gathered once, written, and kept gathered through the step.
schedule kept(D: int = 2, N: int = 4) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        let warm = min(D - r - 1, N)
        gather()
        for i in 0..warm { F(i) }
        for i in 0..N - warm {
            F(warm + i)
            B(i)
        }
        for i in N - warm..N { B(i) }
    }
}
"""


def write(tmp_path: Path, body: str, name: str = "s.pipe") -> Path:
    path = tmp_path / name
    path.write_text(body if body.startswith("#") else HEAD + body + "    }\n}\n")
    return path


def first_error(tmp_path: Path, body: str, *options: str) -> tuple[str, str]:
    """The first diagnostic's message line and its `-->` location, of `check`."""
    path = write(tmp_path, body)
    proc = pipelang_here("check", str(path), *options, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout
    lines = proc.stderr.splitlines()
    return lines[0], lines[1].split("/")[-1]


SHARD = ("--dp", "2", "--shard")


def test_dump_shows_the_written_ops_where_written(tmp_path: Path) -> None:
    path = write(tmp_path, AFTER_FORWARD)
    proc = pipelang_here("compile", str(path), *SHARD, "--dump-after", "insert-shard", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2:] == [
        "rank 0: gather@0/main F0@0/main reshard@0/main gather1@0/main F1@0/main "
        "reshard1@0/main gather2@0/main B0@0/main F2@0/main reshard2@0/main gather3@0/main "
        "B1@0/main F3@0/main reshard3@0/main gather4@0/main B2@0/main B3@0/main "
        "reduce_scatter@0/main",
        "rank 1: gather@1/main F0@1/main reshard@1/main gather1@1/main B0@1/main F1@1/main "
        "reshard1@1/main gather2@1/main B1@1/main F2@1/main reshard2@1/main gather3@1/main "
        "B2@1/main F3@1/main reshard3@1/main gather4@1/main B3@1/main reduce_scatter@1/main",
    ]


def test_a_written_gather_is_the_only_one(tmp_path: Path) -> None:
    program = api.compile_schedule(
        str(write(tmp_path, KEPT)), dp=2, shard=2, stop_after="insert-shard"
    ).need_program()
    assert [a.text() for a in program.ranks[0][:3]] == ["gather@0/main", "F0@0/main", "F1@0/main"]
    assert [a.kind for a in program.ranks[0]].count(Kind.GATHER) == 1
    assert program.ranks[0][0].span is not None  # the written one, not an inserted one
    assert program.ranks[0][0].span.line == 7


def test_numbered_shard_tokens_read_back() -> None:
    for token in ("gather1@0/main", "reshard@2/main", "reshard3@1/up"):
        assert Action.parse(token).text() == token
    with pytest.raises(ValueError, match="only `gather` and `reshard` are numbered"):
        Action.parse("reduce_scatter1@0/main")


def test_simulate_times_each_gather_and_no_reshard(tmp_path: Path) -> None:
    path = str(write(tmp_path, AFTER_FORWARD))
    compiled = api.compile_schedule(path, dp=2, shard=2, stop_after="insert-shard")
    timeline = compiled.timeline(cost_model(F=1, B=2, AG=0.25))
    shard = [e for e in timeline.events if e.action.kind in (Kind.GATHER, Kind.RESHARD)]
    assert {(e.action.kind, e.end - e.start) for e in shard} == {
        (Kind.GATHER, 0.25),
        (Kind.RESHARD, 0.0),
    }
    assert sum(e.action.kind is Kind.GATHER for e in shard) == 10  # 5 a rank


ERRORS = [
    (
        "        F(0)\n        if r == 1 { reshard() }\n        B(0) F(1) B(1)\n",
        (),
        "error[E0322]: `B0@1/main` on rank 1 uses stage 1 after its `reshard()` (line 6) "
        "with no `gather()` between",
        "s.pipe:7:9",
    ),
    (
        "        F(0) reshard() B(0) F(1) B(1)\n",
        (),
        "error[E0322]: 2 ops use a resharded stage without a `gather()`: `B0@0/main`, `B0@1/main`",
        "s.pipe:5:24",
    ),
    (
        "        reshard() F(0) B(0) F(1) B(1)\n",
        (),
        "error[E0322]: 2 `reshard()`s drop parameters that are not gathered: `reshard@0/main`, "
        "`reshard@1/main`",
        "s.pipe:5:9",
    ),
    (
        "        F(0) reshard() reshard() gather() B(0) F(1) B(1)\n",
        (),
        "error[E0322]: 2 `reshard()`s drop parameters that are not gathered: "
        "`reshard1@0/main`, `reshard1@1/main`",
        "s.pipe:5:24",
    ),
    (
        "        F(0) B(0) F(1) B(1) reshard()\n",
        (),
        "error[E0322]: 2 `reshard()`s follow their stage's last backward, whose "
        "reduce-scatter reshards it already: `reshard@0/main`, `reshard@1/main`",
        "s.pipe:5:29",
    ),
    (
        "        gather() F(0) gather() B(0) F(1) B(1)\n",
        (),
        "error[E0322]: 2 `gather()`s gather parameters that are gathered already: "
        "`gather1@0/main`, `gather1@1/main`",
        "s.pipe:5:23",
    ),
    (
        "        F(0) reshard() gather() reshard() gather() B(0) F(1) B(1)\n",
        (),
        "error[E0322]: 2 `gather()`s gather parameters that no op uses: `gather1@0/main`, "
        "`gather1@1/main`",
        "s.pipe:5:24",
    ),
    (
        "        F(0) B(0) F(1) B(1) gather()\n",
        (),
        "error[E0322]: 2 `gather()`s gather parameters that no op uses: `gather1@0/main`, "
        "`gather1@1/main`",
        "s.pipe:5:29",
    ),
]


@pytest.mark.parametrize(("body", "extra", "message", "where"), ERRORS)
def test_shard_ops_out_of_place(
    tmp_path: Path, body: str, extra: tuple[str, ...], message: str, where: str
) -> None:
    assert first_error(tmp_path, body, *SHARD, *extra) == (message, where)


def test_shard_ops_without_shard(tmp_path: Path) -> None:
    body = "        F(0)\n        reshard() gather() B(0) F(1) B(1)\n"
    assert first_error(tmp_path, body) == (
        "error[E0322]: `reshard()` needs sharded stages, and the schedule is compiled "
        "without --shard",
        "s.pipe:6:9",
    )
    with pytest.raises(PipelangError, match="the order writes 4 shard ops"):
        api.compile_schedule(str(write(tmp_path, body)), dp=2)


PARSE_ERRORS = [
    ("        gather(0) F(0) B(0) F(1) B(1)\n", "`gather` names a stage copy and takes no "
     "micro-batch", "s.pipe:5:16"),
    ("        reshard(chunk=0) F(0) B(0) F(1) B(1)\n", "`reshard` names a stage copy and takes "
     "no chunk", "s.pipe:5:23"),
    ("        F(0) & gather() B(0) F(1) B(1)\n", "`gather()` cannot be part of an overlapped "
     "pair", "s.pipe:5:16"),
    ("        gather(stage=1 - r + 1) F(0) B(0) F(1) B(1)\n", "`gather()` on rank 0 names no "
     "copy of stage 2", "s.pipe:5:9"),
    ("        gathr() F(0) B(0) F(1) B(1)\n", "`gathr` is not an op", "s.pipe:5:9"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message", "where"), PARSE_ERRORS)
def test_shard_ops_badly_written(tmp_path: Path, body: str, message: str, where: str) -> None:
    assert first_error(tmp_path, body, *SHARD) == (f"error[E0103]: {message}", where)


def test_shard_ops_belong_in_an_order_rank(tmp_path: Path) -> None:
    path = tmp_path / "rep.pipe"
    path.write_text(
        "schedule rep(D: int = 2, N: int = 2) {\n"
        "    pipeline main: stage s in 0..D -> rank s\n"
        "    microbatches 0..N -> main\n"
        "    order repeat i { gather(stage=0) @ 0  F(stage=0) @ 1 }\n"
        "}\n"
    )
    proc = pipelang_here("check", str(path), *SHARD, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0] == "error[E0103]: `gather()` belongs in an `order rank`"


@pytest.mark.slow
@pytest.mark.parametrize("text", [AFTER_FORWARD, KEPT], ids=["after_forward", "kept"])
def test_written_shard_ops_run_bit_for_bit(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    proc = pipelang_here(
        "run", str(path), *SHARD, "--backend", "gloo", "--steps", "2", "--check",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "check OK" in proc.stdout and "(bitwise equal)" in proc.stdout, proc.stdout
