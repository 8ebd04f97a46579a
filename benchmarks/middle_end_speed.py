"""Middle-end speed, by hand: build-dag, validate and insert-comms at 131,072 ops.

Expands the stdlib interleaved 1F1B with D = 64 ranks, N = 512 micro-batches and two
stages per rank, then times each middle-end pass on that one Program (best of a few
runs; wall and CPU seconds, since a shared machine inflates wall time). Also prints
`sum(range(1000))` in microseconds to calibrate the machine (a 2020s laptop: ~6-8 us).

    python benchmarks/middle_end_speed.py [--repeat 3] [-D 64] [-N 512]
"""

from __future__ import annotations

import argparse
import time
import timeit
from collections.abc import Callable
from typing import TypeVar

from pipelang.api import compile_schedule
from pipelang.passes import build_dag as build_dag_module
from pipelang.passes.build_dag import build_dag
from pipelang.passes.insert_comms import insert_comms
from pipelang.passes.validate import validate

T = TypeVar("T")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-D", type=int, default=64)
    parser.add_argument("-N", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    params = {"D": str(args.D), "N": str(args.N), "v": "2"}
    expanded = compile_schedule("interleaved-1f1b", params, stop_after="expand-orders")
    program = expanded.need_program()
    ops = sum(len(actions) for actions in program.ranks)
    best: dict[str, tuple[float, float]] = {}

    def timed(name: str, run: Callable[[], T]) -> T:
        wall, cpu = time.perf_counter(), time.process_time()
        result = run()
        took = (time.perf_counter() - wall, time.process_time() - cpu)
        best[name] = min(best.get(name, took), took)
        return result

    for _ in range(args.repeat):
        build_dag_module._RECENT.clear()  # time the graph's construction every run
        dag = timed("build-dag", lambda: build_dag(program))
        timed("validate", lambda: validate(program, dag, None))  # noqa: B023
        timed("insert-comms", lambda: insert_comms(program))
    calibration = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
    print(
        f"# interleaved-1f1b D={args.D} N={args.N} v=2: {ops} ops; "
        f"sum(range(1000)) = {calibration:.1f} us"
    )
    print("| pass | wall s | cpu s |")
    print("|---|---|---|")
    for name, (wall, cpu) in best.items():
        print(f"| {name} | {wall:.3f} | {cpu:.3f} |")
    total = [sum(t[i] for t in best.values()) for i in (0, 1)]
    print(f"| total | {total[0]:.3f} | {total[1]:.3f} |")


if __name__ == "__main__":
    main()
