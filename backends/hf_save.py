"""`run --model hf:DIR --save-hf OUT_DIR`: the trained model as a Hugging Face checkpoint.

After the last step, each piece of the model is written by one process, from the
weights it trained, as one safetensors shard of OUT_DIR named by Hugging Face's own
tensor names (those of `DIR/config.json`'s model, `HFLayers.slots`):

- a piece is a stage (its layers), or the schedule's frozen part; a piece holding no
  parameter of its own writes nothing;
- its writer is the copy on the lowest rank that holds it (the first pipeline there), in
  data-parallel copy 0: the replicas of a stage are equal after a step, so one writes
  (with `--shard`, every copy gathers the stage's whole weights with it, and copy 0
  writes them);
- a tied weight (GPT-2's, a small Llama's embedding and head) is one tensor, under its
  first name (the embedding's, as `save_pretrained` writes it), written by the piece
  holding the first layer that uses it;
- with `--mixed-precision`, the fp32 masters are written (what the optimizer updated,
  which the bf16 parameters are rounded from); otherwise the parameters in the run's
  dtype. config.json is DIR's, copied unchanged (its `torch_dtype` included).

Shard K of N is `model-0000K-of-0000N.safetensors`, written to a temporary name and
renamed, so a shard that exists is whole. Once the ranks are done (the launcher; rank 0
under torchrun, after every rank reported), `finish` reads the headers of every shard
back, copies config.json (and DIR's generation and tokenizer files, where present), and
writes `model.safetensors.index.json` last, also renamed into place: a directory without
the index is not a checkpoint yet. A run stopped before its last step writes no shard.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelang.backends.hf_config import DTYPES, INDEX, hf_directory, read_header
from pipelang.backends.model_error import ModelError
from pipelang.diagnostics import clip, quote

if TYPE_CHECKING:
    import torch
    from rich.console import Console
    from torch import nn

    from pipelang.backends.config import RunConfig
    from pipelang.backends.hf_models import HFLayers
    from pipelang.backends.models import LayeredModel
    from pipelang.backends.runtime import RankRuntime
    from pipelang.ir import Program

COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
"""DIR's files besides config.json that OUT_DIR gets, where DIR has them (regular files
of at most `COPIED_BYTES`): what `from_pretrained` and a tokenizer read next to it."""
COPIED_BYTES = 64 * 2**20


class SaveError(ModelError):
    """OUT_DIR cannot be written."""


def out_dir_problem(model: str, out: str) -> str | None:
    """Why `--save-hf out` cannot be given with `--model model` (a usage error, before the
    run): another kind of model, OUT_DIR a file or a directory holding anything, or a
    place where nothing can be written. Makes OUT_DIR; None when it is fine."""
    if not model.startswith("hf:"):
        return (
            f"--save-hf writes a Hugging Face checkpoint of --model hf:DIR; the model is "
            f"{quote(model)}: give --save DIR for pipelang's own checkpoints"
        )
    path = Path(out)
    try:
        if path.exists() and not path.is_dir():
            return f"--save-hf {quote(out)} is a file, not a directory"
        if path.is_dir() and any(path.iterdir()):
            return (
                f"--save-hf {quote(out)} is not empty; pipelang writes over nothing: give "
                "a new or empty directory"
            )
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".pipelang-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        return f"--save-hf: cannot write to {quote(out)}: {err.strerror or err}"
    return None


@dataclass(frozen=True, slots=True)
class Piece:
    """One shard of the written checkpoint: a stage's layers (or the frozen part's,
    `stage` None) and the copy that writes them."""

    file: str
    stage: int | None
    layers: range
    rank: int
    pipeline: str | None


def pieces(program: Program, config: RunConfig, model: LayeredModel) -> list[Piece]:
    """The shards of `--save-hf`, in layer order (see the module docstring)."""
    layers = _hf_layers(model)
    bounds = model.stage_bounds(program.num_stages, config.partition)
    found: list[tuple[int | None, range, int, str | None]] = []
    if program.frozen:
        found.append((None, model.frozen_bounds, min(program.frozen), None))
    for stage, held in enumerate(bounds):
        rank, pipeline = min(
            (r, p)
            for r in range(program.num_ranks)
            for s, p in program.stage_copies(r)
            if s == stage
        )
        found.append((stage, held, rank, pipeline))
    kept = [
        f for f in found if any(layers.owner[s.key] in f[1] for i in f[1] for s in layers.slots[i])
    ]
    count = len(kept)
    return [Piece(f"model-{k + 1:05d}-of-{count:05d}.safetensors", *f) for k, f in enumerate(kept)]


def _hf_layers(model: LayeredModel) -> HFLayers:
    from pipelang.backends.hf_models import HFLayers

    layers = model.materializer
    if not isinstance(layers, HFLayers):
        raise SaveError(f"--save-hf needs --model hf:DIR, not {quote(model.spec.name)}")
    return layers


def _names(layers: HFLayers, i: int) -> dict[str, tuple[int, str]]:
    """Layer `i`'s parameters by their name inside the layer: (key, Hugging Face name)."""
    prefixes: dict[int, list[str]] = {}
    for prefix, module in layers.layers[i].named_modules(remove_duplicate=False):
        prefixes.setdefault(id(module), []).append(prefix)
    out = {}
    for slot in layers.slots[i]:
        if not slot.names:
            raise SaveError(f"layer {i}'s parameter {slot.attr} has no Hugging Face name")
        for prefix in prefixes[id(slot.module)]:
            out[f"{prefix}.{slot.attr}" if prefix else slot.attr] = (slot.key, slot.names[0])
    return out


