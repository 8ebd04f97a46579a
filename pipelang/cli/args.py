"""What several commands share: argument definitions, argument types, reading them back.

The leaf of the CLI package: it imports no command module. Torch is imported only when
a run's configuration is built (`config_from_args`), not for `--help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipelang import api
from pipelang.backends import DTYPES
from pipelang.compiler import Compilation
from pipelang.diagnostics import clip
from pipelang.evaluate import MAX_OPS
from pipelang.ir import COMPUTE_KINDS, COST_KINDS, CostModel, Program, cost_problem
from pipelang.readers import ReadError, read_number_rows, whole_number

if TYPE_CHECKING:
    from pipelang.backends.models import ModelSpec
    from pipelang.ir.streams import StreamProgram


class UsageError(Exception):
    """A bad command line (exit status 2)."""


# ---- argument types -------------------------------------------------------------------------


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _whole_number(text, 1)


def at_least_zero(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return _whole_number(text, 0)


SEEDS = 2**64
"""Seeds are 0 to 2**64 - 1: what `torch.manual_seed` takes (a negative seed is the same
as one of these, so it is not taken either)."""


def seed(text: str) -> int:
    """An argparse type: a seed, a whole number from 0 to 2**64 - 1."""
    digits = text.strip()
    if re.fullmatch("[0-9]{1,20}", digits) and int(digits) < SEEDS:
        return int(digits)
    raise argparse.ArgumentTypeError(
        clip(f"a seed is a whole number from 0 to {SEEDS - 1} (2**64 - 1), not `{text}`")
    )


def _whole_number(text: str, least: int, most: int | None = None) -> int:
    try:
        return whole_number(text.strip(), least, most)
    except ReadError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def seconds(text: str) -> float:
    """An argparse type: a time in seconds, more than 0."""
    value = seconds_or_zero(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def seconds_or_zero(text: str) -> float:
    """An argparse type: a time in seconds, 0 or more."""
    return _number(text, "a number of seconds", True, "a number of seconds, 0 or more")


def positive_number(text: str) -> float:
    """An argparse type: a finite number more than 0."""
    return _number(text, "a number", False, "a number more than 0")


def byte_size(text: str) -> float:
    """An argparse type: a size in bytes more than 0 (`40MiB`, `2GB`, `1e9`)."""
    from pipelang.planner.units import UnitError, parse_bytes

    try:
        value = parse_bytes(text)
    except UnitError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"`{text}`: a size more than 0")
    return value


def non_negative_number(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    return _number(text, "a number", True, "a number of at least 0")


def _number(text: str, noun: str, zero: bool, rule: str) -> float:
    """`text` as a finite number above 0 (or from 0, with `zero`), else an argparse
    error saying `rule`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {noun}, not {text!r}") from None
    if not (value >= 0 if zero else value > 0) or value == math.inf:
        raise argparse.ArgumentTypeError(f"must be {rule}, not {text}")
    return value


def betas(text: str) -> tuple[float, float]:
    """An argparse type: `B1,B2`, two numbers in [0, 1) (Adam's moment decays)."""
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or not all(0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected two numbers in [0, 1) as B1,B2 (0.9,0.999), not {text!r}"
        )
    return values[0], values[1]


