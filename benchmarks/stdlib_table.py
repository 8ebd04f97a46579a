"""The standard-library table: every stdlib schedule simulated at one size and cost model.

For each schedule: the number of ranks and stages, the simulated makespan, the bubble
ratio (ours: 1 - busy / (R * makespan), DESIGN.md section 4), the largest per-rank peak of
activations in flight (forwards whose backward has not run, counted per stage copy), the
most weight versions a rank holds at once (its stage copies; more under an asynchronous
schedule's weight stashing), and whether `pipelang check` accepts it. Defaults: D = 8,
N = 16, costs F = 1, B = 2, W = 1, C = 0 for every schedule (one model: a schedule that
does not split W off its backward takes B + W for it, and orders that depend on the
costs are expanded under them, as `pipelang simulate --cost` does); other parameters
(v, f, w) keep their defaults.

    python benchmarks/stdlib_table.py            # print the markdown table
    python benchmarks/stdlib_table.py --write    # also replace it in docs/schedules/README.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelang.api import load_file, stdlib_names
from pipelang.compiler import Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.ir import CostModel

README = Path(__file__).resolve().parent.parent / "docs" / "schedules" / "README.md"
BEGIN, END = "<!-- stdlib-table:begin -->", "<!-- stdlib-table:end -->"
COSTS = CostModel((("F", None, 1.0), ("B", None, 2.0), ("W", None, 1.0), ("C", None, 0.0)))


def row(name: str, params: dict[str, str], costs: CostModel) -> list[str]:
    """One table row: simulate the schedule, and say whether it passes `check`."""
    file = load_file(name)
    given = {k: v for k, v in params.items() if any(p.name == k for p in file.schedule.params)}
    expanded = run_passes(file, Options(given, costs=costs), "build-dag")
    program = expanded.need_program()
    try:
        run_passes(file, Options(given, costs=costs))
        status = "ok"
    except PipelangError as err:
        status = ", ".join(sorted({d.code for d in err.diagnostics}))
    timeline = expanded.timeline(costs)
    ranks = range(program.num_ranks)
    shown = ", ".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in program.params
    )
    return [
        f"[`{name}`]({name}.md)",
        shown,
        str(program.num_stages),
        f"{timeline.makespan:g}",
        f"{timeline.bubble_ratio:.3f}",
        str(max(timeline.peak_activations(r) for r in ranks)),
        str(max(timeline.peak_weight_versions(r) for r in ranks)),
        status,
    ]


def table(D: int, N: int, costs: CostModel) -> str:
    head = [
        "schedule",
        "parameters",
        "stages",
        "makespan",
        "bubble ratio",
        "peak activations",
        "weight versions",
        "check",
    ]
    rows = [row(name, {"D": str(D), "N": str(N)}, costs) for name in stdlib_names()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-D", type=int, default=8)
    parser.add_argument("-N", type=int, default=16)
    parser.add_argument("--write", action="store_true", help=f"update {README}")
    args = parser.parse_args()
    text = table(args.D, args.N, COSTS)
    print(text)
    if args.write:
        readme = README.read_text()
        start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
        README.write_text(f"{readme[:start]}\n{text}\n{readme[end:]}")


if __name__ == "__main__":
    main()
