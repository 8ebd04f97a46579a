"""`pipelang.torch.PipelineSchedule`: a schedule inside the user's own torch loop.

Oracle: examples/train_with_torchrun.py checks, on rank 0, every stage copy's gradients
after one step against one process running the whole model on the same batch (every
data-parallel copy on its own batch); here it runs under torchrun (4 gloo processes).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import pipelang
import pipelang.torch
from pipelang.backends import stage as stage_module
from pipelang.ir import Action, Kind
from pipelang.torch import PipelineSchedule

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_with_torchrun.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        [],  # Chimera D=4 N=4: two pipelines, replicas summed
        # a split backward in two data-parallel copies of a 2-rank pipeline:
        # tests/test_nodes.py, on two nodes
    ],
)
def test_the_torchrun_example_matches_one_process(args: list[str]) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(EXAMPLE),
        *args,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"gradients against one process: largest difference (\S+)", proc.stdout)
    assert found is not None, proc.stdout + proc.stderr
    assert float(found[1]) < 1e-6, found[0]


def test_refusals_before_anything_runs() -> None:
    def build(stage: int) -> object:
        raise AssertionError("no stage is built for a refused schedule")

    with pytest.raises(pipelang.PipelangError, match="asynchronous"):
        PipelineSchedule(pipelang.load("pipedream", D=2, N=4), build, lambda y, t: y)  # type: ignore[arg-type]
    with pytest.raises(pipelang.PipelangError, match="evicts activations"):
        PipelineSchedule(pipelang.load("bpipe"), build, lambda y, t: y)  # type: ignore[arg-type]
    with pytest.raises(pipelang.PipelangError, match="initialised process group"):
        PipelineSchedule(pipelang.load("1f1b", D=2, N=2), build, lambda y, t: y)  # type: ignore[arg-type]


APART = """
schedule apart(N: int = 4) {
    ops F, B, W
    pipeline main: stage s in 0..1 -> rank s
    microbatches 0..N -> main
    order rank r {
        for i in 0..N { F(i) }
        for i in 0..N { B(i) }
        for i in 0..N { W(i) }
    }
}
"""


def test_a_split_schedule_keeps_after_b_only_what_w_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_process: None
) -> None:
    """A split schedule in the user's own loop (one process, D = 1, N = 4, every W after
    every B): after each B, the micro-batch's saved tensors that W does not read are
    released (backends/weight_split.py, as `pipelang run` does), W reads the rest,
    nothing is left after the step, and the gradients are one process's, summed
    micro-batch by micro-batch as the schedule sums them, bit for bit. zb-h1 at D = 1
    runs each W right after its B: one whole backward each, nothing split."""
    import torch
    from torch import nn

    def build(stage: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh(),
            nn.Linear(64, 8),
        )  # fmt: skip

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(y, t)

    torch.manual_seed(1)
    x, target = torch.randn(8, 16), torch.randn(8, 8)
    splits: list[int] = []
    split_backward = stage_module.split_backward
    monkeypatch.setattr(
        stage_module, "split_backward", lambda *a: splits.append(1) or split_backward(*a)
    )
    PipelineSchedule(pipelang.load("zb-h1", D=1, N=4), build, loss_fn).step(x, target)
    assert splits == []
    apart = tmp_path / "apart.pipe"
    apart.write_text(APART)
    sched = PipelineSchedule(pipelang.load(str(apart), N=4), build, loss_fn)
    stash = sched.copies[(0, "main")].settings.stash
    assert stash is not None
    whole: dict[int, int] = {}
    kept: dict[int, int] = {}
    handlers = pipelang.torch._HANDLERS
    forward, weight = handlers[Kind.F], handlers[Kind.W]

    def spy_forward(self: PipelineSchedule, a: Action) -> None:
        forward(self, a)
        whole[a.mb] = stash.resident_bytes({(a.mb, 0, "main", None)})  # type: ignore[index]

    def spy_weight(self: PipelineSchedule, a: Action) -> None:
        kept[a.mb] = stash.resident_bytes({(a.mb, 0, "main", None)})  # type: ignore[index]
        weight(self, a)

    monkeypatch.setitem(handlers, Kind.F, spy_forward)
    monkeypatch.setitem(handlers, Kind.W, spy_weight)
    sched.step(x, target)
    assert sorted(whole) == sorted(kept) == [0, 1, 2, 3]
    assert all(0 < kept[mb] < whole[mb] for mb in whole)  # the GELU's, the norm's went
    assert len(splits) == 4
    assert not stash.entries
    alone = build(0)
    for xs, ts in zip(x.chunk(4), target.chunk(4), strict=True):  # as the schedule sums
        (loss_fn(alone(xs), ts) * 0.25).backward()
    for mine, theirs in zip(sched.parameters(), alone.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.equal(mine.grad, theirs.grad)


class _Tied(torch.nn.Module):
    """A frozen input layer, then one weight used twice (a graph `weight_split` does not
    split: W differentiates it whole)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Linear(16, 32).requires_grad_(False)
        self.twice = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.twice(torch.tanh(self.twice(self.frozen(x))))))


