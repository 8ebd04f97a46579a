"""torchrun's variables, read in one place and checked before anything uses them.

torchrun (or a hand-started rank, `pipelang rank`) tells a process where it stands in the
environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and per node LOCAL_RANK and
LOCAL_WORLD_SIZE. With RANK, WORLD_SIZE and MASTER_ADDR set, `pipelang run` is one rank
of such a job (`under_torchrun`); `torchrun_env` then reads every variable and says in
one line which one is wrong and how (a usage error, exit 2), before torch.distributed
would answer with a traceback, or a rank outside the world would index past its
status.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pipelang.diagnostics import clip

JOB = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
"""The variables whose presence makes this process a rank of a torchrun job."""
MAX_PROCESSES = 1 << 20
"""The most processes a WORLD_SIZE may name (far more than any job has)."""
_DIGITS = re.compile("[0-9]{1,9}")
_HOST = re.compile(r"[A-Za-z0-9_.:\-\[\]%]{1,253}")
"""A host name, an IPv4 address or a bracketed or bare IPv6 address."""


class TorchrunEnvError(Exception):
    """A torchrun variable that is missing or cannot be what it says (exit 2)."""


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """Where this process stands in a torchrun job, every field checked."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or by hand as one rank)."""
    return all(name in os.environ for name in JOB)


def torchrun_env() -> TorchrunEnv:
    """This process's torchrun variables, checked; TorchrunEnvError names the first
    that is missing or wrong."""
    world = _whole("WORLD_SIZE", 1, MAX_PROCESSES, "the number of processes of the job")
    rank = _whole("RANK", 0, world - 1, "this process's rank, 0 to WORLD_SIZE - 1")
    local_world = world
    if "LOCAL_WORLD_SIZE" in os.environ:
        local_world = _whole(
            "LOCAL_WORLD_SIZE", 1, world, "the processes on this node, 1 to WORLD_SIZE"
        )
    local_rank = rank
    if "LOCAL_RANK" in os.environ:
        local_rank = _whole(
            "LOCAL_RANK", 0, local_world - 1, "the rank on this node, 0 to LOCAL_WORLD_SIZE - 1"
        )
    addr = os.environ["MASTER_ADDR"]
    if not _HOST.fullmatch(addr):
        raise TorchrunEnvError(
            clip(f"MASTER_ADDR=`{addr}` is not a host name or address (the rendezvous host)")
        )
    port = _whole("MASTER_PORT", 1, 65535, "the rendezvous port, 1 to 65535")
    return TorchrunEnv(rank, world, local_rank, local_world, addr, port)


def _whole(name: str, least: int, most: int, meaning: str) -> int:
    """Variable `name` as a whole number in `least..most`; `meaning` says what it is."""
    text = os.environ.get(name)
    if text is None:
        given = ", ".join(n for n in JOB if n in os.environ)
        raise TorchrunEnvError(
            f"{name} is not set: with {given} set this process is one rank of a torchrun "
            f"job, which needs {name} too ({meaning})"
        )
    if not _DIGITS.fullmatch(text.strip()):
        raise TorchrunEnvError(clip(f"{name}=`{text}` is not a whole number ({meaning})"))
    value = int(text)
    if value < least or value > most:
        bound = {
            "RANK": f"below WORLD_SIZE={os.environ.get('WORLD_SIZE')}",
            "LOCAL_RANK": (
                f"below LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']}"
                if "LOCAL_WORLD_SIZE" in os.environ
                else f"below WORLD_SIZE={os.environ.get('WORLD_SIZE')}"
            ),
            "LOCAL_WORLD_SIZE": f"at most WORLD_SIZE={os.environ.get('WORLD_SIZE')}",
        }.get(name, f"{least} to {most:,}")
        raise TorchrunEnvError(f"{name}={value} is not {bound} ({meaning})")
    return value
