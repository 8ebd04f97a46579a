"""E0308: a rank that holds more activations than `--max-activations`, counted by the one
rule for held activations (`pipelang.sim.memory`)."""

from __future__ import annotations

from pipelang.diagnostics import Diagnostic, listing
from pipelang.ir import Action, Program
from pipelang.sim import memory


def check_memory(program: Program, cap: int) -> list[Diagnostic]:
    """E0308: per rank, the first op after which it holds more than `cap` forwards'
    activations (until their B; where W is split off, W's share until their W)."""
    diagnostics = []
    share, w = memory.shares(program), memory.w_share(program)
    for rank, actions in enumerate(program.ranks):
        for at, count in enumerate(memory.held(actions, w, share)):
            if count > cap + 1e-9:
                held = memory.holding(actions[: at + 1], w)
                diagnostics.append(_too_many(rank, actions[at], count, held, cap, w is not None))
                break
    return diagnostics


def _too_many(
    rank: int, action: Action, count: float, in_flight: list[Action], cap: int, split: bool
) -> Diagnostic:
    waiting = "B or W" if split else "backward"
    return Diagnostic(
        "E0308",
        f"rank {rank} holds {round(count, 6):g} activations after `{action}`, more than the "
        f"cap of {cap}",
        action.span,
        notes=(f"forwards whose {waiting} has not run yet: {listing(in_flight)}",),
        help=f"start fewer forwards before the first backward on rank {rank}, "
        "or raise --max-activations",
    )
