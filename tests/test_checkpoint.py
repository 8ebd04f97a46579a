"""Checkpoints (issue 17 item 6): `run --save DIR --save-every K`, `run --resume DIR`.

Oracles: an uninterrupted run (6 steps equal 3 steps, saved, then resumed for 3 more, bit
for bit on gloo: parameters, optimizer state and the losses printed), and `--check`'s
one-process reference for a checkpoint resumed by another schedule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from pipelang.cli import main
from tests.helpers import read_checkpoint, run, stdlib


def losses(err: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"step (\d+)/\d+  loss (\S+)", err)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "options"),
    [
        ("1f1b", ("--optimizer", "adam")),
        ("chimera", ("--optimizer", "sgd")),
        ("1f1b", ("--mixed-precision", "bfloat16")),  # the fp32 masters are what is saved
    ],
)
def test_six_steps_equal_three_saved_and_resumed_for_three(
    schedule: str, options: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib(schedule, D=2, N=4)
    assert run(program, *options, "--steps", "6", "--save", str(tmp_path / "a")) == 0
    whole = losses(capsys.readouterr().err)
    assert run(program, *options, "--steps", "3", "--save", str(tmp_path / "b")) == 0
    capsys.readouterr()
    resumed = ("--steps", "6", "--resume", str(tmp_path / "b"), "--save", str(tmp_path / "c"))
    assert run(program, *options, *resumed) == 0
    after = losses(capsys.readouterr().err)
    assert sorted(after) == [4, 5, 6]
    assert all(after[s] == whole[s] for s in after)
    one, two = (read_checkpoint(tmp_path / x / "step-6") for x in "ac")
    assert sorted(one) == sorted(two)
    assert all(tensor.dtype == torch.float32 for tensor in one.values())
    assert any(".exp_avg" in k or ".momentum" in k for k in one)  # optimizer state is there
    assert all(torch.equal(one[key], two[key]) for key in one)
    three = read_checkpoint(tmp_path / "b" / "step-3")
    assert not torch.equal(three["model.7.lm.weight"], one["model.7.lm.weight"])


@pytest.mark.slow
def test_save_every_keeps_a_directory_per_step_and_resume_takes_the_latest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib("1f1b", D=2, N=2)
    save = ("--save", str(tmp_path), "--save-every", "2")
    assert run(program, "--steps", "5", *save) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4", "step-5"]
    assert json.loads((tmp_path / "step-4" / "pipelang.json").read_text())["step"] == 4
    capsys.readouterr()
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 5}\n{"step": 6}\n')  # step 6 came after the checkpoint
    assert run(program, "--steps", "7", "--resume", str(tmp_path), "--log", str(log)) == 0
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [5, 6, 7]


@pytest.mark.slow
def test_another_schedule_resumes_a_checkpoint_with_its_own_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Saved by 1F1B on 2 ranks (4 layers per stage), resumed by Chimera on 4 ranks with
    two pipelines (2 layers per stage, each stage on two ranks)."""
    one_f_one_b = stdlib("1f1b", D=2, N=4)
    assert run(one_f_one_b, "--steps", "6") == 0
    whole = losses(capsys.readouterr().err)
    assert run(one_f_one_b, "--steps", "3", "--save", str(tmp_path)) == 0
    capsys.readouterr()
    resumed = ("--steps", "6", "--resume", str(tmp_path / "step-3"), "--check")
    assert run(stdlib("chimera", D=4, N=4), *resumed) == 0
    out, err = capsys.readouterr()
    assert "check OK" in out
    after = losses(err)
    assert sorted(after) == [4, 5, 6]
    assert all(after[s] == pytest.approx(whole[s], abs=1e-5) for s in after)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step checkpoint of gpt:tiny with Adam, float32."""
    path = tmp_path_factory.mktemp("saved")
    assert run(stdlib("1f1b", D=2, N=2), "--steps", "2", "--save", str(path)) == 0
    return path


@pytest.mark.parametrize(
    ("options", "status", "message"),
    [
        (["--model", "llama:tiny"], 1, "has no `0.weight`: it was saved from gpt:tiny"),
        (["--dtype", "bfloat16"], 1, "is [256, 64] float32 there and [256, 64] bfloat16"),
        (["--optimizer", "sgd"], 1, "was saved with --optimizer adam; this run uses sgd"),
        (["--steps", "2"], 2, "is at step 2 and --steps 2 counts from step 0"),
        (["--backend", "local"], 2, "checkpoints (--save, --resume) need a process per rank"),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_one_error(
    saved: Path, options: list[str], status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--steps", "4", "--resume", str(saved)]
    assert main([*argv, *options]) == status
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_resume_and_save_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", "1f1b", "-p", "D=2", "--steps", "2"]
    assert main([*base, "--resume", str(tmp_path)]) == 2
    assert "no checkpoint there (a `step-K` directory" in capsys.readouterr().err
    assert main([*base, "--resume", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main([*base, "--save-every", "2"]) == 2
    assert "--save-every needs --save DIR" in capsys.readouterr().err
    assert main([*base, "--keep-last", "2"]) == 2
    assert "--keep-last needs --save DIR" in capsys.readouterr().err
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "pipelang.json").write_text("{not json")
    assert main([*base, "--resume", str(tmp_path / "step-1")]) == 2
    assert "is not a pipelang checkpoint" in capsys.readouterr().err
    assert main(["run", "pipedream", "-p", "D=2", "--save", str(tmp_path / "x")]) == 1
    assert "checkpoints do not save yet" in capsys.readouterr().err


class _Touch:
    """Unpickling this runs `touch PATH`: what a crafted `.metadata` could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("where", ["metadata", "inside"])
