"""`simulate --model`'s memory per process: each one's predicted bytes of parameters,
gradients, optimizer state (pipelang/sim/state.py) and saved activations, under
`--dp K [--shard]`, `--optimizer` and `--mixed-precision` as `pipelang run` takes them."""

from __future__ import annotations

import argparse

from rich.table import Table

from pipelang.backends import OPTIMIZERS
from pipelang.cli.args import UsageError, _model_spec, _partitioned, model_named
from pipelang.ir import Program

COLUMNS = {
    "param_bytes": "parameters",
    "grad_bytes": "gradients",
    "optimizer_bytes": "optimizer",
    "peak_activation_bytes": "activations",
    "total_bytes": "total",
}
"""The byte counts of each process's row (`--json`'s keys) and their columns' titles."""


def add_state_arguments(parser: argparse.ArgumentParser) -> None:
    """`--optimizer` and `--mixed-precision`, as `pipelang run` takes them."""
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
    dp, shard = getattr(args, "dp", 1), getattr(args, "shard", False)
    _refuse_as_run(args, program)
    held = rank_bytes(
        program, model, args.optimizer or "adam", bool(args.mixed_precision), dp, shard
    )
    rows = []
    for process, each in enumerate(held):
        rank = process % program.num_ranks
        active = round(activations[rank]) if activations is not None else 0
        row = {
            "process": process,
            "rank": rank,
            "replica": process // program.num_ranks,
            "param_bytes": each.params,
            "grad_bytes": each.grads,
            "optimizer_bytes": each.optimizer,
            "peak_activation_bytes": active,
        }
        row["total_bytes"] = each.params + each.grads + each.optimizer + active
        rows.append(row)
    return rows


def _refuse_as_run(args: argparse.Namespace, program: Program) -> None:
    """UsageError where `pipelang run` refuses `--mixed-precision` with what the schedule
    uses (asynchronous weights: `features.REFUSED`), in the run's words."""
    from pipelang.features import refusal

    why = refusal(program, "--mixed-precision") if args.mixed_precision else None
    if why is not None:
        raise UsageError(why)


def memory_table(args: argparse.Namespace, rows: list[dict[str, int]], most: int) -> Table:
    """The text table of `memory_rows`, its first `most` rows."""
    optimizer = args.optimizer or "adam"
    what = optimizer
    if args.mixed_precision:
        what += f", {args.mixed_precision} with fp32 masters"
    shard = f", sharded over --dp {args.dp}" if getattr(args, "shard", False) else ""
    table = Table(title=f"predicted bytes per process ({args.model}, {what}{shard})")
    dp = getattr(args, "dp", 1) > 1
    for key in ("process", "rank", "replica") if dp else ("rank",):
        table.add_column("data-parallel copy" if key == "replica" else key, justify="right")
    for title in COLUMNS.values():
        table.add_column(title, justify="right")
    for row in rows[:most]:
        ids = [row["process"], row["rank"], row["replica"]] if dp else [row["rank"]]
        table.add_row(*map(str, ids), *(f"{row[k]:,}" for k in COLUMNS))
    return table
