"""Inputs at the edges (issue 29): text from inputs in written files, limits checked before
the work they limit, numbers at the ends of the float range, readers that validate whole,
a user's model that exits, the API's one error class. One test (or one table) per class;
each case failed before its fix."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_cli import GOOD, run_in_process

# ---- text from inputs in written files ----------------------------------------------------


def test_a_file_name_cannot_add_lines_to_a_rank_program(tmp_path: Path) -> None:
    source = tmp_path / 'a\nimport os\r"""x.pipe'
    source.write_text(GOOD)
    status, _, err = run_in_process(["compile", str(source), "-o", str(tmp_path / "out")])
    assert status == 0, err
    text = (tmp_path / "out" / "rank0.py").read_text()
    assert "\\nimport os\\r" in text.splitlines()[0]
    module = ast.parse(text)
    assert not [
        n for n in ast.walk(module) if isinstance(n, ast.Import) and n.names[0].name == "os"
    ]