def test_a_checkpoint_whose_metadata_would_run_code_is_refused_unread(
    saved: Path, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle
    import shutil

    crafted = tmp_path / "step-2"
    shutil.copytree(saved / "step-2", crafted)
    marker = tmp_path / "ran"
    if where == "metadata":  # the whole file
        payload: object = _Touch(marker)
    else:  # hidden inside a real Metadata, where DCP's reader would build it too
        payload = FileSystemReader(str(crafted)).read_metadata()
        payload.planner_data = _Touch(marker)  # type: ignore[attr-defined]
    (crafted / ".metadata").write_bytes(pickle.dumps(payload))
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--steps", "4", "--resume", str(crafted)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert not marker.exists()
    assert "is not a readable DCP checkpoint: it names `posix.system`" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_an_interrupted_run_says_where_to_resume(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) stops every rank and names the latest complete checkpoint."""
    import signal
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-m", "pipelang.cli", "run", "1f1b", "-p", "D=2", "-p", "N=2"]
    argv += ["--steps", "100000", "--save", str(tmp_path), "--save-every", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "step-1" / "pipelang.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted: every rank stopped; the latest checkpoint is" in err
    assert f"go on with --resume {tmp_path}" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_run_stopped_and_resumed_goes_on_with_its_learning_rate_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """AdamW with warm-up and a cosine decay over --steps 6: resumed from step 3 with the
    same command line, steps 4-6 and the final state equal the uninterrupted run's, bit
    for bit (the rate is a function of the step). A resume with another --steps says
    that the rate jumps."""
    program = stdlib("1f1b", D=2, N=2)
    options = ("--optimizer", "adamw", "--lr-schedule", "cosine", "--warmup-steps", "2")
    whole = ("--steps", "6", "--save", str(tmp_path / "a"), "--save-every", "3")
    assert run(program, *options, *whole) == 0
    first = losses(capsys.readouterr().err)
    info = json.loads((tmp_path / "a" / "step-3" / "pipelang.json").read_text())
    assert info["lr_schedule"] == "cosine from 0.003 to 0.0003 at step 6, 2 steps of warm-up"
    resumed = ("--steps", "6", "--resume", str(tmp_path / "a" / "step-3"))
    assert run(program, *options, *resumed, "--save", str(tmp_path / "b")) == 0
    err = capsys.readouterr().err
    after = losses(err)
    assert "note:" not in err
    assert sorted(after) == [4, 5, 6] and all(after[s] == first[s] for s in after)
    one, two = (read_checkpoint(tmp_path / x / "step-6") for x in "ab")
    assert all(torch.equal(one[key], two[key]) for key in one)
    longer = ("--steps", "8", "--resume", str(tmp_path / "a" / "step-3"))
    assert run(program, *options, *longer) == 0
    assert "so the rate jumps at step 4" in capsys.readouterr().err


def test_keep_last_deletes_older_complete_checkpoints_only(tmp_path: Path) -> None:
    from pipelang.backends.checkpoint import prune

    for step in (2, 4, 5, 6, 8):
        (tmp_path / f"step-{step}").mkdir()
        if step != 5:  # step-5 was cut short
            (tmp_path / f"step-{step}" / "pipelang.json").write_text(f'{{"step": {step}}}')
    (tmp_path / "step-9").mkdir()  # being written: newer than every complete one
    (tmp_path / "notes").mkdir()
    gone = prune(str(tmp_path), 2)
    assert sorted(p.name for p in gone) == ["step-2", "step-4", "step-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-6", "step-8", "step-9"]


@pytest.mark.slow
def test_keep_last_over_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = stdlib("1f1b", D=2, N=2)
    save = ("--save", str(tmp_path), "--save-every", "2", "--keep-last", "2")
    assert run(program, "--steps", "9", *save) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-8", "step-9"]
