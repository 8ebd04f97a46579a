"""`python -m pipelang.cli`: the `pipelang` command."""

from pipelang.cli.app import console

console()
