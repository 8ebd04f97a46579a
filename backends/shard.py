"""Sharded stage copies (`--dp K --shard`): each copy's module is sharded with FSDP2
(`torch.distributed.fsdp.fully_shard`) over the K data-parallel copies of its stage, the
processes that would otherwise allreduce its gradients (the transport's reduce group of
the stage, as a DeviceMesh; with `--tp`, the run mesh's "dp" dimension, which FSDP2 joins
with the tensor-parallel parameters' "tp": backends/tensor_parallel.py).

A stage copy (backends/stage.py) keeps its module, now an `FSDPModule` whose parameters
are DTensors, each process holding one shard of each (dim 0, padded where it does not
divide). What the copy trains are those shards' local tensors: `Stage.params` are set to
them and its optimizer (backends/optim.py, unchanged) is built over them, so parameters,
gradients and optimizer state all take 1/K of the bytes on each process.

The program says when the collectives run (`insert-shard`), and the executor calls:

- `gather` (`gather@s/p`): FSDP2's `unshard()`, before the copy's first op of the step;
  the parameters stay gathered through every micro-batch (no reshard after a forward or
  a backward, no reduce per micro-batch: `set_reshard_after_backward(False)`,
  `set_requires_gradient_sync(False)`, `set_is_last_backward(False)`, as
  torch.distributed.pipelining drives an FSDP2 stage);
- `reshard` (`reshard@s/p`, where the order writes `reshard()`): FSDP2's `reshard()`,
  which frees the gathered parameters and keeps the accumulated gradients; the order
  then gathers the copy again (`gather()`) before its next op;
- `reduce_scatter` (`reduce_scatter@s/p`): after the copy's last backward of the step,
  the three back on and FSDP2's post-backward (pipelining's REDUCE_GRAD): one
  reduce-scatter of the gradients the micro-batches accumulated, a plain sum (the loss
  is scaled by 1/(N K) already), then the gathered parameters are dropped. Each shard's
  summed gradient becomes its local tensor's `.grad`, which `step` applies. On gloo the
  reduce-scatter is an all-reduce of FSDP2's flat input in place, each process keeping
  its rows (`_in_place_reduce_scatter`): gloo's own copies the input first.

With `--mixed-precision` the sharded parameters are the copy's fp32 masters, and FSDP2's
`MixedPrecisionPolicy` does what backends/precision.py does for a whole copy: the
gather rounds them to bf16 for the step, micro-batch gradients accumulate in fp32 and
reduce in fp32, and the optimizer steps the fp32 shards (`_masters_sharded`); the same
bits as an unsharded run's masters at K = 2. Checkpoints (backends/checkpoint.py) save
the shards as DTensors, and `--clip-grad`'s norm adds each copy's shards' squares
(`RankRuntime.grad_square_sum`; `--check` repeats it: `summation.shard_piece`).

At K = 2 the sum of two gradients is the same in either order, so `--check` holds bit
for bit against one process (which sums a copy's micro-batches first, then the copies:
backends/summation.py); above 2 the order of gloo's reduce-scatter is not replayed and
`--check` allows its tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipelang.backends.rank_base import _comm, make_optimizer
from pipelang.backends.tensor_parallel import fused_sharded, note_repeated, tp_part
from pipelang.diagnostics import InternalError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipelang.backends.runtime import RankRuntime
    from pipelang.backends.stage import Stage


def shard_copies(runtime: RankRuntime) -> None:
    """Shard every stage copy of `runtime` over its stage's reduce group (FSDP2), and
    give each copy its local shards as the parameters it trains, with an optimizer over
    them. Every process of a group calls it, in the same order of copies."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    groups = getattr(runtime.transport, "reduce_groups", None)
    if groups is None:
        raise InternalError("--shard needs a process per rank (a DistTransport)")
    for copy in runtime.copies.values():
        group, ranks = groups[copy.stage]
        mesh = _dp_mesh(runtime, ranks) or DeviceMesh.from_group(group, runtime.device.type)
        policy = _masters_sharded(copy)
        module: Any = fully_shard(
            copy.module, mesh=mesh, reshard_after_forward=False, mp_policy=policy
        )
        module.set_gradient_divide_factor(1.0)  # a sum: the loss is scaled already
        module.set_force_sum_reduction_for_comms(True)  # SUM, which gloo has
        if mesh.device_type == "cpu":  # gloo's processes (nccl's are on GPUs)
            module.set_custom_reduce_scatter(_in_place_reduce_scatter())
        sharded = _sharded(copy)
        copy.params = [_local(p) for p in sharded]
        if runtime.config.tp > 1:
            note_repeated(runtime, sharded, copy.params)
        copy.optimizer = make_optimizer(copy.params, runtime.config)


def _dp_mesh(runtime: RankRuntime, ranks: list[int]) -> DeviceMesh | None:
    """With `--tp`: the "dp" dimension of the run's mesh through this process, which
    FSDP2 joins with its tensor-parallel parameters' "tp" dimension (one root mesh: the
    torchtitan recipe); it must be the stage's reduce group, `ranks`. None without --tp."""
    if runtime.config.tp < 2:
        return None
    whole = getattr(runtime.transport, "mesh", None)
    if whole is None:
        raise InternalError("--tp needs a process per tensor rank (a DistTransport)")
    mesh: DeviceMesh = whole["dp"]
    if sorted(mesh.mesh.flatten().tolist()) != sorted(ranks):
        raise InternalError(f"the reduce group {ranks} is not the mesh's dp slice")
    return mesh


