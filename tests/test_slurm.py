"""The SLURM script of docs/runtime.md ("Several nodes"), run as two tasks see it (issue
44 item 7): `scontrol`, `srun` and `torchrun` are stood in by scripts on PATH; the `srun`
stand-in starts its command twice, as SLURM starts one task per node, each with its own
SLURM_NODEID, and the `torchrun` stand-in writes down the command line it was given.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from pathlib import Path

from pipelang.cli.app import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"

STUBS = {
    "scontrol": 'printf "node0\\nnode1\\n"\n',
    "srun": 'for id in 0 1; do\n  SLURM_NODEID=$id "$@" &\n  echo $! > "$OUT/pid$id"\ndone\nwait\n',
    "torchrun": 'printf "%s\\n" "$$" "$@" > "$OUT/task$SLURM_NODEID"\n',
}


def slurm_script() -> str:
    """The one `#!/bin/bash` block of docs/runtime.md."""
    blocks = re.findall(r"```\n(#!/bin/bash\n.*?)```", (DOCS / "runtime.md").read_text(), re.S)
    assert len(blocks) == 1
    return str(blocks[0])


def test_the_slurm_script_gives_each_node_its_own_node_rank(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(slurm_script())
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path), "HOME": str(tmp_path)}
    env |= {"SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_NODEID": "0"}
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    tasks = [(tmp_path / f"task{node}").read_text().splitlines() for node in (0, 1)]
    ranks = [argv[argv.index("--node-rank") + 1] for _, *argv in tasks]
    assert ranks == ["0", "1"]  # each task's own SLURM_NODEID (the batch shell's is 0)
    for node, (pid, *argv) in enumerate(tasks):
        assert pid == (tmp_path / f"pid{node}").read_text().strip()  # exec'd: SIGTERM reaches it
        options = dict(itertools.pairwise(argv))
        assert options["--nnodes"] == "2" and options["--master-addr"] == "node0"
        command = argv[argv.index("--no-python") + 1 :]
        assert command[:2] == ["pipelang", "run"]
        if "--data" in command:  # read at parse time: one that is here
            command[command.index("--data") + 1] = str(script)
        args = build_parser().parse_args(command[1:])
        assert str(args.resume) == "auto" and args.save is not None
