"""Every command on every stdlib schedule at the op limit: wall time and peak memory.

    python benchmarks/limits.py [COMMANDS] [SCHEDULES]

COMMANDS (comma-separated, default check,simulate,export,viz,compile) run as whole
processes on each stdlib schedule (or SCHEDULES) at D=8 and the largest N (a multiple of
16) that keeps the schedule within 98% of `MAX_OPS`, the default `--max-ops`
(docs/language.md, "Limits"). Peak memory is the process's maximum resident set
(`/usr/bin/time -f %M`). The op limit is chosen from this table: at it, every command
should answer within about 10 s.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelang import api
from pipelang.evaluate import MAX_OPS

COMMANDS = ("check", "simulate", "export", "viz", "compile")


def micro_batches(name: str) -> int:
    """The largest N (multiple of 16) whose schedule at D=8 stays under 98% of MAX_OPS."""
    program = api.compile_schedule(name, {"D": "8", "N": "64"}, stop_after="expand-orders")
    ops = sum(a.kind.is_compute for actions in program.need_program().ranks for a in actions)
    n = int(MAX_OPS * 0.98 / (ops / 64))
    return n - n % 16


def main() -> None:
    commands = sys.argv[1].split(",") if len(sys.argv) > 1 else list(COMMANDS)
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else api.stdlib_names()
    out = Path(tempfile.mkdtemp())
    extra = {
        "export": ["--format", "json", "-o", str(out / "x.json")],
        "compile": ["-o", str(out / "compiled")],
        "viz": ["-o", str(out / "x.svg")],
    }
    print(f"MAX_OPS {MAX_OPS}; D=8")
    print("| schedule | N | " + " | ".join(commands) + " |")
    print("|---|---:|" + "---:|" * len(commands))
    for name in names:
        n = micro_batches(name)
        cells = []
        for command in commands:
            argv = ["pipelang", command, name, "-p", "D=8", "-p", f"N={n}", *extra.get(command, [])]
            start = time.perf_counter()
            done = subprocess.run(
                ["/usr/bin/time", "-f", "%M", *argv], capture_output=True, text=True
            )
            seconds = time.perf_counter() - start
            megabytes = int(done.stderr.split()[-1]) // 1024
            status = "" if done.returncode == 0 else f" (exit {done.returncode})"
            cells.append(f"{seconds:.1f} s, {megabytes} MB{status}")
        print(f"| {name} | {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
