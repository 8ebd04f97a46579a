"""`RankRuntime`: what a rank's program calls (backends/executor.py), one method per action.

A rank holds the stage copies `program.stage_copies(rank)`, each a `Stage`
(backends/stage.py), which owns its module, optimizer and saved activations and does the
arithmetic of F, R, B, W, its reduce and its update. A rank materializes only those
stages' layers of a built-in model, each from its own seed (backends/layer_init.py), and
builds a user's model whole from the seed, keeping only those stages, so the replicas of
a stage (Chimera's `down` and `up` copies) start identical.

The runtime is what lies between the stages: the inputs and targets of its micro-batches
and the loss, scaled by 1/N here and nowhere else (`_scaled_loss`, which the stages call
on the last stage); the values in flight (`values`: a stage's output, an input gradient)
that `send_*`/`recv_*` move and the next stage's action takes; `signal` and `wait`,
which carry no data; `allreduce`, which starts summing one stage's gradients over its
replicas, and `step`, which waits for those sums, clips, and steps every copy; `update`
(asynchronous schedules only, which have no `step`), one copy's new weight version
(backends/versions.py); evictions (BPipe); and the counters, times and faults of each
action.

The actions are grouped by concern, one module each, which `RankRuntime` combines:
backends/rank_compute.py (F, P, R, B, W, U: inputs in, outputs out), rank_comms.py
(sends, receives, signals), rank_stash.py (evictions), rank_sync.py (allreduce, step,
clipping, tied weights); what they share (the value names, RankResult, the action
decorators) is rank_base.py.
"""

from __future__ import annotations

import copy as copying
import resource
import time
from collections.abc import Callable, MutableSequence
from time import perf_counter_ns
from typing import Any

import torch
from torch import nn

from pipelang.backends.config import RunConfig
from pipelang.backends.mesh import Grid
from pipelang.backends.metrics import tensor_bytes
from pipelang.backends.models import (
    LayeredModel,
    Shapes,
    plan_stages,
)
from pipelang.backends.precision import master_weights
from pipelang.backends.rank_base import (
    Fault,
    RankResult,
    Value,
    fingerprint,
    make_optimizer,
)
from pipelang.backends.rank_comms import CommActions
from pipelang.backends.rank_compute import ComputeActions
from pipelang.backends.rank_stash import StashActions
from pipelang.backends.rank_sync import (
    SyncActions,
    TiedGrads,
)
from pipelang.backends.shard import ShardActions, full_params, full_state, shard_copies
from pipelang.backends.stage import Settings, Stage
from pipelang.backends.stash import Stash
from pipelang.backends.transport import Handle, Transport, peer_failures
from pipelang.backends.versions import CopyVersions
from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program, placement
from pipelang.ir.program import whole_backwards
from pipelang.weights import weight_versions


