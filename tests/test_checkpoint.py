"""Checkpoints (issue 17 item 6): `run --save DIR --save-every K`, `run --resume DIR`.

Oracles: an uninterrupted run (6 steps equal 3 steps, saved, then resumed for 3 more, bit
for bit on gloo: parameters, optimizer state and the losses printed), and `--check`'s
one-process reference for a checkpoint resumed by another schedule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

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
    assert main([*base, "--resume", str(tmp_path / "step-1")]) == 1  # a bad input file
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
    """Only this run's: another run's `step-3` and `step-7` (complete or cut short) and a
    checkpoint whose run cannot be told (`step-1`, from before run ids) are kept."""
    from pipelang.backends.checkpoint import prune

    def checkpoint(step: int, run: str | None, complete: bool = True) -> None:
        (tmp_path / f"step-{step}").mkdir()
        if run is not None:
            (tmp_path / f"step-{step}" / "pipelang.run").write_text(run)
        if complete:
            info = {"step": step} | ({"run": run} if run else {})
            (tmp_path / f"step-{step}" / "pipelang.json").write_text(json.dumps(info))

    for step in (2, 4, 6, 8):
        checkpoint(step, "mine")
    checkpoint(5, "mine", complete=False)  # cut short
    checkpoint(9, "mine", complete=False)  # being written: newer than every complete one
    checkpoint(3, "other")
    checkpoint(7, "other", complete=False)
    checkpoint(1, None)
    (tmp_path / "notes").mkdir()
    gone = prune(str(tmp_path), 2, "mine")
    assert sorted(p.name for p in gone) == ["step-2", "step-4", "step-5"]
    left = ["notes", "step-1", "step-3", "step-6", "step-7", "step-8", "step-9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == left


def test_keep_last_counts_the_runs_resumed_from_up_to_where_they_were_left(
    tmp_path: Path,
) -> None:
    """Run `b` resumed `a`'s step-4: `a`'s step-2 and step-4 are on its way, `a`'s step-6
    (after the step `b` went on from: another branch) is not."""
    from pipelang.backends.checkpoint import prune

    for step, writer in ((2, "a"), (4, "a"), (6, "a"), (5, "b"), (7, "b")):
        (tmp_path / f"step-{step}").mkdir()
        info = {"step": step, "run": writer}
        (tmp_path / f"step-{step}" / "pipelang.json").write_text(json.dumps(info))
    gone = prune(str(tmp_path), 1, "b", (("a", 4),))
    assert sorted(p.name for p in gone) == ["step-2", "step-4", "step-5"]


def test_save_into_another_runs_checkpoints_is_refused_without_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 9: `--save` where another run's `step-400` and `step-496` are."""
    monkeypatch.chdir(tmp_path)
    for step in (400, 496):
        Path(f"ck/step-{step}").mkdir(parents=True)
        Path(f"ck/step-{step}/pipelang.json").write_text(f'{{"step": {step}}}')
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--steps", "3", "--save", "ck"]
    assert main([*argv, "--keep-last", "1"]) == 2
    assert capsys.readouterr().err == (
        "pipelang run: error: --save ck already holds checkpoints (step-400, step-496) of an "
        "earlier run: give --resume auto to go on from the latest of them, or another "
        "--save directory to start afresh\n"
    )
    assert sorted(p.name for p in Path("ck").iterdir()) == ["step-400", "step-496"]
    assert main([*argv[:-2], "--resume", "auto"]) == 2
    assert capsys.readouterr().err == (
        "pipelang run: error: --resume auto goes on from the latest checkpoint under --save "
        "DIR: give --save (or a checkpoint's path to --resume)\n"
    )


