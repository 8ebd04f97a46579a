"""Each rank builds only its stages (issue 41): a built-in model is made on the meta
device and only the layers asked for are materialized, each from a seed of its own
(backends/layer_init.py).

Oracles: the whole model as `--check`'s reference builds it (every layer), tensor by
tensor with torch.equal; the bytes of the layers a stage holds, counted on that whole
model; the layers a schedule puts on each rank (`Program.stage_copies`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pipelang.backends.config import RunConfig
from pipelang.backends.layer_init import init_layer
from pipelang.backends.models import LayeredModel, ModelSpec
from pipelang.backends.runtime import RankRuntime, copy_names, full_model_names
from pipelang.diagnostics import InternalError
from pipelang.ir import Program
from tests.helpers import stdlib

BUILT_IN = ["gpt:tiny", "llama:tiny"]


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    return dict(layer.state_dict())


def _bytes(layers: list[nn.Module]) -> int:
    """Bytes of every parameter and buffer of `layers` not on the meta device."""
    return sum(
        t.numel() * t.element_size()
        for layer in layers
        for t in (*layer.parameters(), *layer.buffers())
        if not t.is_meta
    )


@pytest.mark.parametrize("name", BUILT_IN)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_built_alone_equal_those_built_with_everything(name: str, dtype: str) -> None:
    """Layer i's weights depend on the seed and i alone: built alone, with others, or
    with all of them (the reference), they are equal bit for bit; the layers not asked
    for stay on the meta device."""
    spec = ModelSpec(name, dtype=dtype, seed=7)
    whole = spec.build()
    count = len(whole.layers)
    assert all(not t.is_meta for layer in whole.layers for t in _tensors(layer).values())
    for asked in ([0], [count - 1], [3, 1], [count - 1, 2, 0], range(count)):
        part = spec.build(layers=asked)
        for i, (mine, theirs) in enumerate(zip(part.layers, whole.layers, strict=True)):
            tensors, reference = _tensors(mine), _tensors(theirs)
            assert tensors.keys() == reference.keys()
            for key, tensor in tensors.items():
                if i in asked:
                    assert tensor.dtype == reference[key].dtype == spec.torch_dtype
                    assert torch.equal(tensor, reference[key]), (name, asked, i, key)
                else:
                    assert tensor.is_meta, (name, asked, i, key)


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_layer_has_its_own_draws_and_the_init_rule(name: str) -> None:
    """Alike blocks get different weights (a seed of their own each), another run seed
    gives others; biases are zero, norm scales one, matrices about 0.02 (the residual
    projections 0.02/sqrt(2 * blocks)), as the GPT-2 init says."""
    spec = ModelSpec(name)
    model = spec.build()
    blocks = len(model.layers) - 2
    first, second = _tensors(model.layers[1]), _tensors(model.layers[2])
    other = _tensors(replace(spec, seed=1).build(layers=[1]).layers[1])
    for key, tensor in first.items():
        if key.endswith("bias"):
            assert not tensor.any()
        elif tensor.dim() == 1:
            assert torch.equal(tensor, torch.ones_like(tensor))
        else:
            residual = key in ("proj.weight", "out.weight", "o.weight", "down.weight")
            want = 0.02 / blocks**0.5 / 2**0.5 if residual else 0.02
            assert float(tensor.std()) == pytest.approx(want, rel=0.1), key
            assert not torch.equal(tensor, second[key]) and not torch.equal(tensor, other[key])


def test_building_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(3)
    state = torch.get_rng_state()
    ModelSpec("gpt:tiny").build(layers=[0, 2])
    assert torch.equal(torch.get_rng_state(), state)


class _Silent:
    def end_step(self) -> None: ...


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[nn.Module]]]:
    """The layer lists of every model `ModelSpec.build` makes from now on (the runtime
    lets its list go after taking its stages; the layers themselves are kept here)."""
    made: list[list[nn.Module]] = []
    build = ModelSpec.build

    def recording(spec: ModelSpec, *args: object, **kwargs: object) -> LayeredModel:
        model = build(spec, *args, **kwargs)  # type: ignore[arg-type]
        made.append(model.layers)
        return model

    monkeypatch.setattr(ModelSpec, "build", recording)
    yield made


def _runtime(program: Program, rank: int, config: RunConfig, replica: int = 0) -> RankRuntime:
    config = config.for_program(program)
    cpu = torch.device("cpu")
    return RankRuntime(program, rank, config, _Silent(), cpu, replica=replica)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("schedule", "params", "model", "options"),
    [
        ("1f1b", {"D": 4, "N": 4}, "gpt:tiny", {}),
        ("chimera", {"D": 4, "N": 4}, "llama:tiny", {}),
        ("interleaved-1f1b", {"D": 2, "N": 4, "v": 2}, "gpt:tiny", {"dp": 2}),
        ("diffusionpipe", {"D": 4, "N": 4, "h": 2}, "gpt:tiny", {"frozen_layers": 2}),
    ],
)
def test_a_rank_materializes_only_the_layers_of_its_stages(
    built: list[list[nn.Module]],
    schedule: str,
    params: dict[str, int],
    model: str,
    options: dict[str, int],
) -> None:
    """Every layer a rank's runtime materializes is one of its stage copies' (or of the
    frozen part it runs): its parameter bytes are its stages' share of the model's, not
    the whole model's; and each copy's weights are the reference's, bit for bit, so
    the replicas of a stage (Chimera's two pipelines, `--dp` copies) agree without
    communicating."""
    program = stdlib(schedule, **params)
    config = RunConfig(model=model, seed=5, **options)  # type: ignore[arg-type]
    reference = config.for_program(program).spec.build()
    whole, covered = full_model_names(reference), set()
    for rank in range(program.num_ranks):
        for replica in range(config.dp):
            built.clear()
            runtime = _runtime(program, rank, config, replica)
            held = {i for c in runtime.copies.values() for i in c.layers}
            weights = [copy_names(c) for c in runtime.copies.values()]
            if runtime.frozen is not None:  # the frozen part is the model's first layers
                held |= set(range(len(runtime.frozen)))
                weights.append(dict(runtime.frozen.state_dict()))
            (layers,) = built
            assert _bytes(layers) == _bytes([reference.layers[i] for i in held]), (rank, replica)
            assert 0 < _bytes(layers) < _bytes(reference.layers)
            for key, tensor in ((k, t) for names in weights for k, t in names.items()):
                assert torch.equal(tensor, whole[key]), (rank, replica, key)
            covered |= held
    assert covered == set(range(len(reference.layers)))


def test_per_rank_parameter_bytes_follow_the_stages_share(built: list[list[nn.Module]]) -> None:
    """1F1B, D = 4 on gpt:tiny: rank r holds exactly stage r's layers' bytes (the first
    and last with the embedding and the head), and together the ranks hold the model once."""
    program = stdlib("1f1b", D=4, N=4)
    config = RunConfig(model="gpt:tiny")
    reference = config.spec.build()
    bounds = reference.stage_bounds(4, None)
    measured = []
    for rank in range(4):
        built.clear()
        _runtime(program, rank, config)
        measured.append(_bytes(built[0]))
    assert measured == [_bytes([reference.layers[i] for i in b]) for b in bounds]
    assert sum(measured) == _bytes(reference.layers)


USER_MODEL = """
from torch import nn


def model():
    seq = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64))
    seq.vocab_size, seq.seq_len = 64, 8
    return seq
"""


def test_a_users_model_is_built_whole_whatever_layers_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's factory is not asked to build on meta: it runs as before, seeded, and
    every layer is there (and the same) whichever layers are asked for."""
    (tmp_path / "mine.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    spec = ModelSpec("mine.py:model", seed=4)
    whole, part = spec.build(), spec.build(layers=[0])
    assert all(not t.is_meta for layer in part.layers for t in _tensors(layer).values())
    for mine, theirs in zip(part.layers, whole.layers, strict=True):
        assert all(torch.equal(t, _tensors(theirs)[k]) for k, t in _tensors(mine).items())


def test_a_built_in_layer_with_a_buffer_or_an_unknown_parameter_is_an_internal_error() -> None:
    """`to_empty` leaves garbage in buffers and parameters: one the rule does not cover
    is refused rather than trained from garbage."""
    norm = nn.BatchNorm1d(4)  # running_mean, running_var, num_batches_tracked
    with pytest.raises(InternalError, match="buffer `running_mean`"):
        init_layer(norm, frozenset(), 0.01)
    odd = nn.Module()
    odd.scale = nn.Parameter(torch.zeros(3))
    with pytest.raises(InternalError, match="parameter `scale` has no init rule"):
        init_layer(odd, frozenset(), 0.01)
