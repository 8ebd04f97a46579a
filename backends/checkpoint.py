"""Checkpoints: `run --save DIR [--save-every K]` and `run --resume DIR`.

A checkpoint is a `torch.distributed.checkpoint` (DCP) directory of its own,
`DIR/step-K` for the state after step K, plus `pipelang.json` (step, model, optimizer,
precision, schedule), written last: a directory without it is incomplete and is never resumed.

Every entry is named as in the whole model, never by rank or stage: `model.{layer}.{name}`
for a parameter (the layer counted over the whole model, as `--check` names it) and
`optim.{layer}.{name}.{field}` for its optimizer state (`exp_avg`, `exp_avg_sq` and
`step` for Adam, `momentum` for SGD). So the replicas of a stage (Chimera's two pipelines,
`--dp` copies) write one entry between them (DCP keeps one of equal keys), and a checkpoint
loads into any schedule, rank count or partition over the same model: each rank reads the
entries of the layers it holds.

DCP keeps its index, `.metadata`, as a pickle, and its own reader unpickles it whole:
a crafted file would run whatever it names. pipelang reads it with `_MetadataUnpickler`,
which builds only the classes DCP's metadata is made of and refuses anything else before
it is created; tensors are read with `torch.load(weights_only=True)` by DCP itself, and
only entries that the metadata calls tensors are ever asked for.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from pipelang.backends.config import RunConfig
    from pipelang.backends.optim import Optimizer

__all__ = [
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

INFO = "pipelang.json"
"""What pipelang adds to a DCP directory; written last, so it marks a complete one."""
STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(Exception):
    """A checkpoint that cannot be found, or does not fit this run."""


@dataclass(frozen=True, slots=True)
class Held:
    """Parameters held together with the optimizer that updates them: a stage copy, or
    the whole model of the `--check` reference. `params[i]` is named `names[i]` in the
    whole model and is the optimizer's parameter `i`."""

    names: list[str]
    params: list[nn.Parameter]
    optimizer: Optimizer

    def entries(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint key, tensor) of every parameter and optimizer state."""
        for i, (name, param) in enumerate(zip(self.names, self.params, strict=True)):
            yield f"model.{name}", param
            for field, value in self.optimizer.state(i).items():
                yield f"optim.{name}.{field}", value


def held_by_model(
    module: nn.Module,
    optimizer: Optimizer,
    first_layer: int = 0,
    masters: list[nn.Parameter] | None = None,
) -> Held:
    """The trainable parameters of `module` (an nn.Sequential of layers `first_layer`,
    ...) under their whole-model names, in the optimizer's order; with `masters`
    (`--mixed-precision`), those in their place."""
    names, params = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            local, _, rest = name.partition(".")
            names.append(f"{first_layer + int(local)}.{rest}")
            params.append(param)
    return Held(names, masters if masters is not None else params, optimizer)


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
    process writes `pipelang.json`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    assert config.save is not None
    path = step_dir(config.save, step)
    info = {"step": step, "model": config.model, "optimizer": config.optimizer}
    info |= {"precision": precision(config), "schedule": schedule}
    info["lr_schedule"] = lr_text(config)

    state = {key: value.detach() for h in held for key, value in h.entries()}
    distributed = dist.is_initialized()
    first = not distributed or dist.get_rank() == 0
    if first:  # before the collective save: an overwritten step is incomplete until done
        (path / INFO).unlink(missing_ok=True)
    with _one_process_quiet():
        dcp.save(state, checkpoint_id=path, no_dist=not distributed)
    if distributed:
        dist.barrier()
    if first:
        (path / INFO).write_text(json.dumps(info, indent=1) + "\n")
        if config.keep_last is not None:
            prune(config.save, config.keep_last)


def prune(root: str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints under `root` (run by the
    first process, right after a newer one is complete), and any cut-short `step-K`
    older than the newest complete one (it can never be resumed); what it deleted."""
    steps = sorted(
        (int(m.group(1)), d)
        for d in Path(root).iterdir()
        if (m := STEP_DIR.fullmatch(d.name)) and d.is_dir()
    )
    complete = [(step, d) for step, d in steps if (d / INFO).is_file()]
    if not complete:
        return []
    newest = complete[-1][0]
    kept = {d for _, d in complete[-keep:]}
    gone = [d for step, d in steps if d not in kept and step < newest]
    for directory in gone:
        (directory / INFO).unlink(missing_ok=True)  # incomplete first: never half-resumed
        shutil.rmtree(directory, ignore_errors=True)
    return gone


