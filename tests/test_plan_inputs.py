"""`pipelang plan`'s written file stays a file `check` reads whatever names its inputs give
(issue 44 item 14): a profile's names are checked for length as they are read, and every
name the header repeats is written on one line and cut (a 1 MB profile name once made a
plan over the 1 MiB `check` takes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_in_process

LAYER = {
    "name": "Block",
    "forward_ms": 1,
    "backward_input_ms": 1,
    "backward_weight_ms": 1,
    "activation_bytes": 1000,
    "weight_bytes": 1000,
    "output_bytes": 100,
}


def plan(tmp_path: Path, topology: str, layers: int = 4, **fields: str) -> tuple[int, str]:
    profile = {
        "format": "pipelang-profile/1",
        "model": "m",
        "device": "cpu",
        "micro_batch_size": 1,
        "seq_len": 1,
        "layers": [LAYER] * layers,
        **fields,
    }
    (tmp_path / "p.json").write_text(json.dumps(profile))
    (tmp_path / "t.yaml").write_text(topology)
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--topology", str(tmp_path / "t.yaml")]
    status, _, err = run_in_process(
        [*args, "--micro-batches", "8", "-o", str(tmp_path / "o.pipe"), "--schedules", "1f1b"]
    )
    return status, err


TWO = "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nintra_node: {bandwidth: 10GB/s}\n"


def test_a_profile_name_past_the_limit_is_refused(tmp_path: Path) -> None:
    status, err = plan(tmp_path, TWO, model="m" * 1_100_000)
    assert status == 1
    assert ": `model` is 1,100,000 characters long; a profile's names are at most 1,000" in err
    assert len(err) < 2000
    status, err = plan(tmp_path, TWO, device="c" * 1001)
    assert status == 1 and "`device` is 1,001 characters long" in err


@pytest.mark.slow
def test_the_written_plan_stays_a_file_check_reads(tmp_path: Path) -> None:
    """Names at the profile's limit, with line breaks and wide characters, and devices of
    200,000-character names (1.6 MB of them before): the header writes each on one line,
    cut in the middle, and `check` takes the file."""
    devices = "".join(f"  - {{name: {'dév' * 66_666}{i}, memory: 1GiB}}\n" for i in range(8))
    topology = f"devices:\n{devices}default_link: {{bandwidth: 10GB/s}}\n"
    status, err = plan(tmp_path, topology, 8, model="é" * 999 + "\n", device="c\npu" * 200)
    assert status == 0, err
    written = (tmp_path / "o.pipe").read_text()
    assert len(written.encode()) < 50_000
    header = written.splitlines()[:6]
    assert all(len(line) < 1000 for line in header)
    assert "\\n (1,001 characters) on c\\npuc\\npu" in header[1]  # the line break escaped
    assert "(1,000 characters), float32" in header[1]
    assert (
        header[5].startswith("#   devices: rank 0 -> dévdév")
        and "(199,999 characters)" in header[5]
    )
    status, _, err = run_in_process(["check", str(tmp_path / "o.pipe")])
    assert status == 0, err
