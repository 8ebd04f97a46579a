"""pipelang: a language and compiler for pipeline-parallel training schedules.

    import pipelang
    prog = pipelang.load("chimera", D=4, N=4)
    prog.simulate({"F": 1, "B": 2}).makespan

docs/api.md describes the API.
"""

__version__ = "0.1.0"

from pipelang.diagnostics import Diagnostic, PipelangError
from pipelang.schedule import Schedule, load, synthesize

__all__ = ["Diagnostic", "PipelangError", "Schedule", "__version__", "load", "synthesize"]
