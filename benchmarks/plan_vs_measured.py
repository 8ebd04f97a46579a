"""Planner predictions against measured runs: CPU, gloo, 2 ranks, an unbalanced demo model.

1. `pipelang profile --calibrate gloo` the model `pipelang.planner.demo:unbalanced_short`
   (six layers, one block with 4x the arithmetic of the three others: its best two-stage
   split does not hinge on the exact ratio the profile measures, and beats the even split
   by more than this machine's noise) with sequences of 128 tokens, not the
   model's default 32: a light block's forward then takes a few ms on one thread, so the
   layers' compute, not the runtime's costs per action and per message, makes most of a
   step, and the partition matters. Profiled on this CPU with one thread (each of two
   gloo ranks gets one core here): per-layer times, optimizer step times, and the
   runtime's costs read from a short traced gloo run (`backends/calibrate.py`).
2. Measure the loopback link gloo uses between two processes (latency from 4-byte
   messages, bandwidth from 8 MiB ones, the fastest of 20 ping-pongs) and describe the
   2-core machine with it.
3. `pipelang plan --data-parallel` it with N = 8 micro-batches, SGD, and a 120 MiB
   memory cap: the cap leaves out GPipe (it holds all N micro-batches' activations),
   which predicts the same time as 1F1B on two ranks, so the top plans have distinct
   predictions. Plans of two processes are kept: two ranks, or two copies of a
   one-rank pipeline (`--dp 2`, 4 micro-batches each); a single process is set aside
   (it runs with both cores' threads, which the cost model does not model).
4. Run, with `pipelang run --backend gloo` (the written `.pipe` files as they are, with
   `--dp 2` for copies): the top 3 plans; the planner's 1F1B and 1F1B with the even
   split of the layers; and the best, a mid-ranked and the worst two-process plan of
   the ranked table (predicted far
   apart, to test the order beyond the noise). Every plan runs once per round, the
   order reversed every other round; each run does 2 warm-up and 6 timed steps and
   counts as its fastest step (the machine's load drifts over seconds and only adds
   time).

Reports per plan the prediction with and without the calibration, the median and the
lowest of its runs (and the highest), the error, and for each comparison the predicted
gaps against the measured ones and the run-to-run noise. Verdicts use the lowest run.

    python benchmarks/plan_vs_measured.py             # ~10 min; replaces its RESULTS.md part
    python benchmarks/plan_vs_measured.py --no-write  # print only
    python benchmarks/plan_vs_measured.py --model skewed --rounds 4
        # demo:skewed (work in the second half; 300 MiB cap), its own RESULTS.md block
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelang.backends.calibrate import calibrate
from pipelang.backends.measure import ProfileOptions, measure
from pipelang.planner.plans import Inputs, Plan
from pipelang.planner.search import Planner
from pipelang.planner.topology import Link, Topology
from pipelang.planner.write import plan_source
from pipelang.profile import Profile

try:
    from benchmarks.results import write_block
except ImportError:  # run as a script from the repository root
    from results import write_block  # type: ignore[no-redef]

SECTION = "## Planner"
MODELS = {
    "short": ("pipelang.planner.demo:unbalanced_short", 120 * 2**20),
    "skewed": ("pipelang.planner.demo:skewed", 300 * 2**20),
}
"""`--model`: the demo model and the memory cap that leaves GPipe out for it."""
MODEL, MAX_MEMORY = MODELS["short"]
MICRO_BATCH_SIZE = 8
SEQ_LEN = 128
MICROBATCHES = 8
WARMUP, TIMED = 2, 6


def replace_block(heading: str, text: str) -> None:
    """Put `text` (a `###` block) under `## Planner` in RESULTS.md."""
    intro = "How well `pipelang plan` predicts, and how fast it searches (issue 8)."
    write_block(SECTION, intro, heading, text)


def two_cores(link: Link) -> Topology:
    return Topology(("cpu0", "cpu1"), (8 * 2**30,) * 2, ((None, link), (link, None)))


def _ping(rank: int, port: int, sizes: tuple[int, ...], out: dict[int, float]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for size in sizes:
        buffer = torch.zeros(size // 4)
        samples = []
        for i in range(25):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            if i >= 5:
                samples.append((time.perf_counter() - start) / 2)
        if rank == 0:
            out[size] = min(samples)
    dist.destroy_process_group()


def loopback_link() -> Link:
    """gloo between two processes here: one-way time of 4-byte and 8 MiB messages
    (ping-pong, the fastest of 20: the link itself, not the load on the machine), as a
    latency and a bandwidth."""
    small, large = 4, 8 * 2**20
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29000 + os.getpid() % 1000
        mp.spawn(_ping, args=(port, (small, large), out), nprocs=2)
        latency, big = out[small], out[large]
    return Link((large - small) / max(big - latency, 1e-9), latency)


def measure_run(path: Path, workdir: Path, dp: int) -> list[float]:
    """Step times (ms) of the timed steps of one `pipelang run` of `path` (`--dp dp`)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelang.cli",
            "run",
            str(path),
            "--model",
            MODEL,
            "--backend",
            "gloo",
            "--steps",
            str(WARMUP + TIMED),
            "--micro-batch-size",
            str(MICRO_BATCH_SIZE),
            "--optimizer",
            "sgd",
            "--seq-len",
            str(SEQ_LEN),
            "--dp",
            str(dp),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"run of {path} failed:\n{proc.stderr}")
    times = [
        float(m) for m in re.findall(r"^step \d+/\d+\s+loss \S+\s+([0-9.]+) ms", proc.stderr, re.M)
    ]
    return times[WARMUP:]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} / {min(values):.1f} ({max(values):.1f})"


