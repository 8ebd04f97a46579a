"""`python -m pipelang.backends SCHEDULE.json [run options]`: run a compiled program
(`pipelang.cli.rank.compiled_main`)."""

import sys

from pipelang.cli.rank import compiled_main

sys.exit(compiled_main())
