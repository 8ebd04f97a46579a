"""The one order of gradient sums (backends/summation.py) and the `--check` reference that
repeats it: the tree's grouping, the exchanges that compute it across processes, the
plan of who adds what, a bitwise check on long Adam runs on real text (Chimera's two
replicas, `--dp` copies, clipping), a bitwise check of orders whose W's run in another
order than their B's, and the report of a check that fails."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import run, run_in_process, stdlib
from torch import nn

from pipelang.api import load_program
from pipelang.backends.config import RunConfig
from pipelang.backends.rank_base import RankResult
from pipelang.backends.reference import Comparison, Reference, _Grouping, compare
from pipelang.backends.reference_runs import added_by_backward
from pipelang.backends.summation import (
    Member,
    SumPlan,
    Unit,
    accumulation,
    exchange_sum,
    tree_sum,
)
from pipelang.ir import Program

ROOT = Path(__file__).resolve().parent.parent


def _grouped(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tree written out by hand for up to 8 parts: extras fold into i - m, then a
    balanced pairwise sum."""
    m = 1 << (len(parts).bit_length() - 1)
    level = [parts[i] + parts[i + m] if i + m < len(parts) else parts[i] for i in range(m)]
    if m == 1:
        return level[0]
    if m == 2:
        return level[0] + level[1]
    if m == 4:
        return (level[0] + level[1]) + (level[2] + level[3])
    return ((level[0] + level[1]) + (level[2] + level[3])) + (
        (level[4] + level[5]) + (level[6] + level[7])
    )


@pytest.mark.parametrize("count", range(1, 9))
def test_tree_sum_groups_as_written(count: int) -> None:
    gen = torch.Generator().manual_seed(count)
    # magnitudes far apart: another grouping changes the last bits
    parts = [torch.randn(257, generator=gen) * 10.0 ** (i % 5 - 2) for i in range(count)]
    assert torch.equal(tree_sum(parts), _grouped(parts))
    if count >= 3:  # and the grouping matters: a left fold differs somewhere
        fold = parts[0].clone()
        for part in parts[1:]:
            fold += part
        assert not torch.equal(fold, tree_sum(parts))


