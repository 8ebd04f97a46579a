"""`simulate --model`'s memory per process: each one's predicted bytes of parameters,
gradients, optimizer state (pipelang/sim/state.py) and saved activations, under
`--dp K [--shard]`, `--tp T`, `--optimizer` and `--mixed-precision` as `pipelang run`
takes them."""

from __future__ import annotations

import argparse

from rich.table import Table

from pipelang.backends import OPTIMIZERS
from pipelang.cli.args import (
    UsageError,
    _model_spec,
    _partitioned,
    model_named,
    positive,
)
from pipelang.cli.args import activation_bytes as args_activation_bytes
from pipelang.diagnostics import clip
from pipelang.ir import CostModel, Program

COLUMNS = {
    "param_bytes": "parameters",
    "grad_bytes": "gradients",
    "optimizer_bytes": "optimizer",
    "peak_activation_bytes": "activations",
    "total_bytes": "total",
}
"""The byte counts of each process's row (`--json`'s keys) and their columns' titles."""


def add_state_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tp`, `--optimizer` and `--mixed-precision`, as `pipelang run` takes them."""
    parser.add_argument(
        "--tp",
        type=positive,
        default=1,
        metavar="T",
        help="with --model: as `pipelang run --tp T`, K x ranks x T processes (process "
        "k*R*T + r*T + t), each holding its tensor rank's part of its stages: the blocks' "
        "column- and row-parallel projections 1/T each (as backends/tensor_parallel.py "
        "splits them), the embedding, norms and head whole; with --dp K --shard that part "
        "sharded over the K copies; the saved activations one tensor rank's (measured with "
        "its parts of the split projections). A model of your own is split by its "
        "tp(module, mesh) hook, which simulate does not run: refused (default 1)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="with --model: the optimizer whose state each process holds, as `pipelang run "
        "--optimizer` (default adam): sgd one momentum buffer per parameter, adam and adamw "
        "two moments",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("bfloat16",),
        help="with --model: as `pipelang run --mixed-precision`: bf16 parameters and "
        "activations, fp32 master weights, gradients and optimizer state",
    )


def check_state_arguments(args: argparse.Namespace) -> None:
    """UsageError where `--optimizer` or `--mixed-precision` come without `--model`, or
    `--mixed-precision` with another `--dtype`; then the compute dtype in `args.dtype`
    (bf16 under `--mixed-precision`), which the activations are measured in too."""
    if args.tp > 1 and args.model is None:
        raise UsageError(
            f"--tp {args.tp} says what each process holds of the model's parameters: give "
            "--model too"
        )
    named = ("optimizer", "mixed_precision")
    given = [f"--{key.replace('_', '-')}" for key in named if getattr(args, key)]
    if given and args.model is None:
        raise UsageError(
            f"{' and '.join(given)} say{'s' * (len(given) == 1)} what each process's "
            "optimizer state holds, for the model: give --model too"
        )
    if args.mixed_precision:
        from pipelang.cli.run_options import _mixed_precision

        args.dtype = _mixed_precision(args)


def activation_bytes(
    args: argparse.Namespace, program: Program, costs: CostModel
) -> list[float] | None:
    """Per rank, the most bytes of saved activations it holds at once (`args.
    activation_bytes`); under `--tp` one tensor rank's (the run's refusals first):
    measured on the model with each split parameter cut to its part, one tensor rank's
    shapes (`tensor_parallel.localize`)."""
    if args.tp == 1:
        return args_activation_bytes(args, program, costs)
    from pipelang.backends.measure import activation_peaks, stage_activation_bytes
    from pipelang.backends.models import ModelError

    program = _partitioned(args, program)
    _refuse_as_run(args, program)
    spec = _model_spec(args, program)
    try:
        stages = stage_activation_bytes(spec, program.num_stages, program.partition, args.tp)
        return activation_peaks(spec, program, costs, stages)
    except ModelError as err:
        raise UsageError(str(err)) from None


