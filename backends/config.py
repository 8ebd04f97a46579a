"""A run's configuration, `RunConfig`: every option of `pipelang run` in one place.

Each field that `pipelang run` (and a generated rank file) takes from its command line
says so here, with its help text and how its value is read (`Option`); the CLI builds the
options from these fields (`cli/run_options.py`, `add_run_arguments`) and the config back from
them (`config_from_args`), so a new option is one field. The model's own options
(`--model`, `--micro-batch-size`, `--seq-len`, `--dtype`, `--seed`) are shared with
`profile` and `simulate --model` and are the CLI's `add_model_arguments`. Nothing here
imports torch, so that `--help` starts at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pipelang.backends import OPTIMIZERS
from pipelang.backends.backend import BACKENDS, DEFAULT

if TYPE_CHECKING:
    from pipelang.backends.models import ModelSpec
    from pipelang.backends.optim import LrSchedule
    from pipelang.ir import Program

DEFAULT_LR = {"sgd": 0.05, "adam": 3e-3, "adamw": 3e-3}
DEFAULT_WEIGHT_DECAY = 0.1
LR_SCHEDULES = ("constant", "cosine", "linear")
SGD_MOMENTUM = 0.9
MAX_STEPS = 10**9
"""The most training steps a run takes (a bound on what a command line can ask for)."""


@dataclass(frozen=True, slots=True)
class Option:
    """How the command line gives a field: its help, how the text is read (`parse`: a
    reader the CLI names, `cli/run_options.py`'s `READERS`; "" for a flag), and its metavar and
    choices."""

    help: str
    parse: str = ""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None


def option(default: Any, help: str, parse: str = "", **kwargs: Any) -> Any:
    """A RunConfig field that `pipelang run` takes as `--NAME` (the field's name, `_` as
    `-`)."""
    return field(default=default, metadata={"option": Option(help, parse, **kwargs)})


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything a rank needs to know about a run besides the Program; picklable. The
    fields with an `option` are `pipelang run`'s command line, in its `--help` order."""

    model: str = "gpt:tiny"
    backend: str = option(
        DEFAULT,
        "; ".join(f"{name}: {row.help}" for name, row in BACKENDS.items())
        + f" (default {DEFAULT})",
        choices=tuple(BACKENDS),
    )
    steps: int = option(3, f"training steps (default 3, at most {MAX_STEPS:,})", "steps")
    dp: int = option(
        1,
        "data parallelism: K copies of the whole pipeline, K x ranks processes, each "
        "copy on its own N micro-batches of a K x N step, gradients averaged over the "
        "copies (default 1)",
        "positive",
        metavar="K",
    )
    shard: bool = option(
        False,
        "with --dp K: shard each stage copy's parameters, gradients and optimizer state "
        "over its K data-parallel copies (FSDP2; gloo or nccl): an all-gather before the "
        "copy's first op of the step, one reduce-scatter after its last backward "
        "(docs/runtime.md, Larger than one device); --check compares bit for bit at K = 2 "
        "(a sum of two adds in either order alike), within 1e-5 relative above",
    )
    tp: int = option(
        1,
        "tensor parallelism for the built-in models (gpt, llama), Hugging Face models of "
        "the Llama family (hf:DIR: llama, qwen2, mistral), and a model of your own by the "
        "tp(module, mesh) its module defines: each stage copy split "
        "over T processes (DTensor: attention heads and MLP features column-, their output "
        "projections row-parallel; embedding, norms and head whole on each), K x ranks x T "
        "processes (gloo or nccl); T must divide the heads (and llama's key/value heads); "
        "--check holds within its tolerance (fp32: 1e-5 + 1e-4 x |reference|, Adam adding "
        "lr/20), not bit for bit: the row-parallel products add in another order "
        "(docs/runtime.md, Tensor parallelism) (default 1)",
        "positive",
        metavar="T",
    )
    check: bool = option(
        False,
        "compare weights and losses with single-process training that computes and adds "
        "the gradients as the run does: bit for bit equal on a CPU (tied weights too), "
        "except for an asynchronous schedule whose W's run in another order than its "
        "B's, or on a GPU (kernels that add in varying order), where a "
        "tolerance holds (docs/runtime.md); a failure names the first step that differs "
        "and prints the per-step losses",
    )
    graphs: bool = option(
        False,
        "graph mode, with capturable optimizers: with nccl, each rank's stream "
        "program is captured as one CUDA graph after 3 eager steps and replayed (not yet "
        "run on a GPU); over gloo it runs as without --graphs (a CPU has nothing to "
        "capture); with --backend local on a machine without CUDA, every rank's stream "
        "program runs on the CPU executor, streams interleaved as --stream-seed picks, "
        "dead slots NaN",
    )
    stream_seed: int = option(
        0,
        "with --graphs on the CPU: the interleaving of step k is seed S + k (default 0)",
        "seed",
        metavar="S",
    )
    optimizer: str = option(
        "adam",
        "adam; adamw (Adam with decoupled weight decay); or sgd with momentum 0.9 (default adam)",
        choices=OPTIMIZERS,
    )
    lr: float | None = option(
        None,
        "learning rate, the peak of --lr-schedule (default 0.05 sgd, 3e-3 adam and adamw)",
        "positive_number",
    )
    weight_decay: float | None = option(
        None,
        "adamw's decoupled weight decay (default 0.1); matrices and embeddings decay, "
        "biases and norms do not (as nanoGPT and torchtitan), unless --decay-all",
        "fraction",
        metavar="WD",
    )
    decay_all: bool = option(False, "adamw: decay every parameter, biases and norms too")
    betas: tuple[float, float] | None = option(
        None, "adam and adamw's betas (default 0.9,0.999)", "betas", metavar="B1,B2"
    )
    eps: float | None = option(None, "adam and adamw's eps (default 1e-8)", "positive_number")
    lr_schedule: str = option(
        "constant",
        "the learning rate over the run: constant, or after --warmup-steps a cosine or "
        "linear decay from --lr to --min-lr at the last of --steps (a function of the "
        "step: a resumed run goes on where it was) (default constant)",
        choices=LR_SCHEDULES,
    )
    warmup_steps: int = option(
        0, "steps of linear warm-up from --lr / K to --lr (default 0)", "count", metavar="K"
    )
    min_lr: float | None = option(
        None,
        "where --lr-schedule's decay ends (default --lr / 10)",
        "fraction",
        metavar="LR",
    )
    mixed_precision: str | None = option(
        None,
        "compute in bfloat16 (parameters, activations, messages) with fp32 master "
        "weights, optimizer state, gradient sums and allreduces; --dtype is the other "
        "mode, everything in one dtype, and stays float32 with this",
        choices=("bfloat16",),
    )
    """The model spec's dtype is then the compute dtype; `dtype` stays float32."""
    clip_grad: float | None = option(
        None,
        "clip the gradients to global norm MAX before each step, the norm taken over "
        "every stage of every rank, as torch.nn.utils.clip_grad_norm_ does in one process",
        "positive_number",
        metavar="MAX",
    )
    predict_weights: bool = option(
        False,
        "asynchronous schedules with stashed versions (pipedream, pipedream-2bw): run "
        "each forward on the weights predicted for the update its gradient meets, the "
        "newest moved by the last update once per update in between (XPipe)",
    )
    partition: tuple[int, ...] | None = option(
        None,
        "layers per stage (default: as even as possible); with a frozen part, of "
        "the layers after it",
        "layer_counts",
        metavar="L0,L1,...",
    )
    frozen_layers: int | None = option(
        None,
        "for a schedule with a `frozen` line: the model's first K layers are its "
        "frozen part, run without gradients by the `P` ops and never updated (default 1, "
        "the embedding of a built-in model)",
        "positive",
        metavar="K",
    )
    init: str | None = option(
        None,
        "how a model of your own (--model FILE.py:FUNC) gets its weights: factory, "
        "built whole by FUNC on every rank, its own initialization kept (default); "
        "layers, FUNC called on the meta device and each rank materializing only its "
        "stages' layers, each set by its modules' reset_parameters() from a seed of "
        "its own (--seed and the layer's index), so a rank holds only its share "
        "(docs/runtime.md)",
        choices=("factory", "layers"),
    )
    timeout: float = option(
        60.0,
        "stop every rank if one fails or none moves for this long (default 60)",
        "seconds",
        metavar="SECONDS",
    )
    trace: str | None = option(
        None,
        "write every action's real start and end as a Chrome trace (with --trace-every, "
        "of every K-th step only)",
        "path",
        metavar="OUT.json",
    )
    trace_every: int | None = option(
        None,
        "with --trace OUT.json: trace only steps K, 2K, ..., each written as it ends to "
        "its own file OUT-stepK.json (which `pipelang viz --trace` draws), so a long run "
        "keeps no more than one step's actions; with --tensorboard, each such step's "
        "measured timeline is the image `timeline` at step K",
        "positive",
        metavar="K",
    )
    log: str | None = option(
        None,
        "write one JSON line per step: step, loss, seconds, tokens, tokens_per_s, lr, "
        "grad_norm (before clipping), peak_memory (bytes, per rank), bubble (measured), "
        "predicted_bubble (the simulator's, with the schedule's costs) and per rank the "
        "bytes of its parameters, gradients and optimizer state (param_bytes, grad_bytes, "
        "optimizer_bytes)",
        "path",
        metavar="FILE.jsonl",
    )
    tensorboard: str | None = option(
        None,
        "write the --log metrics per step as TensorBoard scalars to DIR, and with --trace "
        "the measured timeline's figure at the end (with --trace-every K, at steps K, 2K, "
        "...) (needs the tensorboard extra: pip install pipelang[tensorboard])",
        "path",
        metavar="DIR",
    )
    data: str | None = option(
        None,
        "train on this file's tokens instead of synthetic data: a .npy of integer "
        "ids, a .bin of uint16 ids, or any other file as bytes (ids 0-255); each step's "
        "windows are drawn at offsets seeded by --seed, the same as the --check reference",
        "data_file",
        metavar="FILE",
    )
    rank_hosts: str | None = option(
        None,
        "the host each process must run on, one per line in rank order (--dp copies "
        "included); every process checks it at start, and the run stops before its first "
        "step when one runs elsewhere (a plan's devices held across nodes: docs/runtime.md)",
        "data_file",
        metavar="FILE",
    )
    save: str | None = option(
        None,
        "write a checkpoint (torch.distributed.checkpoint) of parameters and optimizer "
        "state to DIR/step-K after the last step K, and every --save-every steps; a DIR "
        "that holds checkpoints already needs --resume (auto: go on from them)",
        "path",
        metavar="DIR",
    )
    save_hf: str | None = option(
        None,
        "with --model hf:DIR: after the last step, write the trained model to OUT_DIR "
        "(new or empty) as a Hugging Face checkpoint: DIR's config.json, one safetensors "
        "shard per stage and model.safetensors.index.json, which "
        "AutoModelForCausalLM.from_pretrained(OUT_DIR) loads (--mixed-precision: the "
        "fp32 masters)",
        "path",
        metavar="OUT_DIR",
    )
    save_every: int | None = option(
        None, "with --save: also checkpoint after every K steps", "positive", metavar="K"
    )
    keep_last: int | None = option(
        None,
        "with --save: keep only this run's newest K complete checkpoints, deleting an "
        "older one only once a newer one is complete (another run's are never deleted) "
        "(default: keep all)",
        "positive",
        metavar="K",
    )
    resume: str | None = option(
        None,
        "start from a checkpoint: DIR/step-K as --save wrote it, or the latest one "
        "under DIR; `auto`: the latest complete one under --save DIR, or step 0 when "
        "there is none yet (one command line for a job's first run and its requeues); "
        "--steps still counts from step 0, so a step-3 checkpoint with --steps 6 "
        "runs 3 more steps. Any schedule over the same model loads it",
        "checkpoint",
        metavar="DIR|auto",
    )
    """The checkpoint directory to start from (a `step-K`, found already); None: step 0."""
    micro_batch_size: int = 4
    seq_len: int | None = None
    dtype: str = "float32"
    seed: int = 0
    debug: bool = False
    count_activations: bool = False
    """Count the bytes of saved activations per rank (always on with evictions)."""
    first_step: int = 0
    """The step the run starts at: 0, or the resumed checkpoint's step."""
    run_id: str | None = None
    """This run's id, in its checkpoints (`checkpoint_dirs.py`); None without --save."""
    lineage: tuple[tuple[str, int], ...] = ()
    """The runs this run goes on from, each with its last step on the way (its resumed
    checkpoint's lineage and run): `--keep-last` deletes their checkpoints up to there."""
    batch_shapes: tuple[tuple[int, int], ...] | None = None
    """(samples, length) of each micro-batch when the schedule's differ (`for_program`)."""

    @property
    def spec(self) -> ModelSpec:
        from pipelang.backends.models import ModelSpec

        dtype = self.mixed_precision or self.dtype  # what the stages compute in
        size = self.micro_batch_size
        frozen = self.frozen_layers or 0
        shapes = self.batch_shapes
        return ModelSpec(
            self.model,
            self.seq_len,
            size,
            dtype,
            self.seed,
            self.data,
            frozen,
            shapes,
            self.init or "factory",
        )

    def for_program(self, program: Program) -> RunConfig:
        """This config completed by the schedule: its `partition` line unless
        `--partition` is given, one frozen layer for a schedule with a `frozen` line
        unless `--frozen-layers` is given, and its micro-batches' shapes where they
        differ (the largest samples and length then size the buffers, and the length the
        model's positions unless `--seq-len` is given)."""
        config = self
        if config.partition is None and program.partition is not None:
            config = replace(config, partition=program.partition)
        if config.frozen_layers is None and program.frozen is not None:
            config = replace(config, frozen_layers=1)
        shapes = program.shapes
        if shapes is not None and config.batch_shapes is None:
            config = replace(
                config,
                batch_shapes=tuple(zip(shapes.samples, shapes.lengths, strict=True)),
                micro_batch_size=max(shapes.samples),
                seq_len=config.seq_len or max(shapes.lengths),
            )
        return config

    @property
    def logs_metrics(self) -> bool:
        """Whether each step measures what only the metrics show (`--log`,
        `--tensorboard`): the gradient norm without `--clip-grad` (a collective over every
        rank), and on a GPU the step's busy time (a wait for the step's last op)."""
        return self.log is not None or self.tensorboard is not None

    @property
    def run_steps(self) -> int:
        """How many steps this run trains: `--steps` counts from step 0, not from a
        resumed checkpoint's step."""
        return self.steps - self.first_step

    @property
    def learning_rate(self) -> float:
        """The peak learning rate (the constant one without a schedule)."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    def lr_schedule_at(self) -> LrSchedule:
        """The learning rate of every step (`optim.LrSchedule`)."""
        from pipelang.backends.optim import LrSchedule

        peak = self.learning_rate
        floor = self.min_lr if self.min_lr is not None else peak / 10
        return LrSchedule(peak, self.lr_schedule, self.warmup_steps, floor, self.steps)
