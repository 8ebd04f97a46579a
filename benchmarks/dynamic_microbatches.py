"""Dynamic micro-batching (`pipelang pack`) against fixed-size batches and packed sequences.

    python benchmarks/dynamic_microbatches.py [--count 256] [--seeds 0 1 2]

For each seed: `count` sequence lengths drawn from a long-tailed distribution, lognormal
with median 256 tokens and sigma 1 (`random.Random(seed).lognormvariate(log 256, 1)`,
rounded, clipped to 16..4096). Each schedule (1F1B and ZB-H1 on 4 ranks) is simulated
with costs F = 1, B = 2, W = 1 (one model: 1F1B's backward takes B + W), A = 0.3
(attention's share for one sequence of the longest length), O = 0.05 (the share a
smaller micro-batch still takes), under a cap of 4 x the longest sequence's tokens per
rank; `pack` has its default work bound (`pack.MAX_CANDIDATES` packings simulated), so
the table is the same on any machine but for the pack's time (wall time of the
search here). The baselines are as `pipelang pack` prints them: fixed-size batches, the
best of k = 1..64 sequences per micro-batch in the data's order, padded to their
longest; sorted fixed-size batches, the same after sorting the lengths longest first
(what a user tries first); and packed sequences, the best of sequences packed to the
longest and twice the longest.
benchmarks/RESULTS.md has the table ("Dynamic micro-batching").
"""

from __future__ import annotations

import argparse
import math
import random
import time

from pipelang.ir import CostModel
from pipelang.pack import best_of, fixed_batches, pack, packed_sequences

COSTS = CostModel(
    (("F", None, 1.0), ("B", None, 2.0), ("W", None, 1.0), ("A", None, 0.3), ("O", None, 0.05))
)


SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Sequences per micro-batch the fixed-size baselines try."""


def long_tail(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(16, min(4096, round(rng.lognormvariate(math.log(256), 1.0)))) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print(
        "| schedule | seed | tokens | longest | pack: micro-batches, makespan, padding | "
        "fixed-size: makespan (gain) | sorted fixed-size: makespan (gain) | "
        "packed: makespan (gain) | pack: packings, time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for sched in ("1f1b", "zb-h1"):
        for seed in args.seeds:
            lengths = long_tail(args.count, seed)
            cap, params = 4 * max(lengths), {"D": "4"}
            start = time.perf_counter()
            best = pack(lengths, sched, params, COSTS, cap)
            seconds = time.perf_counter() - start
            fixed, _ = best_of(
                lengths,
                sched,
                params,
                COSTS,
                cap,
                [fixed_batches(lengths, k) for k in SIZES],
            )
            ordered = sorted(lengths, reverse=True)
            sorted_fixed, _ = best_of(
                lengths, sched, params, COSTS, cap, [fixed_batches(ordered, k) for k in SIZES]
            )
            packed, _ = best_of(
                lengths,
                sched,
                params,
                COSTS,
                cap,
                [packed_sequences(lengths, n) for n in (max(lengths), 2 * max(lengths))],
            )
            cells = [
                "-"
                if other is None
                else f"{other.makespan:.2f} ({other.makespan / best.makespan:.2f}x)"
                for other in (fixed, sorted_fixed, packed)
            ]
            print(
                f"| {sched} | {seed} | {sum(lengths)} | {max(lengths)} | {len(best.shapes)}, "
                f"{best.makespan:.2f}, {best.padding:.1%} | {cells[0]} | {cells[1]} | {cells[2]} | "
                f"{best.tried}, {seconds:.1f} s |"
            )


if __name__ == "__main__":
    main()
