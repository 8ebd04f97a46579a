"""Everything that can be known wrong about a run before a rank starts (`preflight`):
the program against the model, the machine and the options; raises RunError.

`RunError` is a run that cannot start (exit 1), `WorldError` one whose processes do not
fit the machine or torchrun's world (a usage error, exit 2). The launcher
(backends/launch.py) and a rank under torchrun (torchrun_rank.py) both call it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pipelang.backends.backend import BACKENDS
from pipelang.backends.mesh import Grid
from pipelang.diagnostics import clip
from pipelang.features import refusal
from pipelang.ir import SHARD_KINDS, Kind, Program

if TYPE_CHECKING:  # they import torch: only once a run starts
    from pipelang.backends.config import RunConfig
    from pipelang.backends.models import Shapes


class RunError(Exception):
    """A run that cannot start: the program does not fit the model or the machine."""


class WorldError(RunError):
    """The processes asked for (`--dp` x ranks) do not fit the machine or torchrun's
    world: a usage error (exit 2)."""


def preflight(program: Program, config: RunConfig) -> Shapes:
    """Everything that can be known wrong before a rank starts; raises RunError.

    Returns the shape of every stage's output (the receive buffers' shapes).
    """
    if config.frozen_layers and program.frozen is None:
        raise RunError(
            f"--frozen-layers {config.frozen_layers}: `{program.name}` has no frozen part "
            "(no `frozen` line), so no layers would run as one; drop the option"
        )
    if program.frozen is not None and config.frozen_layers is not None and config.frozen_layers < 1:
        raise RunError(
            f"`{program.name}` runs a frozen part (`P`), which needs at least one "
            "layer: --frozen-layers 1 or more"
        )
    shapes = program.shapes
    if shapes is not None and config.seq_len is not None and config.seq_len < max(shapes.lengths):
        raise RunError(
            f"--seq-len {config.seq_len}: `{program.name}` has micro-batches of "
            f"{max(shapes.lengths)} tokens; give at least that, or leave --seq-len out"
        )
    refused = (
        eviction_refusal(program, config)
        or chunks_refusal(program, config)
        or shard_refusal(program, config)
        or tp_refusal(config)
    )
    for consumer, used in (
        ("--dp", config.dp > 1),
        ("--tp", config.tp > 1),
        ("--mixed-precision", config.mixed_precision),
        ("--clip-grad", config.clip_grad is not None),
        ("checkpoints", config.save or config.resume),
    ):
        refused = refused or (refusal(program, consumer) if used else None)
    if refused is not None:
        raise RunError(refused)
    if config.predict_weights and (program.weights is None or not program.weights.stashes):
        policy = "synchronous" if program.weights is None else "`weights latest`"
        raise RunError(
            f"--predict-weights: `{program.name}` is {policy}; weight prediction is for "
            "asynchronous schedules that stash versions (`weights stash` or `weights K`: "
            "pipedream, pipedream-2bw), where a forward's weights are known to be stale"
        )
    if config.resume is not None:
        from pipelang.backends.checkpoint import CheckpointError, verify

        try:
            verify(config)
        except CheckpointError as err:
            raise RunError(str(err)) from None
    from pipelang.backends.models import plan_stages

    _check_world(program, config)
    plan = plan_stages(config.spec, program.num_stages, config.partition)
    hook = tp_hook_refusal(config)
    if hook is not None:
        raise RunError(hook)
    if plan.ties and config.shard:
        raise RunError(
            f"--shard: {config.model} ties weights across stages, whose copies are kept "
            "equal by a sum over whole gradients that sharded stages do not hold yet; "
            "untie them or run without --shard"
        )
    if plan.ties and program.weights is not None:
        raise RunError(
            f"`{program.name}` is asynchronous (`weights {program.weights.text()}`) and "
            f"{config.model} ties weights across stages, whose copies are kept equal at "
            "`step`, which an asynchronous schedule does not have; untie them or use a "
            "synchronous schedule"
        )
    for rank in range(program.num_ranks):
        _check_rank(program, rank)
    return plan.shapes


def _check_world(program: Program, config: RunConfig) -> None:
    """The processes the run needs are there: a GPU per rank for nccl, and under torchrun
    WORLD_SIZE = --dp x the program's ranks; raises WorldError."""

    from pipelang.backends.torchrun_env import MAX_PROCESSES, torchrun_env, under_torchrun

    grid = Grid(config.dp, program.num_ranks, config.tp)
    world = grid.world
    ranks = f"{program.num_ranks} ranks"
    if config.tp > 1:
        factors = [f"--dp {config.dp:,}"] * (config.dp > 1) + [ranks, f"--tp {config.tp:,}"]
        ranks = f"{world:,} processes ({' x '.join(factors)})"
    elif config.dp > 1:
        ranks = f"{world:,} ranks (--dp {config.dp:,} x {ranks})"
    if world > MAX_PROCESSES:
        raise WorldError(f"the run needs {ranks}, more than the {MAX_PROCESSES:,} a job may have")
    torchrun = torchrun_env() if under_torchrun() else None
    if torchrun is not None and torchrun.world != world:
        raise WorldError(
            f"torchrun started {torchrun.world} processes but the run needs "
            f"{ranks}; WORLD_SIZE must be --dp x the program's ranks" + " x --tp" * (config.tp > 1)
        )
    problem = BACKENDS[config.backend].world_problem(world, ranks, torchrun)
    if problem is not None:
        raise WorldError(problem)
    if config.rank_hosts is not None and not under_torchrun():
        from pipelang.backends.hosts import HostsError, mismatch, read_hosts, this_host

        try:  # every process starts here: each must be on this host
            hosts = read_hosts(config.rank_hosts)
        except HostsError as error:
            raise WorldError(str(error)) from error
        split = grid.hosts_problem(hosts, config.rank_hosts)
        if split is not None:
            raise WorldError(split)
        problem = mismatch(config.rank_hosts, hosts, [this_host()] * world)
        if problem is not None:
            raise WorldError(problem.split(". Launch")[0] + " (every process runs here)")