def pick_spread_plans(plans: list[Plan]) -> list[Plan]:
    """The best plan, a mid-ranked one and the worst of `plans` (ranked by prediction):
    the mid one is the plan whose prediction is nearest the geometric mean of the best
    and the worst, so that neighbours are predicted far apart."""
    best, worst = plans[0], plans[-1]
    middle = (best.time_ms * worst.time_ms) ** 0.5
    mid = min(plans[1:-1], key=lambda p: abs(math.log(p.time_ms / middle)))
    return [best, mid, worst]


def order_verdict(
    names: list[str], plans: dict[str, Plan], measured: dict[str, list[float]]
) -> list[str]:
    """Per neighbouring pair of `names` (in predicted order): the predicted gap, the
    measured gaps (min and median), and the run-to-run noise of the two."""
    out = []
    for a, b in itertools.pairwise(names):
        predicted = plans[b].time_ms / plans[a].time_ms - 1
        low = min(measured[b]) / min(measured[a]) - 1
        mid = statistics.median(measured[b]) / statistics.median(measured[a]) - 1
        noise = max(relative_spread(measured[a]), relative_spread(measured[b]))
        out.append(
            f"{a} vs {b}: predicted {100 * predicted:+.0f}%, measured {100 * low:+.0f}% "
            f"(min), {100 * mid:+.0f}% (median); noise {100 * noise:.0f}%"
            + ("" if predicted > noise else ", the predicted gap is inside the noise")
        )
    return out


def relative_spread(values: list[float]) -> float:
    """(highest - lowest) / median of the runs of one plan."""
    return (max(values) - min(values)) / statistics.median(values)