class _Summed:
    """An allreduce over one process: the sum is the process's own gradients."""

    def wait(self) -> None:
        return None


def test_a_split_schedule_whose_graph_does_not_split_trains_its_parameters(
    monkeypatch: pytest.MonkeyPatch, one_process: None
) -> None:
    """A stage whose weight is used twice keeps its whole graph for W, which then
    differentiates it toward the parameters that take gradients (a frozen one takes
    none): the gradients are one process's, and the frozen layer has none, also after
    the sum over its replicas (here a stand-in replica; a zero gradient written back
    would let weight decay move a frozen weight)."""
    monkeypatch.setattr(pipelang.torch, "reduce_ranks", lambda *_: [0, 1])
    torch.manual_seed(1)
    x, target = torch.randn(8, 16), torch.randn(8, 8)
    sched = PipelineSchedule(
        pipelang.load("zb-h1", D=1, N=4), lambda s: _Tied(), torch.nn.functional.mse_loss
    )
    monkeypatch.setattr(sched.transport, "allreduce", lambda stage, flat: _Summed())
    sched.step(x, target)
    assert sched.reducing  # the stand-in replica's sum ran
    alone = _Tied()
    for xs, ts in zip(x.chunk(4), target.chunk(4), strict=True):
        (torch.nn.functional.mse_loss(alone(xs), ts) * 0.25).backward()
    for mine, theirs in zip(sched.parameters(), alone.parameters(), strict=True):
        assert (mine.grad is None) == (theirs.grad is None) == (not mine.requires_grad)
        assert mine.grad is None or torch.equal(mine.grad, theirs.grad)


# ---- several tensors between stages (issue 44) ------------------------------------------------


class _Gives(torch.nn.Module):
    """Stage 0: hands on a dict holding a tensor, a tuple with an integer mask in it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 32)
        self.skip = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"h": torch.tanh(self.lin(x)), "pair": (self.skip(x), (x > 0).long())}


class _Takes(torch.nn.Module):
    """Stage 1: takes the dict whole, as `x = stage(x)`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(32, 8)

    def forward(self, v: dict[str, Any]) -> torch.Tensor:
        skip, mask = v["pair"]
        return self.lin(v["h"] + skip * mask.sum(dim=1, keepdim=True).float())


def _stage(s: int) -> torch.nn.Module:
    return _Gives() if s == 0 else _Takes()


def _one_process_grads(x: torch.Tensor, target: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Both stages' gradients in one process, micro-batch by micro-batch as the schedules
    sum them."""
    first, second = _Gives(), _Takes()
    for xs, ts in zip(x.chunk(n), target.chunk(n), strict=True):
        (torch.nn.functional.mse_loss(second(first(xs)), ts) / n).backward()
    return [p.grad for m in (first, second) for p in m.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "params"), [("interleaved-1f1b", {"D": 1, "N": 4, "v": 2}), ("zbv", {"D": 1, "N": 4})]
)
def test_a_dict_between_stages_trains_as_one_process(
    name: str, params: dict[str, int], one_process: None
) -> None:
    """A stage that hands the next a dict (a tuple and an integer tensor in it) trains,
    packed as `pipelang run` packs it, with one process's gradients bit for bit (it was
    `AttributeError: 'dict' object has no attribute 'detach'`); here both stages on one
    rank, with a split backward too (zbv); over a channel in the slow test below."""
    torch.manual_seed(2)
    x, target = torch.randn(8, 16), torch.randn(8, 8)
    sched = PipelineSchedule(pipelang.load(name, **params), _stage, torch.nn.functional.mse_loss)
    loss = sched.step(x, target)
    assert loss is not None and sched.boundaries[0].leaves[-1][1] == torch.int64
    theirs = _one_process_grads(x, target, 4)
    mine = [p.grad for s in (0, 1) for p in sched.stages[(s, "main")].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))  # type: ignore[arg-type]


_TWO_RANKS = """\
import sys, torch, torch.distributed as dist, pipelang
from pipelang.torch import PipelineSchedule
from tests.test_torch_api import _one_process_grads, _stage

