"""Reading a Hugging Face checkpoint directory, `--model hf:DIR`, without torch.

What is read, and the limits each file is read under (every problem is one
`ModelError` naming the file, before anything is built or loaded):

- `DIR` itself: an existing directory. pipelang never downloads: a hub name
  (`meta-llama/Llama-3.2-1B`) or any other path is refused, saying to download it first.
- `DIR/config.json`: at most `CONFIG_BYTES`, strict JSON (`readers.read_json`), an
  object whose `model_type` is one of `FAMILIES`, and whose sizes (layers, width, heads,
  vocabulary, positions) are whole numbers within `SIZES`' bounds, so that building
  the model on the meta device takes milliseconds.
- The weights, optional: `DIR/model.safetensors`, or shards named by
  `DIR/model.safetensors.index.json` (at most `INDEX_BYTES`; its `weight_map` maps each
  tensor's name to a shard, a plain file name in `DIR` that must exist). Without either,
  the model is initialized (backends/hf_models.py). `pytorch_model.bin` (a pickle) is
  never read.
- A safetensors header (`read_header`): 8 bytes of its length (at most `HEADER_BYTES`
  and inside the file), then a JSON object of tensors, each a known dtype, a shape of
  whole numbers, and `data_offsets` that span exactly its bytes, inside the file's data,
  overlapping no other. Only then does `safetensors.safe_open` read a tensor, so a
  header that lies about sizes or offsets is refused before anything is loaded.

`hf_directory` is the check of `--model hf:DIR` itself, the extra installed included,
and is what the CLI's `--model` reader runs (a usage error), so it imports no torch.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelang.backends.model_error import ModelError
from pipelang.diagnostics import quote
from pipelang.readers import ReadError, read_json, read_text

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
"""The `model_type`s `--model hf:DIR` builds: the Llama family and GPT-2."""
EXTRA = "pip install pipelang[hf]"
CONFIG_BYTES = 2**20
INDEX_BYTES = 64 * 2**20
HEADER_BYTES = 100 * 2**20
"""The largest safetensors header read (safetensors' own limit)."""
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

SIZES: dict[str, int] = {
    "num_hidden_layers": 1024,
    "n_layer": 1024,
    "hidden_size": 2**17,
    "n_embd": 2**17,
    "intermediate_size": 2**20,
    "n_inner": 2**20,
    "num_attention_heads": 2**12,
    "n_head": 2**12,
    "num_key_value_heads": 2**12,
    "head_dim": 2**14,
    "vocab_size": 2**22,
    "max_position_embeddings": 2**22,
    "n_positions": 2**22,
}
"""The largest value of each size a config.json may give (when it gives one): past
any released model of these families, small enough that the meta build stays fast."""

DTYPES: dict[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""The safetensors dtypes a weight may have, and their bytes: floating point only."""
OTHER_DTYPES: dict[str, int] = {
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Dtypes a header may list (for tensors not loaded); a weight in one is refused."""


def located(path: Path) -> str:
    """A file of the checkpoint in a message: its name whole, then its directory (which
    a long message may cut in the middle)."""
    return f"{quote(path.name)} in {quote(path.parent)}"


def hf_directory(name: str) -> Path:
    """The directory of `--model hf:DIR` (`name`), after checking that the extra is
    installed and that DIR is an existing directory holding a config.json."""
    shown, path = quote(name), name.removeprefix("hf:")
    if any(importlib.util.find_spec(m) is None for m in ("transformers", "safetensors")):
        raise ModelError(
            f"{shown} needs the Hugging Face extra (transformers, safetensors, tokenizers): {EXTRA}"
        )
    directory = Path(path)
    try:
        found = bool(path) and "\0" not in path and directory.is_dir()
    except OSError:  # a name too long for the file system
        found = False
    if not found:
        raise ModelError(
            f"{shown}: no directory {quote(path)}; pipelang never downloads a model: "
            "download it first (e.g. `hf download NAME --local-dir DIR`) and give hf:DIR"
        )
    if not (directory / "config.json").is_file():
        raise ModelError(f"{shown}: the directory holds no config.json")
    return directory


def read_config(directory: Path) -> dict[str, Any]:
    """DIR/config.json as a dict (see the module docstring for what is checked)."""
    path = directory / "config.json"
    where = located(path)
    config = _read_json(path, CONFIG_BYTES)
    if not isinstance(config, dict):
        raise ModelError(f"{where}: expected a JSON object, found {type(config).__name__}")
    family = config.get("model_type")
    if family not in FAMILIES:
        given = quote(family if isinstance(family, str) else json.dumps(family))
        raise ModelError(
            f"{where}: model_type {given} is not supported; --model hf:DIR builds "
            f"{', '.join(FAMILIES)}"
        )
    for key, most in SIZES.items():
        value = config.get(key)
        if value is None and key in ("n_inner", "head_dim", "num_key_value_heads"):
            continue  # optional: the family's default
        if key in config and not (type(value) is int and 1 <= value <= most):
            raise ModelError(f"{where}: {key} must be a whole number from 1 to {most:,}")
    if config.get("add_cross_attention"):
        raise ModelError(f"{where}: add_cross_attention: a causal LM has no encoder to attend to")
    return config


def _read_json(path: Path, limit: int) -> object:
    """A JSON file of at most `limit` bytes; a ModelError naming it (and the line and
    column where it is not JSON)."""
    text = ""
    try:
        text = read_text(path, limit)
        return read_json(text)
    except ReadError as err:
        where = ""
        if err.offset is not None and text:
            line = text.count("\n", 0, err.offset) + 1
            where = f" (line {line}, column {err.offset - text.rfind(chr(10), 0, err.offset)})"
        raise ModelError(f"{located(path)}: {err}{where}") from None


@dataclass(frozen=True, slots=True)
class Weights:
    """Where a checkpoint's tensors are: each tensor's name to its file in `directory`."""

    directory: Path
    files: dict[str, str]
    """Tensor name -> file name (`model.safetensors`, or a shard)."""


def find_weights(directory: Path) -> Weights | None:
    """The checkpoint's safetensors (see the module docstring); None without any."""
    index, single = directory / INDEX, directory / WEIGHTS
    if index.is_file():
        return Weights(directory, _read_index(index))
    if single.is_file():
        return Weights(directory, dict.fromkeys(read_header(single), WEIGHTS))
    shards = sorted(p.name for p in directory.glob("model-*-of-*.safetensors"))
    if shards:
        raise ModelError(f"{quote(directory)} holds {quote(shards[0])} ... but no {INDEX}")
    if (directory / "pytorch_model.bin").exists():
        raise ModelError(
            f"{quote(directory)} holds pytorch_model.bin, a pickle, which pipelang does "
            "not load: save the model as safetensors (save_pretrained does by default)"
        )
    return None


def _read_index(path: Path) -> dict[str, str]:
    where = located(path)
    index = _read_json(path, INDEX_BYTES)
    files = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise ModelError(f"{where}: expected an object with a `weight_map` of names to files")
    for shard in sorted(set(files.values())):
        if Path(shard).name != shard or shard in (".", "..") or not shard:
            raise ModelError(f"{where}: shard {quote(shard)} is not a file name in the directory")
        if not (path.parent / shard).is_file():
            raise ModelError(f"{where} names shard {quote(shard)}, which is missing")
    return files


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file's header lists, checked against the file (see the
    module docstring); a ModelError naming the file and the first lie."""
    where = located(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= length <= min(HEADER_BYTES, size - 8):
                raise ModelError(
                    f"{where}: not a safetensors file (its header length "
                    f"{'is missing' if length < 0 else f'{length:,} bytes'} does not fit its "
                    f"{size:,} bytes)"
                )
            text = file.read(length).decode("utf-8")
    except OSError as err:
        raise ModelError(f"{where}: cannot read it: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ModelError(f"{where}: its header is not UTF-8") from None
    try:
        header = read_json(text)
    except ReadError as err:
        raise ModelError(f"{where}: its header {str(err).removeprefix('it ')}") from None
    if not isinstance(header, dict):
        raise ModelError(f"{where}: its header is not a JSON object")
    return _tensors(where, header, size - 8 - length)


def _tensors(where: str, header: dict[str, Any], data: int) -> dict[str, TensorInfo]:
    """The header's tensors, each checked to span its bytes inside the `data` bytes."""
    found: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        what = f"{where}: tensor {quote(name)}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ModelError(f"{what} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        width = DTYPES.get(dtype) or OTHER_DTYPES.get(dtype) if isinstance(dtype, str) else None
        if width is None:
            raise ModelError(f"{what} has an unknown dtype {quote(dtype)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ModelError(f"{what} has a shape that is not a list of whole numbers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
        ):
            raise ModelError(f"{what} has data_offsets that are not two whole numbers")
        begin, end = offsets
        need = math.prod(shape) * width
        if not 0 <= begin <= end <= data or end - begin != need:
            raise ModelError(
                f"{what} claims bytes {begin:,} to {end:,} for a {dtype} {shape} of "
                f"{need:,} bytes, in {data:,} bytes of data: the header lies"
            )
        spans.append((begin, end, name))
        found[name] = TensorInfo(dtype, tuple(shape))
    spans.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise ModelError(
                f"{where}: tensors {quote(first)} and {quote(second)} overlap: the header lies"
            )
    return found
