"""`pipelang.torch.PipelineSchedule`: a schedule inside the user's own torch loop.

Oracle: examples/train_with_torchrun.py checks, on rank 0, every stage copy's gradients
after one step against one process running the whole model on the same batch (every
data-parallel copy on its own batch); here it runs under torchrun (4 gloo processes).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import pipelang
from pipelang.torch import PipelineSchedule

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_with_torchrun.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        [],  # Chimera D=4 N=4: two pipelines, replicas summed
        # a split backward in two data-parallel copies of a 2-rank pipeline:
        # tests/test_nodes.py, on two nodes
    ],
)
def test_the_torchrun_example_matches_one_process(args: list[str]) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(EXAMPLE),
        *args,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"gradients against one process: largest difference (\S+)", proc.stdout)
    assert found is not None, proc.stdout + proc.stderr
    assert float(found[1]) < 1e-6, found[0]


def test_refusals_before_anything_runs() -> None:
    def build(stage: int) -> object:
        raise AssertionError("no stage is built for a refused schedule")

    with pytest.raises(pipelang.PipelangError, match="asynchronous"):
        PipelineSchedule(pipelang.load("pipedream", D=2, N=4), build, lambda y, t: y)  # type: ignore[arg-type]
    with pytest.raises(pipelang.PipelangError, match="evicts activations"):
        PipelineSchedule(pipelang.load("bpipe"), build, lambda y, t: y)  # type: ignore[arg-type]
    with pytest.raises(pipelang.PipelangError, match="initialised process group"):
        PipelineSchedule(pipelang.load("1f1b", D=2, N=2), build, lambda y, t: y)  # type: ignore[arg-type]