def schedule_name(text: str) -> str:
    """An argparse type: SCHED, a path or a stdlib name; not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "the schedule name is empty: give a .pipe file or a stdlib name (`pipelang list`)"
        )
    return text


MOST_LAYERS = 1_000_000
"""The most layers a `--partition` gives one stage (models have far fewer)."""


def layer_counts(text: str) -> tuple[int, ...]:
    """An argparse type: `3,3,2`, layers per stage, each at most `MOST_LAYERS`."""
    counts = []
    for part in (p.strip() for p in text.split(",")):
        if not re.fullmatch(r"[+-]?[0-9]+", part):
            shown = text if len(text) <= 40 else f"{text[:36]}... ({len(text):,} characters)"
            raise argparse.ArgumentTypeError(f"expected layer counts like 3,3,2, not {shown!r}")
        if len(part) > 8 or abs(int(part)) > MOST_LAYERS:
            shown = part if len(part) <= 24 else f"{part[:20]}... ({len(part):,} digits)"
            raise argparse.ArgumentTypeError(
                f"a stage has at most {MOST_LAYERS:,} layers, not {shown}"
            )
        counts.append(int(part))
    return tuple(counts)


# ---- schedules ------------------------------------------------------------------------------


def add_param_options(parser: argparse.ArgumentParser, help: str) -> None:
    """`-p NAME=VALUE`, repeatable, into `args.params` (read with `parse_params`), and
    `--max-ops`."""
    parser.add_argument(
        "-p", dest="params", action="append", default=[], metavar="NAME=VALUE", help=help
    )
    parser.add_argument(
        "--max-ops",
        type=positive,
        default=MAX_OPS,
        metavar="K",
        help=f"refuse a schedule of more than K ops (default {MAX_OPS:,}, which every "
        "command handles in about 10 s); raise it for a schedule that is really bigger",
    )


def parse_params(pairs: Sequence[str]) -> dict[str, str]:
    """`-p K=V` strings into a dict; a malformed one is a usage error."""
    params: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"`-p {pair}`: expected NAME=VALUE, e.g. `-p D=4`")
        params[name.strip()] = value
    return params


def add_schedule_arguments(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    """SCHED (`optional`: where a --config file may give it) and its `-p` parameters."""
    parser.add_argument(
        "sched",
        type=schedule_name,
        metavar="SCHED",
        nargs="?" if optional else None,
        help="a .pipe file, or the name of a stdlib schedule (see `pipelang list`)",
    )
    add_param_options(parser, "set a schedule parameter; repeat for several (-p D=4 -p N=8)")
    add_lengths_argument(parser)


SHARD_HELP = (
    "with --dp K: shard each stage copy's parameters, gradients and optimizer state over "
    "its K data-parallel copies (FSDP2); the compiler adds `gather@S/P` before the copy's "
    "first op of the step (unless the order writes `gather()` first; after a written "
    "`reshard()` the order gathers again itself) and `reduce_scatter@S/P` after its last "
    "backward (timed by the cost entries AG and RS; docs/runtime.md, Larger than one device)"
)


def add_shard_arguments(parser: argparse.ArgumentParser, dp: bool = True) -> None:
    """`--shard`, and `--dp K` where the command has no --dp of its own (`dp`)."""
    if dp:
        parser.add_argument(
            "--dp",
            type=positive,
            default=1,
            metavar="K",
            help="data-parallel copies of the pipeline, for --shard (default 1)",
        )
    parser.add_argument("--shard", action="store_true", help=SHARD_HELP)


def add_lengths_argument(parser: argparse.ArgumentParser) -> None:
    """`--lengths FILE`: the micro-batches' shapes."""
    parser.add_argument(
        "--lengths",
        type=path,
        metavar="FILE",
        help="micro-batches of different shapes: one line per micro-batch, `LENGTH` or "
        "`SAMPLES LENGTH` (what `pipelang pack` writes); replaces the schedule's "
        "`lengths` and `sizes` lines, and N is their number unless -p N= gives it",
    )


def read_lengths(file: Path) -> tuple[tuple[int, int], ...]:
    """A `--lengths` file: per micro-batch, `LENGTH` or `SAMPLES LENGTH` (E0212)."""
    rows = read_number_rows(file, "E0212", "`LENGTH` or `SAMPLES LENGTH`", 2, "micro-batch")
    return tuple((1, row[0]) if len(row) == 1 else (row[0], row[1]) for row in rows)


def add_max_activations(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-activations",
        type=positive,
        metavar="K",
        help="reject the schedule if a rank ever holds more than K activations",
    )


def compile_args(
    args: argparse.Namespace, stop_after: str | None = None, sched: str | None = None
) -> Compilation:
    """Compile the schedule the parsed options name (SCHED or `sched`, -p, and where the
    command has them --max-activations, --dp, --shard, --lengths and --cost, under which orders
    that depend on the costs are expanded), through pass `stop_after` (default: all)."""
    lengths = getattr(args, "lengths", None)
    dp = getattr(args, "dp", 1)
    if getattr(args, "shard", False) and dp < 2:
        raise UsageError(
            "--shard shards each stage over its --dp copies: give --dp 2 or more with it"
        )
    return api.compile_schedule(
        sched or args.sched,
        parse_params(args.params),
        max_activations=getattr(args, "max_activations", None),
        stop_after=stop_after,
        dp=dp,
        max_ops=args.max_ops,
        shapes=None if lengths is None else read_lengths(lengths),
        costs=parse_cost(args.cost) if getattr(args, "cost", "") else None,
        shard=dp if getattr(args, "shard", False) else 1,
    )


