"""`run --trace OUT.json --trace-every K` (issue 43): the trace of steps K, 2K, ... only,
each to its own file `OUT-stepK.json` as the step ends, which `pipelang viz --trace`
draws; with `--tensorboard`, each such step's measured timeline as the image `timeline`
at step K. Local, gloo and torchrun alike; a bad K is a usage error.

Oracles: `pipelang viz --trace` and `pipelang.trace.read_actions` (the trace's own
reader), TensorBoard's own reader of its event files.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipelang.trace import load, read_actions
from tests.helpers import pipelang_here, run_in_process

RUN = ["run", "1f1b", "-p", "D=2", "-p", "N=2"]


def _traced(tmp_path: Path, steps: list[int], ranks: int = 2) -> None:
    """Exactly the step files of `steps` were written next to t.json (and no t.json),
    each a trace of that one step (index step - 1) of every rank, which `viz --trace`
    draws as that step."""
    written = sorted(p.name for p in tmp_path.glob("t*.json"))
    assert written == sorted(f"t-step{k}.json" for k in steps)
    for k in steps:
        path = tmp_path / f"t-step{k}.json"
        actions = read_actions(load(path), str(path))
        assert {a.step for a in actions} == {k - 1}
        assert {a.rank for a in actions} == set(range(ranks))
        assert {a.action.text() for a in actions if a.rank == 0} >= {"F0@0/main", "step"}
        drawn = pipelang_here("viz", "--trace", str(path), cwd=tmp_path)
        assert drawn.returncode == 0, drawn.stderr
        assert drawn.stdout.startswith(f"t-step{k}: measured")
        assert f"step {k - 1} of {k - 1} " in drawn.stdout


@pytest.mark.slow
def test_local_writes_steps_2_and_4_and_their_tensorboard_images(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    options = ["--steps", "5", "--backend", "local", "--trace", str(tmp_path / "t.json")]
    options += ["--trace-every", "2", "--tensorboard", str(board)]
    status, out, _ = run_in_process([*RUN, *options])
    assert status == 0
    name = tmp_path / "t-stepK.json"
    assert f"wrote the trace of steps 2, 4 (--trace-every 2) to {name}, a file each" in out
    assert "wrote the trace of every action" not in out
    _traced(tmp_path, [2, 4])
    accumulator = EventAccumulator(str(board), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    images = accumulator.Images("timeline")
    assert [image.step for image in images] == [2, 4]
    assert all(image.encoded_image_string.startswith(b"\x89PNG") for image in images)
    assert [e.step for e in accumulator.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert not (board / "timeline.svg").exists()  # the end-of-run figure is --trace's alone


@pytest.mark.slow
def test_gloo_writes_steps_2_and_4(tmp_path: Path) -> None:
    proc = pipelang_here(
        *RUN,
        *("--steps", "5", "--backend", "gloo", "--trace", "t.json", "--trace-every", "2"),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    _traced(tmp_path, [2, 4])


@pytest.mark.slow
def test_a_resumed_run_goes_on_counting_from_its_checkpoint(tmp_path: Path) -> None:
    """Steps count from 1 of the whole run, as checkpoints do: a run resumed at step 3 of
    5 traces step 4 only; the config written beside its checkpoints keeps the key."""
    save = ["--save", "ck", "--backend", "gloo", "--trace", "t.json", "--trace-every", "2"]
    first = pipelang_here(*RUN, "--steps", "3", *save, cwd=tmp_path, timeout=120)
    assert first.returncode == 0, first.stderr
    (tmp_path / "t-step2.json").unlink()
    again = pipelang_here(*RUN, "--steps", "5", *save, "--resume", "auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "wrote the trace of step 4 (--trace-every 2) to t-stepK.json" in again.stdout
    _traced(tmp_path, [4])
    written = (tmp_path / "ck" / "config.toml").read_text()
    assert "trace-every = 2" in written


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_torchrun_rank_0_writes_every_ranks_steps(tmp_path: Path) -> None:
    """Under torchrun rank 0 gathers the other ranks' events of a traced step only."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(_port()), "--no-python", "--", "pipelang", *RUN]
    command += ["--backend", "gloo", "--steps", "4", "--trace", "t.json", "--trace-every", "2"]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _traced(tmp_path, [2, 4])


def test_a_config_file_takes_trace_every(tmp_path: Path) -> None:
    """A RunConfig option is a --config key; its checks hold there too."""
    config = tmp_path / "c.toml"
    config.write_text('schedule = "1f1b"\nsteps = 2\ntrace-every = 3\ntrace = "t.json"\n')
    status, _, err = run_in_process(["run", "--config", str(config)])
    assert status == 2
    assert err.strip() == (
        "pipelang run: error: --trace-every 3 traces no step of a 2-step run (--steps): "
        "give K of at most 2"
    )


NO_TRACE = "--trace-every needs --trace OUT.json (the name of the step files)"
NO_STEP = "--trace-every 4 traces no step of a 3-step run (--steps): give K of at most 3"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--trace-every", "2"], NO_TRACE),
        (["--trace", "t.json", "--trace-every", "4"], NO_STEP),
    ],
)
def test_trace_every_needs_a_trace_and_a_step(
    tmp_path: Path, options: list[str], message: str
) -> None:
    proc = pipelang_here(*RUN, *options, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"pipelang run: error: {message}"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("k", "message"),
    [
        ("0", "must be at least 1, not 0"),
        ("-2", "expected a whole number, not `-2`"),
        ("two", "expected a whole number, not `two`"),
    ],
)
def test_a_bad_k_is_a_usage_error(tmp_path: Path, k: str, message: str) -> None:
    proc = pipelang_here(*RUN, "--trace", "t.json", "--trace-every", k, cwd=tmp_path)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"pipelang run: error: argument --trace-every: {message}"
    assert not list(tmp_path.iterdir())


def test_the_end_of_a_run_names_only_the_step_files_written(tmp_path: Path) -> None:
    """A step whose file could not be written (a folder where it goes; the run warned
    as it went) is not among those the last line says were written."""
    from pipelang.backends.config import RunConfig
    from pipelang.backends.trace_steps import written_line

    trace = tmp_path / "t.json"
    config = RunConfig(steps=3, trace=str(trace), trace_every=1)
    (tmp_path / "t-step1.json").write_text("{}")
    (tmp_path / "t-step2.json").mkdir()
    (tmp_path / "t-step3.json").write_text("{}")
    name = tmp_path / "t-stepK.json"
    assert written_line(config, 3) == (
        f"wrote the trace of steps 1, 3 (--trace-every 1) to {name}, a file each; "
        "that of step 2 could not be written"
    )
    for step in (1, 3):
        (tmp_path / f"t-step{step}.json").unlink()
    assert (
        written_line(config, 3) == "wrote no trace: the trace of steps 1, 2, 3 could not be written"
    )
