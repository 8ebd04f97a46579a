"""Checkpoints: `run --save DIR [--save-every K]` and `run --resume DIR` (or `auto`).

A checkpoint is a `torch.distributed.checkpoint` (DCP) directory of its own,
`DIR/step-K` for the state after step K, plus `pipelang.json` (step, model, optimizer,
precision, schedule, the run and its lineage), written last: a directory without it is
incomplete and is never resumed. Which checkpoints under DIR are this run's, which one
`--resume` takes and which `--keep-last` deletes is `checkpoint_dirs.py`'s; reading a
checkpoint's files, none of them trusted, is `checkpoint_read.py`'s.

Every entry is named as in the whole model, never by rank or stage: `model.{layer}.{name}`
for a parameter (the layer counted over the whole model, as `--check` names it; a user
model's list of stage modules has a layer per stage, each named as the user's module names
its parameters, however pipelang wraps it to pack what crosses its boundaries) and
`optim.{layer}.{name}.{field}` for its optimizer state (`exp_avg`, `exp_avg_sq` and
`step` for Adam, `momentum` for SGD). So the replicas of a stage (Chimera's two pipelines,
`--dp` copies) write one entry between them (DCP keeps one of equal keys), and a checkpoint
loads into any schedule, rank count or partition over the same model, and into a
`pipelang.torch.PipelineSchedule` over the same stage modules (pipelang/torch_state.py,
which writes them the same way): each rank reads the entries of the layers it holds.
Every entry the run's optimizer keeps must be there, in its shape and dtype (a checkpoint
without Adam's moments is refused, naming the first missing one, before any rank starts:
`verify`, and again by each rank: `load`).

A sharded stage copy (`--dp K --shard`, backends/shard.py) writes its parameters and
their optimizer state as DTensors laid out as FSDP2 shards them (`Held.sharded`): each
process writes its own shard of each entry, under the same names, so the checkpoint
holds the same whole tensors as one of the unsharded run, and either loads into the
other (DCP reads each process's part of whatever layout it was written in). A
tensor-parallel copy (`--tp T`, backends/tensor_parallel.py) does the same with its
DTensor parts, the tensors it holds whole written once between its tensor ranks; a
fused projection's part (rows t of each of its parts, which DCP cannot describe as one
box of the whole tensor) is redistributed to plain rows to be written and back once
read (`Held.whole`, `Held.local`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipelang.backends.checkpoint_dirs import find, mark, may_overwrite, prune
from pipelang.backends.checkpoint_read import (
    INFO,
    STEP_DIR,
    CheckpointError,
    read_info,
    reader,
    tensor_entries,
)
from pipelang.backends.tensor_parallel import dp_piece, fused_sharded, tp_part
from pipelang.backends.user_models import PackedStage
from pipelang.diagnostics import clip

if TYPE_CHECKING:
    from pipelang.backends.config import RunConfig
    from pipelang.backends.optim import LrSchedule, Optimizer

__all__ = [
    "INFO",
    "STEP_DIR",
    "CheckpointError",
    "Held",
    "find",
    "held_by_model",
    "load",
    "prune",
    "saves_after",
    "step_dir",
    "verify",
    "write",
]

Entry = tuple[tuple[int, ...], torch.dtype]


def _world_not_held() -> None:
    """Let `dist.destroy_process_group()` free the default process group after DCP is used.

    DCP (torch.distributed.checkpoint, through torch.distributed._shard) imports
    torch/distributed/nn/functional.py, whose collectives take `group=group.WORLD` as a
    default argument, evaluated at import (functional.py:32 `broadcast` and each one
    after it, torch 2.13): imported after `init_process_group`, as DCP is here, lazily,
    they hold the default group for the life of the process. Its gloo threads then
    outlive `destroy_process_group()` into the interpreter's finalization, where a worker
    thread still letting go of a finished collective's tensor needs the GIL and is ended
    inside a destructor: std::terminate, "terminate called without an active exception"
    (a user's loop aborted at exit so). So the module is imported now, with pipelang's
    (before the process group, as a script imports), and a group already bound is
    replaced by None, the value it binds then (None: the default group)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    import torch.distributed.nn.functional as collectives

    for function in vars(collectives).values():
        defaults = getattr(function, "__defaults__", None)
        if getattr(function, "__module__", None) == collectives.__name__ and defaults:
            function.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in defaults
            )