def _check_rank(program: Program, rank: int) -> None:
    """`rank`'s list is one the runtime can run: one copy of a stage, a `step` (in a
    synchronous schedule), and an allreduce for each replicated stage; raises RunError."""
    copies = program.stage_copies(rank)
    twice = [s for s, n in Counter(s for s, _ in copies).items() if n > 1]
    if twice:
        raise RunError(
            f"rank {rank} holds two copies of stage {twice[0]}; the runtime needs "
            "the replicas of a stage on different ranks"
        )
    kinds = {a.kind for a in program.ranks[rank]}
    if copies and Kind.STEP not in kinds and program.weights is None:
        raise RunError(
            f"rank {rank}'s program has no `step`; run a fully compiled program "
            "(the insert-sync pass adds the optimizer step)"
        )
    reduced = {(a.stage, a.pipeline) for a in program.ranks[rank] if a.kind is Kind.ALLREDUCE}
    for stage, pipe in copies:
        if len(set(program.replicas(stage))) > 1 and (stage, pipe) not in reduced:
            raise RunError(
                f"stage {stage} has replicas on ranks {program.replicas(stage)} but "
                f"rank {rank} never runs `allreduce@{stage}/{pipe}`; the replicas "
                "would drift apart"
            )


def shard_refusal(program: Program, config: RunConfig) -> str | None:
    """Why `--shard` cannot run as asked (`config.shard` against a program compiled with
    or without it, and a backend without a process per rank), or None."""
    sharded = any(a.kind in SHARD_KINDS for actions in program.ranks for a in actions)
    if sharded and not config.shard:
        return (
            f"`{program.name}` was compiled with --shard (its stages' `gather` and "
            "`reduce_scatter` ops): run it with --dp K --shard as it was compiled"
        )
    if config.shard and not sharded:
        return (
            f"--shard: `{program.name}` was compiled without it (it has no `gather` or "
            "`reduce_scatter` ops): compile it with --dp K --shard"
        )
    if config.shard and not BACKENDS[config.backend].processes:
        return (
            f"--shard needs a process per rank (FSDP2 shards over process groups): use "
            f"--backend {' or '.join(n for n, b in BACKENDS.items() if b.processes)}, not "
            f"{config.backend}"
        )
    return None


def eviction_refusal(program: Program, config: RunConfig) -> str | None:
    """Why the runtime cannot run `program`'s evictions (`E`, `H`, `L`) with `config`;
    None when it has none or they can run: on the CPU (gloo, local), without `R`."""
    if program.first_eviction() is None:
        return None

    cuda = BACKENDS[config.backend].computes_on_gpu()
    return (cuda and refusal(program, "a GPU")) or refusal(program, "the runtime's evictions")


def chunks_refusal(program: Program, config: RunConfig) -> str | None:
    """Why the runtime cannot run `program`'s sequence chunks with `config`, or None."""
    if program.chunks is None:
        return None
    count = program.chunks.count
    refused = refusal(program, "the runtime's chunks")
    if refused is not None:
        return refused
    from pipelang.backends.builtin_models import MODEL_FAMILIES

    family, _, name = config.model.partition(":")
    if family not in MODEL_FAMILIES:
        return (
            f"`{program.name}` splits micro-batches into {count} sequence chunks, which the "
            "runtime runs on the built-in models (`--model gpt:SIZE` or `llama:SIZE`), whose "
            f"attention reads the keys and values of earlier chunks; `--model {config.model}` "
            "cannot yet"
        )
    size = MODEL_FAMILIES[family].get(name)
    seq_len = config.seq_len or (size.seq_len if size is not None else count)
    if seq_len < count:
        return (
            f"`{program.name}` splits each sequence into {count} chunks, more than its "
            f"{seq_len} tokens: raise --seq-len or lower the chunks"
        )
    return None