class RankRuntime(ComputeActions, CommActions, StashActions, SyncActions, ShardActions):
    """The `rt` of one rank: its stage copies, their saved activations, and the actions
    (one method per action, by concern: backends/rank_compute.py, rank_comms.py,
    rank_stash.py, rank_sync.py, and a sharded copy's collectives, shard.py)."""

    def __init__(
        self,
        program: Program,
        rank: int,
        config: RunConfig,
        transport: Transport,
        device: torch.device,
        status: MutableSequence[int] | None = None,
        shapes: Shapes | None = None,
        replica: int = 0,
    ) -> None:
        self.program = program
        self.rank = rank
        self.replica = replica
        self.tensor: int = getattr(transport, "tensor", 0)
        """This process's tensor rank (`--tp`; 0 without)."""
        grid = Grid(config.dp, program.num_ranks, config.tp)
        self.world_rank = grid.process(replica, rank, self.tensor)
        """This process's rank in the whole run: `replica * R * T + rank * T + tensor`
        (backends/mesh.py; `replica * R + rank` without --tp)."""
        self.repeated: set[int] = set()
        """The ids of the trained tensors that every process of a tensor group holds
        whole (`--tp`: the norms, embeddings, head): a sum over the run counts them on
        tensor rank 0 only."""
        self.config = config
        self.transport = transport
        self.device = device
        slot = 3 * self.world_rank
        self.status: MutableSequence[int] = status if status is not None else [0] * (slot + 3)
        self.step_slot, self.action_slot = slot + 1, slot + 2
        self.fault = Fault.from_env(self.world_rank)
        self.split_backward = Kind.W in program.kinds
        self.recomputes = Kind.R in program.kinds
        self.scale = 1.0 / (program.num_microbatches * config.dp)
        if program.weights is not None:
            self.scale = 1.0  # each update averages the gradients it applies instead
        self.first_mb = replica * program.num_microbatches
        """This replica's micro-batch `mb` is micro-batch `first_mb + mb` of the step."""
        self._build_stages(shapes)
        if config.tp > 1:  # each copy's blocks split over its tensor group
            from pipelang.backends.tensor_parallel import parallelize_copies

            mesh = getattr(transport, "mesh", None)
            if mesh is None:
                raise InternalError("--tp needs a process per tensor rank (a DistTransport)")
            parallelize_copies(self, mesh["tp"])
        if config.shard:  # each copy FSDP2-sharded over its --dp copies (backends/shard.py)
            shard_copies(self)
        self.versions = _versions(program, config, self.copies)
        self.peak_versions = len(self.versions)
        self.reduced_at_step = [
            self.copies[key] for key in placement.reduced_at_step(program, rank, config.dp)
        ]
        self.group_sizes = {
            stage: len(set(program.replicas(stage))) * config.dp for stage, _ in self.copies
        }
        self.values: dict[Value, torch.Tensor] = {}
        self.reducing: list[tuple[Stage, torch.Tensor, list[torch.Tensor], Handle]] = []
        self.losses: list[tuple[int, torch.Tensor]] = []
        self.lr = config.lr_schedule_at()
        """The learning rate of each step (`--lr-schedule`)."""
        self.grad_bytes = 0
        """The most bytes of gradients this rank held at an optimizer step or update
        (`note_grad_bytes`)."""
        self.fingerprints: list[list[int]] = []
        """Per step, each copy's parameters' `fingerprint` (with `--check`)."""
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Static ids and targets per micro-batch (`load_inputs`); empty: made per use."""
        self.events: list[tuple[int, int, int, int]] = []
        self.timed = config.trace is not None
        """Time every action for the trace (CUDA: always, with events)."""
        self.busy_ns = 0
        self.span_ns: tuple[int, int] | None = None
        self.step_index = 0
        self.action_index = 0
        self.stepped = False
        self.t0 = time.perf_counter_ns()
        self.t0_event: torch.cuda.Event | None = None
        self.gpu_events: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] | None = None

    def _build_stages(self, shapes: Shapes | None) -> None:
        """The model cut into this rank's stage copies (and its frozen part where the rank
        runs `P`): of a built-in model only their layers are ever materialized, on the
        rank's device, the rest stay on the meta device (`ModelSpec.build`); a user's is
        built whole. The rest of the model is let go."""
        program, config, rank, device = self.program, self.config, self.rank, self.device
        self.model = config.spec.build(layers=())
        chunks, attention = program.chunks, program.costs.of("A")
        self.chunk_bounds = chunks and chunks.token_bounds(self.model.seq_len, attention)
        """The token boundaries of the sequence chunks (`Chunks.token_bounds`); None
        without chunks."""
        self.counting = config.count_activations or program.first_eviction() is not None
        """Whether the saved activations' bytes are measured (`RankResult`)."""
        self.stash = Stash() if self.counting or self.split_backward else None
        """Saved activations per forward: for evictions, their byte count, and what a
        split backward keeps for W (`weight_split`)."""
        whole = whole_backwards(program.ranks[rank]) if self.split_backward else frozenset()
        self.settings = Settings(
            self._scaled_loss,
            self.split_backward,
            self.recomputes,
            whole,
            self.stash,
            self.counting,
            self.chunk_bounds,
        )
        bounds = self.model.stage_bounds(program.num_stages, config.partition)
        if shapes is None:
            shapes = plan_stages(config.spec, program.num_stages, config.partition).shapes
        self.shapes = shapes
        held = {i for s, _ in program.stage_copies(rank) for i in bounds[s]}
        if rank in (program.frozen or ()):
            held.update(self.model.frozen_bounds)
        with torch.device(device):
            self.model.materialize(held)
        self.copies = {
            (s, p): self._stage_copy(s, p, bounds[s]) for s, p in program.stage_copies(rank)
        }
        copies = list(self.copies.values())
        self.tied = TiedGrads(self.model, bounds, copies, self.counts, device)
        self.frozen: nn.Module | None = None
        """The model's frozen part, on a rank that holds it (runs `P`)."""
        if rank in (program.frozen or ()):
            self.frozen = self.model.stage_module(self.model.frozen_bounds).to(device)
        self.model.layers = []  # keep only this rank's stages (and frozen part) alive

    def start_clock(self, t0: int | None = None, t0_event: torch.cuda.Event | None = None) -> None:
        """Action times count from now (or from `t0`, a perf_counter_ns shared by ranks).

        On CUDA an action's time is its GPU time, measured with events from `t0_event`
        (recorded now on this rank's stream unless given).
        """
        self.t0 = time.perf_counter_ns() if t0 is None else t0
        if self.device.type == "cuda":
            if t0_event is None:
                t0_event = torch.cuda.Event(enable_timing=True)
                t0_event.record()
            self.t0_event = t0_event
            self.gpu_events = []
            self.timed = True

    def fault_check(self, index: int) -> None:
        """Fire the injected fault if this is its step and action."""
        fault = self.fault
        if fault is not None and fault.step == self.step_index and fault.action == index:
            fault.trigger()

    def timed_call(
        self, index: int, method: Callable[..., None], args: Any, kwargs: dict[str, Any]
    ) -> None:
        """Run one action and record its start and end (CUDA events on a GPU)."""
        if self.gpu_events is not None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            method(self, *args, **kwargs)
            end.record()
            self.gpu_events.append((self.step_index, index, begin, end))
            return
        start = perf_counter_ns()
        method(self, *args, **kwargs)
        end_ns = perf_counter_ns()
        self.events.append((self.step_index, index, start - self.t0, end_ns - self.t0))
        if self.program.ranks[self.rank][index].kind.is_compute:
            self.busy_ns += end_ns - start

    def _stage_copy(self, stage: int, pipeline: str, layers: range) -> Stage:
        module = self.model.stage_module(layers)
        if self.model.ties:  # a tied weight: each copy its own, kept equal by `step`
            module = copying.deepcopy(module)  # shared inside the stage stay shared
        module = module.to(self.device)
        params = [p for p in module.parameters() if p.requires_grad]
        masters = master_weights(params) if self.config.mixed_precision else None
        return Stage(
            stage,
            pipeline,
            layers,
            module,
            stage == 0,
            stage == self.program.num_stages - 1,
            params,
            make_optimizer(masters or params, self.config),
            self.settings,
            masters,
        )

    def begin_step(self, step: int) -> None:
        """Start iteration `step`: reset the action counter, set the step's learning rate."""
        lr = self.lr.lr(step)
        for copy in self.copies.values():
            copy.optimizer.set_lr(lr)
        self.step_index = step
        self.action_index = 0
        self.stepped = False
        self.status[self.step_slot] = step
        if self.span_ns is None:
            start = perf_counter_ns() - self.t0
            self.span_ns = (start, start)

    def end_step(self) -> dict[int, float]:
        """Finish the iteration: wait for sends, check nothing is left; losses by mb."""
        self.status[self.action_slot] = self.action_index  # past the last: "after step k"
        with peer_failures():
            self.transport.end_step()
        left = [Action(Kind(k[0]), k[1], k[2], k[3], chunk=k[4]).text() for k in self.values] + [
            Action(Kind.F, mb, s, p, chunk=c).text()
            for copy in self.copies.values()
            for mb, s, p, c in copy.saved
        ]
        if self.stash is not None:
            left += [f"H{mb}@{s}/{p}" for mb, s, p, _ in self.stash.held]
        for versions in self.versions.values():
            versions.end_iteration()
        if left or self.reducing or not (self.stepped or self.versions):
            what = ", ".join(left) if left else "no `step` action ran"
            raise InternalError(f"rank {self.rank} ended step {self.step_index} unfinished: {what}")
        if self.config.check:
            self.fingerprints.append([fingerprint(full_params(c)) for c in self.copies.values()])
        losses: dict[int, float] = {}
        for mb, loss in self.losses:  # a chunked micro-batch's loss is its chunks' sum
            losses[mb] = losses.get(mb, 0.0) + float(loss)
        self.losses.clear()
        if self.span_ns is not None:
            self.span_ns = (self.span_ns[0], perf_counter_ns() - self.t0)
        return losses

    def close(self) -> None:
        """Release what must go before the process groups (a captured graph)."""

    def held_bytes(self) -> tuple[int, int]:
        """The bytes of this rank's (parameters, optimizer state) now: its stage copies'
        and frozen part's parameters; its optimizers' state tensors and, with
        `--mixed-precision`, their fp32 masters (each storage once, `tensor_bytes`)."""
        frozen = list(self.frozen.parameters()) if self.frozen is not None else []
        params = [p for c in self.copies.values() for p in c.module.parameters()]
        state: list[torch.Tensor] = []
        for copy in self.copies.values():
            state.extend(copy.masters or ())
            optimizer = copy.optimizer
            if optimizer is not None:
                for i in range(len(optimizer.params)):
                    state.extend(t for t in optimizer.state(i).values() if t.dim())
        return tensor_bytes([*params, *frozen]), tensor_bytes(state)

    def result(self, with_weights: bool) -> RankResult:
        """The report of this rank after the last step."""
        if self.gpu_events is not None and self.t0_event is not None:
            torch.cuda.synchronize(self.device)
            zero = self.t0_event
            self.events = [
                (step, index, int(zero.elapsed_time(b) * 1e6), int(zero.elapsed_time(e) * 1e6))
                for step, index, b, e in self.gpu_events
            ]
            actions = self.program.ranks[self.rank]
            self.busy_ns = sum(e - b for _, i, b, e in self.events if actions[i].kind.is_compute)
            if self.events:
                self.span_ns = (self.events[0][2], self.events[-1][3])
        params, state = self.held_bytes()
        result = RankResult(
            self.world_rank,
            [(c.stage, c.pipeline, c.layers.start) for c in self.copies.values()],
            events=self.events,
            peak_memory=peak_memory(self.device),
            param_bytes=params,
            grad_bytes=self.grad_bytes,
            optimizer_bytes=state,
            busy_ns=self.busy_ns,
            span_ns=self.span_ns or (0, 0),
            peak_weight_versions=self.peak_versions,
            peak_activation_bytes=self.stash.peak_bytes if self.stash is not None else 0,
            fingerprints=self.fingerprints,
            tp=self.config.tp,
        )
        if with_weights:
            for c in self.copies.values():
                result.copy_weights.append(copy_names(c))
        return result


