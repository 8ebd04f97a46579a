"""Planner predictions against measured runs: CPU, gloo, 2 ranks, the unbalanced demo model.

1. `pipelang profile` the model `pipelang.planner.demo:unbalanced` (one block 4x the
   others) on this CPU with one thread, as each of two gloo ranks gets one core here.
2. `pipelang plan` it for a 2-device cluster (the two cores; the link is gloo over
   loopback, given as 1 GB/s and 100 us) with N = 8 micro-batches.
3. Run the top 3 plans, and 1F1B with the even split of the layers, with `pipelang run
   --backend gloo` (the written `.pipe` files as they are), in rounds that alternate the
   order; each run does 3 warm-up and 12 timed steps; the median step time is the
   measurement.

Reports predicted vs measured iteration time, the error, whether the measured order of
the top 3 is the predicted one, and whether the planner's partition beats the even split.

    python benchmarks/plan_vs_measured.py             # ~3 min; replaces its RESULTS.md part
    python benchmarks/plan_vs_measured.py --no-write  # print only
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch

from pipelang.planner.profile import ProfileOptions, measure
from pipelang.planner.search import Inputs, Plan, Planner
from pipelang.planner.topology import Link, Topology
from pipelang.planner.write import plan_source

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Planner"
MODEL = "pipelang.planner.demo:unbalanced"
MICRO_BATCH_SIZE = 8
MICROBATCHES = 8
WARMUP, TIMED = 3, 12


def replace_block(heading: str, text: str) -> None:
    """Put `text` (which starts with `heading`, a `###` line) under `## Planner` in
    RESULTS.md, replacing the block of that heading if there is one."""
    doc = RESULTS.read_text()
    if SECTION not in doc:
        intro = "How well `pipelang plan` predicts, and how fast it searches (issue 8)."
        doc = doc.rstrip("\n") + f"\n\n{SECTION}\n\n{intro}\n"
    start = doc.index(SECTION)
    end = doc.find("\n## ", start + len(SECTION))
    end = len(doc) if end < 0 else end + 1
    section = doc[start:end].rstrip("\n") + "\n"
    if heading in section:
        a = section.index(heading)
        b = section.find("\n### ", a + len(heading))
        section = section[:a] + text + ("" if b < 0 else "\n" + section[b + 1 :])
    else:
        section = section + "\n" + text
    rest = doc[end:]
    RESULTS.write_text(doc[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else ""))


def two_cores() -> Topology:
    link = Link(1e9, 100e-6)
    return Topology(("cpu0", "cpu1"), (8 * 2**30,) * 2, ((None, link), (link, None)))


def measure_run(path: Path, workdir: Path) -> list[float]:
    """Step times (ms) of the timed steps of one `pipelang run` of `path`."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    load_before = os.getloadavg()
    profile = measure(
        ProfileOptions(MODEL, micro_batch_size=MICRO_BATCH_SIZE, threads=1, repeats=7)
    )
    planner = Planner(Inputs(profile, two_cores(), MICROBATCHES, optimizer="sgd"))
    result = planner.search()
    top = [p for p in result.plans if p.exact][:3]
    one_f_one_b = next(p for p in result.plans if p.candidate.label.startswith("1f1b D=2"))
    layers = len(profile.layers)
    even = planner.predict(
        one_f_one_b.candidate, (layers - layers // 2, layers // 2), one_f_one_b.devices, True
    )
    runs: list[tuple[str, Plan]] = [(f"plan {i + 1}", p) for i, p in enumerate(top)]
    if all(p.candidate != one_f_one_b.candidate for p in top):
        runs.append(("planner's 1F1B", one_f_one_b))
    runs.append(("1F1B, even split", even))
    measured: dict[str, list[float]] = {name: [] for name, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, plan in runs:
            path = Path(tmp) / f"{len(files)}.pipe"
            path.write_text(plan_source(plan, planner, "profile", "two cores"))
            files[name] = path
        for round_ in range(args.rounds):
            order = runs if round_ % 2 == 0 else runs[::-1]
            for name, _ in order:
                measured[name].extend(measure_run(files[name], Path(tmp)))
                print(name, f"{statistics.median(measured[name]):.1f} ms", flush=True)
    rows = []
    for name, plan in runs:
        times = sorted(measured[name])
        med = statistics.median(times)
        q1, q3 = times[len(times) // 4], times[(3 * len(times)) // 4]
        rows.append(
            f"| {name} | {plan.candidate.label} | {','.join(map(str, plan.partition))} | "
            f"{plan.time_ms:.1f} | {med:.1f} ({q1:.1f}-{q3:.1f}) | "
            f"{100 * (plan.time_ms / med - 1):+.0f}% |"
        )
    predicted_order = [name for name, _ in runs[: len(top)]]
    measured_order = sorted(predicted_order, key=lambda n: statistics.median(measured[n]))
    planner_1f1b = (
        "plan " + str(1 + top.index(one_f_one_b)) if one_f_one_b in top else "planner's 1F1B"
    )
    beats = statistics.median(measured[planner_1f1b]) < statistics.median(
        measured["1F1B, even split"]
    )
    lines = [
        "### Predicted vs measured (CPU, gloo)",
        "",
        f"- Machine: {os.cpu_count()}-core {platform.machine()} VM shared with other jobs; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
        f"- torch {torch.__version__}, Python {platform.python_version()}, 1 thread per rank",
        "- Command: `python benchmarks/plan_vs_measured.py`",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- Model `{MODEL}` ({layers} layers), micro-batches of {MICRO_BATCH_SIZE} x "
        f"{profile.seq_len} tokens, N = {MICROBATCHES}, SGD; profiled with `threads=1`; "
        "cluster: 2 devices joined by 1 GB/s, 100 us; "
        f"{args.rounds} rounds x {TIMED} timed steps per plan, median (quartiles).",
        "",
        "| run | schedule | partition | predicted ms | measured ms | error |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"- Rank order of the top 3: predicted {', '.join(predicted_order)}; measured "
        f"{', '.join(measured_order)}: {'' if measured_order == predicted_order else 'not '}"
        "preserved.",
        f"- The planner's 1F1B partition {one_f_one_b.partition} against the even split "
        f"{even.partition}: predicted {one_f_one_b.time_ms:.1f} vs {even.time_ms:.1f} ms, "
        f"measured {statistics.median(measured[planner_1f1b]):.1f} vs "
        f"{statistics.median(measured['1F1B, even split']):.1f} ms: "
        f"{'the plan is faster' if beats else 'the plan is NOT faster'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        replace_block("### Predicted vs measured (CPU, gloo)", text)


if __name__ == "__main__":
    main()
