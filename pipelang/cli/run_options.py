"""`pipelang run`'s own options, one per `RunConfig` field (backends/config.py), which a
generated rank file reads too: the parser's options from the fields
(`add_run_arguments`), and the config back from the parsed options (`config_from_args`),
with the checks of options that must work together."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from pipelang.backends.backend import checkpoint_problem
from pipelang.backends.config import MAX_STEPS, Option, RunConfig
from pipelang.cli.args import (
    UsageError,
    _whole_number,
    add_model_arguments,
    betas,
    data_file,
    layer_counts,
    non_negative_number,
    path,
    positive,
    positive_number,
    seconds,
    seed,
    writable,
)

READERS: dict[str, Any] = {
    "seed": seed,
    "positive": positive,
    "positive_number": positive_number,
    "seconds": seconds,
    "steps": lambda text: _whole_number(text, 1, MAX_STEPS),
    "layer_counts": layer_counts,
    "path": path,
    "checkpoint": lambda text: text.strip() if text.strip() == "auto" else path(text),
    "data_file": data_file,
    "fraction": non_negative_number,
    "betas": betas,
    "count": lambda text: _whole_number(text, 0, MAX_STEPS),
}
"""How the text of each kind of run option is read (`config.Option.parse`)."""


def _run_options() -> list[tuple[str, Any, Option]]:
    """(name, default, option) of every RunConfig field the command line gives."""
    return [
        (f.name, f.default, f.metadata["option"])
        for f in dataclasses.fields(RunConfig)
        if "option" in f.metadata
    ]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `pipelang run`, also read by a generated rank program (the global
    --debug is the CLI's): the model's, then one per RunConfig field with an `option`."""
    add_model_arguments(parser, default_model="gpt:tiny")
    for name, default, option in _run_options():
        flag = "--" + name.replace("_", "-")
        if not option.parse and not option.choices:
            parser.add_argument(flag, action="store_true", help=option.help)
            continue
        parser.add_argument(
            flag,
            type=READERS[option.parse] if option.parse else str,
            default=default,
            metavar=option.metavar,
            choices=option.choices,
            help=option.help,
        )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig that the options of `add_run_arguments` describe; a UsageError for
    options that cannot work together."""
    given = {name: getattr(args, name) for name, _, _ in _run_options()}
    if args.log is not None:
        writable(args.log)
    _check_trace_every(args)
    for name, _, option in _run_options():  # a path is kept as its text
        if option.parse == "path" and given[name] is not None:
            given[name] = str(given[name])
    config = RunConfig(
        model=args.model,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        dtype=args.dtype,
        seed=args.seed,
        debug=bool(getattr(args, "debug", False)),
        **given | {"mixed_precision": _mixed_precision(args)} | _checkpoint_options(args),
    )
    _check_optimizer(config)
    kind = config.model.partition(":")[0]
    if config.init is not None and kind in ("gpt", "llama", "hf"):
        raise UsageError(
            f"--init is for a model of your own (--model FILE.py:FUNC); {kind} models are "
            "always made on the meta device, each rank materializing only its layers"
        )
    if config.save_hf is not None:
        from pipelang.backends.hf_save import out_dir_problem

        problem = out_dir_problem(config.model, config.save_hf)
        if problem is not None:
            raise UsageError(problem)
    return config


def _check_trace_every(args: argparse.Namespace) -> None:
    """`--trace-every K` has a trace to write and a step to trace; UsageError if not."""
    every = args.trace_every
    if every is None:
        return
    if args.trace is None:
        raise UsageError("--trace-every needs --trace OUT.json (the name of the step files)")
    if every > args.steps:
        raise UsageError(
            f"--trace-every {every} traces no step of a {args.steps}-step run (--steps): "
            f"give K of at most {args.steps}"
        )


def _check_optimizer(config: RunConfig) -> None:
    """The optimizer options fit the optimizer and the schedule; UsageError if not."""
    optimizer = config.optimizer
    if optimizer != "adamw" and (config.weight_decay is not None or config.decay_all):
        raise UsageError(
            f"--weight-decay and --decay-all are adamw's (decoupled decay); the optimizer "
            f"is {optimizer}: give --optimizer adamw"
        )
    if optimizer == "sgd" and (config.betas is not None or config.eps is not None):
        raise UsageError("--betas and --eps are adam's and adamw's; the optimizer is sgd")
    if config.lr_schedule == "constant" and config.min_lr is not None:
        raise UsageError("--min-lr is where a decay ends: give --lr-schedule cosine or linear")
    if config.min_lr is not None and config.min_lr > config.learning_rate:
        raise UsageError(
            f"--min-lr {config.min_lr:g} is above the peak --lr {config.learning_rate:g}"
        )
    if config.warmup_steps >= config.steps and config.lr_schedule != "constant":
        raise UsageError(
            f"--warmup-steps {config.warmup_steps} leaves no step of the run (--steps "
            f"{config.steps}) for the {config.lr_schedule} decay"
        )


def _mixed_precision(args: argparse.Namespace) -> str | None:
    if args.mixed_precision and args.dtype != "float32":
        raise UsageError(
            f"--mixed-precision {args.mixed_precision} keeps fp32 master weights and "
            f"--dtype {args.dtype} puts everything in one dtype: give one of them"
        )
    return str(args.mixed_precision) if args.mixed_precision else None


def _checkpoint_options(args: argparse.Namespace) -> dict[str, Any]:
    """RunConfig's checkpoint fields (`checkpoint_dirs.resolve`, which says what `--resume
    auto` takes); UsageError if they do not work together or name no checkpoint,
    CheckpointError (exit 1) for a checkpoint that cannot be read."""
    if args.save_every is not None and args.save is None:
        raise UsageError("--save-every needs --save DIR (where the checkpoints go)")
    if args.keep_last is not None and args.save is None:
        raise UsageError("--keep-last needs --save DIR (where the checkpoints go)")
    problem = (args.save or args.resume) and checkpoint_problem(args.backend)
    if problem:
        raise UsageError(problem)
    if args.save is not None:
        try:
            args.save.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--save: cannot make `{args.save}`: {err.strerror}") from None
    from pipelang.backends.checkpoint_dirs import CheckpointError, resolve

    save = str(args.save) if args.save else None
    try:
        start = resolve(save, args.resume, args.steps)
    except CheckpointError as err:
        if err.status == 2:
            raise UsageError(str(err)) from None
        raise
    if start.said is not None and os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(start.said, file=sys.stderr, flush=True)
    resume = str(start.path) if start.path else None
    return {"save": save, "save_every": args.save_every, "keep_last": args.keep_last} | {
        "resume": resume,
        "first_step": start.step,
        "run_id": start.run_id,
        "lineage": start.lineage,
    }