def memory_rows(
    args: argparse.Namespace, program: Program, activations: list[float] | None
) -> list[dict[str, int]] | None:
    """Per process of the run (`replica * R + rank`, R the schedule's ranks), its
    predicted bytes (`COLUMNS`); None without `--model`."""
    if not model_named(args):
        return None
    from pipelang.backends.models import ModelError
    from pipelang.backends.param_shapes import model_params
    from pipelang.sim.state import rank_bytes

    program = _partitioned(args, program)
    spec = _model_spec(args, program)
    try:
        model = model_params(spec, program.num_stages, program.partition)
    except ModelError as err:
        raise UsageError(str(err)) from None
    dp, shard, tp = getattr(args, "dp", 1), getattr(args, "shard", False), args.tp
    _refuse_as_run(args, program)
    held = rank_bytes(
        program, model, args.optimizer or "adam", bool(args.mixed_precision), dp, shard, tp
    )
    rows = []
    for process, each in enumerate(held):
        rank = process // tp % program.num_ranks
        active = round(activations[rank]) if activations is not None else 0
        row = {
            "process": process,
            "rank": rank,
            "replica": process // (program.num_ranks * tp),
            "tensor": process % tp,
            "param_bytes": each.params,
            "grad_bytes": each.grads,
            "optimizer_bytes": each.optimizer,
            "peak_activation_bytes": active,
        }
        row["total_bytes"] = each.params + each.grads + each.optimizer + active
        rows.append(row)
    return rows


def _refuse_as_run(args: argparse.Namespace, program: Program) -> None:
    """UsageError where `pipelang run` refuses `--mixed-precision` or `--tp` with what the
    schedule uses (asynchronous weights, ...: `features.REFUSED`), or `--tp` with the
    model or the options (`preflight.tp_refusal`), in the run's words; and `--tp` with a
    model of your own, whose `tp(module, mesh)` hook splits it as only running it tells."""
    from pipelang.features import refusal

    why = refusal(program, "--mixed-precision") if args.mixed_precision else None
    if args.tp > 1 and why is None:
        from pipelang.backends.config import RunConfig
        from pipelang.backends.preflight import tp_refusal
        from pipelang.backends.tensor_parallel import block_plans

        config = RunConfig(
            model=args.model, backend="gloo", tp=args.tp, mixed_precision=args.mixed_precision
        )
        why = refusal(program, "--tp") or tp_refusal(config)
        if why is None and block_plans(args.model) is None:
            why = clip(
                f"--tp {args.tp} with --model `{args.model}`: a model of your own is split by "
                "its tp(module, mesh) hook, which simulate does not run, so what each tensor "
                "rank holds is not predicted; simulate it without --tp, or measure it with "
                "`pipelang run --tp --log`"
            )
    if why is not None:
        raise UsageError(why)


def memory_table(args: argparse.Namespace, rows: list[dict[str, int]], most: int) -> Table:
    """The text table of `memory_rows`, its first `most` rows."""
    optimizer = args.optimizer or "adam"
    what = optimizer
    if args.mixed_precision:
        what += f", {args.mixed_precision} with fp32 masters"
    shard = f", sharded over --dp {args.dp}" if getattr(args, "shard", False) else ""
    split = f", split over --tp {args.tp}" if args.tp > 1 else ""
    table = Table(title=f"predicted bytes per process ({args.model}, {what}{shard}{split})")
    dp = getattr(args, "dp", 1)
    ids = ["rank"]
    if dp > 1 or args.tp > 1:
        ids = ["process", "rank"] + ["replica"] * (dp > 1) + ["tensor"] * (args.tp > 1)
    titles = {"replica": "data-parallel copy", "tensor": "tensor rank"}
    for key in ids:
        table.add_column(titles.get(key, key), justify="right")
    for title in COLUMNS.values():
        table.add_column(title, justify="right")
    for row in rows[:most]:
        table.add_row(*(str(row[k]) for k in ids), *(f"{row[k]:,}" for k in COLUMNS))
    return table