@pytest.mark.slow
def test_keep_last_keeps_another_runs_checkpoints_and_its_own_newest(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 44 item 9: another run's `step-400` and `step-496` under --save DIR; this run
    (resumed from elsewhere) saves step-3 and step-4 with --keep-last 1: step-3 goes (it
    is this run's, older), step-4 stays, and the other run's two stay (before: all of this
    run's were deleted, step-496 being the newest). A line says each one is complete."""
    for step in (400, 496):
        (tmp_path / f"step-{step}").mkdir()
        info = {"step": step, "run": "0ther"}
        (tmp_path / f"step-{step}" / "pipelang.json").write_text(json.dumps(info))
    options = ("--steps", "4", "--resume", str(saved), "--save", str(tmp_path))
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", *options, "--save-every", "1"]
    assert main([*argv, "--keep-last", "1"]) == 0
    err = capsys.readouterr().err
    kept = sorted(p.name for p in tmp_path.iterdir())  # and the run's options (--config)
    assert kept == ["config.toml", "step-4", "step-400", "step-496"]
    for step in (3, 4):
        assert f"checkpoint {tmp_path}/step-{step} complete (step {step})" in err


@pytest.mark.slow
def test_resume_auto_starts_afresh_then_resumes_the_latest_complete_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 44 item 8: one command line for the first run and the resumes. A `step-3`
    cut short (no pipelang.json) is passed over."""
    import shutil

    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--save", str(tmp_path)]
    assert main([*argv, "--steps", "2", "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert f"--resume auto: no complete checkpoint in {tmp_path} yet: starting at step 0\n" in err
    assert sorted(losses(err)) == [1, 2]
    shutil.copytree(tmp_path / "step-2", tmp_path / "step-3")
    (tmp_path / "step-3" / "pipelang.json").unlink()
    assert main([*argv, "--steps", "4", "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert f"--resume auto: resuming from {tmp_path}/step-2 (step 2)\n" in err
    assert sorted(losses(err)) == [3, 4]
    assert json.loads((tmp_path / "step-4" / "pipelang.json").read_text())["step"] == 4


def test_resume_auto_is_not_a_directory_named_auto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    base = ["run", "1f1b", "-p", "D=2", "--steps", "2"]
    assert main([*base, "--resume", "auto"]) == 2
    assert "--resume auto goes on from the latest checkpoint under --save DIR" in (
        capsys.readouterr().err
    )
    assert main([*base, "--resume", "./auto"]) == 2
    assert "`--resume ./auto`: no such directory" in capsys.readouterr().err


@pytest.mark.slow
def test_keep_last_over_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = stdlib("1f1b", D=2, N=2)
    save = ("--save", str(tmp_path), "--save-every", "2", "--keep-last", "2")
    assert run(program, "--steps", "9", *save) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-8", "step-9"]


def _metadata(path: Path) -> Any:
    return FileSystemReader(str(path)).read_metadata()


def _hostile(case: str, crafted: Path, outside: Path) -> None:
    """Make checkpoint `crafted` (a good one) hostile as `case` says (issue 44 item 13)."""
    import os
    import pickle

    metadata, info = crafted / ".metadata", crafted / "pipelang.json"
    if case in PICKLED:
        data = _metadata(crafted)
        entries = data.state_dict_metadata
        first = entries["model.0.tokens.weight"]
        if case == "metadata list":
            data = [1, 2]
        elif case == "metadata entries list":
            data.state_dict_metadata = [1]
        elif case == "metadata properties None":
            first.properties = None
        elif case == "metadata chunk outside":
            first.chunks[0].sizes = torch.Size([s + 1 for s in first.size])
        elif case == "metadata stored outside":
            for where in data.storage_data.values():
                where.relative_path = "../x.distcp"
        metadata.write_bytes(pickle.dumps(data))
    elif case == "metadata fifo":
        metadata.unlink()
        os.mkfifo(metadata)
    elif case == "metadata /dev/zero":
        metadata.unlink()
        metadata.symlink_to("/dev/zero")
    elif case == "metadata link out":
        (outside / "m").write_bytes(metadata.read_bytes())
        metadata.unlink()
        metadata.symlink_to(outside / "m")
    elif case == "metadata huge":
        with open(metadata, "r+b") as file:
            file.truncate(300 << 20)  # sparse: nothing is written
    elif case == "metadata empty":
        metadata.write_bytes(b"")
    elif case == "json deep":
        info.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "json list":
        info.write_text("[1, 2]")
    elif case == "json step true":
        info.write_text('{"step": true}')
    elif case == "json empty":
        info.write_text("")
    elif case == "shards truncated":
        for shard in crafted.glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[:1000])
    elif case == "shard missing":
        (crafted / "__1_0.distcp").unlink()
    elif case == "shard a directory":
        (crafted / "__1_0.distcp").unlink()
        (crafted / "__1_0.distcp").mkdir()


PICKLED = {
    "metadata list",
    "metadata entries list",
    "metadata properties None",
    "metadata chunk outside",
    "metadata stored outside",
}
"""The cases that write a `.metadata` of DCP's own classes, as pickle does."""
HOSTILE = {
    "metadata list": "/.metadata` is not a readable DCP checkpoint: it holds list, not DCP's "
    "Metadata",
    "metadata entries list": "/.metadata`: its entries are a list, not a dict",
    "metadata properties None": "/.metadata`: entry `model.0.tokens.weight` has no tensor dtype",
    "metadata chunk outside": "/.metadata`: entry `model.0.tokens.weight` has a chunk outside "
    "its size",
    "metadata stored outside": "/.metadata`: entry `model.0.tokens.weight` is stored outside "
    "the directory",
    "metadata fifo": "/.metadata` is not a regular file",
    "metadata /dev/zero": "/.metadata` is a link out of its checkpoint directory",
    "metadata link out": "/.metadata` is a link out of its checkpoint directory",
    "metadata huge": "/.metadata` is 314,572,800 bytes, more than such a file ever is (4,194,304)",
    "metadata empty": "/.metadata` is not a readable DCP checkpoint: Ran out of input",
    "json deep": "/pipelang.json` is not a pipelang checkpoint: it nests deeper than JSON is "
    "read (pipelang writes one flat object)",
    "json list": "/pipelang.json` is not a pipelang checkpoint: it holds a list where pipelang "
    "writes an object",
    "json step true": "/pipelang.json` is not a pipelang checkpoint: `step` is a boolean, not a "
    "positive integer",
    "json empty": "/pipelang.json` is not a pipelang checkpoint: it is not JSON (Expecting "
    "value: line 1 column 1 (char 0))",
    "shards truncated": "/__0_0.distcp` is cut short: it has 1,000 bytes and `.metadata` "
    "stores `model.0.tokens.weight` at bytes 0 to ",
    "shard missing": "/__1_0.distcp` is missing",
    "shard a directory": "/__1_0.distcp` is not a regular file",
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_checkpoint_is_one_line_naming_the_file_and_what_is_wrong(
    saved: Path,
    case: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 44 item 13: each is refused before any rank starts, at once (the
    /dev/zero link was read whole: 30 s), exit 1 (a bad input file), one line."""
    import shutil
    import time

    monkeypatch.chdir(tmp_path)
    shutil.copytree(saved / "step-2", "ck/step-2")
    (tmp_path / "outside").mkdir()
    _hostile(case, tmp_path / "ck" / "step-2", tmp_path / "outside")
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--steps", "4", "--resume", "ck"]
    start = time.monotonic()
    assert main(argv) == 1
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.fullmatch(
        r"(pipelang run: )?error: `ck/step-2" + re.escape(HOSTILE[case]) + r".*\n", err
    )


def _without(saved: Path, crafted: Path, dropped: str) -> None:
    """A copy of checkpoint `saved` as DCP writes one, without the entries whose names
    contain `dropped`."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {k: v for k, v in read_checkpoint(saved).items() if dropped not in k}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(state, checkpoint_id=crafted, no_dist=True)
    shutil.copy(saved / "pipelang.json", crafted / "pipelang.json")


@pytest.mark.parametrize(
    ("dropped", "missing"),
    [("optim.", "optim.0.tokens.weight.step"), (".exp_avg", "optim.0.tokens.weight.exp_avg")],
)
def test_a_checkpoint_without_optimizer_state_names_what_is_missing(
    saved: Path, dropped: str, missing: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 44 item 14: it failed on a rank with `KeyError: 'exp_avg'`."""
    _without(saved / "step-2", tmp_path / "step-2", dropped)
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--steps", "4"]
    assert main([*argv, "--resume", str(tmp_path / "step-2")]) == 1
    err = capsys.readouterr().err
    assert f"has no optimizer state `{missing}`: this run's optimizer keeps" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert main([*argv, "--resume", str(tmp_path / "step-2"), "--optimizer", "sgd"]) == 1
    assert "was saved with --optimizer adam; this run uses sgd" in capsys.readouterr().err


def test_load_names_the_missing_optimizer_state_on_each_rank(saved: Path, tmp_path: Path) -> None:
    """The check every rank (and --check's reference) goes through, not only the launcher's."""
    from pipelang.backends.checkpoint import CheckpointError, held_by_model, load
    from pipelang.backends.models import ModelSpec
    from pipelang.backends.optim import Adam

    _without(saved / "step-2", tmp_path / "step-2", ".exp_avg_sq")
    model = torch.nn.Sequential(*ModelSpec("gpt:tiny", None, 4, "float32", 0).build().layers)
    held = held_by_model(model, Adam(list(model.parameters()), 1e-3))
    missing = re.escape("no optimizer state `optim.0.tokens.weight.exp_avg_sq`")
    with pytest.raises(CheckpointError, match=missing):
        load([held], str(tmp_path / "step-2"))


def test_a_shard_that_holds_no_tensors_is_named_by_load(saved: Path, tmp_path: Path) -> None:
    """A shard of the right size whose bytes are not torch.save's is found only when a
    rank reads it: `load` says so in one line (DCP's CheckpointException, a BaseException,
    escaped as `CheckpointException ranks:dict_keys([1])`), without torch's advice to load
    it with weights_only=False."""
    import shutil

    from pipelang.backends.checkpoint import CheckpointError, held_by_model, load
    from pipelang.backends.models import ModelSpec
    from pipelang.backends.optim import Adam

    shutil.copytree(saved / "step-2", tmp_path / "step-2")
    for shard in (tmp_path / "step-2").glob("*.distcp"):
        shard.write_bytes(bytes(64) + shard.read_bytes()[64:])
    model = torch.nn.Sequential(*ModelSpec("gpt:tiny", None, 4, "float32", 0).build().layers)
    held = held_by_model(model, Adam(list(model.parameters()), 1e-3))
    with pytest.raises(CheckpointError) as raised:
        load([held], str(tmp_path / "step-2"))
    assert str(raised.value) == (
        f"`{tmp_path / 'step-2'}`: its tensors cannot be read: a shard does not hold tensors "
        "as torch.save writes them (UnpicklingError)"
    )
