"""Visualization speed: render D = 64, N = 512 timelines to every format.

Compiles and simulates each schedule once (timed apart: that is the compiler's and the
simulator's time, not the renderer's), then times `pipelang.visualize.render` for each
format, best of `--repeat` runs, wall and CPU seconds (a shared machine inflates wall
time). The issue's bar: SVG and JSON under 5 s at D = 64, N = 512.

    python benchmarks/viz_speed.py [--repeat 3] [-D 64] [-N 512] [--png]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

from pipelang.api import compile_schedule
from pipelang.visualize import render
from pipelang.visualize.panel import simulated

SCHEDULES = [("1f1b", {}), ("chimera", {}), ("zbv", {}), ("interleaved-1f1b", {"v": "2"})]
FORMATS = [(".svg", False), (".svg", True), (".json", True), (".html", False), (".txt", False)]


def best(fn: object, repeat: int) -> tuple[float, float, int]:
    """(best wall s, best CPU s, size of the output) over `repeat` runs."""
    walls, cpus, size = [], [], 0
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()  # type: ignore[operator]
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        size = len(out)
    return min(walls), min(cpus), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-D", type=int, default=64)
    parser.add_argument("-N", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--png", action="store_true", help="also time .png (matplotlib)")
    args = parser.parse_args()
    formats = FORMATS + ([(".png", False)] if args.png else [])
    print(
        f"# {platform.node()}: {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, {datetime.date.today()}"
    )
    print(
        f"# python benchmarks/viz_speed.py -D {args.D} -N {args.N} --repeat {args.repeat}"
        + (" --png" if args.png else "")
    )
    print("| schedule | ops | compile + simulate s | format | wall s | CPU s | MB |")
    print("|---|---|---|---|---|---|---|")
    for sched, extra in SCHEDULES:
        params = {"D": str(args.D), "N": str(args.N), **extra}
        start = time.perf_counter()
        try:
            compiled = compile_schedule(sched, params)
        except Exception as err:
            print(f"| {sched} | - | does not compile: {str(err).splitlines()[0][:60]} | | | | |")
            continue
        panel = simulated(compiled.timeline())
        prepare = time.perf_counter() - start
        ops = len(panel.timeline.events)
        for suffix, comms in formats:
            wall, cpu, size = best(
                lambda s=suffix, c=comms, p=panel: render([p], s, c), args.repeat
            )
            name = suffix + (" --comms" if comms else "")
            print(
                f"| {sched} | {ops} | {prepare:.2f} | {name} | {wall:.2f} | {cpu:.2f} | "
                f"{size / 1e6:.1f} |"
            )


if __name__ == "__main__":
    main()
