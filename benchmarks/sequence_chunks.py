"""Seq1F1B's sequence chunks: simulated bubbles and memory, and measured activation bytes.

    python benchmarks/sequence_chunks.py [-D 8] [-N 16]

Part 1 simulates `seq1f1b` (costs F = 1, B = 2) at C = 1, 2, 4, 8 chunks, with attention
a share A = 0 or 0.3 of the work, chunks of equal tokens or of equal compute, against the
paper's formulas: makespan N(F+B) + (D-1)(F+B)/C and stage 0's activations (C+D-1)/C
micro-batches, which count a chunk's own tokens only (KV = 0); then with the keys and
values each chunk past the first saves again (the default KV). Part 2 runs 1F1B and
Seq1F1B on gloo (gpt:tiny, sequences of 256 tokens, D = 4, N = 8, 2 steps) and measures
each rank's peak bytes of saved activations (`RankResult.peak_activation_bytes`,
backends/stash.py), next to the simulator's bytes:
its count of held micro-batches (`memory.shares`: a chunk's tokens, plus past the first
chunk the keys and values it saves again, `KV`) times each stage's activation bytes
as `pipelang profile` measures them, with the default KV and with KV = 0.
benchmarks/RESULTS.md has the tables ("Sequence chunks").
"""

from __future__ import annotations

import argparse

from pipelang.api import compile_schedule
from pipelang.backends.backend import runs_streams
from pipelang.backends.config import RunConfig
from pipelang.backends.measure import ProfileOptions, measure
from pipelang.backends.models import plan_stages
from pipelang.backends.processes import launch
from pipelang.compiler import stream_program
from pipelang.ir import KV_SHARE, CostModel
from pipelang.sim import memory
from pipelang.sim.timeline import Timeline, simulate


def timeline(
    name: str, params: dict[str, str], attention: float = 0.0, kv: float = 0.0
) -> Timeline:
    compiled = compile_schedule(name, params)
    program, graph = compiled.need_program(), compiled.graph
    assert graph is not None
    costs = CostModel(
        (("F", None, 1.0), ("B", None, 2.0), ("A", None, attention), ("KV", None, kv))
    )
    return simulate(program, graph, program.costs.merged(costs))


def simulated(d: int, n: int) -> None:
    base = timeline("1f1b", {"D": str(d), "N": str(n)})
    print(
        f"1f1b D={d} N={n}: makespan {base.makespan:g}, stage 0 holds "
        f"{base.peak_activations(0)} micro-batches"
    )
    print(
        "| C | A | chunks | makespan | formula | bubble | stage 0 holds (KV = 0) | of 1F1B's "
        f"| (C+D-1)/(CD) | stage 0 holds (KV = {KV_SHARE:g}) | of 1F1B's |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in (1, 2, 4, 8):
        for attention, balanced in ((0.0, "false"), (0.3, "false"), (0.3, "true")):
            if c == 1 and attention:
                continue
            params = {"D": str(d), "N": str(n), "C": str(c), "balanced": balanced}
            t = timeline("seq1f1b", params, attention)
            held = t.peak_activations(0)
            with_kv = timeline("seq1f1b", params, attention, KV_SHARE).peak_activations(0)
            split = "equal compute" if balanced == "true" else "equal tokens"
            whole = base.peak_activations(0)
            print(
                f"| {c} | {attention:g} | {split} | {t.makespan:.3f} | "
                f"{n * 3 + (d - 1) * 3 / c:.3f} | {t.bubble_ratio:.3f} | {held:.3f} | "
                f"{held / whole:.3f} | {(c + d - 1) / (c * d):.3f} | {with_kv:.3f} "
                f"| {with_kv / whole:.3f} |"
            )


def measured() -> None:
    """Measured peak bytes per rank on gloo next to the simulator's: its count of held
    micro-batches (chunks as their shares, `KV` included) times each stage's activation
    bytes from `pipelang profile` (one micro-batch through each layer, measured apart
    from the run)."""
    config = RunConfig(backend="gloo", steps=2, seq_len=256, count_activations=True)
    layers = measure(ProfileOptions("gpt:tiny", config.micro_batch_size, 256, repeats=1)).layers
    no_kv = CostModel((("KV", None, 0.0),))
    print("| schedule | rank | measured | simulated | measured / simulated | without KV |")
    print("|---|---|---|---|---|---|")
    for name, params in (
        ("1f1b", {"D": "4", "N": "8"}),
        ("seq1f1b", {"D": "4", "N": "8", "C": "2"}),
        ("seq1f1b", {"D": "4", "N": "8", "C": "4"}),
    ):
        compiled = compile_schedule(name, params)
        program, graph = compiled.need_program(), compiled.graph
        assert graph is not None
        plan = plan_stages(config.spec, program.num_stages, None)
        kept = [sum(layers[i].activation_bytes for i in bounds) for bounds in plan.bounds]
        streams = stream_program(program, config.dp) if runs_streams(program, config) else None
        outcome = launch(program, config, plan.shapes, lambda *_: None, streams)
        w = memory.w_share(program)
        label = name if "C" not in params else f"{name} C = {params['C']}"
        for rank, result in enumerate(outcome.results):
            actions = program.ranks[rank]
            got = result.peak_activation_bytes
            with_kv, without = (
                memory.peak_bytes(actions, w, kept, share=memory.shares(program, costs))
                for costs in (program.costs, program.costs.merged(no_kv))
            )
            print(
                f"| {label} | {rank} | {got / 1024:.0f} KiB | {with_kv / 1024:.0f} KiB "
                f"| {got / with_kv:.3f} | {got / without:.3f} |"
            )


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