dist.init_process_group("gloo")
torch.manual_seed(2)
x, target = torch.randn(8, 16), torch.randn(8, 8)
prog = pipelang.load(sys.argv[1], D=2, N=4)
sched = PipelineSchedule(prog, _stage, torch.nn.functional.mse_loss)
sched.step(x, target)
rank = dist.get_rank()
theirs = _one_process_grads(x, target, 4)
theirs = theirs[:4] if rank == 0 else theirs[4:]
mine = [p.grad for p in sched.parameters()]
same = len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs))
print(f"rank {rank} bitwise {same}")
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_dict_crosses_a_channel_as_one_process_trains(name: str, tmp_path: Path) -> None:
    """Two gloo processes: the dict crosses rank 0 -> 1 packed, its structure announced
    with the first message, and each rank's gradients are one process's, bit for bit."""
    import os

    script = tmp_path / "two.py"
    script.write_text(_TWO_RANKS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), name]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=root
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 bitwise True" in proc.stdout and "rank 1 bitwise True" in proc.stdout


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def test_clip_grad_norm_is_torchs_over_the_whole_model(one_process: None) -> None:
    """`clip_grad_norm_` after `step`: the norm and the clipped gradients of one process
    that accumulates the same micro-batches (torch.nn.utils.clip_grad_norm_)."""
    torch.manual_seed(1)
    x, target = torch.randn(8, 16), torch.randn(8, 8)
    sched = PipelineSchedule(
        pipelang.load("zb-h1", D=1, N=4), lambda s: _mlp(), torch.nn.functional.mse_loss
    )
    sched.step(x, target)
    norm = sched.clip_grad_norm_(0.05)
    alone = _mlp()
    for xs, ts in zip(x.chunk(4), target.chunk(4), strict=True):
        (torch.nn.functional.mse_loss(alone(xs), ts) * 0.25).backward()
    expected = torch.nn.utils.clip_grad_norm_(alone.parameters(), 0.05)
    assert float(norm) > 0.05 and torch.allclose(norm, expected, rtol=1e-6)
    for mine, theirs in zip(sched.parameters(), alone.parameters(), strict=True):
        assert torch.allclose(mine.grad, theirs.grad, rtol=1e-5, atol=1e-9)  # type: ignore[arg-type]


def test_mixed_precision_computes_in_bf16_and_sums_into_fp32_masters(one_process: None) -> None:
    """`mixed_precision="bfloat16"`: the stages compute in bf16 (the batch cast), the
    loss in fp32, each micro-batch's gradient added in fp32 to the master the optimizer
    gets from `parameters()`; the next `step` rounds the masters into the bf16 weights.
    Against a hand-written one-process loop of the same arithmetic, bit for bit."""
    torch.manual_seed(1)
    x, target = torch.randn(8, 16), torch.randn(8, 8)
    sched = PipelineSchedule(
        pipelang.load("1f1b", D=1, N=4),
        lambda s: _mlp(),
        torch.nn.functional.mse_loss,
        mixed_precision="bfloat16",
    )
    masters = list(sched.parameters())
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(p.dtype == torch.bfloat16 for p in sched.stages[(0, "main")].parameters())
    opt = torch.optim.SGD(masters, lr=0.5)
    sched.step(x, target)
    opt.step()
    opt.zero_grad()
    sched.step(x, target)
    alone = _mlp().to(torch.bfloat16)
    fp32 = [p.detach().float().clone() for p in alone.parameters()]
    for _ in range(2):
        with torch.no_grad():
            for p, m in zip(alone.parameters(), fp32, strict=True):
                p.copy_(m)
        sums = [torch.zeros_like(m) for m in fp32]
        for xs, ts in zip(x.chunk(4), target.chunk(4), strict=True):
            y = alone(xs.to(torch.bfloat16)).float()
            (torch.nn.functional.mse_loss(y, ts) * 0.25).backward()
            for total, p in zip(sums, alone.parameters(), strict=True):
                total.add_(p.grad.float())  # type: ignore[union-attr]
                p.grad = None
        grads = sums
        with torch.no_grad():
            fp32 = [m - 0.5 * g for m, g in zip(fp32, grads, strict=True)]
    assert all(torch.equal(m.grad, g) for m, g in zip(masters, grads, strict=True))  # type: ignore[arg-type]
    first = [p.detach() for p in sched.stages[(0, "main")].parameters()]
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(first, masters, strict=True))


def test_mixed_precision_takes_bfloat16_only(one_process: None) -> None:
    with pytest.raises(pipelang.PipelangError, match="give 'bfloat16'"):
        PipelineSchedule(
            pipelang.load("1f1b", D=1, N=4), lambda s: _mlp(), torch.nn.functional.mse_loss,
            mixed_precision="fp8",
        )  # fmt: skip
