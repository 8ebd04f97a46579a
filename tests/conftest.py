"""Shared test options: `pytest --update-golden` rewrites the expected files."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("COLUMNS", "100")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.expected from the current output",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))