def _in_place_reduce_scatter() -> Any:
    """FSDP2's reduce-scatter for gloo: an all-reduce of FSDP2's flat input in place, of
    which each process keeps its own rows (FSDP2's layout: row block i for group rank i).
    gloo's own reduce-scatter copies the whole input first (the stage's gradients once
    more, at the step's peak) and takes about 3x as long on a CPU; a sum of two is the
    same either way, bit for bit."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class InPlace(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: Any,
            op: Any,
            async_op: bool = False,
        ) -> None:
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])

    return InPlace()


def _masters_sharded(copy: Stage) -> Any:
    """`--mixed-precision`: FSDP2's policy for a copy whose sharded parameters are its
    fp32 masters (set here, exactly, from the bf16 parameters they were made from):
    gathered, they are rounded to the compute dtype, as `copy_back` rounds them, and
    micro-batch gradients accumulate and reduce in fp32, as the masters' hooks add them
    (backends/precision.py). The copy keeps no masters of its own then. None: no mixed
    precision, no policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if copy.masters is None:
        return MixedPrecisionPolicy()
    compute = copy.params[0].dtype if copy.params else torch.float32
    with torch.no_grad():
        for param, master in zip(copy.params, copy.masters, strict=True):
            param.data = master.detach()  # the master's fp32 values, exactly
    copy.masters = None
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def compute_dtype(copy: Stage) -> torch.dtype | None:
    """The dtype a sharded copy with fp32 masters computes in (`--mixed-precision`);
    None for any other copy."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(copy.module, FSDPModule):
        return None
    policy = fully_shard.state(copy.module)._mp_policy  # type: ignore[attr-defined]
    return policy.param_dtype  # type: ignore[no-any-return]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of a sharded (DTensor) parameter: its storage, updated in place."""
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param


def _sharded(copy: Stage) -> list[nn.Parameter]:
    """A sharded copy's DTensor parameters, in `copy.params`' order."""
    return [p for p in copy.module.parameters() if p.requires_grad]


def _syncing(module: Any, on: bool) -> None:
    module.set_is_last_backward(on)
    module.set_reshard_after_backward(on)
    module.set_requires_gradient_sync(on)


class ShardActions:
    """A rank's sharded stage copies' collectives: `gather` and `reduce_scatter`."""

    @_comm
    def gather(self: RankRuntime, stage: int, pipeline: str) -> None:
        """gather: all-gather the copy's parameters and keep them through the step, its
        micro-batches' gradients accumulating unreduced."""
        copy = self.copies[(stage, pipeline)]
        for param in _sharded(copy):  # the last step's sums, applied: FSDP2 would add to them
            param.grad = None
        module: Any = copy.module
        _syncing(module, False)
        module.unshard()

    def reshard(self: RankRuntime, stage: int, pipeline: str) -> None:
        """reshard (written `reshard()`): free the copy's gathered parameters, keeping its
        shard and the gradients its micro-batches accumulated (FSDP2's `reshard()`); the
        next `gather` all-gathers them again."""
        module: Any = self.copies[(stage, pipeline)].module
        module.reshard()

    @_comm
    def reduce_scatter(self: RankRuntime, stage: int, pipeline: str) -> None:
        """reduce_scatter: sum the copy's gradients over its data-parallel copies, each
        keeping its shard's sum (as its local shard's `.grad`); drop the gathered
        parameters."""
        from torch.distributed.fsdp import fully_shard

        copy = self.copies[(stage, pipeline)]
        module: Any = copy.module
        _syncing(module, True)
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        # FSDP2 may have replaced a local tensor at its lazy init (padding): take them anew
        sharded, before = _sharded(copy), copy.params
        copy.params = [_local(p) for p in sharded]
        if self.config.tp > 1:
            note_repeated(self, sharded, copy.params, before)
        assert copy.optimizer is not None
        copy.optimizer.params = copy.params
        for param, local in zip(sharded, copy.params, strict=True):
            grad = param.grad  # the DTensor keeps it too, until the next `gather`
            local.grad = None if grad is None else _local(grad)


def full_params(copy: Stage) -> Iterator[torch.Tensor]:
    """A copy's whole parameters: gathered from the shards where it is sharded (a
    collective: every process of its group takes them all, in the same order), one at a
    time as they are taken, so that a process holds one whole tensor beside its shards
    (`--check`'s fingerprint of every step), not its whole stage; else its own."""
    from torch.distributed.tensor import DTensor

    params: Iterable[torch.Tensor] = copy.module.parameters()
    if not any(isinstance(p, DTensor) for p in params):
        yield from copy.params
        return
    dtype = compute_dtype(copy)
    for param in _sharded(copy):
        yield _full(param, dtype)


def _full(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A DTensor's whole tensor (a collective), in `dtype` where given: fp32 masters as
    the copy computes with them (`compute_dtype`)."""
    from torch.distributed.tensor import DTensor

    if fused_sharded(tensor):  # --tp's fused projection: where its rows lie
        tensor = tp_part(tensor)
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole if dtype is None or not whole.is_floating_point() else whole.to(dtype)


def full_state(copy: Stage) -> dict[str, torch.Tensor]:
    """A copy's state dict with whole tensors (gathered where sharded; a collective), as
    the copy computes with them."""
    dtype = compute_dtype(copy)
    return {name: _full(t.detach(), dtype) for name, t in copy.module.state_dict().items()}
