"""Peak bytes of saved activations per rank, 1F1B against BPipe, on gloo.

    python benchmarks/bpipe_memory.py

Prints, per schedule and shape, each rank's `peak_activation_bytes` (backends/stash.py)
in KiB next to the simulator's `peak_activations` count; benchmarks/RESULTS.md has the
table ("BPipe evictions (CPU)").
"""

from __future__ import annotations

from pipelang.api import compile_schedule
from pipelang.backends.backend import runs_streams
from pipelang.backends.config import RunConfig
from pipelang.backends.models import plan_stages
from pipelang.backends.processes import launch
from pipelang.compiler import stream_program
from pipelang.sim.timeline import CostModel, simulate


def main() -> None:
    for d, n in ((4, 8), (8, 16)):
        for name in ("1f1b", "bpipe"):
            compiled = compile_schedule(name, {"D": str(d), "N": str(n)})
            program, graph = compiled.need_program(), compiled.graph
            assert graph is not None
            config = RunConfig(backend="gloo", steps=2, count_activations=True)
            shapes = plan_stages(config.spec, program.num_stages, None).shapes
            streams = stream_program(program, config.dp) if runs_streams(program, config) else None
            outcome = launch(program, config, shapes, lambda *_: None, streams)
            kib = [round(r.peak_activation_bytes / 1024) for r in outcome.results]
            timeline = simulate(program, graph, CostModel())
            counts = [timeline.peak_activations(r) for r in range(program.num_ranks)]
            print(f"{name} D={d} N={n}: KiB {kib}  simulator {counts}")


if __name__ == "__main__":
    main()
