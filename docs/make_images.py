"""Draw the example pictures under docs/img/ with `pipelang viz` (SVG and PNG).

    python docs/make_images.py            # needs matplotlib for the PNGs: pip install -e '.[viz]'

Schedules missing from the standard library are skipped with a note (DualPipeV is not
in it yet). The measured example is drawn from a trace recorded with
`pipelang run chimera -p D=4 -p N=4 --backend gloo --steps 3 --trace ...` (kept in
tests/data/ for the tests too). The metrics picture is drawn from the `--log` of
`pipelang run chimera -p D=4 -p N=8 --backend gloo --steps 24 --optimizer adamw
--lr-schedule cosine --warmup-steps 4 --clip-grad 1.0 --log ...` (also in tests/data/).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pipelang.api import stdlib_names
from pipelang.cli import main

ROOT = Path(__file__).resolve().parent.parent
OUT = Path("docs/img")

PICTURES = {
    "chimera": ["chimera", "-p", "D=4", "-p", "N=8"],
    "1f1b": ["1f1b", "-p", "D=4", "-p", "N=8"],
    "zbv": ["zbv", "-p", "D=4", "-p", "N=8"],
    "dualpipev": ["dualpipev", "-p", "D=4", "-p", "N=8"],
    # docs/synthesize.md: the best stdlib order within the cap against the synthesized one
    "synthesized": [
        "zb-h1",
        "examples/zb-synth-4x8.pipe",
        *("-p", "D=4", "-p", "N=8", "--cost", "F=1,B=1,W=1,C=0.5"),
    ],
    # docs/runtime.md, Larger than one device: sharded 1F1B, kept gathered through the
    # step (the compiler's gathers) against resharded after each forward (written)
    "1f1b-sharded": [
        "1f1b",
        "examples/1f1b-reshard.pipe",
        *("-p", "D=4", "-p", "N=8", "--dp", "2", "--shard"),
        *("--cost", "F=1,B=2,C=0.1,AG=0.4,RS=0.6"),
    ],
}
MEASURED = {
    "chimera-measured": [
        "chimera",
        "-p",
        "D=4",
        "-p",
        "N=4",
        "--trace",
        "tests/data/trace_chimera_D4_N4.json",
        "--overlay",
    ],
}


METRICS = Path("tests/data/metrics_chimera_D4_N8.jsonl")


def draw_metrics(log: Path, out: Path) -> None:
    """A `--log` file's per-step metrics, one panel each (docs/runtime.md, "Output")."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [line["step"] for line in lines]
    panels = [
        ("loss", ["loss"]),
        ("learning rate", ["lr"]),
        ("gradient norm (before clipping)", ["grad_norm"]),
        ("bubble: measured, predicted", ["bubble", "predicted_bubble"]),
        ("tokens/s", ["tokens_per_s"]),
        ("peak memory per rank (MiB)", ["peak_memory"]),
    ]
    figure, axes = pyplot.subplots(2, 3, figsize=(11, 5.5), constrained_layout=True)
    for axis, (title, keys) in zip(axes.flat, panels, strict=True):
        for key in keys:
            values = [line[key] for line in lines]
            if key == "peak_memory":
                for rank in range(len(values[0])):
                    axis.plot(steps, [v[rank] / 2**20 for v in values], label=f"rank {rank}")
            else:
                axis.plot(steps, values, label=key)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=8)
        if len(keys) > 1 or keys == ["peak_memory"]:
            axis.legend(fontsize=7)
    figure.savefig(out, dpi=90)
    pyplot.close(figure)


def draw_all() -> int:
    os.chdir(ROOT)
    OUT.mkdir(parents=True, exist_ok=True)
    status = 0
    for name, args in {**PICTURES, **MEASURED}.items():
        if args[0] not in stdlib_names():
            print(f"skipped {name}: `{args[0]}` is not in the standard library")
            continue
        for suffix in (".svg", ".png"):
            status |= main(["viz", *args, "-o", str(OUT / f"{name}{suffix}")])
    draw_metrics(METRICS, OUT / "metrics.png")
    return status


if __name__ == "__main__":
    sys.exit(draw_all())
