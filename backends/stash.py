"""Evicted activations (BPipe's `E`, `H`, `L`): what a forward saves, moved to a partner.

"Activations" here means exactly the tensors autograd saves for the backward while one
stage copy runs one micro-batch's forward (`torch.autograd.graph.saved_tensors_hooks`):
the stage input when an op saves it, the layers' intermediate results, a last stage's
log-probabilities. Not activations, so never shipped: the stage's parameters and buffers
(and views of them, such as the transposed weight a linear layer saves), a storage that
another live micro-batch also saved, and the stage's own output, which the send to the
next stage may still be reading.

While a forward runs, the pack hook files every saved tensor in that forward's `Entry`
and hands autograd its index there; the forward's unpack hook returns the tensor at the
index (`Entry.unpack`). `E`
copies the bytes of the entry's storages into one flat uint8 buffer and frees the
storages (`resize_(0)`): every tensor that views them (the hooks' copies, the runtime's
kept input) stays the same object, now without memory. `L` gives the storages their
bytes back, so autograd finds the same tensors, bit for bit, when the backward runs; a
backward that runs while its activations are away raises `EvictedError`.

A split backward releases, right after B, every saved tensor its W will not read
(`Stash.probe` finds them, `Stash.keep` drops the others and holds the gradients W
starts from; backends/weight_split.py): its entry then counts only what W keeps, and a
W that read a released tensor would raise `ReleasedError`.

On the wire an eviction is two messages: its size in bytes (one int64), then the bytes;
the partner does not know the shapes, and keeps the buffer from `H` until it sends it
back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

Key = tuple[int, int, str, int | None]
"""(micro-batch, stage, pipeline) of one forward."""


class EvictedError(RuntimeError):
    """A backward needed activations that are on the partner rank (no `L` ran)."""


class ReleasedError(RuntimeError):
    """A weight gradient read a tensor that was released after its B (a bug)."""


@dataclass(slots=True)
class Entry:
    """The tensors one forward saved, and where their storages' bytes are."""

    name: str
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    """Each saved tensor; None once released after B (`Stash.keep`)."""
    moved: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    """(storage, bytes) of each storage the eviction emptied, in buffer order."""
    evicted: bool = False
    kept_grads: list[torch.Tensor] = field(default_factory=list)
    """The output gradients kept for W after B (`Stash.keep`): held like activations."""
    reads: set[int] | None = None
    """While probing or counting, the indices of the saved tensors handed out."""

    def unpack(self, index: int) -> torch.Tensor:
        """The saved tensor at `index`, for autograd (the unpack hook): an error while it
        is evicted or once released."""
        if self.evicted:
            raise EvictedError(
                f"the backward of {self.name} needs its activations, but they are on the "
                "partner rank: no `L` loaded them back"
            )
        if self.reads is not None:
            self.reads.add(index)
        tensor = self.tensors[index]
        if tensor is None:
            raise ReleasedError(f"the W of {self.name} read a tensor released after its B")
        return tensor

    def storages(self) -> dict[int, torch.UntypedStorage]:
        """Every storage the entry's tensors and kept gradients view, by data pointer
        (each once)."""
        out: dict[int, torch.UntypedStorage] = {}
        for t in (*self.tensors, *self.kept_grads):
            if t is None:
                continue
            storage = _storage(t)
            if storage.nbytes() > 0:
                out.setdefault(storage.data_ptr(), storage)
        return out