@torch.no_grad()
def load(held: Iterable[Held], path: str) -> None:
    """Load this process's entries from checkpoint `path` into its parameters and
    optimizer states, in place; a collective when there is a process group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    held = list(held)
    saved = _saved_keys(path)
    state = {
        key: value.detach().clone()
        for h in held
        for key, value in _wanted(h)
        if key in saved or key.startswith("model.")
    }
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise CheckpointError(f"`{path}` has no tensor `{missing[0]}`")
    with _one_process_quiet():
        dcp.load(state, storage_reader=_reader(path), no_dist=not dist.is_initialized())
    for h in held:
        for i, (name, param) in enumerate(zip(h.names, h.params, strict=True)):
            param.copy_(state[f"model.{name}"])
            prefix = f"optim.{name}."
            fields = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            h.optimizer.load_state(i, fields)


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group, which is
    what `--check`'s reference means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _wanted(held: Held) -> Iterator[tuple[str, torch.Tensor]]:
    """The entries a load fills: those `entries` gives, and SGD's momentum, which a
    fresh optimizer has not made yet."""
    yield from held.entries()
    for name, param in zip(held.names, held.params, strict=True):
        yield f"optim.{name}.momentum", torch.zeros_like(param)


def find(path: str) -> tuple[Path, int]:
    """The checkpoint `--resume path` names and its step: `path` itself when it is one,
    else the latest complete `step-K` under it."""
    root = Path(path)
    if (root / INFO).is_file():
        return root, int(_info(root)["step"])
    if not root.is_dir():
        raise CheckpointError(f"`--resume {path}`: no such directory")
    steps = sorted(
        (int(m.group(1)), d)
        for d in root.iterdir()
        if (m := STEP_DIR.fullmatch(d.name)) and (d / INFO).is_file()
    )
    if not steps:
        raise CheckpointError(
            f"`--resume {path}`: no checkpoint there (a `step-K` directory with {INFO}, "
            "as `--save` writes)"
        )
    step, found = steps[-1]
    return found, step


def _info(path: Path) -> dict[str, int | str]:
    try:
        info = json.loads((path / INFO).read_text())
        step = info["step"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"`{path / INFO}` is not a pipelang checkpoint: {err}") from None
    if not isinstance(step, int) or step < 1:
        raise CheckpointError(f"`{path / INFO}`: `step` must be a positive integer")
    return dict(info)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: `find_class` admits DCP's metadata
    dataclasses, `torch.Size`, torch's dtypes and layouts and paths (the classes
    `dcp.save` writes there), and refuses any other global before it is looked up, so no
    function named in the file is ever called."""

    _ALLOWED: ClassVar[dict[str, set[str]]] = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    }

    def find_class(self, module: str, name: str) -> object:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names `{module}.{name}`, which DCP metadata never holds")


def _read_metadata(path: str) -> Metadata:
    """DCP's metadata of checkpoint `path`, read by `_MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    try:
        data = (Path(path) / ".metadata").read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # a missing file, bad pickle, refused class, bad arguments
        raise CheckpointError(f"`{path}` is not a readable DCP checkpoint: {err}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"`{path}` is not a readable DCP checkpoint: no Metadata in it")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _reader(path: str) -> object:
    """DCP's file reader for checkpoint `path`, with its metadata read by
    `_read_metadata` (built here: DCP takes a second to import)."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
            metadata = _read_metadata(str(self.path))
            assert metadata.storage_meta is not None
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def _saved_keys(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor entry of checkpoint `path`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(path)
    return {
        key: (tuple(entry.size), entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def verify(config: RunConfig) -> None:
    """Raise CheckpointError unless `config.resume` fits the model and optimizer of this
    run (checked before any rank starts, on the meta device: nothing is allocated)."""
    if config.resume is None:
        return
    path = Path(config.resume)
    info = _info(path)
    if info.get("optimizer") != config.optimizer:
        raise CheckpointError(
            f"`--resume {path}` was saved with --optimizer {info.get('optimizer')}; this "
            f"run uses {config.optimizer}"
        )
    saved = _saved_keys(str(path))
    with torch.device("meta"):
        model = config.spec.build()
    for name, param in nn.Sequential(*model.layers).named_parameters():
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


def lr_text(config: RunConfig) -> str:
    """The learning rate over the run, in words (`pipelang.json` keeps it)."""
    lr = config.lr_schedule_at()
    warmup = f", {lr.warmup} steps of warm-up" if lr.warmup else ""
    if lr.kind == "constant":
        return f"constant {lr.peak:g}{warmup}"
    return f"{lr.kind} from {lr.peak:g} to {lr.floor:g} at step {lr.steps}{warmup}"


def lr_note(config: RunConfig) -> str | None:
    """A note when `--resume`'s checkpoint was saved by a run with another learning-rate
    schedule (another --steps moves a decay's end): the rate then jumps; None if not."""
    if config.resume is None:
        return None
    saved = _info(Path(config.resume)).get("lr_schedule")
    here = lr_text(config)
    if saved is None or saved == here:
        return None
    return (
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