def write_rank(runtime: RankRuntime) -> None:
    """Write the shards this rank writes (none outside data-parallel copy 0), after the
    run's last step."""
    config = runtime.config
    if config.save_hf is None or (runtime.replica != 0 and not config.shard):
        return  # with --shard, every copy takes part in gathering its stage's weights
    import dataclasses

    program = runtime.program
    # the runtime let go of the model's layers; its materializer holds them all
    model = dataclasses.replace(runtime.model, layers=_hf_layers(runtime.model).layers)
    for piece in pieces(program, config, model):
        if piece.rank != runtime.rank:
            continue
        if piece.stage is None:
            if runtime.frozen is None:
                raise SaveError(f"rank {runtime.rank} holds no frozen part to write")
            tensors = _tensors(model, runtime.frozen, piece.layers, piece.layers, None)
        else:
            copy = runtime.copies[(piece.stage, piece.pipeline or "")]
            masters = None
            if copy.masters is not None:
                masters = {id(p): m for p, m in zip(copy.params, copy.masters, strict=True)}
            tensors = _tensors(model, copy.module, copy.layers, piece.layers, masters)
        if runtime.replica == 0:
            _write_shard(Path(config.save_hf) / piece.file, tensors)


def _tensors(
    model: LayeredModel,
    module: nn.Module,
    held: range,
    owned: range,
    masters: dict[int, nn.Parameter] | None,
) -> dict[str, torch.Tensor]:
    """The tensors of `module` (an nn.Sequential of layers `held`) whose first layer is in
    `owned`, by their Hugging Face names, on the CPU."""
    from torch.distributed.tensor import DTensor

    layers = _hf_layers(model)
    names = {i: _names(layers, i) for i in held}
    out: dict[str, torch.Tensor] = {}
    written: set[int] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        local, _, rest = name.partition(".")
        layer = held.start + int(local)
        key, hf_name = names[layer][rest]
        if key in written or layers.owner[key] not in owned:
            continue
        written.add(key)
        value: torch.Tensor = masters.get(id(param), param) if masters is not None else param
        if isinstance(value, DTensor):  # --shard: the whole weight, gathered from every copy
            value = value.full_tensor()
        out[hf_name] = value.detach().cpu().contiguous().clone()
    return out


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` as the safetensors file `path`, written whole or not at all."""
    from safetensors.torch import save_file

    temporary = _temporary(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(temporary), metadata={"format": "pt"})
        os.replace(temporary, path)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise SaveError(f"--save-hf: cannot write {quote(path)}: {err.strerror or err}") from None


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def after_run(
    program: Program, config: RunConfig, results: list[Any], status: int, err: Console
) -> int:
    """The launcher's (rank 0's under torchrun) part once the ranks are done: `finish`
    where every rank ran the last step, its line or its error on `err`; the exit status,
    1 where OUT_DIR could not be completed."""
    if config.save_hf is None or status in (130, 143):
        return status
    if any(r.stopped_after is not None for r in results):
        err.print("--save-hf: not written: the run stopped before its last step", markup=False)
        return status
    try:
        line = finish(program, config)
    except ModelError as error:
        err.print(f"error: {clip(str(error))}", markup=False)
        return 1
    if line is not None:
        err.print(line, markup=False)
    return status


def finish(program: Program, config: RunConfig) -> str | None:
    """Once every rank is done: config.json and the index into OUT_DIR (see the module
    docstring); the line that says so, None without --save-hf. A SaveError where a shard
    is missing (a run stopped before its last step) or OUT_DIR cannot be written."""
    if config.save_hf is None:
        return None
    import torch

    out = Path(config.save_hf)
    with torch.device("meta"):
        model = config.spec.build(layers=())
    shards = pieces(program, config, model)
    missing = [p.file for p in shards if not (out / p.file).is_file()]
    if missing:
        raise SaveError(
            f"--save-hf {quote(out)}: no {missing[0]}: a rank wrote no shard (the run "
            "stopped before its last step); OUT_DIR has no index and is no checkpoint"
        )
    weight_map: dict[str, str] = {}
    total = 0
    for piece in shards:
        for name, info in read_header(out / piece.file).items():
            weight_map[name] = piece.file
            total += DTYPES.get(info.dtype, 0) * _count(info.shape)
    source = hf_directory(config.model)
    try:
        _copy(source / "config.json", out / "config.json")
        for name in COPIED:
            found = source / name
            if found.is_file() and found.stat().st_size <= COPIED_BYTES:
                _copy(found, out / name)
    except OSError as err:
        raise SaveError(
            f"--save-hf: cannot copy into {quote(out)}: {err.strerror or err}"
        ) from None
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_text(out / INDEX, _json(index))
    return (
        f"wrote the trained model to {out} as a Hugging Face checkpoint ({len(shards)} "
        f"shards, {len(weight_map)} tensors): AutoModelForCausalLM.from_pretrained({str(out)!r})"
    )


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _json(value: Any) -> str:
    import json

    return json.dumps(value, indent=2) + "\n"


def _copy(source: Path, target: Path) -> None:
    temporary = _temporary(target)
    try:
        shutil.copyfile(source, temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _write_text(path: Path, text: str) -> None:
    temporary = _temporary(path)
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError as err:
        raise SaveError(f"--save-hf: cannot write {quote(path)}: {err.strerror or err}") from None
    finally:
        temporary.unlink(missing_ok=True)
