"""`pipelang profile`: measure a model's layers (and the runtime) into a profile JSON."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipelang.backends.backend import spawning
from pipelang.cli.args import add_model_arguments, path, writable, write_output
from pipelang.diagnostics import clip
from pipelang.progress import console, work_progress
from pipelang.readers import ReadError, whole_number
from pipelang.source import one_line

if TYPE_CHECKING:
    from pipelang.profile import LayerCost, Profile

HELP = "measure a model's per-layer times and memory into a profile JSON"


def count(least: int, most: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `least` to `most` (a count of runs or
    threads: past `most` the command would run for days)."""

    def read(text: str) -> int:
        try:
            return whole_number(text.strip(), least, most)
        except ReadError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return read


def setup(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, default_model=None)
    parser.add_argument(
        "-o", dest="out", type=path, required=True, metavar="PROFILE.json", help="where to write"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:K")
    parser.add_argument(
        "--threads",
        type=count(1, 1024),
        metavar="K",
        help="CPU threads (default torch's; match the threads one rank of a run gets)",
    )
    parser.add_argument(
        "--repeats",
        type=count(1, 1000),
        default=5,
        help="timed runs per layer at a time (default 5): more follow while the runs are "
        "unsteady (their middle half wider than 10%% of the median), up to --max-repeats",
    )
    parser.add_argument(
        "--max-repeats",
        type=count(1, 10_000),
        metavar="K",
        help="the most timed runs of one measurement while they are unsteady (default 4 x "
        "--repeats)",
    )
    parser.add_argument(
        "--warmup", type=count(0, 1000), default=2, help="untimed runs first (default 2)"
    )
    parser.add_argument(
        "--calibrate",
        choices=spawning(),
        metavar="BACKEND",
        help="also run the model under `pipelang run --backend BACKEND --trace` and "
        f"measure what the runtime adds per action and per message ({' or '.join(spawning())})",
    )
    parser.add_argument(
        "--calibrate-ranks",
        type=count(1, 1024),
        default=2,
        metavar="R",
        help="ranks of the calibration run (default 2; as many as the plan will use)",
    )
    parser.add_argument(
        "--calibrate-rounds",
        type=count(1, 100),
        default=3,
        metavar="R",
        help="calibration runs, each cost the median of theirs, their spread printed (default 3)",
    )


def run(args: argparse.Namespace) -> int:
    from pipelang.backends.measure import ProfileOptions, measure
    from pipelang.backends.models import ModelError

    writable(args.out)  # before measuring for a minute, not after
    options = ProfileOptions(
        model=args.model,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        max_repeats=args.max_repeats or 0,
    )
    err = console(stderr=True)
    try:
        with work_progress(err) as update:
            profile = measure(options, lambda i, n, name: update("profiling", i, n, name))
    except (ModelError, RuntimeError) as error:
        err.print(f"error: {error}", markup=False)
        return 1
    if args.calibrate:
        from dataclasses import replace

        from pipelang.backends.calibrate import calibrate

        err.print(f"calibrating: {args.calibrate_ranks} ranks on {args.calibrate}", markup=False)
        costs = calibrate(
            profile, options, args.calibrate, args.calibrate_ranks, rounds=args.calibrate_rounds
        )
        profile = replace(profile, runtime=costs)
    write_output(args.out, profile.to_json() + "\n")
    total = sum(c.forward_ms + c.full_backward_ms for c in profile.layers)
    print(
        f"wrote {args.out}: {len(profile.layers)} layers of {profile.model} on {profile.device}, "
        f"{total:.3f} ms forward + backward per micro-batch"
    )
    print(_spread(profile))
    for disagreement in profile.disagreements():
        err.print(f"warning: {disagreement}", markup=False)
    if profile.runtime is not None:
        print(profile.runtime.described())
        unsteady = [
            f"{key.removesuffix('_ms').replace('_', ' ')} {low:.3g}-{high:.3g}"
            for key, (low, high) in profile.runtime.spread.items()
            if high > 2 * low and high - low > 0.05
        ]
        if unsteady:
            err.print(
                f"note: the runs disagreed by more than 2x ({', '.join(unsteady)}): the "
                "machine was busy; calibrate again when it is quiet, or with more "
                "--calibrate-rounds",
                markup=False,
            )
    return 0


def _spread(profile: Profile) -> str:
    """How steady the layers' measurements were, in one line: the runs each took and the
    widest spread (the middle half of a layer's runs, against its median)."""
    runs = [c.runs or 0 for c in profile.layers]
    widest = max(
        range(len(profile.layers)),
        key=lambda i: _relative(profile.layers[i]),
    )
    layer = profile.layers[widest]
    low, high = layer.spread_ms or (layer.time_ms, layer.time_ms)
    counts = f"{min(runs)}" if min(runs) == max(runs) else f"{min(runs)}-{max(runs)}"
    name = one_line(layer.name).replace("`", "'")
    return clip(
        f"spread: {counts} timed runs per measurement; the widest, layer {widest} "
        f"(`{name}`): the middle half of its runs {low:.3g}-{high:.3g} ms "
        f"around {layer.time_ms:.3g} ms forward + backward ({_relative(layer):.0%}); every "
        "layer's in the profile (`spread_ms`)"
    )


def _relative(layer: LayerCost) -> float:
    low, high = layer.spread_ms or (layer.time_ms, layer.time_ms)
    return (high - low) / layer.time_ms if layer.time_ms > 0 else 0.0
