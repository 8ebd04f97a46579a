"""BPipe's evictions run for real: `E` ships a forward's saved tensors to the partner,
`H` keeps them there, `L` brings them back before the backward (backends/stash.py).

Oracles: `--check`'s single-process reference (the math must be unchanged, so the run is
bitwise equal), and the simulator's per-rank activation counts (`peak_activations`),
which the measured bytes must follow. Faults and a load missing past the compiler are
reported as one clean line.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipelang.backends.config import RunConfig
from pipelang.backends.launch import RunError, preflight
from pipelang.backends.local import run_local
from pipelang.backends.models import plan_stages
from pipelang.ir import Kind, Program
from pipelang.sim.timeline import CostModel
from tests.helpers import replay, run, stdlib

BPIPE = stdlib("bpipe", D=4, N=8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "optimizer"), [("gloo", "sgd"), ("gloo", "adam"), ("local", "adam")]
)
def test_bpipe_check_is_bitwise(
    backend: str, optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert any(a.kind is Kind.E for a in BPIPE.ranks[0])
    options = ["--model", "gpt:tiny", "--backend", backend, "--steps", "2", "--check"]
    assert run(BPIPE, *options, "--optimizer", optimizer, "--timeout", "30") == 0
    assert "bitwise equal" in capsys.readouterr().out


def _peak_bytes(program: Program) -> list[int]:
    config = RunConfig(backend="local", steps=1, count_activations=True)
    shapes = plan_stages(config.spec, program.num_stages, None).shapes
    outcome = run_local(program, config, shapes, lambda *_: None)
    return [r.peak_activation_bytes for r in outcome.results]


def _peak_counts(program: Program) -> list[int]:
    timeline = replay(program, CostModel())
    return [timeline.peak_activations(r) for r in range(program.num_ranks)]


def test_evicting_rank_holds_fewer_activation_bytes_than_under_1f1b() -> None:
    one_f_one_b = stdlib("1f1b", D=4, N=8)
    base, evicting = _peak_bytes(one_f_one_b), _peak_bytes(BPIPE)
    counts_base, counts_evicting = _peak_counts(one_f_one_b), _peak_counts(BPIPE)
    assert (counts_base[0], counts_evicting[0]) == (4, 3)  # docs/schedules/bpipe.md
    assert evicting[0] < base[0]
    # every micro-batch of a stage saves the same bytes: the bytes follow the counts
    assert evicting[0] * counts_base[0] == base[0] * counts_evicting[0]
    assert evicting[1:3] == base[1:3]  # ranks 1 and 2 evict nothing and hold nothing


def test_a_missing_load_is_reported_at_the_backward(capsys: pytest.CaptureFixture[str]) -> None:
    """The compiler refuses an `E` with no `L` (E0315); an edited program gets past it,
    and the backward that finds its activations away fails cleanly."""
    rank0 = tuple(a for a in BPIPE.ranks[0] if not (a.kind is Kind.L and a.mb == 2))
    broken = dataclasses.replace(BPIPE, ranks=(rank0, *BPIPE.ranks[1:]))
    assert run(broken, "--backend", "local", "--steps", "1", "--timeout", "20") == 1
    err = capsys.readouterr().err
    at = next(i for i, a in enumerate(rank0) if a.kind is Kind.B and a.mb == 2)
    assert f"error: rank 0 failed at step 0, action {at} `B2@0/main`" in err
    assert "F2@0/main needs its activations, but they are on the partner rank" in err
    assert "Traceback" not in err


def test_a_fault_at_a_hold_stops_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    at = next(i for i, a in enumerate(BPIPE.ranks[3]) if a.kind is Kind.H)
    monkeypatch.setenv("PIPELANG_FAULT", f"3:0:{at}:raise")
    assert run(BPIPE, "--backend", "gloo", "--steps", "1", "--timeout", "20") == 1
    err = capsys.readouterr().err
    hold = BPIPE.ranks[3][at].text()
    assert f"error: rank 3 failed at step 0, action {at} `{hold}`: RuntimeError: injected" in err
    assert "stopped the other ranks (0, 1, 2)" in err
    assert "Traceback" not in err


def test_cuda_evictions_are_refused_before_any_rank() -> None:
    with pytest.raises(RunError, match="evictions have run only on the CPU"):
        preflight(BPIPE, RunConfig(backend="nccl"))


def test_an_eviction_leaves_memory_torch_does_not_own_in_place() -> None:
    """Ids made by `torch.from_numpy` (what `--data` used to hand the embedding) cannot be
    resized: the eviction moves the other activations and leaves them, and the backward
    after the load gives the gradients of one without eviction."""
    import numpy as np
    import torch
    from torch import nn

    from pipelang.backends.stash import Stash

    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 6), nn.Tanh())
    ids = torch.from_numpy(np.arange(8, dtype=np.int64) % 11)
    assert not ids.untyped_storage().resizable()

    def grads(evict: bool) -> list[torch.Tensor]:
        module.zero_grad()
        stash = Stash()
        key = (0, 0, "main", None)
        with stash.recording(key, "F0@0/main", module):
            out = module(ids)
        if evict:
            buffer = stash.evict(key, keep=out)
            assert buffer.numel() > 0  # the Linear's input and the Tanh's output moved
            stash.load(key, buffer)
        out.sum().backward()
        return [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]

    for plain, evicted in zip(grads(False), grads(True), strict=True):
        assert torch.equal(plain, evicted)
    assert ids.tolist() == [i % 11 for i in range(8)]
