"""Frozen work in the bubbles (DiffusionPipe) against the frozen part run up front, simulated.

The stdlib `diffusionpipe` schedule (1F1B over D ranks, the first h ranks holding the
frozen part) is compiled with a `cost F = 1, B = 2, P = p` line added, so that its greedy
order is chosen with the same costs it is simulated with, three ways: with
`upfront = true` (no stage-0 forward before every P has ended), with `frozen fill` (the
greedy policy alone: an idle holder takes the next P), and as the stdlib writes it,
`frozen best` (the faster of the two). The gain is up front over the stdlib order;
"1F1B alone" is the backbone without any frozen work, the bound no placement of P can
beat.

    python benchmarks/frozen_work.py            # D = 4, N = 8
    python benchmarks/frozen_work.py -D 8 -N 16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pipelang.api import find_schedule, load_file
from pipelang.compiler import SCHEDULE_DONE, Options, run_passes
from pipelang.sim.timeline import simulate

FROZEN_TIMES = (0.25, 0.5, 1.0, 2.0, 4.0)
"""The frozen forward's time per micro-batch, in units of one stage's forward."""


def makespan(source: str, folder: Path, costs: str, params: dict[str, str]) -> float:
    """Simulated makespan of `source` with `costs` added as its first line."""
    path = folder / "variant.pipe"
    head, brace, body = source.partition("{\n")
    path.write_text(f"{head}{brace}    cost {costs}\n{body}")
    done = run_passes(load_file(str(path)), Options(params), SCHEDULE_DONE)
    program, graph = done.need_program(), done.graph
    assert graph is not None
    return simulate(program, graph, program.costs).makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-D", type=int, default=4)
    parser.add_argument("-N", type=int, default=8)
    args = parser.parse_args()
    source = find_schedule("diffusionpipe")[0].read_text()
    fill_source = source.replace("frozen best", "frozen fill")
    assert fill_source != source, "the stdlib diffusionpipe no longer says `frozen best`"
    one_f_one_b = find_schedule("1f1b")[0].read_text()
    size = {"D": str(args.D), "N": str(args.N)}
    print(f"D = {args.D}, N = {args.N}, F = 1, B = 2, C = 0\n")
    print("| holders h | P | 1F1B alone | up front | `frozen fill` | stdlib (`best`) | gain |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        alone = makespan(one_f_one_b, folder, "F = 1, B = 2", size)
        for holders in (args.D, 1):
            for p in FROZEN_TIMES:
                costs = f"F = 1, B = 2, P = {p}"
                params = {**size, "h": str(holders)}
                upfront = makespan(source, folder, costs, {**params, "upfront": "true"})
                fill = makespan(fill_source, folder, costs, params)
                best = makespan(source, folder, costs, params)
                print(
                    f"| {holders} | {p:g} | {alone:g} | {upfront:g} | {fill:g} | {best:g} "
                    f"| {upfront / best:.3f}x |"
                )


if __name__ == "__main__":
    main()
