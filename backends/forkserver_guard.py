"""Preloaded by the forkserver that starts the ranks (rank_server.forkserver), and only by
it: importing this module makes the server die with the `pipelang` process that started
it. A rank dies with its parent, the server (worker._die_with_parent), so a launcher
killed outright (SIGKILL, a closed terminal) takes its ranks with it instead of leaving
them training with nobody to report to."""

from __future__ import annotations

import ctypes
import signal
import sys

if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