def _exchange(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(rank)
        flat = torch.randn(1000, generator=gen) * 10.0 ** (rank % 5 - 2)
        exchange_sum(flat, range(world), rank, None)
        queue.put((rank, flat.numpy().tobytes()))  # bytes: the process may exit first
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("world", [3])  # a fold into the power of two, then a level
def test_exchange_sum_gives_every_process_the_tree_sum(world: int) -> None:
    """Processes exchanging over gloo each end with `tree_sum`'s bits. (Forked: this
    process has started no threads of torch's yet that a child could inherit stuck, and
    a spawned child would import the whole test module again, seconds each.)"""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_exchange, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(world):
        rank, data = queue.get(timeout=120)
        got[rank] = torch.frombuffer(bytearray(data), dtype=torch.float32)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    parts = [
        torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10.0 ** (r % 5 - 2)
        for r in range(world)
    ]
    expected = tree_sum(parts)
    for rank in range(world):
        assert torch.equal(got[rank], expected), rank


def test_accumulation_names_each_copy_and_its_micro_batches() -> None:
    plan = accumulation(stdlib("chimera", D=4, N=4), dp=2)
    assert plan is not None
    # stage 0: down on rank 0 (micro-batches 0, 1), up on rank 3 (2, 3); copy 1 is +4
    assert [(m.process, [mb for mb, _ in m.units]) for m in plan.stages[0]] == [
        (0, [0, 1]),
        (3, [2, 3]),
        (4, [4, 5]),
        (7, [6, 7]),
    ]
    # the norm: each stage once, by its lowest rank in copy 0, in that rank's copy order
    assert plan.norms == [[0, 3], [1, 2], [], [], [], [], [], []]
    # looped-bfs adds its micro-batches last to first
    bfs = accumulation(stdlib("looped-bfs", D=2, N=4), dp=1)
    assert bfs is not None
    assert bfs.stages[0][0].units == ((3, None), (2, None), (1, None), (0, None))
    # a sequence chunk's backward is a unit of its own: a micro-batch's, last chunk first
    seq = accumulation(stdlib("seq1f1b", D=2, N=2, C=3), dp=1)
    assert seq is not None
    assert seq.stages[1][0].units == ((0, 2), (0, 1), (0, 0), (1, 2), (1, 1), (1, 0))


W_REVERSED = """
schedule w_reversed(D: int = 2, N: int = 4) {
    ops F, B, W
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        for i in 0..N { F(i) }
        for i in 0..N { B(i) }
        for i in 0..N { W(N - 1 - i) }
    }
}
"""
"""Every rank runs its W's last to first, its B's first to last."""

W_REVERSED_CHUNKS = """
schedule w_reversed_chunks(D: int = 2, N: int = 3, C: int = 2) {
    ops F, B, W
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    chunks C
    order rank r {
        for i in 0..N { for c in 0..C { F(i, chunk=c) } }
        for i in 0..N { for c in 0..C { B(i, chunk=C - 1 - c) } }
        for i in 0..N { for c in 0..C { W(N - 1 - i, chunk=c) } }
    }
}
"""
"""The same over sequence chunks, and each micro-batch's W's first chunk first."""

W_REVERSED_CHIMERA = """
schedule w_reversed_chimera(D: int = 2, N: int = 6) {
    ops F, B, W
    pipeline down: stage s in 0..D -> rank s
    pipeline up: stage s in 0..D -> rank D - 1 - s
    microbatches m in 0..N // 2 -> down, m in N // 2..N -> up
    order rank r {
        let h = N // 2
        if r == 0 {
            for i in 0..h { F(i) }
            for i in h..N { F(i) }
            for i in h..N { B(i) }
            for i in 0..h { B(i) }
        } else {
            for i in h..N { F(i) }
            for i in 0..h { F(i) }
            for i in 0..h { B(i) }
            for i in h..N { B(i) }
        }
        for i in 0..N { W(N - 1 - i) }
    }
}
"""
"""Two pipelines in opposite directions (each stage's copies then sum by the tree), every
rank's W's last to first."""


def _load(tmp_path: Path, text: str, **params: int) -> Program:
    path = tmp_path / "sched.pipe"
    path.write_text(text)
    return load_program(str(path), {k: str(v) for k, v in params.items()})


def test_accumulation_follows_ws_that_run_in_another_order_than_their_bs(
    tmp_path: Path,
) -> None:
    """A copy whose W's run in another order than its B's adds its weight gradients in
    the W's order (it had no plan: the reference added in micro-batch order)."""
    plan = accumulation(_load(tmp_path, W_REVERSED), dp=2)
    assert plan is not None
    first, *_ = plan.stages[1]
    assert [mb for mb, _ in first.units] == [0, 1, 2, 3]
    assert first.late is not None and [mb for mb, _ in first.late] == [3, 2, 1, 0]
    assert [mb for mb, _ in plan.stages[1][1].late or ()] == [7, 6, 5, 4]  # --dp copy 1
    # where the orders are one, there is one
    same = accumulation(stdlib("zb-h1", D=2, N=4), dp=1)
    assert same is not None and all(m.late is None for ms in same.stages.values() for m in ms)


def test_the_reference_adds_what_b_adds_in_the_bs_order_and_the_rest_in_the_ws() -> None:
    """Gradients 1e8, -1e8, 1 add to 1 in that order and to 0 in the reverse (fp32): a
    parameter B adds follows the B's order, one W adds the W's, each copy in its own."""
    b_order: tuple[Unit, ...] = ((0, None), (1, None), (2, None))
    plan = SumPlan({0: [Member(0, b_order, b_order[::-1])]}, [[0]])
    by_b, by_w = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    values = {0: 1e8, 1: -1e8, 2: 1.0}

    def backward(unit: Unit) -> None:
        for param in (by_b, by_w):
            param.grad = torch.full((1,), values[unit[0]])

    grouping = _Grouping(plan, [[by_b, by_w]], [frozenset({0})])
    grouping.gradients([by_b, by_w], backward, None)
    assert by_b.grad is not None and by_w.grad is not None
    assert (float(by_b.grad), float(by_w.grad)) == (1.0, 0.0)


@pytest.mark.parametrize("model", ["gpt:tiny", "llama:tiny"])
def test_b_adds_the_norms_gradients_and_w_the_rest(tmp_path: Path, model: str) -> None:
    """What the reference asks the runtime: a split B adds a norm's scale and shift (all
    vectors) itself; W adds the rest, a linear's bias with its weight."""
    program = _load(tmp_path, W_REVERSED)
    config = RunConfig(model=model)
    added = added_by_backward(config, program, torch.device("cpu"))
    built = config.spec.build()
    for stage, bounds in enumerate(built.stage_bounds(2, None)):
        named = [
            name for name, p in built.stage_module(bounds).named_parameters() if p.requires_grad
        ]
        by_b = {name for k, name in enumerate(named) if k in added[stage]}
        assert by_b and all("norm" in n or ".ln" in n for n in by_b), by_b
        assert all(not ("norm" in n or ".ln" in n) for n in set(named) - by_b)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "options"),
    [
        (W_REVERSED, ("--backend", "gloo")),
        (W_REVERSED, ("--backend", "local", "--dp", "3", "--clip-grad", "0.5")),
        (W_REVERSED, ("--backend", "local", "--mixed-precision", "bfloat16")),
        (W_REVERSED, ("--backend", "local", "--model", "llama:tiny")),
        (W_REVERSED_CHUNKS, ("--backend", "local")),
        (W_REVERSED_CHIMERA, ("--backend", "gloo")),
    ],
    ids=["gloo", "dp3-clip", "mixed", "llama", "chunks", "chimera"],
)
def test_check_is_bitwise_where_ws_run_in_another_order_than_their_bs(
    text: str, options: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 44: a synthesized order may run its W's in another order than its B's. The
    reference added such a run's gradients in micro-batch order, so the check fell back
    to the tolerance ("parameters first differ (in any bit) after step 0"); it now adds
    each parameter in the order of the ops that add it in the run: bitwise."""
    program = _load(tmp_path, text)
    assert run(program, "--check", "--steps", "3", *options) == 0
    out = capsys.readouterr().out
    assert "check OK" in out and "(bitwise equal)" in out, out
    assert "first differ" not in out, out


W_REVERSED_ASYNC = """
schedule w_reversed_async(D: int = 2, N: int = 4) {
    ops F, B, W
    weights stash
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        for i in 0..N { F(i) }
        for i in 0..N { B(i) }
        for i in 0..N { W(N - 1 - i) }
        U()
    }
}
"""


@pytest.mark.slow
def test_an_asynchronous_schedule_whose_ws_run_reversed_is_checked_within_the_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A case on a CPU where the check is not bitwise (as ties with sequence chunks or
    --shard; other tied weights are, issue 42): an asynchronous schedule whose W's run
    in another order than its B's (a split B adds a
    norm's gradient into the version's shared weights; the replay adds each micro-batch's
    whole gradient in the W's order). `run --help` and docs/runtime.md name it (they
    said "bit for bit equal on a CPU, except with weights tied across stages")."""
    assert run(_load(tmp_path, W_REVERSED_ASYNC), "--check", "--backend", "local") == 0
    out = capsys.readouterr().out
    assert "check OK" in out and "(bitwise equal)" not in out, out
    status, help_text, _ = run_in_process(["run", "--help"])
    said = "an asynchronous schedule whose W's run in another order than its B's"
    assert status == 0 and said in " ".join(help_text.split())
    page = " ".join((ROOT / "docs" / "runtime.md").read_text(encoding="utf-8").split())
    assert "an asynchronous schedule (`weights ...`, below) whose W's run in another" in page


