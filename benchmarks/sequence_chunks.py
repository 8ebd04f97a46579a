"""Seq1F1B's sequence chunks: simulated bubbles and memory, and measured activation bytes.

    python benchmarks/sequence_chunks.py [-D 8] [-N 16]

Part 1 simulates `seq1f1b` (costs F = 1, B = 2) at C = 1, 2, 4, 8 chunks, with attention
a share A = 0 or 0.3 of the work, chunks of equal tokens or of equal compute, against the
paper's formulas: makespan N(F+B) + (D-1)(F+B)/C and stage 0's activations (C+D-1)/C
micro-batches. Part 2 runs 1F1B and Seq1F1B on gloo (gpt:tiny, sequences of 256 tokens,
D = 4, N = 8, 2 steps) and measures each rank's peak bytes of saved activations
(`RankResult.peak_activation_bytes`, backends/stash.py), next to the simulator's count.
benchmarks/RESULTS.md has the tables ("Sequence chunks").
"""

from __future__ import annotations

import argparse

from pipelang.api import compile_schedule
from pipelang.backends.models import plan_stages
from pipelang.backends.processes import launch
from pipelang.backends.runtime import RunConfig
from pipelang.ir import CostModel
from pipelang.simulate import Timeline, simulate


def timeline(name: str, params: dict[str, str], attention: float = 0.0) -> Timeline:
    compiled = compile_schedule(name, params)
    program, graph = compiled.need_program(), compiled.graph
    assert graph is not None
    costs = CostModel((("F", None, 1.0), ("B", None, 2.0), ("A", None, attention)))
    return simulate(program, graph, program.costs.merged(costs))


def simulated(d: int, n: int) -> None:
    base = timeline("1f1b", {"D": str(d), "N": str(n)})
    print(
        f"1f1b D={d} N={n}: makespan {base.makespan:g}, stage 0 holds "
        f"{base.peak_activations(0)} micro-batches"
    )
    print(
        "| C | A | chunks | makespan | formula | bubble | stage 0 holds | of 1F1B's "
        "| (C+D-1)/(CD) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in (1, 2, 4, 8):
        for attention, balanced in ((0.0, "false"), (0.3, "false"), (0.3, "true")):
            params = {"D": str(d), "N": str(n), "C": str(c), "balanced": balanced}
            t = timeline("seq1f1b", params, attention)
            held = t.peak_activations(0)
            split = "equal compute" if balanced == "true" else "equal tokens"
            print(
                f"| {c} | {attention:g} | {split} | {t.makespan:.3f} | "
                f"{n * 3 + (d - 1) * 3 / c:.3f} | {t.bubble_ratio:.3f} | {held:.3f} | "
                f"{held / base.peak_activations(0):.3f} | {(c + d - 1) / (c * d):.3f} |"
            )


def measured() -> None:
    for name, params in (
        ("1f1b", {"D": "4", "N": "8"}),
        ("seq1f1b", {"D": "4", "N": "8", "C": "2"}),
        ("seq1f1b", {"D": "4", "N": "8", "C": "4"}),
    ):
        compiled = compile_schedule(name, params)
        program, graph = compiled.need_program(), compiled.graph
        assert graph is not None
        config = RunConfig(backend="gloo", steps=2, seq_len=256, count_activations=True)
        shapes = plan_stages(config.spec, program.num_stages, None).shapes
        outcome = launch(program, config, shapes, lambda *_: None)
        kib = [round(r.peak_activation_bytes / 1024) for r in outcome.results]
        t = simulate(program, graph, CostModel())
        counts = [t.peak_activations(r) for r in range(program.num_ranks)]
        print(f"{name} {params}: KiB {kib}  simulator {counts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-D", type=int, default=8)
    parser.add_argument("-N", type=int, default=16)
    parser.add_argument("--simulated-only", action="store_true")
    args = parser.parse_args()
    simulated(args.D, args.N)
    if not args.simulated_only:
        measured()


if __name__ == "__main__":
    main()
