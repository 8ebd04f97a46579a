"""The built-in models: llama's parts against independent definitions, and training.

Oracles: torch's own `rms_norm`; the rotary property that a query-key score depends
only on the distance between positions; causality (a later token never changes an
earlier logit); `--check` (one process) for a pipelined run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipelang.backends.builtin_models import LLAMA_SIZES, LlamaBlock, RMSNorm, rotary
from pipelang.backends.models import ModelSpec, plan_stages
from tests.helpers import run, stdlib


def test_rmsnorm_is_torchs() -> None:
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16)
    expected = nn.functional.rms_norm(x, (16,), norm.weight, eps=1e-5)
    torch.testing.assert_close(norm(x), expected)


def test_rotary_scores_depend_only_on_the_distance() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    seq = torch.zeros(1, 1, 12, 8)

    def score(i: int, j: int) -> float:
        qs, ks = seq.clone(), seq.clone()
        qs[0, 0, i], ks[0, 0, j] = q, k
        return float(rotary(qs)[0, 0, i] @ rotary(ks)[0, 0, j])

    assert score(5, 2) == pytest.approx(score(9, 6), abs=1e-5)
    assert score(3, 3) == pytest.approx(score(11, 11), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
    assert score(0, 0) == pytest.approx(float(q @ k), abs=1e-6)  # position 0 is not turned


def test_a_llama_block_attends_causally_with_fewer_key_value_heads() -> None:
    cfg = LLAMA_SIZES["tiny"]
    block = LlamaBlock(cfg)
    head_dim = cfg.width // cfg.heads
    assert cfg.kv_heads < cfg.heads
    assert block.kv.out_features == 2 * cfg.kv_heads * head_dim  # grouped-query attention
    assert block.gate_up.out_features == 2 * cfg.hidden  # SwiGLU's gate and up
    x = torch.randn(2, 10, cfg.width)
    changed = x.clone()
    changed[:, 7:] = torch.randn(2, 3, cfg.width)
    torch.testing.assert_close(block(x)[:, :7], block(changed)[:, :7])
    assert not torch.allclose(block(x)[:, 7:], block(changed)[:, 7:])


def test_llama_tiny_splits_like_its_plan() -> None:
    """The stage plan's shapes (no weights built) are what the layers make."""
    spec = ModelSpec("llama:tiny", micro_batch_size=2)
    plan = plan_stages(spec, 4, None)
    model = spec.build()
    x, _ = model.batch(0, 0, torch.device("cpu"))
    for bounds, (shape, dtype) in zip(plan.bounds, plan.shapes.values(), strict=True):
        for i in bounds:
            x = model.layers[i](x)
        assert (tuple(x.shape), x.dtype) == (shape, dtype)
    assert len(model.layers) == LLAMA_SIZES["tiny"].blocks + 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chimera", "zbv"])
def test_llama_tiny_trains_like_one_process(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    params = {"D": 4, "N": 4} if name == "chimera" else {"D": 2, "N": 4}
    assert run(stdlib(name, **params), "--model", "llama:tiny", "--check") == 0
    assert "check OK" in capsys.readouterr().out


def test_an_unknown_size_names_the_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(stdlib("1f1b", D=2, N=2), "--model", "llama:huge") == 1
    assert "unknown llama size `huge`; use one of: tiny, small" in capsys.readouterr().err