def tp_refusal(config: RunConfig) -> str | None:
    """Why `--tp T` cannot run with `config` (the model, the backend, the options not
    built with it yet), or None; what it cannot run of a program is features.REFUSED's
    "--tp"."""
    tp = config.tp
    if tp < 2:
        return None
    from pipelang.backends.builtin_models import MODEL_FAMILIES

    family, _, size = config.model.partition(":")
    if family == "hf":
        counts = _hf_tp_counts(config)
        if isinstance(counts, str):
            return counts
    elif family in MODEL_FAMILIES and size in MODEL_FAMILIES[family]:
        cfg = MODEL_FAMILIES[family][size]
        counts = [("attention heads", cfg.heads)]
        counts += [("key/value heads", cfg.kv_heads)] if hasattr(cfg, "kv_heads") else []
        counts += [("MLP hidden features", getattr(cfg, "hidden", 4 * cfg.width))]
    else:  # a model of your own: its hook (`tp_hook_refusal`); a bad size is said elsewhere
        return _backend_refusal(config) or _options_refusal(config)
    for what, count in counts:
        if count % tp:
            return (
                f"--tp {tp}: {config.model} has {count} {what}, which {tp} tensor ranks "
                f"cannot split evenly; give a --tp that divides {count}"
            )
    return _backend_refusal(config) or _options_refusal(config)


def _hf_tp_counts(config: RunConfig) -> list[tuple[str, int]] | str:
    """What `--tp` splits of a Hugging Face model (its config.json's heads, key/value heads
    and MLP features), or why it cannot: GPT-2's fused `Conv1D` projections are not cut."""
    from pipelang.backends.hf_config import hf_directory, read_config
    from pipelang.backends.model_error import ModelError

    try:
        hf = read_config(hf_directory(config.model))
    except ModelError as err:
        return str(err)
    if hf["model_type"] == "gpt2":
        return (
            f"--tp with --model {clip(f'`{config.model}`')}: GPT-2's fused Conv1D "
            "projections are not split yet; the Llama family's (llama, qwen2, mistral) are"
        )
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    return [
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("MLP hidden features", int(hf["intermediate_size"])),
    ]


def _backend_refusal(config: RunConfig) -> str | None:
    if not BACKENDS[config.backend].processes:
        return (
            f"--tp needs a process per tensor rank (DTensor over process groups): use "
            f"--backend {' or '.join(n for n, b in BACKENDS.items() if b.processes)}, not "
            f"{config.backend}"
        )
    return None


def _options_refusal(config: RunConfig) -> str | None:
    options = (
        (
            "--graphs",
            config.graphs,
            "a tensor-parallel stage is not captured in a stream program yet",
        ),
        (
            "--mixed-precision",
            config.mixed_precision,
            "tensor-parallel stages keep no fp32 masters yet",
        ),
        ("--trace", config.trace, "the trace does not name a tensor rank's actions yet"),
        ("--save-hf", config.save_hf, "--save-hf does not gather tensor-parallel stages yet"),
    )
    for flag, given, why in options:
        if given:
            return f"--tp with {flag}: {why}; run it without one of them"
    return None


def tp_hook_refusal(config: RunConfig) -> str | None:
    """Why `--tp T` cannot split a model of your own: the module of `--model FILE.py:FUNC`
    defines no `tp(module, mesh)` beside FUNC; None where it does, or with a built-in
    model or without --tp. Loads the model's module: after it was vetted (`plan_stages`)."""
    from pipelang.backends.builtin_models import MODEL_FAMILIES
    from pipelang.backends.tensor_parallel import HOOK, user_hook

    if config.tp < 2 or config.model.partition(":")[0] in (*MODEL_FAMILIES, "hf"):
        return None
    if user_hook(config.model) is not None:
        return None
    where, _, func = config.model.rpartition(":")
    return clip(
        f"--tp {config.tp} with --model `{config.model}`: `{where}` defines no function "
        f"`{HOOK}(module, mesh)` beside `{func}`, which --tp calls to split each layer of a "
        "stage over its tensor ranks (docs/runtime.md, Tensor parallelism); define one, or "
        "run without --tp"
    )
