"""Hugging Face models, `--model hf:DIR`: a checkpoint directory as pipelang's layers.

The model is built with transformers' own classes (`AutoModelForCausalLM.from_config`,
SDPA attention, every dropout 0) on the meta device, which allocates nothing, and cut
into the layers `LayeredModel` holds:

    layer 0            the token embedding (GPT-2: plus its position embedding)
    layers 1 .. N      one decoder block each (`HFBlock`)
    layer N + 1        the final norm and the LM head

Only hidden states cross a stage boundary: what a block needs besides them (the causal
or sliding-window mask, the Llama family's rotary position embeddings) it computes from
their shape, as the family's model does once for all its blocks. Tied input and output
embeddings (GPT-2, small Llamas with `tie_word_embeddings`) are one parameter held by
the first and the last layer, a tie as a user model's (`LayeredModel.ties`).

A process materializes only the layers it holds (`HFLayers.materialize`). With weights
(backends/hf_config.py: `model.safetensors`, or shards and their index), each
parameter is read with `safetensors.safe_open` from the one file that holds it: only
the tensors of those layers, only the shards that hold them, every header and shape
checked before any tensor is read. Without weights, each layer is initialized with the
family's `_init_weights` rule drawing from a seed of its own
(`layer_init.layer_seed`), so that the replicas of a stage and `--check`'s reference
agree bit for bit; a tied weight takes its first layer's draw, which a process holding
only the head makes too.

No network access ever: `HF_HUB_OFFLINE=1` and `local_files_only=True`.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipelang.backends.hf_config import (
    DTYPES,
    Weights,
    find_weights,
    hf_directory,
    located,
    read_config,
    read_header,
)
from pipelang.backends.layer_init import layer_seed
from pipelang.backends.model_error import ModelError
from pipelang.backends.user_models import Tie, find_ties, said
from pipelang.diagnostics import InternalError, quote

if TYPE_CHECKING:
    from pipelang.backends.models import ModelSpec

DEFAULT_SEQ_LEN = 256
"""`--seq-len` when none is given (at most the model's positions)."""
DROPOUTS = ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout")


class HFEmbedding(nn.Module):
    """Token ids -> hidden states: the token embedding, plus GPT-2's learned positions."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding | None) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.tokens(ids)
        if self.positions is not None:
            where = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
            hidden = hidden + self.positions(where)
        return hidden


class HFBlock(nn.Module):
    """One decoder block of the family, called as its model calls it: with the mask of
    its kind (causal, or sliding-window) and, in the Llama family, the rotary position
    embeddings, both made here from the hidden states' shape."""

    def __init__(
        self, block: nn.Module, config: Any, rotary: nn.Module | None, mask: Callable[..., Any]
    ) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config
        self.mask = mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # config, inputs, no padding mask, no cache (positionally: transformers renames
        # it); positions 0 .. seq - 1, no packed sequences to look for
        mask = self.mask(self.config, hidden, None, None, position_ids=None)
        if self.rotary is None:
            out: torch.Tensor = self.block(hidden, attention_mask=mask)
            return out
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        out = self.block(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(hidden, positions),
        )
        return out


class HFHead(nn.Module):
    """The final norm and the LM head: hidden states -> logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter of a layer: the module and attribute that hold it, its unique
    number in the model (a tied parameter has one for all its holders), and its names in
    the checkpoint (a tied one has several)."""

    module: nn.Module
    attr: str
    key: int
    names: tuple[str, ...]


@dataclass(slots=True)
class HFLayers:
    """A Hugging Face checkpoint's layers, what a LayeredModel holds of them, and what
    materializes them: its weights, or the family's init rule (see the module
    docstring)."""

    spec: ModelSpec
    layers: list[nn.Module]
    vocab: int
    seq_len: int
    ties: tuple[Tie, ...] = ()
    hf: Any = None
    """The transformers model on the meta device (its `_init_weights` rule)."""
    weights: Weights | None = None
    slots: list[list[Slot]] = field(default_factory=list)
    """Per layer, its parameters."""
    holders: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    """Per parameter key, every (module, attribute) that holds it."""
    owner: dict[int, int] = field(default_factory=dict)
    """Per parameter key, the first layer that holds it."""
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The headers read so far, by file name."""

    def materialize(self, indices: Iterable[int]) -> None:
        """Give the layers `indices` still on the meta device their weights, on the
        default device in the run's dtype (under a meta default device: only check the
        files they would be read from)."""
        wanted = sorted(set(indices))
        for i in wanted:
            if not 0 <= i < len(self.layers):
                raise InternalError(f"layer {i} asked for; the model has {len(self.layers)}")
        device = torch.get_default_device()
        if self.weights is not None:
            reads = self._reads(wanted)
            if device.type != "meta":
                self._load(reads, device)
        elif device.type != "meta":  # a tied weight is drawn by its first layer's rule
            owners = {self.owner[s.key] for i in wanted for s in self.slots[i]}
            for i in sorted(owners | set(wanted)):
                self._initialize(i, device)
        if device.type != "meta":
            for i in wanted:
                self._buffers(self.layers[i], device)

    def _reads(self, wanted: list[int]) -> dict[str, list[tuple[Slot, str]]]:
        """Per file, the (slot, tensor name) to read for the layers `wanted`, every
        file's header and every tensor's dtype and shape checked first."""
        assert self.weights is not None
        reads: dict[str, list[tuple[Slot, str]]] = {}
        seen: set[int] = set()
        for i in wanted:
            for slot in self.slots[i]:
                if slot.key in seen or not getattr(slot.module, slot.attr).is_meta:
                    continue
                seen.add(slot.key)
                name = next(n for n in slot.names if n in self.weights.files)
                reads.setdefault(self.weights.files[name], []).append((slot, name))
        for file, items in sorted(reads.items()):
            if file not in self.headers:
                self.headers[file] = read_header(self.weights.directory / file)
            header = self.headers[file]
            for slot, name in items:
                _check_tensor(self.weights.directory / file, header, name, slot)
        return reads

    def _load(self, reads: dict[str, list[tuple[Slot, str]]], device: torch.device) -> None:
        """Read the tensors `reads` names, one file open at a time, into their slots."""
        import safetensors

        assert self.weights is not None
        dtype = self.spec.torch_dtype
        for file, items in sorted(reads.items()):
            path = self.weights.directory / file
            try:
                with safetensors.safe_open(str(path), framework="pt", device="cpu") as opened:
                    values = [(slot, opened.get_tensor(name)) for slot, name in items]
            except Exception as err:  # safetensors' own error: the file changed, or lies
                raise ModelError(f"{located(path)}: cannot read it: {said(err)}") from None
            for slot, value in values:
                self._set(slot, value.to(dtype).to(device))

    def _initialize(self, i: int, device: torch.device) -> None:
        """Layer `i`'s parameters still on meta, by the family's `_init_weights` from
        layer i's seed, on the CPU in fp32, then cast and moved; parameters another
        layer materialized already (a tie) are left as they are."""
        layer, fresh = self.layers[i], []
        for slot in self.slots[i]:
            param = getattr(slot.module, slot.attr)
            if param.is_meta and slot.key not in fresh:
                self._set(slot, torch.empty(param.shape, dtype=torch.float32))
                fresh.append(slot.key)
        flagged = list(layer.parameters())
        for param in flagged:  # transformers' init skips what is marked initialized
            param._is_hf_initialized = not any(  # type: ignore[attr-defined]
                param is self._param(key) for key in fresh
            )
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(layer_seed(self.spec.seed, i))
                for module in _post_order(layer):  # children first, as transformers does
                    self.hf._init_weights(module)
        finally:
            for param in flagged:
                del param._is_hf_initialized  # type: ignore[attr-defined]
        dtype = self.spec.torch_dtype
        for slot in self.slots[i]:
            if slot.key in fresh:  # once each, though several slots may hold it
                fresh.remove(slot.key)
                self._set(slot, getattr(slot.module, slot.attr).detach().to(dtype).to(device))

    def _param(self, key: int) -> nn.Parameter:
        module, attr = self.holders[key][0]
        param: nn.Parameter = getattr(module, attr)
        return param

    def _set(self, slot: Slot, value: torch.Tensor) -> None:
        """Put `value` as the parameter `slot.key` into every module that holds it."""
        old = self._param(slot.key)
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        for module, attr in self.holders[slot.key]:
            module._parameters[attr] = new

    def _buffers(self, layer: nn.Module, device: torch.device) -> None:
        """The layer's buffers still on meta (the rotary frequencies), computed by the
        family's init rule in fp32 and moved to `device`."""
        for module in layer.modules():
            meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta:
                continue
            for name in meta:
                shape = module._buffers[name].shape  # type: ignore[union-attr]
                module._buffers[name] = torch.full(shape, math.nan)
            self.hf._init_weights(module)
            for name in meta:
                buffer = module._buffers[name]
                assert buffer is not None
                if buffer.isnan().any():
                    raise InternalError(f"buffer `{name}` of {type(module).__name__}: no init")
                module._buffers[name] = buffer.to(device)


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _check_tensor(path: Path, header: dict[str, Any], name: str, slot: Slot) -> None:
    """Raise ModelError unless the header lists `name` as a float tensor of the shape
    the config gives its parameter."""
    info = header.get(name)
    if info is None:
        raise ModelError(f"{located(path)} holds no tensor {quote(name)}, though the index says so")
    expected = tuple(getattr(slot.module, slot.attr).shape)
    if info.dtype not in DTYPES:
        raise ModelError(f"{located(path)}: {name} is {info.dtype}, not floating point")
    if info.shape != expected:
        raise ModelError(
            f"{located(path)}: {name} has shape {list(info.shape)} but config.json gives "
            f"{list(expected)}"
        )


