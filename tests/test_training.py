"""What a practitioner needs around a run (issue 17): a metrics log, clear refusals.

Oracles: the step lines the run prints (the log holds the same losses), strict JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipelang.cli import main
from tests.runtime_helpers import run, stdlib


@pytest.mark.parametrize("backend", ["gloo", "local"])
def test_the_log_has_one_json_line_per_step(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "logs" / "metrics.jsonl"
    options = ("--steps", "3", "--backend", backend, "--log", str(log))
    assert run(stdlib("1f1b", D=2, N=4), *options) == 0
    printed = [float(x) for x in re.findall(r"step \d/3  loss (\S+)", capsys.readouterr().err)]
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
