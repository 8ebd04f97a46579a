"""The golden driver: each `tests/golden/PASS/NAME.pipe` says how to run it,
`NAME.expected` beside it holds what that printed. There is one directory per pass
(`parse`, `resolve-params`, ... `streams`: its dumps and the errors it reports) and one
per command that prints more than a pass does (`simulate`, `viz`).

A golden file starts with one or more lines `# RUN: pipelang ARGS`, where `%s` stands
for the file itself. The driver runs each command in-process and compares the exit
status, stdout and stderr with NAME.expected. `pytest --update-golden` rewrites them;
review the diff before committing.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.helpers import run_in_process

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = sorted((ROOT / "tests" / "golden").rglob("*.pipe"))
IDS = [p.relative_to(ROOT / "tests" / "golden").with_suffix("").as_posix() for p in GOLDEN]


def transcript(path: Path) -> str:
    relative = path.relative_to(ROOT).as_posix()
    runs = [
        line.split("RUN:", 1)[1].strip()
        for line in path.read_text().splitlines()
        if line.startswith("# RUN:")
    ]
    assert runs, f"{relative} has no `# RUN:` line"
    parts = []
    for run in runs:
        argv = shlex.split(run.replace("%s", relative))
        assert argv[0] == "pipelang"
        status, out, err = run_in_process(argv[1:])
        parts.append(f"$ {run}\n[exit {status}]\n{out}{err}")
    return "\n".join(parts)


@pytest.mark.parametrize("path", GOLDEN, ids=IDS)
def test_golden(path: Path, update_golden: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    actual = transcript(path)
    expected_path = path.with_suffix(".expected")
    if update_golden or not expected_path.exists():
        expected_path.write_text(actual)
        if not update_golden:
            pytest.fail(f"wrote new golden file {expected_path.name}; review and rerun")
    assert actual == expected_path.read_text()
