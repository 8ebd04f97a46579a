"""Compile speed: pipelang's passes against torch's own lowering of the same schedule.

Times `resolve-params` through `insert-sync` (parse excluded: it is per file, not per
size) for interleaved 1F1B with 2 stages per rank over a sweep of D x N, and, side by
side in the same run, torch.distributed.pipelining's `get_schedule_ops(
"Interleaved1F1B", D, N, num_stages_per_rank=2, with_comms=True)`, which builds the
same per-rank order and lowers it with send/recv.

    python benchmarks/compile_speed.py            # the full sweep (torch at 64x512 ~ 20 s)
    python benchmarks/compile_speed.py --quick    # small sizes only

It ends with the time of each pass at the largest size, in CPU seconds (a shared machine
inflates wall time), and `sum(range(1000))` in microseconds to calibrate the machine.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import statistics
import subprocess
import sys
import time
import timeit

from pipelang.api import load_file
from pipelang.bulk import bulk
from pipelang.compiler import PASS_NAMES, Compilation, Options, passes, run_passes

SIZES = [(4, 8), (8, 16), (16, 64), (32, 128), (32, 256), (64, 256), (64, 512)]


def best_of(fn: object, repeat: int) -> float:
    """Best wall time of `fn()`. The result is freed after the clock stops: freeing 10^5
    objects is not compile work (the same rule for pipelang and torch)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
        del result
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 16 x 64 only")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's lowering")
    args = parser.parse_args()
    from torch.distributed.pipelining import _schedule_visualizer

    file = load_file("interleaved-1f1b")
    sizes = SIZES[:3] if args.quick else SIZES
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| D | N | ops | pipelang s | us/op | torch s | torch / pipelang |")
    print("|---|---|---|---|---|---|---|")
    per_op = []
    for d, n in sizes:
        options = Options({"D": str(d), "N": str(n), "v": "2"})
        ops = d * 2 * n * 2
        ours = best_of(lambda o=options: run_passes(file, o), 3 if ops < 50_000 else 2)
        per_op.append(ours / ops * 1e6)
        theirs = float("nan")
        if not args.no_torch:
            theirs = best_of(
                lambda d=d, n=n: _schedule_visualizer.get_schedule_ops(
                    "Interleaved1F1B", d, n, num_stages_per_rank=2, with_comms=True
                ),
                1,
            )
        print(
            f"| {d} | {n} | {ops} | {ours:.3f} | {ours / ops * 1e6:.2f} | {theirs:.2f} | "
            f"{theirs / ours:.1f}x |"
        )
    print(
        f"\nus/op spread over sizes: min {min(per_op):.2f}, median "
        f"{statistics.median(per_op):.2f}, max {max(per_op):.2f} (flat = linear time)"
    )
    d, n = sizes[-1]
    print(f"\nper pass at D={d}, N={n}, v=2 (CPU seconds, best of 3):")
    options = Options({"D": str(d), "N": str(n), "v": "2"})
    best: dict[str, float] = {}

    @bulk  # as `run_passes` runs them: with the cycle collector paused
    def each_pass() -> None:
        c = Compilation(file, options)
        for module, name in zip(passes(), PASS_NAMES, strict=True):
            run = importlib.import_module(f"pipelang.passes.{module}").run
            start = time.process_time()
            c = run(c)
            best[name] = min(best.get(name, float("inf")), time.process_time() - start)

    for _ in range(3):
        each_pass()
    print(
        "  "
        + ", ".join(f"{name} {t:.3f}" for name, t in best.items())
        + f"; total {sum(best.values()):.3f}"
    )
    fresh = sorted(_fresh_process(d, n) for _ in range(3))
    print(
        f"\nfresh process at D={d}, N={n}, v=2 (one compile each, as `pipelang check` runs it;"
        f" imports and parsing not counted): {', '.join(f'{t:.3f}' for t in fresh)} s"
    )
    calibrate = min(timeit.repeat("sum(range(1000))", number=10_000, repeat=5)) / 10_000
    print(f"machine: sum(range(1000)) takes {calibrate * 1e6:.1f} us")


def _fresh_process(d: int, n: int) -> float:
    """Wall time of the passes, once, in a new interpreter: what a user's `pipelang check`
    pays. The table's best-of timings run in a process that has compiled the smaller sizes
    already; a first compile in a process measures 10-30% slower here."""
    code = (
        "import time; from pipelang.api import load_file; "
        "from pipelang.compiler import Options, run_passes; "
        "f = load_file('interleaved-1f1b'); "
        f"o = Options({{'D': '{d}', 'N': '{n}', 'v': '2'}}); "
        "t = time.perf_counter(); run_passes(f, o); print(time.perf_counter() - t)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout)


if __name__ == "__main__":
    main()
