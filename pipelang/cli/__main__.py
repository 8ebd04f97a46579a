"""`python -m pipelang.cli`: the `pipelang` command."""

import sys

from pipelang.cli.app import main

sys.exit(main())