def describe(program: Program) -> str:
    """One line: the schedule, its parameters and sizes."""
    params = ", ".join(f"{k}={v}" for k, v in program.params)
    ops = sum(1 for actions in program.ranks for a in actions if a.kind in COMPUTE_KINDS)
    return (
        f"{program.name}({params}): {program.num_ranks} ranks, {program.num_stages} stages, "
        f"{len(program.pipelines)} pipeline(s), {program.num_microbatches} micro-batches, "
        f"{ops} compute ops"
    )


_NAMES = "|".join(sorted(COST_KINDS, key=len, reverse=True))
_COST_ITEM = re.compile(rf"({_NAMES})(?:\[(\d{{1,18}})\])?=([0-9]*\.?[0-9]+)")
"""One `--cost` entry: a name, an optional stage, a decimal number."""


def add_cost_argument(parser: argparse.ArgumentParser, more: str = "") -> None:
    """`--cost`, one text for every command (`more`: what it adds there); the stages it
    names are checked where it meets the schedule (`layout.given_costs`, exit 2)."""
    text = "cost entries over the schedule's `cost` line (else F=B=R=P=1, W=C=0), e.g. "
    text += "F=1,B=2,W=1,C=0.1; per stage F[3]=2, C[b] the link between stages b and b+1; "
    text += "FB an overlapped pair; E, L an eviction's trips; shares A (attention), O (what a "
    text += "smaller micro-batch still takes), KV (keys and values), MW (what W keeps after "
    text += "B); S the reference's tokens (docs/language.md, Costs)"
    parser.add_argument("--cost", metavar="SPEC", default="", help=text + more)