@contextlib.contextmanager
def _quiet() -> Iterator[Any]:
    """transformers, offline and without its warnings, for the time of a build."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import transformers
    except ImportError as err:
        raise ModelError(
            f"--model hf:DIR cannot import transformers ({err}): pip install pipelang[hf]"
        ) from None
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield transformers
    finally:
        logging.set_verbosity(verbosity)


def hf_model(spec: ModelSpec) -> HFLayers:
    """The model of `spec.name` (`hf:DIR`) on the meta device, cut into layers."""
    directory = hf_directory(spec.name)
    read_config(directory)  # checked before transformers reads it
    weights = find_weights(directory)
    headers = {}
    if weights is not None and torch.get_default_device().type == "meta":
        # planning the run (`plan_stages`): every header checked before the long import;
        # a rank builds on its own device and reads only its own files' headers
        for file in sorted(set(weights.files.values())):
            headers[file] = read_header(directory / file)
    with _quiet() as transformers, torch.device("meta"):
        try:
            config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
            for name in DROPOUTS:
                if hasattr(config, name):
                    setattr(config, name, 0.0)
            hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except Exception as err:
            raise ModelError(
                f"{located(directory / 'config.json')}: transformers cannot build it: {said(err)}"
            ) from None
        layers = _cut(hf)
    positions = getattr(hf.config, "max_position_embeddings", None) or hf.config.n_positions
    seq_len = spec.seq_len or min(positions, DEFAULT_SEQ_LEN)
    if seq_len > positions:
        raise ModelError(
            f"--seq-len {seq_len} is longer than the {positions} positions of --model "
            f"{quote(spec.name)} (config.json's max_position_embeddings)"
        )
    model = HFLayers(spec, layers, hf.config.vocab_size, seq_len, hf=hf, weights=weights)
    model.headers = headers
    model.ties = find_ties(layers)
    _index(model, hf)
    return model


def _cut(hf: Any) -> list[nn.Module]:
    """The family's model as layers: embedding, one per decoder block, norm and head."""
    config = hf.config
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    if config.model_type == "gpt2":
        body = hf.transformer
        first: nn.Module = HFEmbedding(body.wte, body.wpe)
        blocks = [HFBlock(b, config, None, create_causal_mask) for b in body.h]
        return [first, *blocks, HFHead(body.ln_f, hf.lm_head)]
    body = hf.model
    types = getattr(config, "layer_types", None)
    blocks = []
    for i, block in enumerate(body.layers):
        if types:
            sliding = types[i] == "sliding_attention"
        else:
            sliding = getattr(config, "sliding_window", None) is not None
        mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        blocks.append(HFBlock(block, config, type(body.rotary_emb)(config=config), mask))
    return [HFEmbedding(body.embed_tokens, None), *blocks, HFHead(body.norm, hf.lm_head)]


def _index(model: HFLayers, hf: Any) -> None:
    """Fill `model.slots` and `holders`; with weights, check that each parameter has a
    tensor in them."""
    names: dict[int, list[str]] = {}
    for name, param in hf.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    keys: dict[int, int] = {}
    for layer in model.layers:
        slots = []
        for module in layer.modules():
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                key = keys.setdefault(id(param), len(keys))
                model.owner.setdefault(key, len(model.slots))
                holders = model.holders.setdefault(key, [])
                if (module, attr) not in holders:
                    holders.append((module, attr))
                slots.append(Slot(module, attr, key, tuple(names.get(id(param), ()))))
        model.slots.append(slots)
    if model.weights is None:
        return
    for slots in model.slots:
        for slot in slots:
            if not any(n in model.weights.files for n in slot.names):
                raise ModelError(
                    f"the weights in {quote(model.weights.directory)} hold no tensor "
                    f"{quote(slot.names[0] if slot.names else slot.attr)}"
                )