_world_not_held()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


announce: Callable[[str], None] = _say
"""Where the first process says that a checkpoint is complete: standard error (rank 0
under torchrun); a rank of `pipelang run` sends it to the launcher instead."""


@dataclass(frozen=True, slots=True)
class Held:
    """Parameters held together with the optimizer that updates them: a stage copy, or
    the whole model of the `--check` reference. `params[i]` is named `names[i]` in the
    whole model and is the optimizer's parameter `i`."""

    names: list[str]
    params: list[nn.Parameter]
    optimizer: Optimizer | None
    """None: the parameters alone (a user's loop with an optimizer of its own)."""
    sharded: Sequence[torch.Tensor] | None = None
    """`--shard` or `--tp`: the DTensor parameter each of `params` is the local part of
    (which says where the part lies in the whole tensor), or the parameter itself where
    it is whole on every process (`--tp`'s embedding, norms, head); None: `params` are
    whole."""

    def entries(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint key, tensor) of every parameter and optimizer state; a shard as a
        DTensor laid out as its parameter (DCP writes each process's shards, and reads
        into them whatever layout the checkpoint was written in)."""
        for i, (name, param) in enumerate(zip(self.names, self.params, strict=True)):
            yield f"model.{name}", self.whole(i, param)
            if self.optimizer is not None:
                for field, value in self.optimizer.state(i).items():
                    yield f"optim.{name}.{field}", self.whole(i, value)

    def whole(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """`local`, a tensor of parameter `i`'s shape on this process, as an entry of the
        checkpoint: laid out as the parameter's DTensor where it is split (a 0-d tensor,
        such as Adam's step count, is whole on every process). A part DCP cannot
        describe as one box of the whole tensor (`--tp`'s fused projections: rows t of
        each part, `_StridedShard`) is redistributed to plain rows (`Shard`) first, a
        collective over its mesh."""
        if self.sharded is None or local.dim() == 0:
            return local
        from torch.distributed.tensor import DTensor

        layout = self.sharded[i]
        if not isinstance(layout, DTensor):
            return local
        entry = DTensor.from_local(
            local.detach(),
            layout.device_mesh,
            layout.placements,
            run_check=False,
            shape=layout.shape,
            stride=layout.stride(),
        )
        if fused_sharded(layout):  # --shard --tp: its tensor-parallel part, over "tp"
            entry = tp_part(entry)
        boxes = _boxes(entry.placements)
        if boxes == tuple(entry.placements):
            return entry
        return entry.redistribute(entry.device_mesh, boxes)

    def local(self, i: int, entry: torch.Tensor) -> torch.Tensor:
        """`entry` (read into `whole`'s layout) as this process's part of parameter
        `i`: `whole` undone (a collective where `whole` redistributed)."""
        from torch.distributed.tensor import DTensor

        if not isinstance(entry, DTensor):
            return entry
        assert self.sharded is not None
        layout = self.sharded[i]
        assert isinstance(layout, DTensor)
        if fused_sharded(layout):  # whole()'s rows over "tp": this process's FSDP2 shard
            part = entry.redistribute(entry.device_mesh, [layout.placements[1]])
            return dp_piece(part.to_local(), layout)
        if entry.placements != layout.placements:
            entry = entry.redistribute(layout.device_mesh, layout.placements)
        return entry.to_local()


def _boxes(placements: Sequence[Any]) -> tuple[Any, ...]:
    """`placements` with each `_StridedShard` that no later placement cuts further (a
    fused projection's part, several boxes of the whole tensor) a plain `Shard` of the
    same dimension (one box); FSDP2's over a tensor-parallel `Shard` is one box already."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def box(m: int, p: Any) -> Any:
        if not isinstance(p, _StridedShard):
            return p
        later = placements[m + 1 :]
        return p if any(isinstance(q, Shard) and q.dim == p.dim for q in later) else Shard(p.dim)

    return tuple(box(m, p) for m, p in enumerate(placements))


def held_by_model(
    module: nn.Sequential,
    optimizer: Optimizer | None,
    first_layer: int = 0,
    masters: list[nn.Parameter] | None = None,
) -> Held:
    """The trainable parameters of `module` (an nn.Sequential of layers `first_layer`,
    ...) under their whole-model names, in the optimizer's order; with `masters`
    (`--mixed-precision`), those in their place."""
    names, params = [], []
    for name, param in named_parameters(module, first_layer):
        if param.requires_grad:
            names.append(name)
            params.append(param)
    if not any(_is_dtensor(p) for p in params):
        return Held(names, masters if masters is not None else params, optimizer)
    shards: list[Any] = [_local(p) for p in params]  # what the optimizer trains
    return Held(names, masters if masters is not None else shards, optimizer, sharded=params)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a checkpoint's tensor: a DTensor's local shard."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def named_parameters(
    layers: nn.Sequential, first_layer: int = 0
) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters of `layers` (layers `first_layer`, ...) by their whole-model names,
    `{layer}.{name}`: `name` as the layer's own module names it, inside the wrapper that
    packs a user's stage (`user_models.PackedStage`), so that a checkpoint's names do not
    depend on what its boundaries carry."""
    for name, param in layers.named_parameters():
        local, _, rest = name.partition(".")
        if isinstance(layers[int(local)], PackedStage):
            rest = rest.removeprefix("stage.")
        yield f"{first_layer + int(local)}.{rest}", param


def step_dir(root: str, step: int) -> Path:
    """Where the checkpoint of step `step` goes under `--save root`."""
    return Path(root) / f"step-{step}"


def saves_after(config: RunConfig, step: int) -> bool:
    """Whether the run saves after step `step` (counted from 1): every `--save-every`
    steps, and after the last."""
    if config.save is None:
        return False
    every = config.save_every
    return step == config.steps or (every is not None and step % every == 0)


def write(held: Iterable[Held], step: int, config: RunConfig, schedule: str) -> None:
    """Save this process's entries as part of the checkpoint of step `step` under
    `--save`; a collective over the default process group when there is one. The first
    process marks the directory as this run's, writes `pipelang.json` once every process
    is done, says so (`announce`) and applies `--keep-last`. A `step-K` of another run
    is never written over (CheckpointError)."""
    assert config.save is not None
    path = step_dir(config.save, step)
    info: dict[str, object] = {"step": step, "model": config.model}
    info |= {"optimizer": config.optimizer, "precision": precision(config)}
    info |= {"schedule": schedule, "lr_schedule": lr_text(config)}
    if config.run_id is not None:
        info |= {"run": config.run_id, "lineage": [list(x) for x in config.lineage]}
    if commit(held, path, info, config.run_id, config.lineage):
        announce(f"checkpoint {path} complete (step {step})")
        if config.keep_last is not None:
            prune(config.save, config.keep_last, config.run_id, config.lineage)


def commit(
    held: Iterable[Held],
    path: Path,
    info: dict[str, object],
    run_id: str | None = None,
    lineage: tuple[tuple[str, int], ...] = (),
) -> bool:
    """Save this process's entries into checkpoint `path` and, once every process is
    done, `info` as its `pipelang.json` (the first process; a collective over the
    default process group when there is one); whether this is the first process. A
    checkpoint of another run is never written over (CheckpointError)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = {key: value.detach() for h in held for key, value in h.entries()}
    distributed = dist.is_initialized()
    first = not distributed or dist.get_rank() == 0
    if first:  # before the collective save: an overwritten step is incomplete until done
        if not may_overwrite(path, run_id, lineage):
            raise CheckpointError(f"`{path}` holds another run's checkpoint: not written over")
        (path / INFO).unlink(missing_ok=True)
        mark(path, run_id)
    with _one_process_quiet():
        dcp.save(state, checkpoint_id=path, no_dist=not distributed)
    if distributed:
        dist.barrier()
    if first:
        temporary = path / f".{INFO}.{os.getpid()}"  # complete at once, never half written
        temporary.write_text(json.dumps(info, indent=1) + "\n")
        temporary.replace(path / INFO)
    return first


def load(held: Iterable[Held], path: str) -> None:
    """Load this process's entries from checkpoint `path` into its parameters and
    optimizer states, in place; a collective when there is a process group. Every entry
    the optimizer keeps must be there (`_fit`); a shard DCP cannot read is a
    CheckpointError naming the checkpoint."""
    held = list(held)
    read(held, path, wanted(held, path))


def wanted(
    held: list[Held], path: str, where: str | None = None, hint: str = ""
) -> dict[str, torch.Tensor]:
    """The entries of checkpoint `path` that `held` loads, as tensors to read them into
    (no collective); CheckpointError, its message naming the checkpoint as `where`
    (default: `--resume PATH`) and ending in `hint` where an entry is missing or of
    another shape, unless the checkpoint holds every one the optimizer keeps, in its
    shape and dtype."""
    required: dict[str, torch.Tensor] = {}
    optional: dict[str, torch.Tensor] = {}
    for h in held:
        required.update((key, value.detach().clone()) for key, value in h.entries())
        if h.optimizer is None:
            continue
        for i, (name, param) in enumerate(zip(h.names, h.params, strict=True)):
            momentum = h.whole(i, torch.zeros_like(param))  # SGD's, made at its first step
            optional[f"optim.{name}.momentum"] = momentum
    saved = tensor_entries(Path(path))
    shapes = {key: (tuple(v.shape), v.dtype) for key, v in required.items()}
    where = where if where is not None else f"`--resume {path}`"
    try:
        _fit(where, saved, shapes, {k: (tuple(v.shape), v.dtype) for k, v in optional.items()})
    except CheckpointError as err:
        raise CheckpointError(f"{err}{hint}") from None
    return required | {k: v for k, v in optional.items() if k in saved and k not in required}


@torch.no_grad()
def read(held: list[Held], path: str, state: dict[str, torch.Tensor]) -> None:
    """Read `state` (`wanted`) from checkpoint `path` and set `held`'s parameters and
    optimizer states from it; a collective when there is a process group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process_quiet():
            dcp.load(state, storage_reader=reader(Path(path)), no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP's gathers every rank's
        raise CheckpointError(
            f"`{path}`: its tensors cannot be read: {first_failure(err)}"
        ) from None
    for h in held:
        for i, (name, param) in enumerate(zip(h.names, h.params, strict=True)):
            param.copy_(h.local(i, state[f"model.{name}"]))
            prefix = f"optim.{name}."
            fields = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            fields = {field: h.local(i, v) for field, v in fields.items()}
            if h.optimizer is not None:
                h.optimizer.load_state(i, fields)


def first_failure(err: BaseException) -> str:
    """The first failure inside DCP's CheckpointException (one per rank, each an
    (exception, traceback) pair), in one line; an unpickling error without torch's
    advice to load the file with `weights_only=False`."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) and first else first
    if isinstance(err, pickle.UnpicklingError):
        return "a shard does not hold tensors as torch.save writes them (UnpicklingError)"
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _fit(
    where: str, saved: dict[str, Entry], required: dict[str, Entry], optional: dict[str, Entry]
) -> None:
    """CheckpointError unless the checkpoint `where` names (`saved`: its tensor entries)
    holds every entry of `required`, and those of `optional` it holds, in their shape
    and dtype."""
    for key, want in [*required.items(), *optional.items()]:
        if key not in saved:
            if key in required:
                raise CheckpointError(_missing(where, key))
            continue
        if saved[key] != want:
            raise CheckpointError(
                f"{where}: `{key}` is {_text(saved[key])} there and {_text(want)} in this run"
            )


