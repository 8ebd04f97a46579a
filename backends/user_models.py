"""A model of the user's own, `--model package.module:FUNC` or `--model path/file.py:FUNC`.

FUNC (called with `seq_len=` when it takes one and `--seq-len` is given) returns one of:

- an `nn.Sequential`: its layers, which pipelang splits into stages (`--partition`);
- a list of modules, one per stage, as many as the schedule has stages;
- any other `nn.Module` whose forward calls `torch.distributed.pipelining.pipe_split()`:
  torch's own `pipeline()` traces it on a batch of token ids and splits it there;
- a dict with the model under `"model"` (any of the above) and, optionally,
  `"split_spec"` (torch's `{"layers.4": SplitPoint.BEGINNING, ...}`, for a module without
  `pipe_split()` calls), `"loss"` (`loss(output, targets) -> scalar`, instead of
  next-token cross-entropy on logits), `"vocab_size"`, `"seq_len"` and `"unpack"`.

A stage may hand the next several tensors (a tuple, a list, a dict). Between the layers
of an `nn.Sequential` and between the modules of a list it is passed on whole, `x =
stage(x)`, as plain PyTorch does; with `"unpack": True` a tuple becomes the next stage's
positional arguments and a dict its keyword arguments. Modules split by torch's
`pipeline()` take their values unpacked, as torch calls them. Such a value crosses a stage
boundary packed into one flat tensor (`Boundary`), so the transport, the stream
program's slots and `--check` see one tensor per boundary as they do for the built-in
models. The boundaries are found by running the model once on the meta device (nothing
is computed or allocated).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipelang.backends.layer_init import on_meta
from pipelang.backends.model_error import ModelError
from pipelang.backends.model_import import trust, vet
from pipelang.diagnostics import clip

if TYPE_CHECKING:
    from pipelang.backends.models import ModelSpec

__all__ = ["Boundary", "PackedStage", "Tie", "UserModel", "find_ties", "said", "user_model"]

Loss = Callable[[Any, torch.Tensor], torch.Tensor]
KEYS = {"model", "split_spec", "loss", "vocab_size", "seq_len", "unpack"}


@dataclass(frozen=True, slots=True)
class Boundary:
    """What one stage hands the next, packed into one flat tensor: the tree of the value
    (a tensor, a tuple, a dict ...) and every leaf's shape and dtype. Floating-point
    leaves travel in their common dtype; with an integer or boolean leaf the whole value
    travels as float32, which holds integers exactly up to 2**24."""

    tree: pytree.TreeSpec
    leaves: tuple[tuple[tuple[int, ...], torch.dtype], ...]

    @staticmethod
    def of(value: object, where: str) -> Boundary:
        leaves, tree = pytree.tree_flatten(value)
        if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            kinds = sorted({type(leaf).__name__ for leaf in leaves}) or ["nothing"]
            raise ModelError(
                f"{where} returns {', '.join(kinds)}; a stage may hand the next only "
                "tensors (one, or a tuple, list or dict of them)"
            )
        return Boundary(tree, tuple((tuple(t.shape), t.dtype) for t in leaves))

    @property
    def single(self) -> bool:
        """One tensor: nothing to pack."""
        return self.tree.is_leaf()

    @property
    def dtype(self) -> torch.dtype:
        dtypes = [dtype for _, dtype in self.leaves]
        if not all(d.is_floating_point for d in dtypes):
            return torch.float32
        common = dtypes[0]
        for dtype in dtypes[1:]:
            common = torch.promote_types(common, dtype)
        return common

    def pack(self, value: object) -> torch.Tensor:
        leaves = pytree.tree_leaves(value)
        return torch.cat([leaf.reshape(-1).to(self.dtype) for leaf in leaves])

    def unpack(self, flat: torch.Tensor) -> object:
        sizes = [math.prod(shape) for shape, _ in self.leaves]
        parts = flat.split(sizes)
        leaves = [
            part.view(shape).to(dtype)
            for part, (shape, dtype) in zip(parts, self.leaves, strict=True)
        ]
        return pytree.tree_unflatten(leaves, self.tree)


class PackedStage(nn.Module):
    """A stage whose input or output is more than one tensor: unpacks what it receives,
    calls the stage (a tuple as positional arguments, a dict as keyword arguments, unless
    `whole`), and packs what it hands on."""

    def __init__(
        self, stage: nn.Module, takes: Boundary | None, gives: Boundary | None, whole: bool
    ) -> None:
        super().__init__()
        self.stage = stage
        self.takes = takes
        self.gives = gives
        self.whole = whole

    def forward(self, x: torch.Tensor) -> object:
        y = (
            self.stage(x)
            if self.takes is None
            else _call(self.stage, self.takes.unpack(x), self.whole)
        )
        return y if self.gives is None else self.gives.pack(y)


def _call(stage: nn.Module, value: object, whole: bool) -> object:
    if whole:
        return stage(value)
    if isinstance(value, tuple | list):
        return stage(*value)
    if isinstance(value, dict):
        return stage(**value)
    return stage(value)


# ---- loading ----------------------------------------------------------------------------------


_files: dict[tuple[str, int, int], ModuleType] = {}
"""The modules of `--model FILE.py:FUNC` files loaded in this process, by path, time and
size: a file is executed once (a second load, `--tp`'s `tp` hook, finds the classes its
model was built from)."""
_loaded: dict[str, ModuleType] = {}


def loaded_module(name: str) -> ModuleType:
    """The module of `--model name` as `load_factory` last loaded it (call that first)."""
    return _loaded[name]


def load_factory(name: str) -> Callable[..., object]:
    """The callable `--model` names: `package.module:FUNC`, or `path/to/file.py:FUNC` (a
    file, loaded as a module of its own; relative to the working directory)."""
    module_name, _, attr = name.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ImportError(f"no file {module_name}")
            stat = path.stat()
            key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
            module = _files.get(key)
            if module is None:  # once per file, as an import is: its classes stay one
                loader = importlib.util.spec_from_file_location(f"pipelang_model_{path.stem}", path)
                if loader is None or loader.loader is None:
                    raise ImportError(f"cannot import {module_name}")
                module = importlib.util.module_from_spec(loader)
                loader.loader.exec_module(module)
                _files[key] = module
        else:
            module = importlib.import_module(module_name)
        factory = getattr(module, attr)
        _loaded[name] = module
    except (ImportError, AttributeError, SyntaxError, ValueError) as err:
        raise ModelError(
            clip(f"`--model {name}`: cannot load `{attr}` from `{module_name}`: {_cut(str(err))}")
        ) from None
    except SystemExit as exit_:  # the user's file ended the process: not a success
        raise ModelError(f"`--model {name}`: importing `{module_name}` {said(exit_)}") from None
    except BaseException as err:  # anything the user's module raises (KeyboardInterrupt too)
        raise ModelError(
            clip(f"`--model {name}`: importing `{module_name}` failed: {said(err)}")
        ) from None
    if not callable(factory):
        raise ModelError(f"`--model {name}`: `{attr}` is not callable")
    return factory  # type: ignore[no-any-return]


Tie = tuple[tuple[int, str], ...]
"""One parameter shared by several layers: (layer, its name in that layer) of each use,
in layer order."""


def find_ties(layers: Sequence[nn.Module]) -> tuple[Tie, ...]:
    """The trainable parameters that more than one layer holds."""
    uses: dict[int, list[tuple[int, str]]] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if param.requires_grad:
                uses.setdefault(id(param), []).append((index, name))
    return tuple(tuple(u) for u in uses.values() if len({i for i, _ in u}) > 1)


@dataclass(frozen=True, slots=True)
class UserModel:
    """A user's model as the layers the runtime splits (or its stages), ready to build
    a LayeredModel from."""

    layers: list[nn.Module]
    vocab: int
    seq_len: int
    stages: bool
    loss: Loss | None
    ties: tuple[Tie, ...]


@dataclass(slots=True)
class _Built:
    """What the model function gave, split into layers (or stages)."""

    layers: list[nn.Module]
    stages: bool
    """The layers are the stages (a list, or split by torch's `pipeline`)."""
    whole: bool
    """Hand a stage's value to the next as one argument (a split nn.Sequential)."""
    vocab: int
    seq_len: int
    loss: Loss | None


def load_in_child(spec: ModelSpec, result: str) -> str:
    """The work of `model_import.vet`'s child: `user_model` of the spec on the meta
    device, after touching RESULT.started (the deadline counts from there); its error in
    one line ("" when it loaded)."""
    try:
        with torch.device("meta"):  # torch's own lazy imports (its meta kernels) first
            torch.nn.Linear(2, 2)(torch.nn.Embedding(2, 2)(torch.zeros(1, dtype=torch.long)))
        Path(f"{result}.started").touch()  # the model's own code runs from here
        trust(spec.name)
        with on_meta():
            user_model(spec)
    except ModelError as err:
        return str(err) or "ModelError"
    except BaseException as err:  # whatever the user's code raises, sys.exit() too
        return clip(f"`--model {spec.name}`: loading it failed: {said(err)}")
    return ""


def user_model(spec: ModelSpec) -> UserModel:
    """The model `spec.name` names, built on the current default device (see the module
    docstring). Raises ModelError with what is wrong. The model is loaded in a child
    process first (`model_import.vet`: a deadline, and a model that ends the process
    is told)."""
    vet(spec, load_in_child)
    factory = load_factory(spec.name)
    built = _build(spec, factory)
    if torch.get_default_device().type == "meta":
        boundaries = _boundaries(spec, built)  # already on meta: probe this one
    else:
        with on_meta():
            boundaries = _boundaries(spec, _build(spec, factory))
    layers = built.layers
    if any(b is not None and not b.single for b in boundaries):
        layers = _packed(built, boundaries)
    return UserModel(
        layers, built.vocab, built.seq_len, built.stages, built.loss, find_ties(layers)
    )


def _build(spec: ModelSpec, factory: Callable[..., object]) -> _Built:
    name, attr = spec.name, spec.name.rpartition(":")[2]
    kwargs = {}
    if spec.seq_len and "seq_len" in inspect.signature(factory).parameters:
        kwargs["seq_len"] = spec.seq_len
    try:
        returned = factory(**kwargs)
    except SystemExit as exit_:
        raise ModelError(f"`--model {name}`: `{attr}()` {said(exit_)}") from None
    except BaseException as err:
        raise ModelError(
            clip(f"`--model {name}`: `{attr}()` failed: {said(err)}{_on_meta(err)}")
        ) from None
    extras: dict[str, Any] = {}
    if isinstance(returned, dict):
        unknown = sorted(set(returned) - KEYS)
        if "model" not in returned or unknown:
            raise ModelError(
                f"`--model {name}`: the dict `{attr}()` returns needs a `model` and may "
                f"have {', '.join(sorted(KEYS - {'model'}))}"
                + (f"; unknown: {', '.join(map(str, unknown))}" if unknown else "")
            )
        extras, returned = returned, returned["model"]
    loss = extras.get("loss")
    if loss is not None and not callable(loss):
        raise ModelError(f"`--model {name}`: its `loss` is not callable")
    seq_len = spec.seq_len or int(extras.get("seq_len") or getattr(returned, "seq_len", None) or 32)
    if isinstance(returned, nn.Sequential | list | tuple):
        layers = list(returned)
        if not layers:
            sequential = isinstance(returned, nn.Sequential)
            raise ModelError(
                f"`--model {name}`: `{attr}()` returns an empty "
                + (
                    "nn.Sequential: no layers to split into stages"
                    if sequential
                    else f"{type(returned).__name__}: no stage modules"
                )
            )
        stages, whole = not isinstance(returned, nn.Sequential), not extras.get("unpack")
        if "split_spec" in extras:
            raise ModelError(f"`--model {name}`: `split_spec` splits one module, not a list")
    elif isinstance(returned, nn.Module):
        names = [n for n, _ in returned.named_parameters(remove_duplicate=False)]
        if len(names) != len(dict(returned.named_parameters())):
            raise ModelError(
                f"`--model {name}`: its module ties weights (one parameter under several "
                "names), which torch's pipeline() splits into separate copies that would "
                "drift apart; return a list of stage modules sharing the parameter instead"
            )
        layers, stages, whole = (
            _split_by_torch(spec, returned, extras.get("split_spec"), seq_len),
            True,
            False,
        )
    else:
        layers = []
    if not layers or not all(isinstance(m, nn.Module) for m in layers):
        raise ModelError(
            f"`--model {name}`: `{attr}()` must return an nn.Sequential (its layers, split "
            "into stages by pipelang), a list of modules (one per stage), a module with "
            "pipe_split() calls, or a dict with one of them under `model`; not "
            f"{type(returned).__name__}"
        )
    vocab = extras.get("vocab_size") or getattr(returned, "vocab_size", None)
    if vocab is None:
        vocab = _first_embedding([returned] if isinstance(returned, nn.Module) else layers)
    if vocab is None:
        raise ModelError(
            f"`--model {name}`: cannot tell the vocabulary size; return a dict with "
            "`vocab_size`, set `vocab_size` on the module, or give it an nn.Embedding"
        )
    return _Built(layers, stages, whole, int(vocab), seq_len, loss)


def _on_meta(err: BaseException) -> str:
    """What to add to a model function's failure on the meta device that says so."""
    if torch.get_default_device().type != "meta" or "meta" not in str(err):
        return ""
    return (
        " (pipelang calls it on the meta device, where tensors hold no values, to find the "
        "stages' boundaries and to build it under --init layers: it may not read a value)"
    )


def _first_embedding(layers: list[nn.Module]) -> int | None:
    """The vocabulary of the first nn.Embedding the layers hold, in order."""
    for layer in layers:
        for sub in layer.modules():
            if isinstance(sub, nn.Embedding):
                return sub.num_embeddings
    return None


def _split_by_torch(
    spec: ModelSpec, module: nn.Module, split_spec: object, seq_len: int
) -> list[nn.Module]:
    """The stages torch's `pipeline()` makes of `module` at its `pipe_split()` calls or
    `split_spec`, traced on a micro-batch of token ids."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    points = split_spec.values() if isinstance(split_spec, dict) else [None]
    if split_spec is not None and not all(isinstance(v, SplitPoint) for v in points):
        raise ModelError(
            f"`--model {spec.name}`: `split_spec` must map module names to "
            "torch.distributed.pipelining.SplitPoint values"
        )
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    ids = torch.zeros(spec.micro_batch_size, seq_len, dtype=torch.long, device=device)
    try:
        with warnings.catch_warnings():  # torch's own tracer uses a deprecated pytree check
            warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
            pipe = pipeline(module, mb_args=(ids,), split_spec=split_spec)  # type: ignore[arg-type]
    except Exception as err:
        raise ModelError(
            f"`--model {spec.name}`: torch.distributed.pipelining could not split it: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ) from None
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def _boundaries(spec: ModelSpec, built: _Built) -> list[Boundary | None]:
    """What each stage (each layer, for an nn.Sequential) hands the next, found by
    running the meta-device model on a batch of ids; None after the last."""
    for layer in built.layers:
        layer.to(spec.torch_dtype)  # as ModelSpec.build will: the leaves' dtypes are final
    x: object = torch.zeros(spec.micro_batch_size, built.seq_len, dtype=torch.long, device="meta")
    found: list[Boundary | None] = []
    try:
        with torch.no_grad():
            for i, layer in enumerate(built.layers):
                x = _probe(spec, built, i, layer, x)
                if i < len(built.layers) - 1:
                    found.append(Boundary.of(x, f"`--model {spec.name}` layer {i}"))
                elif not isinstance(x, torch.Tensor):
                    raise ModelError(
                        f"`--model {spec.name}`: the last layer returns "
                        f"{type(x).__name__}, not one tensor (the logits [batch, seq, "
                        "vocab], or what the model's own `loss` takes)"
                    )
                else:
                    found.append(None)
    except ModelError:
        raise
    except BaseException as err:  # sys.exit() in a forward, too
        raise ModelError(
            clip(f"`{spec.name}` does not run on a batch of token ids: {said(err)}")
        ) from None
    return found


def _probe(spec: ModelSpec, built: _Built, i: int, layer: nn.Module, x: object) -> object:
    """Layer (or stage) `i` run on what the one before it returned; a ModelError naming
    it, and what it was given, when it fails."""
    try:
        return layer(x) if i == 0 else _call(layer, x, built.whole)
    except ModelError:
        raise
    except BaseException as err:  # sys.exit() in a forward, too
        what = "stage" if built.stages else "layer"
        given = "a batch of token ids" if i == 0 else f"what {what} {i - 1} returns ({_kind(x)})"
        hint = ""
        if i and built.whole and isinstance(x, tuple | list | dict):
            hint = (
                f"; the value is handed on whole (`x = {what}(x)`, as nn.Sequential does): to "
                "call the next with a tuple as positional arguments or a dict as keyword "
                'arguments, return {"model": ..., "unpack": True}'
            )
        raise ModelError(
            clip(
                f"`--model {spec.name}`: {what} {i} ({type(layer).__name__}) fails on "
                f"{given}: {said(err)}{hint}"
            )
        ) from None


SAID = 200
"""The most characters of what the user's code said (an exception's text) a message shows."""


def said(err: BaseException) -> str:
    """An exception of the user's code in one line, its text cut at SAID characters:
    `Type: first line`, or `called sys.exit(...)`."""
    if isinstance(err, SystemExit):
        return f"called sys.exit({_cut(repr(err.code))})"
    if isinstance(err, OSError) and err.strerror:  # not the (maybe long) file name again
        return f"{type(err).__name__}: {err.strerror}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {_cut(text[0])}" if text else type(err).__name__


def _cut(text: str) -> str:
    return text if len(text) <= SAID else f"{text[:SAID]}... ({len(text):,} characters)"


def _kind(value: object) -> str:
    """What a stage returned, in words: `a tensor [4, 32, 64]`, `a dict of h, mask`."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)}"
    if isinstance(value, dict):
        return f"a dict of {', '.join(map(str, value))}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _packed(built: _Built, boundaries: Sequence[Boundary | None]) -> list[nn.Module]:
    """Every layer wrapped to take and give one flat tensor where its neighbours hand
    over more."""
    out: list[nn.Module] = []
    for i, layer in enumerate(built.layers):
        takes = boundaries[i - 1] if i else None
        gives = boundaries[i]
        takes = None if takes is None or takes.single else takes
        gives = None if gives is None or gives.single else gives
        out.append(
            layer
            if takes is None and gives is None
            else PackedStage(layer, takes, gives, built.whole)
        )
    return out
