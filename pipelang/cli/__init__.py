"""The `pipelang` command, a thin shell over the public API (`pipelang`, `pipelang.api`).

- `app`: `main()`, the parser, exit statuses, the error handling every command shares;
  `console()`, the console script, which leaves without the interpreter's teardown;
- `args`: the argument definitions and types several commands share (the leaf);
- one module per command (`check`, `compile`, `simulate`, ...), each with `HELP`,
  `setup(parser)` that adds its options and `run(args)` that does it and prints;
- `rank`: the command line of a generated `rank{r}.py` and of `python -m pipelang.backends`.

argparse is used only in this package. A command imports what only it needs (torch,
the planner, the renderers) inside `run`: every start imports every command module, and
importing all of that up front makes `pipelang --help` ~24% slower (benchmarks/RESULTS.md,
"Lazy imports"); torch, imported only when a run starts, would cost seconds.
"""

from pipelang.cli.app import console, main

__all__ = ["console", "main"]