def _versions(
    program: Program, config: RunConfig, copies: dict[tuple[int, str], Stage]
) -> dict[tuple[int, str], CopyVersions]:
    """An asynchronous schedule's weight versions per stage copy, and with
    --predict-weights each forward's gradient delay (weights.py), given to each copy
    (`Stage.versions`, `Stage.delays`); empty otherwise."""
    if program.weights is None:
        return {}
    predict = config.predict_weights
    delays = weight_versions(program).gradient_delays() if predict else {}
    versions = {}
    for key, copy in copies.items():
        copy.versions = versions[key] = CopyVersions(
            copy.module, copy.params, program.weights.stashes, predict
        )
        copy.delays = {mb: d for (mb, s, p), d in delays.items() if (s, p) == key}
    return versions


def copy_names(copy: Stage) -> dict[str, torch.Tensor]:
    """A stage copy's parameters named as in the whole model (`{layer}.{name}`)."""
    out = {}
    for name, tensor in full_state(copy).items():
        local, _, rest = name.partition(".")
        out[f"{copy.layers.start + int(local)}.{rest}"] = tensor.detach().cpu().clone()
    return out


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank in bytes: allocated on the GPU, resident on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def full_model_names(model: LayeredModel) -> dict[str, torch.Tensor]:
    """The whole model's parameters named like `copy_names`."""
    return {
        k: v.detach().cpu().clone() for k, v in nn.Sequential(*model.layers).state_dict().items()
    }
