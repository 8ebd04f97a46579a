"""Planner speed: `pipelang plan`'s whole search on clusters up to 64 devices and N = 512.

The profile is synthetic and fixed (so that runs compare): a 128-layer GPT-like model,
an embedding, 126 equal transformer blocks and a head, with the block's times and sizes
those of a GPT-2-medium block (width 1024, 4 x 1024 tokens per micro-batch) scaled to
round numbers. The cluster is N nodes x 8 GPUs (NVLink inside, a network between). The
search is everything `pipelang plan` does before writing the file: every candidate
(schedule, D dividing the device count, v/f/w) bounded from below and, unless the bound
shows it slower than three plans already found, screened; the best three refined and
simulated at N, under a time budget of 25 s (`pipelang plan`'s default until 2026-11-25,
now 8 s; a candidate whose screening would end past it is left out, one whose simulation
at N would is kept extrapolated; the table counts both). The bar (issue 8): D up to 64
and N up to 512 within 30 s on this 2-core machine.

    python benchmarks/plan_speed.py             # replaces the speed part of "Planner" in RESULTS.md
    python benchmarks/plan_speed.py --no-write  # print only
    python benchmarks/plan_speed.py --data-parallel  # the same with copies planned too
    python benchmarks/plan_speed.py --growth    # search time and memory against devices
                                                # and layers, no budget (issue 20 item 5)
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime

import torch

from pipelang.planner.plans import Inputs
from pipelang.planner.search import Planner
from pipelang.planner.topology import Link, Topology
from pipelang.profile import LayerCost, Profile

try:
    from benchmarks.plan_vs_measured import replace_block
except ImportError:  # run as a script from the repository root
    from plan_vs_measured import replace_block  # type: ignore[no-redef]

SIZES = ((8, 64), (16, 128), (32, 256), (64, 512))
"""(devices, micro-batches) pairs; D ranges over the divisors of the device count."""


def synthetic_profile(blocks: int = 126) -> Profile:
    block = LayerCost("Block", 2.0, 2.4, 1.6, 200e6, 50e6, 16.8e6)
    layers = (
        LayerCost("Embedding", 0.4, 0.0, 0.8, 1e6, 206e6, 16.8e6),
        *([block] * blocks),
        LayerCost("Head", 3.0, 3.0, 3.0, 400e6, 206e6, 800e6),
    )
    return Profile("synthetic:gpt-128", "cuda", "bfloat16", 4, 1024, layers)


def cluster(devices: int) -> Topology:
    per_node = min(8, devices)
    nvlink, network = Link(300e9, 2e-6), Link(25e9, 10e-6)
    return Topology(
        tuple(f"node{d // per_node}.gpu{d % per_node}" for d in range(devices)),
        (80 * 2**30,) * devices,
        tuple(
            tuple(
                None if a == b else (nvlink if a // per_node == b // per_node else network)
                for b in range(devices)
            )
            for a in range(devices)
        ),
    )


GROWTH = (
    *((devices, 126) for devices in (16, 64, 256, 1024)),
    *((256, blocks) for blocks in (30, 62)),
)
"""(devices, transformer blocks) points of `--growth`: N = devices, `--data-parallel`."""


def one_search(devices: int, blocks: int) -> None:
    """Child of `--growth`: the whole search, no time budget; prints seconds, peak RSS
    (MiB), candidates and the best plan."""
    started = time.perf_counter()
    inputs = Inputs(synthetic_profile(blocks), cluster(devices), devices, data_parallel=True)
    result = Planner(inputs, time_budget=0).search()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    total = len(result.plans) + len(result.rejected)
    pruned = sum(r.reason.startswith("not simulated") for r in result.rejected)
    print(f"{seconds:.1f}|{peak:.0f}|{total}|{pruned}|{result.plans[0].candidate.label}")


def growth(write: bool) -> None:
    """Search time and peak memory against devices and layers, each in its own process."""
    load_before = os.getloadavg()
    rows = []
    for devices, blocks in GROWTH:
        code = f"from benchmarks.plan_speed import one_search; one_search({devices}, {blocks})"
        out = (
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        seconds, peak, total, pruned, best = out.split("|")
        rows.append(
            f"| {devices} | {blocks + 2} | {devices} | {total} | {pruned} | {seconds} | {peak} "
            f"| {best} |"
        )
        print(rows[-1], flush=True)
    heading = "### Search growth with devices and layers (`--data-parallel`, no budget)"
    lines = [
        heading,
        "",
        f"- Machine: {os.cpu_count()}-core {platform.machine()} VM; load average "
        f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        "- Command: `python benchmarks/plan_speed.py --growth`",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "- The synthetic profile with its number of transformer blocks varied (layers = "
        "blocks + 2), clusters of 8-GPU nodes, N = devices, copies planned too, no time "
        "budget (`Planner(..., time_budget=0).search()`), each point in a fresh process "
        "(peak RSS is that process's). The goal of issue 20 is the 1024-device row "
        "within 10 s. `pruned`: candidates the lower bound left out unsimulated "
        "(`pipelang/planner/bound.py`).",
        "",
        "| devices | layers | N | candidates | pruned | seconds | peak RSS MiB | best plan |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if write:
        replace_block(heading, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--data-parallel",
        action="store_true",
        help="plan copies of pipelines too (`pipelang plan --data-parallel`); its own block",
    )
    parser.add_argument(
        "--growth",
        action="store_true",
        help="time the whole search (no budget) against devices and layers; its own block",
    )
    args = parser.parse_args()
    if args.growth:
        growth(not args.no_write)
        return
    flag = " --data-parallel" if args.data_parallel else ""
    heading = f"### Search speed{' with `--data-parallel`' if args.data_parallel else ''}"
    load_before = os.getloadavg()
    rows = []
    for devices, n in SIZES:
        started = time.perf_counter()
        inputs = Inputs(synthetic_profile(), cluster(devices), n, data_parallel=args.data_parallel)
        planner = Planner(inputs, time_budget=25.0)
        result = planner.search()
        seconds = time.perf_counter() - started
        best = result.plans[0]
        total = len(result.plans) + len(result.rejected)
        skipped = sum(r.reason.startswith("not searched") for r in result.rejected)
        pruned = sum(r.reason.startswith("not simulated") for r in result.rejected)
        exact = sum(p.exact for p in result.plans)
        rows.append(
            f"| {devices} | {n} | {total} | {pruned} | {skipped} | {exact} | {seconds:.1f} | "
            f"{best.candidate.label} | {best.time_ms:.0f} |"
        )
        print(rows[-1], flush=True)
    lines = [
        heading,
        "",
        f"- Machine: {os.cpu_count()}-core {platform.machine()} VM shared with other jobs; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        f"- Command: `python benchmarks/plan_speed.py{flag}`",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "- Synthetic 128-layer profile, clusters of 8-GPU nodes; every candidate screened, "
        "the best 3 refined and simulated at N (`Planner.search` with the CLI's default "
        "25 s budget: the whole of `pipelang plan` but reading the inputs and writing "
        "the file). `pruned`: left out unsimulated by the lower bound "
        "(`pipelang/planner/bound.py`).",
        "",
        "| devices | N | candidates | pruned | skipped (budget) | simulated at N | seconds "
        "| best plan | predicted ms |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        replace_block(heading, text)


if __name__ == "__main__":
    main()
