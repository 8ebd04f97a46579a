"""`python -m pipelang.backends SCHEDULE.json [run options]`: run a compiled program
(`pipelang.cli.rank.compiled_main`)."""

from pipelang.cli.app import leave
from pipelang.cli.rank import compiled_main

leave(compiled_main())