def _missing(where: str, key: str) -> str:
    if not key.startswith("optim."):
        return f"{where} has no tensor `{key}`"
    field = key.rsplit(".", 1)[1]
    return (
        f"{where} has no optimizer state `{key}`: this run's optimizer keeps "
        f"`{field}` for every parameter, and a checkpoint without it cannot resume it "
        "(a fresh optimizer state is not made up)"
    )


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group, which is
    what `--check`'s reference means, and that it writes over a checkpoint, which
    `may_overwrite` has allowed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        warnings.filterwarnings("ignore", "Detected an existing checkpoint", UserWarning)
        yield


def verify(config: RunConfig) -> None:
    """Raise CheckpointError unless `config.resume` fits the model and optimizer of this
    run (checked before any rank starts, on the meta device: nothing is allocated):
    every parameter, and every entry of optimizer state the run's optimizer keeps."""
    from pipelang.backends.rank_base import make_optimizer

    if config.resume is None:
        return
    path = Path(config.resume)
    info = read_info(path)
    if info.get("optimizer") != config.optimizer:
        raise CheckpointError(
            f"`--resume {path}` was saved with --optimizer {info.get('optimizer')}; this "
            f"run uses {config.optimizer}"
        )
    saved = tensor_entries(path)
    with torch.device("meta"):
        model = config.spec.build()
    trained: list[tuple[str, nn.Parameter]] = []
    for name, param in named_parameters(nn.Sequential(*model.layers)):
        key = f"model.{name}"
        if key not in saved:
            raise CheckpointError(
                f"`--resume {path}` has no `{name}`: it was saved from {info.get('model')}, "
                f"a different model from {config.model}"
            )
        want = (tuple(param.shape), torch.float32 if config.mixed_precision else param.dtype)
        if saved[key] != want:
            raise CheckpointError(
                f"`--resume {path}`: `{name}` is {_text(saved[key])} there and "
                f"{_text(want)} in {config.model} ({precision(config)})"
            )
        if param.requires_grad:
            master = torch.empty(want[0], dtype=want[1], device="meta")
            trained.append((name, nn.Parameter(master)))
    optimizer = make_optimizer([p for _, p in trained], config)
    required: dict[str, Entry] = {}
    optional: dict[str, Entry] = {}
    for i, (name, param) in enumerate(trained):
        for field, value in optimizer.state(i).items():
            required[f"optim.{name}.{field}"] = (tuple(value.shape), value.dtype)
        optional[f"optim.{name}.momentum"] = (tuple(param.shape), param.dtype)
    _fit(f"`--resume {path}`", saved, required, optional)