def parse_cost(spec: str) -> CostModel:
    """`F=1,B=2,F[3]=1.5,C=0.1` into a CostModel; a malformed spec is a usage error."""
    entries: list[tuple[str, int | None, float]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        match = _COST_ITEM.fullmatch(item)
        if match is None:
            raise UsageError(
                f"`--cost {spec}`: cannot read `{item}`; expected e.g. "
                "F=1,B=2,W=1,C=0,FB=2 or F[3]=2 for stage 3"
            )
        kind, stage, value = match.groups()
        problem = cost_problem(kind, float(value))
        if problem is not None:
            raise UsageError(f"`--cost {spec}`: {problem}")
        entries.append((kind, None if stage is None else int(stage), float(value)))
    return CostModel(tuple(entries))


# ---- files ----------------------------------------------------------------------------------


def write_output(path: Path, data: str | bytes) -> None:
    """Write a file the user asked for, creating its folder; failures are usage errors."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    except OSError as err:
        raise UsageError(f"cannot write `{path}`: {err.strerror}") from None


def writable(path: Path) -> Path:
    """`path`, once a file can be written there (its folder made): a usage error now."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        made = not path.exists()  # checked, not written: a later failure leaves no file
        path.open("a").close()
        if made:
            path.unlink()
    except OSError as err:
        raise UsageError(f"cannot write `{path}`: {err.strerror}") from None
    return path


def path(text: str) -> Path:
    """An argparse type: a file or directory name, not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty")
    return Path(text)


def data_file(text: str) -> str:
    """A `--data` file that exists (what it holds is checked before the run starts)."""
    if not path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def model_name(text: str) -> str:
    """`--model`: `hf:DIR` checked here (the extra installed, DIR a directory with a
    config.json); the other kinds when the model is built."""
    if text.startswith("hf:"):
        from pipelang.backends.hf_config import hf_directory
        from pipelang.backends.model_error import ModelError

        try:
            hf_directory(text)
        except ModelError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return text


# ---- runs -----------------------------------------------------------------------------------


def add_model_arguments(
    parser: argparse.ArgumentParser, default_model: str | None, purpose: str = ""
) -> None:
    """The options that pick the model and its inputs, shared by `run` and `profile`;
    without a `default_model`, `--model` is required, unless a `purpose` says what it
    is for (the slot bytes of `simulate` and `compile`)."""
    parser.add_argument(
        "--model",
        type=model_name,
        default=default_model,
        required=default_model is None and not purpose,
        metavar="MODEL",
        help=(purpose or "")
        + "gpt:tiny, gpt:small, gpt:medium, llama:tiny, llama:small, hf:DIR (a Hugging Face "
        "checkpoint directory: Llama, Qwen2, Mistral, GPT-2; pip install pipelang[hf]), or "
        "your own package.module:FUNC or file.py:FUNC returning an nn.Sequential (layers) or "
        "a list of modules (one per stage)"
        + (f" (default {default_model})" if default_model else ""),
    )
    parser.add_argument(
        "--micro-batch-size",
        type=positive,
        default=4,
        metavar="B",
        help="sequences per micro-batch (default 4)",
    )
    parser.add_argument(
        "--seq-len",
        type=positive,
        metavar="T",
        help="tokens per sequence (default: the model's, 32 for gpt:tiny)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="parameter and activation dtype (default float32)",
    )
    parser.add_argument(
        "--seed",
        type=seed,
        default=0,
        help=f"model and data seed, 0 to {SEEDS - 1:,} (default 0)",
    )


def add_slot_model_arguments(parser: argparse.ArgumentParser, activations: bool = False) -> None:
    """`--model` and its inputs, optional: the bytes of the stream program's data slots
    (and with `activations`, each rank's peak bytes of saved activations)."""
    held = ", and its peak bytes of saved activations (measured per stage)" if activations else ""
    add_model_arguments(
        parser,
        default_model=None,
        purpose=f"give each rank's data-slot bytes (what a run allocates){held} for this model: ",
    )
    parser.add_argument(
        "--partition",
        type=layer_counts,
        metavar="L0,L1,...",
        help="with --model: the model's layers per stage (default: the schedule's "
        "`partition` line, else as even as possible, as `pipelang run` cuts it)",
    )


def data_slot_bytes(
    args: argparse.Namespace, program: Program, streams: StreamProgram
) -> list[int] | None:
    """Per process of `streams`, the bytes of its data slots for the model the options of
    `add_slot_model_arguments` name (None without `--model`)."""
    if not model_named(args):
        return None
    from pipelang.backends.models import ModelError, plan_stages
    from pipelang.backends.stream_executor import slot_bytes

    program = _partitioned(args, program)
    spec = _model_spec(args, program)
    try:
        shapes = plan_stages(spec, program.num_stages, program.partition).shapes
    except ModelError as err:
        raise UsageError(str(err)) from None
    return [sum(slot_bytes(streams, r, shapes).values()) for r in range(streams.ranks)]


def activation_bytes(
    args: argparse.Namespace, program: Program, costs: CostModel
) -> list[float] | None:
    """Per rank, the most bytes of saved activations it holds at once for the model the
    options of `add_slot_model_arguments` name (None without `--model`; see
    `measure.activation_peaks`)."""
    if not model_named(args):
        return None
    from pipelang.backends.measure import activation_peaks
    from pipelang.backends.models import ModelError

    program = _partitioned(args, program)
    spec = _model_spec(args, program)
    try:
        return activation_peaks(spec, program, costs)
    except ModelError as err:
        raise UsageError(str(err)) from None


def model_named(args: argparse.Namespace) -> bool:
    """Whether `--model` is given; `--partition` cuts its layers, so it needs one."""
    if args.partition is not None and args.model is None:
        raise UsageError("--partition cuts the model's layers into stages: give --model too")
    return args.model is not None


def _partitioned(args: argparse.Namespace, program: Program) -> Program:
    """`program` with `--partition` in place of its `partition` line, where given."""
    return (
        program
        if args.partition is None
        else dataclasses.replace(program, partition=args.partition)
    )


def _model_spec(args: argparse.Namespace, program: Program) -> ModelSpec:
    """The model `--model` names, its first layer frozen where the schedule has a frozen
    part (as `pipelang run` does by default)."""
    from pipelang.backends.models import ModelSpec

    frozen = 1 if program.frozen is not None else 0
    return ModelSpec(
        args.model, args.seq_len, args.micro_batch_size, args.dtype, args.seed, frozen_layers=frozen
    )
