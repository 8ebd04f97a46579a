"""A rank's transfers: activations, frozen outputs and gradients sent and received,
signals and waits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipelang.backends.rank_base import Value, _comm

if TYPE_CHECKING:
    from pipelang.backends.runtime import RankRuntime


class CommActions:
    """A rank's transfers: activations, frozen outputs and gradients sent and received,
    signals and waits."""

    def shape_of(
        self: RankRuntime, stage: int, chunk: int | None = None, mb: int | None = None
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape of stage `stage`'s output (-1: stage 0's input): of micro-batch `mb`'s
        samples and tokens where micro-batches differ (`ModelSpec.shapes`), of one
        sequence chunk's tokens when `chunk` is given (batch and sequence are the first
        two dimensions)."""
        shape, dtype = self.shapes[stage]
        if mb is not None and self.config.batch_shapes is not None:
            shape = (*self.model.shape(mb), *shape[2:])
        if chunk is None or self.chunk_bounds is None:
            return shape, dtype
        length = self.chunk_bounds[chunk + 1] - self.chunk_bounds[chunk]
        return (shape[0], length, *shape[2:]), dtype

    def _send(self: RankRuntime, key: Value, peer: int) -> None:
        tensor = self.values.pop(key)
        self.transport.send(tensor, peer)

    def _recv(self: RankRuntime, key: Value, stage_output: int, peer: int) -> None:
        shape, dtype = self.shape_of(stage_output, key[4], key[1])
        self.values[key] = self.transport.recv(shape, dtype, peer)

    @_comm
    def send_activation(
        self: RankRuntime, mb: int, stage: int, pipeline: str, to: int, chunk: int | None = None
    ) -> None:
        """send:F: send the output of F(mb, stage) to the rank of stage + 1."""
        self._send(("F", mb, stage, pipeline, chunk), to)

    @_comm
    def recv_activation(
        self: RankRuntime, mb: int, stage: int, pipeline: str, src: int, chunk: int | None = None
    ) -> None:
        """recv:F: receive the output of F(mb, stage), the input of stage + 1."""
        self._recv(("F", mb, stage, pipeline, chunk), stage, src)

    @_comm
    def send_frozen(self: RankRuntime, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:P: send the frozen part's output for micro-batch `mb` to stage 0's rank."""
        self._send(("P", mb, stage, pipeline, None), to)

    @_comm
    def recv_frozen(self: RankRuntime, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:P: receive the frozen part's output, the input of F(mb, 0)."""
        self._recv(("P", mb, stage, pipeline, None), -1, src)

    @_comm
    def send_grad(
        self: RankRuntime, mb: int, stage: int, pipeline: str, to: int, chunk: int | None = None
    ) -> None:
        """send:B: send the input gradient B(mb, stage) made to the rank of stage - 1."""
        self._send(("B", mb, stage, pipeline, chunk), to)

    @_comm
    def recv_grad(
        self: RankRuntime, mb: int, stage: int, pipeline: str, src: int, chunk: int | None = None
    ) -> None:
        """recv:B: receive the gradient of stage - 1's output, made by B(mb, stage)."""
        self._recv(("B", mb, stage, pipeline, chunk), stage - 1, src)

    @_comm
    def signal(self: RankRuntime, op: str, mb: int, stage: int, pipeline: str, to: int) -> None:
        """signal: tell rank `to` that an op finished (an `after` dependency); no data."""
        self.transport.send(torch.ones(1, device=self.device), to)

    @_comm
    def wait(self: RankRuntime, op: str, mb: int, stage: int, pipeline: str, src: int) -> None:
        """wait: block until rank `src` signals that an op finished."""
        self.transport.recv((1,), torch.float32, src)