def lr_text(config: RunConfig) -> str:
    """The learning rate over the run, in words (`pipelang.json` keeps it)."""
    return lr_words(config.lr_schedule_at())


def lr_words(lr: LrSchedule) -> str:
    """A learning-rate schedule in words, as `pipelang.json` keeps it."""
    warmup = f", {lr.warmup} steps of warm-up" if lr.warmup else ""
    if lr.kind == "constant":
        return f"constant {lr.peak:g}{warmup}"
    return f"{lr.kind} from {lr.peak:g} to {lr.floor:g} at step {lr.steps}{warmup}"


def lr_note(config: RunConfig) -> str | None:
    """A note when `--resume`'s checkpoint was saved by a run with another learning-rate
    schedule (another --steps moves a decay's end): the rate then jumps; None if not."""
    if config.resume is None:
        return None
    saved = read_info(Path(config.resume)).get("lr_schedule")
    here = lr_text(config)
    if saved is None or saved == here:
        return None
    return clip(
        f"note: `--resume {config.resume}` was trained with the learning rate {saved}; "
        f"this run's is {here}, so the rate jumps at step {config.first_step + 1}"
    )


def precision(config: RunConfig) -> str:
    """The run's precision as its options say it (`pipelang.json` keeps it)."""
    if config.mixed_precision:
        return f"--mixed-precision {config.mixed_precision}: fp32 master weights"
    return f"--dtype {config.dtype}"


def _text(entry: tuple[tuple[int, ...], torch.dtype]) -> str:
    shape, dtype = entry
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"
