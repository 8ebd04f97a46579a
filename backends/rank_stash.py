"""Evicted activations (BPipe; backends/stash.py): E, the partner's H, L, and their
trips; the byte count of saved activations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipelang.backends.rank_base import _action, _comm
from pipelang.backends.stash import Key, Stash
from pipelang.diagnostics import InternalError

if TYPE_CHECKING:
    from pipelang.backends.runtime import RankRuntime


class StashActions:
    """Evicted activations (BPipe; backends/stash.py): E, the partner's H, L, and their
    trips; the byte count of saved activations."""

    def _measure(self: RankRuntime) -> None:
        if self.stash is not None and self.counting:
            self.stash.measure(set(self.stash.entries))

    def _stash(self: RankRuntime) -> Stash:
        if self.stash is None:
            raise InternalError("an eviction action ran, but the runtime keeps no stash")
        return self.stash

    def _send_bytes(self: RankRuntime, buffer: torch.Tensor, peer: int) -> None:
        """An eviction's bytes go as two messages: their count (int64), then the bytes."""
        size = torch.tensor([buffer.numel()], dtype=torch.int64, device=self.device)
        self.transport.send(size, peer)
        self.transport.send(buffer, peer)

    def _recv_bytes(self: RankRuntime, peer: int) -> torch.Tensor:
        size = self.transport.recv((1,), torch.int64, peer)
        return self.transport.recv((int(size.item()),), torch.uint8, peer)

    @_action
    def evict(self: RankRuntime, mb: int, stage: int, pipeline: str, to: int) -> None:
        """E: copy the forward's activations into one buffer and free their storages."""
        key: Key = (mb, stage, pipeline, None)
        copy = self.copies[(stage, pipeline)]
        keep = None if copy.last else copy.saved[key].y
        self.values[("E", *key)] = self._stash().evict(key, keep)

    @_comm
    def send_evicted(self: RankRuntime, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:E: send the evicted activations to the partner."""
        self._send_bytes(self.values.pop(("E", mb, stage, pipeline, None)), to)

    @_comm
    def recv_evicted(self: RankRuntime, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:E: on the partner, receive activations another rank evicts."""
        self.values[("E", mb, stage, pipeline, None)] = self._recv_bytes(src)

    @_action
    def hold(self: RankRuntime, mb: int, stage: int, pipeline: str) -> None:
        """H: keep the received activations until the owner loads them back."""
        stash = self._stash()
        key: Key = (mb, stage, pipeline, None)
        stash.held[key] = self.values.pop(("E", *key))
        self._measure()

    @_comm
    def send_held(self: RankRuntime, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:H: send the held activations back to their owner; stop holding them."""
        self._send_bytes(self._stash().held.pop((mb, stage, pipeline, None)), to)

    @_comm
    def recv_held(self: RankRuntime, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:H: on the owner, receive its activations back from the partner."""
        self.values[("H", mb, stage, pipeline, None)] = self._recv_bytes(src)

    @_action
    def load(self: RankRuntime, mb: int, stage: int, pipeline: str) -> None:
        """L: give the forward's storages their bytes back, for the backward."""
        key: Key = (mb, stage, pipeline, None)
        self._stash().load(key, self.values.pop(("H", *key)))
        self._measure()
