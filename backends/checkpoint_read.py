"""Reading a checkpoint's files without trusting them (`checkpoint.py` writes them).

Every file is read through `read_inside`: it must be a regular file that is inside the
checkpoint directory once every link is followed (a link out of it, to `/dev/zero` or to
another checkpoint, is refused), and no larger than what pipelang ever writes there,
checked before a byte is read. Every structure is checked for its shape before use:
`pipelang.json` must be one JSON object with a positive integer `step` and strings where
pipelang writes strings (`read_info`), and DCP's `.metadata` must be a `Metadata` whose
entries are tensors of known dtypes and non-negative sizes, cut into chunks that tile
each tensor, each chunk stored at a byte range of a shard file in the directory
(`read_metadata`); so a truncated or missing shard is named before any rank starts.

DCP keeps its index, `.metadata`, as a pickle, and its own reader unpickles it whole: a
crafted file would run whatever it names. pipelang reads it with `_MetadataUnpickler`,
which builds only the classes DCP's metadata is made of and refuses anything else before
it is created; tensors are read with `torch.load(weights_only=True)` by DCP itself, only
entries that the metadata calls tensors are ever asked for, and only from byte ranges
checked here. Every error is a `CheckpointError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pipelang.diagnostics import clip

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

INFO = "pipelang.json"
"""What pipelang adds to a DCP directory; written last, so it marks a complete one."""
MAX_INFO = 1 << 20
"""The most bytes of a `pipelang.json` (pipelang writes a few hundred)."""
MAX_METADATA = 4 << 20
"""The most bytes of a `.metadata`: DCP writes about 230 bytes per entry, so 18,000
entries (4,500 parameters with Adam's three). Also what bounds the memory a crafted
pickle can take: an opcode byte can make a 64-byte object, 4 MiB of them 300 MB, 1 s."""
MAX_CHUNKS = 256
"""The most chunks one tensor is stored in (pipelang writes one)."""
Shape = tuple[int, ...]
SHORT = 400
"""A message longer than this has its long quoted pieces (a path, a name) cut in the
middle (`diagnostics.clip`); a shorter one keeps its paths whole."""


class CheckpointError(Exception):
    """A checkpoint that cannot be found, cannot be read, or does not fit this run.
    `status` is the exit status it means: 2 for a command line that names no
    checkpoint (docs/language.md's table), 1 for a checkpoint that is wrong."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(clip(message) if len(message) > SHORT else message)
        self.status = status


def read_inside(directory: Path, name: str, limit: int) -> bytes:
    """The bytes of file `name` of checkpoint `directory`: a regular file inside it once
    every link is followed, of at most `limit` bytes (checked before reading)."""
    where = directory / name
    fd, size = _open_inside(directory, name)
    try:
        if size > limit:
            raise CheckpointError(
                f"`{where}` is {size:,} bytes, more than such a file ever is ({limit:,})"
            )
        with os.fdopen(fd, "rb") as file:
            fd = -1
            data = file.read(limit + 1)
    except OSError as err:
        raise CheckpointError(f"`{where}` cannot be read: {_reason(err)}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"`{where}` grew past {limit:,} bytes while it was read")
    return data


def file_size(directory: Path, name: str) -> int:
    """The size of file `name` of checkpoint `directory`, with `read_inside`'s checks."""
    fd, size = _open_inside(directory, name)
    os.close(fd)
    return size


def _open_inside(directory: Path, name: str) -> tuple[int, int]:
    """An open descriptor of file `name` of checkpoint `directory` and its size: a
    regular file inside the directory once every link is followed (a FIFO or a device is
    never opened: its type is checked first, and it is opened without blocking)."""
    where = directory / name
    try:
        root = directory.resolve(strict=True)
        real = where.resolve(strict=True)
    except FileNotFoundError:
        raise CheckpointError(f"`{where}` is missing") from None
    except (OSError, RuntimeError) as err:  # a loop of links, a name too long
        raise CheckpointError(f"`{where}` cannot be read: {_reason(err)}") from None
    if real == root or not real.is_relative_to(root):
        raise CheckpointError(f"`{where}` is a link out of its checkpoint directory")
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise CheckpointError(f"`{where}` is not a regular file")
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as err:
        raise CheckpointError(f"`{where}` cannot be read: {_reason(err)}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # replaced since
        os.close(fd)
        raise CheckpointError(f"`{where}` is not a regular file")
    return fd, info.st_size


def _reason(err: BaseException) -> str:
    """What went wrong, in one line."""
    text = getattr(err, "strerror", None) or str(err).strip() or type(err).__name__
    return text.splitlines()[0]


STEP_DIR = re.compile(r"step-(\d{1,18})")
"""The name of a checkpoint under `--save DIR`: `step-K`."""
STRINGS = ("model", "optimizer", "precision", "schedule", "lr_schedule", "run")
"""The fields of `pipelang.json` that pipelang writes as strings (each may be absent:
older checkpoints lack some)."""
MAX_LINEAGE = 100_000


@dataclass(frozen=True, slots=True)
class Info:
    """A checkpoint's `pipelang.json`, checked: its step, its string fields, and the runs
    it descends from, `(run, last step of that run on its way)`, oldest first."""

    step: int
    strings: dict[str, str]
    lineage: tuple[tuple[str, int], ...] = ()

    def get(self, key: str) -> str | None:
        return self.strings.get(key)


def read_info(directory: Path) -> Info:
    """The `pipelang.json` of checkpoint `directory`, its shape checked."""
    where = directory / INFO
    data = read_inside(directory, INFO, MAX_INFO)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"`{where}` is not a pipelang checkpoint: {what}")

    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("it is not UTF-8 text") from None
    except RecursionError:
        raise bad("it nests deeper than JSON is read (pipelang writes one flat object)") from None
    except ValueError as err:
        raise bad(f"it is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise bad(f"it holds {_kind(doc)} where pipelang writes an object")
    step = doc.get("step")
    if type(step) is not int or step < 1:
        raise bad(f"`step` is {_kind(step)}, not a positive integer")
    named = STEP_DIR.fullmatch(directory.name)
    if named and int(named[1]) != step:
        raise bad(f"`step` is {step} but the directory is `{directory.name}`")
    strings = {}
    for key in STRINGS:
        if key in doc:
            if not isinstance(doc[key], str):
                raise bad(f"`{key}` is {_kind(doc[key])}, not a string")
            strings[key] = doc[key]
    return Info(step, strings, _lineage(doc.get("lineage", []), bad))


def _lineage(value: object, bad: Any) -> tuple[tuple[str, int], ...]:
    shape = "a list of [run, step] pairs"
    if not isinstance(value, list) or len(value) > MAX_LINEAGE:
        raise bad(f"`lineage` is {_kind(value)}, not {shape}")
    pairs = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
        if not ok or type(item[1]) is not int or item[1] < 0:
            raise bad(f"`lineage` holds {_kind(item)}, not a [run, step] pair")
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def _kind(value: object) -> str:
    """What a JSON value is, in words, without echoing it (it may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return str(value) if abs(value) < 10**18 else "an integer too large"
    if isinstance(value, float):
        return f"{value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def is_complete(directory: Path) -> bool:
    """Whether `directory` has its `pipelang.json` (any entry by that name: whether it
    is a good one is `read_info`'s to say)."""
    return os.path.lexists(directory / INFO)


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
        raise pickle.UnpicklingError(
            clip(f"it names `{module}.{name}`, which DCP metadata never holds")
        )


def read_metadata(directory: Path) -> Metadata:
    """DCP's metadata of checkpoint `directory`, read by `_MetadataUnpickler` and checked:
    every tensor entry's properties, size and chunks, and every chunk's byte range in a
    shard file of the directory (`check_storage`). Its planner data is dropped (pipelang
    loads flat names, which need none)."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    where = directory / ".metadata"
    data = read_inside(directory, ".metadata", MAX_METADATA)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # a bad pickle, a refused class, bad arguments to one
        raise CheckpointError(
            f"`{where}` is not a readable DCP checkpoint: {_reason(err)}"
        ) from None
    if type(metadata) is not Metadata:
        raise CheckpointError(
            f"`{where}` is not a readable DCP checkpoint: it holds {type(metadata).__name__}, "
            "not DCP's Metadata"
        )
    chunks = _check_entries(where, metadata)
    check_storage(directory, getattr(metadata, "storage_data", None), chunks)
    metadata.planner_data = None
    if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta):
        metadata.storage_meta = StorageMeta()
    return metadata


def _check_entries(where: Path, metadata: Metadata) -> dict[tuple[str, Shape], int]:
    """Check every entry of `metadata`; the bytes each tensor chunk holds at least, by
    (entry, offsets)."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise CheckpointError(f"`{where}`: its entries are {_pytype(entries)}, not a dict")
    chunks: dict[tuple[str, Shape], int] = {}
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise CheckpointError(f"`{where}`: an entry is named by {_pytype(key)}")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise CheckpointError(f"`{where}`: entry `{key}` is {_pytype(entry)}")
        properties = getattr(entry, "properties", None)
        dtype = getattr(properties, "dtype", None)
        if type(properties) is not TensorProperties or not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"`{where}`: entry `{key}` has no tensor dtype")
        size = _shape(getattr(entry, "size", None))
        if size is None:
            raise CheckpointError(f"`{where}`: entry `{key}`'s size is not a tensor shape")
        itemsize = dtype.itemsize
        for offsets, sizes in _chunks(where, key, size, getattr(entry, "chunks", None)):
            chunks[(key, offsets)] = math.prod(sizes) * itemsize
    return chunks


def _chunks(where: Path, key: str, size: Shape, chunks: object) -> list[tuple[Shape, Shape]]:
    """The (offsets, sizes) of tensor entry `key`'s chunks, which must tile it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    if not isinstance(chunks, list) or not 1 <= len(chunks) <= MAX_CHUNKS:
        raise CheckpointError(
            f"`{where}`: entry `{key}`'s chunks are not a list of 1 to {MAX_CHUNKS}"
        )
    found = []
    for chunk in chunks:
        offsets = _shape(getattr(chunk, "offsets", None))
        sizes = _shape(getattr(chunk, "sizes", None))
        if (
            type(chunk) is not ChunkStorageMetadata
            or offsets is None
            or sizes is None
            or not len(offsets) == len(sizes) == len(size)
        ):
            raise CheckpointError(f"`{where}`: entry `{key}` has a chunk of another shape")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise CheckpointError(f"`{where}`: entry `{key}` has a chunk outside its size")
        found.append((offsets, sizes))
    overlap = any(
        all(a < c + t and c < a + s for a, s, c, t in zip(*one, *two, strict=True))
        for i, one in enumerate(found)
        for two in found[i + 1 :]
    )
    if overlap or sum(math.prod(s) for _, s in found) != math.prod(size):
        raise CheckpointError(f"`{where}`: entry `{key}`'s chunks do not cover it once")
    return found


def check_storage(directory: Path, storage: object, chunks: dict[tuple[str, Shape], int]) -> None:
    """Every chunk of `chunks` is stored at a byte range of a shard file of `directory`
    that the file holds (a truncated shard is named here, not when a rank reads it)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    where = directory / ".metadata"
    if not isinstance(storage, dict):
        raise CheckpointError(f"`{where}`: its storage index is {_pytype(storage)}")
    sizes: dict[str, int] = {}
    for (key, offsets), least in chunks.items():
        info = storage.get(MetadataIndex(key, offsets))
        if type(info) is not _StorageInfo:
            raise CheckpointError(f"`{where}`: entry `{key}` is not stored in any file")
        name = getattr(info, "relative_path", None)
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or name in ("", ".", "..") or set(name) & set("/\\\0"):
            raise CheckpointError(f"`{where}`: entry `{key}` is stored outside the directory")
        if type(start) is not int or type(length) is not int or min(start, length) < 0:
            raise CheckpointError(f"`{where}`: entry `{key}` has a bad byte range")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"`{where}`: entry `{key}` is stored transformed")
        if name not in sizes:
            sizes[name] = file_size(directory, name)
        if length < least:
            raise CheckpointError(
                f"`{where}`: entry `{key}` is stored in {length:,} bytes, fewer than its "
                f"shape and dtype take ({least:,})"
            )
        if start + length > sizes[name]:
            raise CheckpointError(
                f"`{directory / name}` is cut short: it has {sizes[name]:,} bytes and "
                f"`.metadata` stores `{key}` at bytes {start:,} to {start + length:,}"
            )


def _shape(value: object) -> Shape | None:
    """`value` as a tensor shape (non-negative integers), or None."""
    if not isinstance(value, tuple | list) or len(value) > 64:
        return None
    if not all(type(n) is int and 0 <= n < 1 << 62 for n in value):
        return None
    return tuple(value)


def _pytype(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def tensor_entries(directory: Path) -> dict[str, tuple[Shape, torch.dtype]]:
    """Shape and dtype of every tensor entry of checkpoint `directory`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: (tuple(entry.size), entry.properties.dtype)
        for key, entry in read_metadata(directory).state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def reader(directory: Path) -> object:
    """DCP's file reader for checkpoint `directory`, with its metadata read by
    `read_metadata` (built here: DCP takes a second to import)."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
            metadata = read_metadata(Path(self.path))
            assert metadata.storage_meta is not None
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(directory))
