"""What a practitioner needs around a run (issue 17): a metrics log, data from a file,
clear refusals.

Oracles: the step lines the run prints (the log holds the same losses), strict JSON, the
data file's own bytes, and `--check`'s one-process reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelang.backends.data import load_tokens, sample_batch
from pipelang.cli import main
from tests.helpers import run, stdlib


@pytest.mark.parametrize("backend", ["gloo", "local"])
def test_the_log_has_one_json_line_per_step(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "logs" / "metrics.jsonl"
    options = ("--steps", "3", "--backend", backend, "--log", str(log))
    assert run(stdlib("1f1b", D=2, N=4), *options) == 0
    out, err = capsys.readouterr()
    assert "plan: predicted" not in out  # a stdlib schedule is no plan
    printed = [float(x) for x in re.findall(r"step \d/3  loss (\S+)", err)]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert [round(line["loss"], 4) for line in lines] == printed
    assert all(line["tokens"] == 4 * 4 * 32 and line["tokens_per_s"] > 0 for line in lines)
    assert all(line["tokens_per_s"] == pytest.approx(512 / line["seconds"]) for line in lines)


def test_a_log_that_cannot_be_written_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert main(["run", "1f1b", "-p", "D=2", "--log", str(blocked / "m.jsonl")]) == 2
    assert f"cannot write `{blocked / 'm.jsonl'}`" in capsys.readouterr().err


# ---- --data ------------------------------------------------------------------------------

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def test_a_data_batch_is_windows_of_the_file_shifted_by_one(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    ids, targets = sample_batch(str(path), 3, 5, 2, 4, 16, torch.device("cpu"))
    assert ids.shape == targets.shape == (4, 16) and ids.dtype == torch.long
    for row, target in zip(ids.tolist(), targets.tolist(), strict=True):
        window = bytes([*row, target[-1]]).decode()
        assert window in TEXT and target[:-1] == row[1:]
    again = sample_batch(str(path), 3, 5, 2, 4, 16, torch.device("cpu"))
    assert torch.equal(again[0], ids)
    other = sample_batch(str(path), 3, 5, 3, 4, 16, torch.device("cpu"))
    assert not torch.equal(other[0], ids)


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_token_files_hold_ids(suffix: str, tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.uint16) % 300
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".npy":
        np.save(path, ids.astype(np.int32))
    else:
        ids.tofile(path)
    assert np.array_equal(load_tokens(str(path)), ids)
    batch, _ = sample_batch(str(path), 0, 0, 0, 2, 8, torch.device("cpu"))
    starts = [int(row[0]) for row in batch]
    assert batch.tolist() == [[(s + k) % 300 for k in range(8)] for s in starts]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_a_run_on_a_text_file_matches_one_process_and_learns(
    schedule: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    options = ("--data", str(path), "--steps", "8", "--check", "--seq-len", "16")
    assert run(stdlib(schedule, D=2, N=4), *options) == 0
    out, err = capsys.readouterr()
    losses = [float(x) for x in re.findall(r"step \d/8  loss (\S+)", err)]
    assert "check OK" in out and len(losses) == 8
    assert losses[-1] < losses[0] - 1.0  # a repeated sentence is quickly learnt


def _write(path: Path, kind: str) -> None:
    if kind == "2-D":
        np.save(path, np.zeros((4, 100), dtype=np.int64))
    elif kind == "float":
        np.save(path, np.zeros(100, dtype=np.float32))
    elif kind == "odd":
        path.write_bytes(b"\0" * 101)
    elif kind == "large id":
        np.save(path, np.full(100, 256, dtype=np.int64))
    elif kind == "negative":
        np.save(path, np.full(100, -1, dtype=np.int64))
    else:
        path.write_text("short")


@pytest.mark.parametrize(
    ("kind", "name", "message"),
    [
        ("2-D", "t.npy", "expected a 1-D array of integer token ids, found 2-D int64"),
        ("float", "t.npy", "found 1-D float32"),
        ("odd", "t.bin", "size (101 bytes) is odd"),
        ("large id", "t.npy", "holds token id 256, outside the model's vocabulary 0..255"),
        ("negative", "t.npy", "holds token id -1"),
        ("short", "t.txt", "holds 5 tokens; a sequence of 32 needs at least 33"),
    ],
)
def test_data_that_cannot_feed_the_model_is_one_error(
    kind: str, name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    _write(path, kind)
    assert main(["run", "1f1b", "-p", "D=2", "--data", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_missing_data_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "1f1b", "-p", "D=2", "--data", "no/such/file.txt"]) == 2
    assert "no such file: no/such/file.txt" in capsys.readouterr().err


# ---- --clip-grad ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "options"),
    [
        ("chimera", ("--backend", "gloo")),  # replicas: each stage counted once
        ("chimera", ("--backend", "local")),
        ("chimera", ("--backend", "local", "--graphs")),  # the stream executor
        ("1f1b", ("--backend", "gloo", "--dp", "2")),  # data-parallel copies too
    ],
)
def test_clipping_by_the_global_norm_equals_one_process_clipping(
    schedule: str, options: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """With SGD an update is proportional to the clipped gradient, so a norm counted
    wrongly (a replica's copy twice, a rank left out) fails `--check`'s tolerance; the
    reference clips with torch.nn.utils.clip_grad_norm_."""
    program = stdlib(schedule, D=4 if schedule == "chimera" else 2, N=4)
    sgd = ("--optimizer", "sgd", "--steps", "3", *options)
    assert run(program, *sgd, "--clip-grad", "0.5", "--check") == 0
    out, err = capsys.readouterr()
    assert "check OK" in out
    clipped = re.findall(r"step \d/3  loss (\S+)", err)
    assert run(program, *sgd) == 0
    assert re.findall(r"step \d/3  loss (\S+)", capsys.readouterr().err) != clipped


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x"])
def test_a_clip_norm_must_be_a_positive_number(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "1f1b", "-p", "D=2", "--clip-grad", value]) == 2
    assert "argument --clip-grad" in capsys.readouterr().err


def test_asynchronous_schedules_refuse_clipping(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "pipedream", "-p", "D=2", "--clip-grad", "1"]) == 1
    assert "no one step at which to take the global gradient norm" in capsys.readouterr().err


# ---- --mixed-precision ---------------------------------------------------------------------


def _final_loss(capsys: pytest.CaptureFixture[str], *options: str) -> float:
    assert run(stdlib("1f1b", D=2, N=4), "--steps", "12", "--lr", "0.001", *options) == 0
    return float(re.findall(r"step 12/12  loss (\S+)", capsys.readouterr().err)[0])


@pytest.mark.slow
def test_mixed_precision_trains_closer_to_fp32_than_pure_bf16(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fp32 masters keep the small updates that bf16 weights round away; same compute."""
    fp32 = _final_loss(capsys)
    bf16 = _final_loss(capsys, "--dtype", "bfloat16")
    mixed = _final_loss(capsys, "--mixed-precision", "bfloat16")
    assert abs(mixed - fp32) < abs(bf16 - fp32) / 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "options"),
    [
        ("chimera", ("--backend", "gloo")),
        ("zbv", ("--backend", "gloo", "--clip-grad", "0.5", "--optimizer", "sgd")),  # W apart
        ("interleaved-1f1b", ("--backend", "local", "--dp", "2")),
        ("chimera", ("--backend", "local", "--graphs")),
    ],
)
def test_mixed_precision_matches_one_process_in_the_same_precision(
    schedule: str, options: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib(schedule, D=4 if schedule == "chimera" else 2, N=4)
    assert run(program, "--mixed-precision", "bfloat16", "--check", *options) == 0
    out = capsys.readouterr().out
    assert "check OK" in out and "atol 0.02" in out  # the bf16 tolerance


def test_mixed_precision_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    mixed = ["--mixed-precision", "bfloat16"]
    assert main(["run", "1f1b", "-p", "D=2", *mixed, "--dtype", "bfloat16"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(["run", "pipedream", "-p", "D=2", *mixed]) == 1
    assert "not kept as fp32 masters yet" in capsys.readouterr().err


# ---- bad values of the training options ---------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--save", ""], "argument --save: the path is empty"),
        (["--resume", " "], "argument --resume: the path is empty"),
        (["--log", ""], "argument --log: the path is empty"),
        (["--save", "/proc/no/such"], "--save: cannot make `/proc/no/such`"),
        (["--lr", "nan"], "argument --lr: must be a number more than 0, not nan"),
        (["--lr", "-1"], "argument --lr: must be a number more than 0"),
    ],
)
def test_bad_training_options_are_usage_errors(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "1f1b", "-p", "D=2", *options]) == 2
    assert message in capsys.readouterr().err


def test_an_empty_module_name_is_one_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "1f1b", "-p", "D=2", "--model", ":f"]) == 1
    err = capsys.readouterr().err
    assert "cannot load `f` from ``" in err and "internal error" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_log_that_stops_being_writable_warns_and_the_run_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(stdlib("1f1b", D=2, N=2), "--log", "/dev/full", "--steps", "2") == 0
    err = capsys.readouterr().err
    assert "warning: cannot write --log /dev/full (No space left on device)" in err
    assert "step 2/2" in err