def _text(tmp_path: Path) -> str:
    """Real text: the project's own docs."""
    path = tmp_path / "docs.txt"
    path.write_bytes(b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md"))))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sched", "options"),
    [
        ("chimera", ("--steps", "12")),
        ("chimera", ("--steps", "5", "--dp", "2", "--clip-grad", "1.0")),
        ("zb-h1", ("--steps", "5", "--clip-grad", "1.0", "--optimizer", "sgd")),
        ("seq1f1b", ("--steps", "5", "--clip-grad", "1.0")),  # each chunk as the run has it
    ],
)
def test_check_is_bitwise_on_long_adam_runs_on_text(
    sched: str, options: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the sums had one order, Chimera with Adam on text left the tolerance
    after 15-40 steps (0.05 at step 40; 0.0045 with clipping): the replicas' sum added
    micro-batches in another grouping than the reference. The check compares every
    step's parameters bit for bit, so a grouping that differs fails at its first step;
    12 steps of Adam cover a run of changing moments. With `--dp 2` four copies sum
    each stage, by exchanges. Seq1F1B's reference computes each sequence chunk as the run
    does (it left the tolerance within 30 steps when it trained on whole sequences)."""
    program = stdlib(sched, D=4, N=4)
    assert run(program, "--check", "--data", _text(tmp_path), *options) == 0
    out = capsys.readouterr().out
    assert "check OK" in out and "(bitwise equal)" in out, out


def _result(fingerprints: list[list[int]]) -> RankResult:
    weights = {"0.w": torch.zeros(2)}
    return RankResult(0, [(0, "main", 0)], copy_weights=[weights], fingerprints=fingerprints)


def test_a_failed_check_names_the_first_step_that_differs_and_shows_the_losses() -> None:
    reference = Reference(
        losses=[2.0, 1.9, 1.8, 1.7, 1.6],
        weights={"0.w": torch.zeros(2)},
        fingerprints=[[7], [8], [9], [10], [11]],
    )
    run_losses = [2.0, 1.9, 1.8 + 1e-7, 1.75, 1.7]
    # the parameters first differ after step 2 (of steps 10-14, after a resume at 10)
    result = _result([[7], [8], [99], [98], [97]])
    config = _config(first_step=10)
    comparison = compare(reference, [result], run_losses, config)
    assert not comparison.ok and not comparison.bitwise
    text = comparison.render()
    assert "parameters first differ (in any bit) after step 12 (stage 0/main on rank 0)" in text
    assert "the loss first leaves the tolerance at step 13" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:2].isdigit()]
    assert [int(r[0]) for r in rows] == [11, 12, 13, 14]
    assert math.isclose(float(rows[2][3]), 0.05, rel_tol=1e-6)


def test_a_bitwise_check_reports_no_first_difference() -> None:
    reference = Reference([2.0], {"0.w": torch.zeros(2)}, fingerprints=[[7]])
    comparison = compare(reference, [_result([[7]])], [2.0], _config())
    assert comparison.ok and comparison.bitwise and comparison.first_difference is None
    assert isinstance(comparison, Comparison) and "\n" not in comparison.render()


@pytest.mark.parametrize(
    ("run_weight", "reference_weight", "ok", "bitwise", "largest"),
    [
        (torch.empty(0), torch.empty(0), True, True, 0.0),  # no elements: nothing differs
        (torch.tensor([1.5, -0.0]), torch.tensor([1.5, 0.0]), True, True, 0.0),
        (torch.tensor([math.inf]), torch.tensor([math.inf]), True, True, math.inf),
        (torch.tensor([3e38, 3e38]), torch.tensor([3e38, 3e38]), True, True, 0.0),  # sum: inf
        (torch.tensor([math.nan]), torch.tensor([math.nan]), False, False, math.inf),
        (torch.tensor([1.0 + 2**-20]), torch.tensor([1.0]), True, False, 2**-20),
    ],
)
def test_equal_bits_compare_cheaply_as_a_difference_of_zero(
    run_weight: torch.Tensor,
    reference_weight: torch.Tensor,
    ok: bool,
    bitwise: bool,
    largest: float,
) -> None:
    """Bit-equal tensors (the common case) skip the float64 difference, a pass over
    every whole parameter: still a difference of 0 (an infinity's, inf - inf, reported
    as infinite and within inf's tolerance, as before); an empty parameter now compares
    (its float64 difference had no maximum: a RuntimeError)."""
    reference = Reference([2.0], {"0.w": reference_weight})
    result = RankResult(0, [(0, "main", 0)], copy_weights=[{"0.w": run_weight}])
    comparison = compare(reference, [result], [2.0], _config())
    assert (comparison.ok, comparison.bitwise) == (ok, bitwise)
    assert comparison.max_weight_diff == largest


def _config(first_step: int = 0) -> RunConfig:
    return RunConfig(optimizer="sgd", first_step=first_step)
