"""Planner predictions against measured runs: CPU, gloo, 2 ranks, the unbalanced demo model.

1. `pipelang profile --calibrate gloo` the model `pipelang.planner.demo:unbalanced` (one
   block 4x the others) on this CPU with one thread (each of two gloo ranks gets one core
   here): per-layer times, optimizer step times, and the runtime's costs per action and
   per message read from a short traced gloo run (`pipelang/planner/calibrate.py`).
2. Measure the loopback link gloo uses between two processes (latency from 4-byte
   messages, bandwidth from 8 MiB ones, the fastest of 20 ping-pongs) and describe the
   2-core machine with it.
3. `pipelang plan` it with N = 8 micro-batches, SGD, and a 40 MiB memory cap: the cap
   leaves out GPipe (it holds all N micro-batches' activations), which predicts the
   same time as 1F1B on two ranks, so the top 3 have distinct predictions.
4. Run the top 3 plans, and 1F1B with the even split of the layers, with `pipelang run
   --backend gloo` (the written `.pipe` files as they are), in rounds that alternate
   the order; each run does 3 warm-up and 10 timed steps and counts as its median step.

Reports per plan the prediction with and without the calibration, the measured median
over the runs and its spread (the lowest and highest run), the error, and whether the
measured order of the top 3 is the predicted one.

    python benchmarks/plan_vs_measured.py             # ~4 min; replaces its RESULTS.md part
    python benchmarks/plan_vs_measured.py --no-write  # print only
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelang.planner.calibrate import calibrate
from pipelang.planner.profile import Profile, ProfileOptions, measure
from pipelang.planner.search import Inputs, Plan, Planner
from pipelang.planner.topology import Link, Topology
from pipelang.planner.write import plan_source

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Planner"
MODEL = "pipelang.planner.demo:unbalanced"
MICRO_BATCH_SIZE = 8
MICROBATCHES = 8
MAX_MEMORY = 40 * 2**20
WARMUP, TIMED = 3, 10


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


def two_cores(link: Link) -> Topology:
    return Topology(("cpu0", "cpu1"), (8 * 2**30,) * 2, ((None, link), (link, None)))


def _ping(rank: int, port: int, sizes: tuple[int, ...], out: dict[int, float]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for size in sizes:
        buffer = torch.zeros(size // 4)
        samples = []
        for i in range(25):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            if i >= 5:
                samples.append((time.perf_counter() - start) / 2)
        if rank == 0:
            out[size] = min(samples)
    dist.destroy_process_group()


def loopback_link() -> Link:
    """gloo between two processes here: one-way time of 4-byte and 8 MiB messages
    (ping-pong, the fastest of 20: the link itself, not the load on the machine), as a
    latency and a bandwidth."""
    small, large = 4, 8 * 2**20
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29000 + os.getpid() % 1000
        mp.spawn(_ping, args=(port, (small, large), out), nprocs=2)
        latency, big = out[small], out[large]
    return Link((large - small) / max(big - latency, 1e-9), latency)


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


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    options = ProfileOptions(MODEL, micro_batch_size=MICRO_BATCH_SIZE, threads=1, repeats=15)
    options = replace(options, warmup=5)
    bare = measure(options)
    profile = replace(bare, runtime=calibrate(bare, options, "gloo", 2, steps=6))
    runtime = profile.runtime
    assert runtime is not None
    link = loopback_link()
    topology = two_cores(link)
    planner = Planner(
        Inputs(profile, topology, MICROBATCHES, max_memory=MAX_MEMORY, optimizer="sgd")
    )
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
    # The same plans under the profile without calibration (layers' times only).
    uncalibrated = Planner(
        Inputs(uncalibrated_profile(profile), topology, MICROBATCHES, optimizer="sgd")
    )
    before = {
        name: uncalibrated.predict(p.candidate, p.partition, p.devices, True).time_ms
        for name, p in runs
    }
    measured: dict[str, list[float]] = {name: [] for name, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, Path] = {}
        for name, plan in runs:
            path = Path(tmp) / f"{len(files)}.pipe"
            path.write_text(plan_source(plan, planner, "profile", "two cores"))
            files[name] = path
        for round_ in range(args.rounds):
            order = runs if round_ % 2 == 0 else runs[::-1]
            for name, _ in order:
                measured[name].append(statistics.median(measure_run(files[name], Path(tmp))))
                print(name, f"{measured[name][-1]:.1f} ms", flush=True)
    medians = {name: statistics.median(values) for name, values in measured.items()}
    rows = []
    for name, plan in runs:
        med = medians[name]
        rows.append(
            f"| {name} | {plan.candidate.label} | {','.join(map(str, plan.partition))} | "
            f"{before[name]:.1f} | {plan.time_ms:.1f} | {spread(measured[name])} | "
            f"{100 * (before[name] / med - 1):+.0f}% | {100 * (plan.time_ms / med - 1):+.0f}% |"
        )
    predicted_order = [name for name, _ in runs[: len(top)]]
    measured_order = sorted(predicted_order, key=medians.__getitem__)
    planner_1f1b = (
        "plan " + str(1 + top.index(one_f_one_b)) if one_f_one_b in top else "planner's 1F1B"
    )
    beats = medians[planner_1f1b] < medians["1F1B, even split"]
    gaps = [
        f"{a} vs {b}: predicted {100 * (dict(runs)[b].time_ms / dict(runs)[a].time_ms - 1):+.0f}%,"
        f" measured {100 * (medians[b] / medians[a] - 1):+.0f}%"
        for a, b in itertools.pairwise(predicted_order)
    ]
    noise = max((max(v) - min(v)) / statistics.median(v) for v in measured.values())
    lines = [
        "### Predicted vs measured (CPU, gloo)",
        "",
        f"- Machine: {os.cpu_count()}-core {platform.machine()} VM shared with other jobs; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
        f"- torch {torch.__version__}, Python {platform.python_version()}, 1 thread per rank",
        "- Command: `python benchmarks/plan_vs_measured.py`",
        f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- Model `{MODEL}` ({layers} layers), micro-batches of {MICRO_BATCH_SIZE} x "
        f"{profile.seq_len} tokens, N = {MICROBATCHES}, SGD, memory cap "
        f"{MAX_MEMORY // 2**20} MiB; profiled with `threads=1`, "
        f"{options.repeats} repeats; {args.rounds} runs per plan of {TIMED} timed steps "
        "(after 3 warm-up), each run counted as its median step; measured: the median "
        "over the runs (lowest-highest run).",
        f"- Calibration (`--calibrate gloo`, 2 ranks): {runtime.action_ms:.3f} ms per "
        f"action, send {runtime.send_ms:.3f} ms, receive {runtime.recv_ms:.3f} ms, "
        f"message {runtime.message_ms:.3f} ms, compute x{runtime.compute_scale:.2f} "
        f"beside the other rank; optimizer step (SGD) "
        f"{sum(c.step_ms('sgd') for c in profile.layers):.2f} ms for the whole model. "
        f"Loopback link (gloo, measured): {link.latency * 1e6:.0f} us, "
        f"{link.bandwidth / 1e9:.2f} GB/s.",
        "",
        "| run | schedule | partition | predicted ms, uncalibrated | predicted ms | "
        "measured ms | error, uncalibrated | error |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- Rank order of the top 3: predicted {', '.join(predicted_order)}; measured "
        f"{', '.join(measured_order)}: {'' if measured_order == predicted_order else 'not '}"
        f"preserved. Neighbours: {'; '.join(gaps)}. The widest run-to-run spread: "
        f"{100 * noise:.0f}% of its median.",
        f"- The planner's 1F1B partition {one_f_one_b.partition} against the even split "
        f"{even.partition}: predicted {one_f_one_b.time_ms:.1f} vs {even.time_ms:.1f} ms, "
        f"measured {medians[planner_1f1b]:.1f} vs {medians['1F1B, even split']:.1f} ms: "
        f"{'the plan is faster' if beats else 'the plan is NOT faster'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        replace_block("### Predicted vs measured (CPU, gloo)", text)


def uncalibrated_profile(profile: Profile) -> Profile:
    """`profile` as it was before this work: no runtime costs, no optimizer step."""
    layers = tuple(replace(c, sgd_step_ms=None, adam_step_ms=None) for c in profile.layers)
    return replace(profile, layers=layers, runtime=None)


if __name__ == "__main__":
    main()