class Stash:
    """One rank's saved activations per forward, and what it holds for partners."""

    def __init__(self) -> None:
        self.entries: dict[Key, Entry] = {}
        self.held: dict[Key, torch.Tensor] = {}
        self.peak_bytes = 0

    @contextmanager
    def recording(self, key: Key, name: str, module: nn.Module) -> Iterator[None]:
        """Run a forward of `key` with its saved tensors filed in a fresh entry."""
        entry = self.entries[key] = Entry(name)
        own = _own_storages(module)

        def pack(tensor: torch.Tensor) -> object:
            if _storage(tensor).data_ptr() in own:
                return tensor  # weights and buffers stay: not activations
            tensors = entry.tensors  # not held here: `forget` lets the entry's list go
            tensors.append(tensor)
            return len(tensors) - 1  # its index in the entry: an int, no object to collect

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            assert isinstance(packed, int)
            return entry.unpack(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def evict(self, key: Key, keep: torch.Tensor | None) -> torch.Tensor:
        """Free the storages of `key`'s activations; their bytes as one uint8 buffer.

        `keep` (the stage's output, possibly still being sent), storages another
        resident entry also saved, and memory torch cannot resize (a tensor made by
        `torch.from_numpy`) stay where they are."""
        entry = self.entries[key]
        if entry.evicted:
            raise EvictedError(f"the activations of {entry.name} are evicted twice")
        shared = {p for k, e in self.entries.items() if k != key for p in e.storages()}
        if keep is not None:
            shared.add(_storage(keep).data_ptr())
        moved = [
            (s, s.nbytes())
            for p, s in entry.storages().items()
            if p not in shared and s.resizable()  # memory torch does not own (numpy's) stays
        ]
        parts = [_bytes_of(s, n).clone() for s, n in moved]
        buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        for storage, _ in moved:
            storage.resize_(0)
        entry.moved, entry.evicted = moved, True
        return buffer

    def load(self, key: Key, buffer: torch.Tensor) -> None:
        """Give `key`'s storages their bytes back from `buffer` (what `evict` made)."""
        entry = self.entries[key]
        if not entry.evicted:
            raise EvictedError(f"{entry.name}'s activations are loaded but were not evicted")
        expected = sum(n for _, n in entry.moved)
        if buffer.numel() != expected:
            raise EvictedError(
                f"{entry.name}'s activations came back as {buffer.numel()} bytes, "
                f"{expected} were evicted"
            )
        at = 0
        for storage, n in entry.moved:
            storage.resize_(n)
            _bytes_of(storage, n).copy_(buffer[at : at + n])
            at += n
        entry.moved, entry.evicted = [], False

    def probe(self, key: Key, nodes: Iterable[Node]) -> set[int] | None:
        """The saved tensors of `key` that `nodes` read (by index), found by reading
        every saved value of each node; None when some node's cannot be read."""
        entry = self.entries[key]
        entry.reads = set()
        try:
            for node in nodes:
                for name in _saved_names(type(node)):
                    getattr(node, name)
        except RuntimeError:
            return None
        finally:
            reads, entry.reads = entry.reads, None
        return reads

    def prober(self, key: Key, needed: set[int]) -> Callable[[Iterable[Node]], bool] | None:
        """How a split backward's B finds what W reads of `key`'s saved tensors
        (`weight_split.Probe`), filing them in `needed` for `keep`; None when `key`'s
        forward saved nothing here (a recomputed one: then it is not split)."""
        if key not in self.entries:
            return None

        def probe(nodes: Iterable[Node]) -> bool:
            found = self.probe(key, nodes)
            needed.update(found or ())
            return found is not None

        return probe

    def keep(self, key: Key, needed: set[int], grads: list[torch.Tensor]) -> None:
        """After B: release every saved tensor of `key` but the `needed` ones, and hold
        `grads` (what W reads beside them) in the entry."""
        entry = self.entries[key]
        for index in range(len(entry.tensors)):
            if index not in needed:
                entry.tensors[index] = None
        entry.kept_grads = grads

    def forget(self, key: Key) -> None:
        """Forget `key`'s forward once its backward is done, and let its entry go of the
        tensors. The graph's saved values hold the entry (through its unpack hook), and a kept
        tensor's own graph holds saved values: a cycle through autograd's C++ nodes that
        Python's garbage collector cannot see, so without this, a split backward's
        graph (kept with `retain_graph` past B) would stay, every step's."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            entry.tensors = [None] * len(entry.tensors)
            entry.kept_grads = []

    def resident_bytes(self, alive: set[Key]) -> int:
        """Bytes of activations on this rank now: the distinct storages of live entries
        (an evicted one's are empty) plus the buffers held for partners."""
        seen: dict[int, int] = {}
        for key, entry in self.entries.items():
            if key in alive:
                for p, s in entry.storages().items():
                    seen[p] = s.nbytes()
        held = sum(b.numel() for b in self.held.values())
        return sum(seen.values()) + held

    def measure(self, alive: set[Key]) -> None:
        """Update the peak with what is resident now."""
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes(alive))


@functools.cache
def _saved_names(node_type: type) -> tuple[str, ...]:
    """The attributes of an autograd node type that give its saved values (`_saved_*`,
    and a custom `autograd.Function`'s `saved_tensors`); asked once per type."""
    names = tuple(n for n in dir(node_type) if n.startswith("_saved_"))
    if issubclass(node_type, BackwardCFunction):  # each Function's node type: `<Name>Backward`
        names += ("saved_tensors",)
    return names


def _own_storages(module: nn.Module) -> set[int]:
    """The data pointers of the storages of `module`'s parameters and buffers (those of
    `parameters()` and `buffers()`, read from each submodule's own: a third of the time)."""
    own = set()
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for t in table.values():
                if t is not None:
                    own.add(_storage(t).data_ptr())
    return own


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """`tensor`'s storage; a DTensor's (`--tp`) is its local tensor's, what this process
    holds (a DTensor has no storage of its own)."""
    return getattr(tensor, "_local_tensor", tensor).untyped_storage()


def _bytes_of(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the first `nbytes` of `storage` (no copy)."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (nbytes,), (1,))
