"""`pipelang run --config FILE.toml` (cli/config_file.py): every option of `run` as a key,
the command line over the file, the config a run writes beside its checkpoints running it
again, and one usage error with the file's line for a bad file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from helpers import pipelang_here, run_in_process

from pipelang.cli import app
from pipelang.cli.config_file import effective_config


def _parsed(argv: list[str]) -> argparse.Namespace:
    """`pipelang` ARGV parsed as `main` parses it (with --config: the file under it)."""
    parser = app.build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:
        args = app._configured(parser, args, argv)
    return args


def _options(args: argparse.Namespace) -> dict[str, object]:
    return {k: v for k, v in vars(args).items() if k not in ("config", "debug")}


GIVEN = [
    "run", "chimera", "-p", "D=4", "-p", "N=8", "--model", "llama:tiny", "--seq-len", "16",
    "--micro-batch-size", "2", "--seed", "7", "--steps", "5", "--dp", "2", "--check",
    "--optimizer", "adamw", "--lr", "0.002", "--betas", "0.8,0.95", "--eps", "1e-06",
    "--weight-decay", "0.05", "--lr-schedule", "cosine", "--warmup-steps", "2",
    "--min-lr", "0.0001", "--clip-grad", "1.5", "--partition", "2,1,1,2", "--timeout", "90",
]  # fmt: skip


def test_the_written_config_reads_back_to_the_same_options(tmp_path: Path) -> None:
    """Every option of the command line, defaults included, survives the round trip
    through the file (`effective_config` -> `--config`), numbers, tuples and flags alike."""
    given = _parsed(GIVEN)
    text = effective_config(given, app.COMMAND_PARSERS["run"])
    assert 'schedule = "chimera"' in text and "betas = [0.8, 0.95]" in text
    assert "[params]\nD = 4\nN = 8\n" in text
    file = tmp_path / "run.toml"
    file.write_text(text)
    again = _parsed(["run", "--config", str(file)])
    assert _options(again) == _options(given)


def test_parameters_that_are_no_toml_integer_are_written_as_strings(tmp_path: Path) -> None:
    """`-p N=007` (a leading zero) and `-p X=1e3` are not TOML integers: written bare,
    the file would not read back."""
    given = _parsed(["run", "1f1b", "-p", "N=007", "-p", "X=1e3", "-p", "D=-2"])
    text = effective_config(given, app.COMMAND_PARSERS["run"])
    assert '[params]\nN = "007"\nX = "1e3"\nD = -2\n' in text
    file = tmp_path / "run.toml"
    file.write_text(text)
    assert _parsed(["run", "--config", str(file)]).params == ["N=007", "X=1e3", "D=-2"]


def test_the_command_line_overrides_the_file(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('schedule = "1f1b"\nsteps = 9\nlr = 0.5\ncheck = true\n[params]\nD = 4\n')
    args = _parsed(["run", "--config", str(file), "--steps", "2", "-p", "D=2", "zb-h1"])
    assert (args.sched, args.steps, args.lr, args.check) == ("zb-h1", 2, 0.5, True)
    assert args.params == ["D=4", "D=2"]  # -p: the last of a name wins (parse_params)


BAD = [
    ('steps = "x"', "bad.toml:1: `steps`: expected a whole number, not `x`"),
    ('schedule = "1f1b"\nstepz = 3', "bad.toml:2: unknown key `stepz`: the keys are"),
    ('schedule = "1f1b"\ncheck = 1', "bad.toml:2: `check` is a flag: give true or false, not 1"),
    ("lr = true", "bad.toml:1: `lr`: expected a value, not true/false"),
    ("lr = {a = 1}", "bad.toml:1: `lr`: expected a value, not a table"),
    ('backend = "mpi"', "bad.toml:1: `backend`: 'mpi' is not one of gloo, nccl, local"),
    ("steps = [1, [2]]", "bad.toml:1: `steps`: expected a value, not an array"),
    ("= broken", "--config bad.toml: not TOML: Invalid statement (at line 1, column 1)"),
    ("params = 3", "bad.toml:1: [params] is a table of NAME = VALUE"),
    ("[params]\nD = [1, 2]", "bad.toml:1: [params] is a table of NAME = VALUE"),
    ('config = "other.toml"', "bad.toml:1: unknown key `config`"),
    ("seed = -1", "bad.toml:1: `seed`: a seed is a whole number from 0 to"),
    ('"dp" = 0', "bad.toml:1: `dp`: must be at least 1, not 0"),
    ("steps = 3", "give the schedule: SCHED (a .pipe file or a stdlib name), or `schedule"),
    ("a = " + "[" * 100_000 + "]" * 100_000, "--config bad.toml: nested too deeply"),
    ("#" * (1 << 21), "--config bad.toml: 2,097,152 bytes; a config is at most 1,048,576"),
]


@pytest.mark.parametrize(("text", "said"), BAD)
def test_a_bad_config_is_one_usage_error_with_its_line(
    text: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("bad.toml").write_text(text)
    status, out, err = run_in_process(["run", "--config", "bad.toml"])
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and said in err, err


def test_a_byte_order_mark_is_read_past(tmp_path: Path) -> None:
    file = tmp_path / "bom.toml"
    file.write_bytes('schedule = "1f1b"\nsteps = 7\n'.encode("utf-8-sig"))
    assert _parsed(["run", "--config", str(file)]).steps == 7


def test_a_config_that_is_not_text_or_not_there(tmp_path: Path) -> None:
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe")
    status, _, err = run_in_process(["run", "--config", str(binary)])
    assert status == 2 and "bin.toml: not UTF-8 text" in err
    status, _, err = run_in_process(["run", "--config", str(tmp_path / "none.toml")])
    assert status == 2 and "none.toml: cannot read it: No such file or directory" in err


@pytest.mark.slow
def test_the_config_beside_the_checkpoints_runs_the_run_again(tmp_path: Path) -> None:
    """A run with --save writes DIR/config.toml; `run --config` of it (another --save and
    --log on the command line) trains to the same losses, bit for bit."""

    def run(*argv: str) -> list[float]:
        log = tmp_path / f"{len(list(tmp_path.glob('*.jsonl')))}.jsonl"
        done = pipelang_here("run", *argv, "--log", str(log), cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    first = run(
        "zb-h1", "-p", "D=2", "-p", "N=4", "--steps", "3", "--optimizer", "adamw",
        "--lr-schedule", "cosine", "--clip-grad", "0.5", "--seed", "3", "--save", "one",
    )  # fmt: skip
    assert len(first) == 3
    again = run("--config", "one/config.toml", "--save", "two")
    assert again == first
    written = (tmp_path / "two" / "config.toml").read_text()
    same = written.replace('"two"', '"one"').replace("1.jsonl", "0.jsonl")
    assert same == (tmp_path / "one" / "config.toml").read_text()