def ranked(names: list[str], measured: dict[str, list[float]], stat: Callable) -> list[str]:
    return sorted(names, key=lambda n: stat(measured[n]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="short",
        help="short: one heavy block of six layers (the default); skewed: the heavy blocks "
        "in the second half, so the even split is far from the best (its own block)",
    )
    args = parser.parse_args()
    global MODEL, MAX_MEMORY
    MODEL, MAX_MEMORY = MODELS[args.model]
    began = time.perf_counter()
    load_before = os.getloadavg()
    options = ProfileOptions(
        MODEL, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, threads=1, repeats=15
    )
    options = replace(options, warmup=5)
    bare = measure(options)
    profile = replace(bare, runtime=calibrate(bare, options, "gloo", 2))
    runtime = profile.runtime
    assert runtime is not None
    link = loopback_link()
    topology = two_cores(link)
    planner = Planner(
        Inputs(
            profile,
            topology,
            MICROBATCHES,
            max_memory=MAX_MEMORY,
            optimizer="sgd",
            data_parallel=True,
        )
    )
    result = planner.search()
    gpipe_out = [r.reason for r in result.rejected if r.candidate.label.startswith("gpipe D=2")]
    # Plans of two processes only, one per core (two ranks, or two copies of one rank): a
    # single process runs with both cores' threads, which the cost model does not model
    # (docs/planner.md, "Cores").
    table = [p for p in result.plans if p.exact and p.candidate.ranks * p.candidate.dp == 2]
    top = table[:3]
    one_f_one_b = next(p for p in table if p.candidate.label.startswith("1f1b D=2"))
    layers = len(profile.layers)
    even = planner.predict(
        one_f_one_b.candidate, (layers - layers // 2, layers // 2), one_f_one_b.devices, True
    )
    runs: list[tuple[str, Plan]] = [(f"plan {i + 1}", p) for i, p in enumerate(top)]
    if one_f_one_b not in top:
        runs.append((f"plan {1 + table.index(one_f_one_b)} (1F1B)", one_f_one_b))
    # Right after the planner's 1F1B in every round, so that the two are compared under
    # the same load (it drifts over seconds on a shared machine).
    after = next(i for i, (_, p) in enumerate(runs) if p is one_f_one_b)
    runs.insert(after + 1, ("1F1B, even split", even))
    wide = pick_spread_plans(table)
    wide_names = []
    for plan in wide:
        name = next((n for n, p in runs if p is plan), None)
        if name is None:
            name = f"plan {1 + table.index(plan)}"
            runs.append((name, plan))
        wide_names.append(name)
    plans = dict(runs)
    # The same plans under the profile without calibration (layers' times only).
    uncalibrated = Planner(
        Inputs(uncalibrated_profile(profile), topology, MICROBATCHES, optimizer="sgd")
    )
    before = {
        name: (uncalibrated if p.candidate.dp == 1 else uncalibrated.with_copies(p.candidate.dp))
        .predict(p.candidate, p.partition, p.devices, True)
        .time_ms
        for name, p in runs
    }
    measured: dict[str, list[float]] = {name: [] for name, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, Path] = {}
        for name, plan in runs:
            path = Path(tmp) / f"{len(files)}.pipe"
            path.write_text(plan_source(plan, planner, "profile", "two cores"))
            files[name] = path
        for round_ in range(args.rounds):
            order = runs if round_ % 2 == 0 else runs[::-1]
            for name, _ in order:
                dp = plans[name].candidate.dp
                measured[name].append(min(measure_run(files[name], Path(tmp), dp)))
                print(name, f"{measured[name][-1]:.1f} ms", flush=True)
    minutes = (time.perf_counter() - began) / 60
    rows = []
    for name, plan in runs:
        low, med = min(measured[name]), statistics.median(measured[name])
        rows.append(
            f"| {name} | {plan.candidate.label} | {','.join(map(str, plan.partition))} | "
            f"{before[name]:.1f} | {plan.time_ms:.1f} | {spread(measured[name])} | "
            f"{100 * relative_spread(measured[name]):.0f}% | "
            f"{100 * (plan.time_ms / low - 1):+.0f}% / {100 * (plan.time_ms / med - 1):+.0f}% |"
        )
    top_names = [f"plan {i + 1}" for i in range(len(top))]
    planner_name = next(n for n, p in runs if p is one_f_one_b)
    even_name = "1F1B, even split"

    def holds(names: list[str]) -> str:
        by_min = ranked(names, measured, min) == names
        by_median = ranked(names, measured, statistics.median) == names
        return (
            f"measured by min {', '.join(ranked(names, measured, min))}: "
            f"{'' if by_min else 'not '}preserved; by median "
            f"{', '.join(ranked(names, measured, statistics.median))}: "
            f"{'' if by_median else 'not '}preserved"
        )

    def faster(stat: Callable) -> str:
        a, b = stat(measured[planner_name]), stat(measured[even_name])
        return f"{a:.1f} vs {b:.1f} ms ({100 * (b / a - 1):+.0f}%)"

    wins = sum(a < b for a, b in zip(measured[planner_name], measured[even_name], strict=True))

    blocks = sorted(profile.layers[1:-1], key=lambda c: c.forward_ms + c.full_backward_ms)
    lights = blocks[: max(1, len(blocks) // 2)]
    heavy = blocks[-1]
    ratio = (heavy.forward_ms + heavy.full_backward_ms) / statistics.median(
        c.forward_ms + c.full_backward_ms for c in lights
    )
    best_name = top_names[0]
    best_wins = sum(a < b for a, b in zip(measured[best_name], measured[even_name], strict=True))
    noise = max(relative_spread(measured[n]) for n in (planner_name, even_name))
    gap = even.time_ms / one_f_one_b.time_ms - 1
    heading = "### Predicted vs measured (CPU, gloo)"
    if args.model != "short":
        heading = f"### Predicted vs measured, {args.model} model (CPU, gloo)"
    lines = [
        heading,
        "",
        f"- Machine: {os.cpu_count()}-core {platform.machine()} VM; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
        f"- torch {torch.__version__}, Python {platform.python_version()}, 1 thread per rank",
        f"- Command: `python benchmarks/plan_vs_measured.py --rounds {args.rounds}"
        + ("" if args.model == "short" else f" --model {args.model}")
        + "` "
        f"({minutes:.1f} min)",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- Model `{MODEL}` ({layers} layers), micro-batches of {MICRO_BATCH_SIZE} x "
        f"{profile.seq_len} tokens (`--seq-len {SEQ_LEN}`: a light block's forward "
        f"{statistics.median(c.forward_ms for c in lights):.1f} ms; a heavy block, 4x "
        f"the arithmetic, measured {ratio:.1f}x a light block's forward + backward), "
        f"N = {MICROBATCHES}, SGD, memory cap {MAX_MEMORY // 2**20} MiB"
        + (f" (GPipe D=2: {gpipe_out[0]})" if gpipe_out else "")
        + f"; profiled with `threads=1`, {options.repeats} repeats. Every plan run "
        f"{args.rounds} times, the rounds interleaved (each round runs every plan once, "
        f"in reverse order every other round), each run {TIMED} timed steps after "
        f"{WARMUP} warm-up and counted as its fastest step.",
        f"- Calibration (`--calibrate gloo`, 2 ranks): {runtime.action_ms:.3f} ms per "
        f"action, send {runtime.send_ms:.3f} ms, receive {runtime.recv_ms:.3f} ms, "
        f"message {runtime.message_ms:.3f} ms, compute x{runtime.compute_scale:.2f} "
        f"beside the other rank; optimizer step (SGD) "
        f"{sum(c.step_ms('sgd') for c in profile.layers):.2f} ms for the whole model. "
        f"Loopback link (gloo, measured): {link.latency * 1e6:.0f} us, "
        f"{link.bandwidth / 1e9:.2f} GB/s.",
        "- Measured: the median / the lowest of the runs (the highest); noise: (highest - "
        "lowest) / median. Error: predicted against the lowest run / against the median. "
        "The verdicts use the lowest run: interference from the rest of the machine only "
        "adds time, so the fastest run is the closest to the plan's own cost, which is "
        "what the model predicts; the median's verdict is given beside it.",
        "",
        "| run | schedule | partition | predicted ms, uncalibrated | predicted ms | "
        "measured ms: median / min (max) | noise | error: min / median |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- Top 3 ({', '.join(top_names)}): {holds(top_names)}. "
        + "; ".join(order_verdict(top_names, plans, measured))
        + ".",
        f"- Best, mid-ranked and worst of the {len(table)} two-process plans "
        f"({', '.join(wide_names)}): {holds(wide_names)}. "
        + "; ".join(order_verdict(wide_names, plans, measured))
        + ".",
        f"- The planner's 1F1B partition {one_f_one_b.partition} against the even split "
        f"{even.partition}: predicted {one_f_one_b.time_ms:.1f} vs {even.time_ms:.1f} ms "
        f"({100 * (even.time_ms / one_f_one_b.time_ms - 1):+.0f}%); measured, min "
        f"{faster(min)}, median {faster(statistics.median)}; faster in {wins} of the "
        f"{args.rounds} rounds (the two run one after the other in each). The predicted "
        f"gap is {100 * gap:.0f}%, {gap / noise:.1f}x the larger of the two runs' noise "
        f"({100 * noise:.0f}%).",
        f"- The planner's choice ({best_name}, {plans[best_name].candidate.label}) against "
        f"the stdlib 1F1B with the even split: faster in {best_wins} of the {args.rounds} "
        "rounds.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        replace_block(heading, text)


def uncalibrated_profile(profile: Profile) -> Profile:
    """`profile` as it was before this work: no runtime costs, no optimizer step."""
    layers = tuple(replace(c, sgd_step_ms=None, adam_step_ms=None) for c in profile.layers)
    return replace(profile, layers=layers, runtime=None)


if __name__ == "__main__":
    main()
