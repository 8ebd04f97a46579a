"""Checks of a lowered Program: one whose transfers are explicit comm actions.

`insert-comms` makes such programs (the tests check its output with `check_lowered`; the
compiler does not run it every time, since it costs as much as the pass). A Program read
back from a `schedule.json`, perhaps edited by hand, has not been through the compiler,
so every runtime that runs one reads it with `read_lowered`, which checks it here first:
a mismatch would otherwise hang the ranks.

E0307: a channel (one directed rank pair) delivers in the order it is sent, so on each
channel the k-th `send` or `signal` must match the k-th `recv` or `wait`: the same
op's result, a recv for a send and a wait for a signal. The first mismatch of each
channel is reported, including a send nobody receives and a recv nobody sends.

    rank 0: F0@0/main send:F0@0/main>1 F1@0/main send:F1@0/main>1
    rank 1: recv:F1@0/main<0 recv:F0@0/main<0 F1@1/main F0@1/main
  =>
    error[E0307]: transfers from rank 0 to rank 1 do not match: rank 0 sends
    `send:F0@0/main>1` (step 1) where rank 1 receives `recv:F1@0/main<0` (step 0)
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from pipelang.diagnostics import Diagnostic, Label, PipelangError, fail
from pipelang.ir import Action, Kind, Program
from pipelang.readers import ReadError, read_text

_COUNTERPART = {
    Kind.SEND: Kind.RECV,
    Kind.SIGNAL: Kind.WAIT,
    Kind.RECV: Kind.SEND,
    Kind.WAIT: Kind.SIGNAL,
}
"""The kind of the other end of a transfer."""


class _End(NamedTuple):
    """One end of a transfer: `action`, at `step` of `rank`'s list."""

    rank: int
    step: int
    action: Action


def read_lowered(path: Path) -> Program:
    """The `schedule.json` at `path` (what `pipelang compile -o` writes), read back and
    checked before a runtime runs it: a file that cannot be read or is not a program is
    E0003, transfers that do not match are E0307."""
    try:
        program = Program.from_json(read_text(path))
    except ReadError as err:
        raise fail("E0003", f"cannot read `{path}`: {err}") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        why = f"{type(err).__name__}: {err}" if isinstance(err, KeyError) else str(err)
        raise fail(
            "E0003",
            f"`{path}` is not a pipelang program as `pipelang compile -o` writes it ({why})",
        ) from None
    found = check_lowered(program)
    if found:
        raise PipelangError(found)
    return program


def check_lowered(program: Program) -> list[Diagnostic]:
    """E0307 for every channel whose sends and recvs do not match one to one, in order
    (see the module docstring); empty when all of them do."""
    sent: dict[tuple[int, int], list[_End]] = defaultdict(list)
    received: dict[tuple[int, int], list[_End]] = defaultdict(list)
    for rank, actions in enumerate(program.ranks):
        for step, action in enumerate(actions):
            kind, peer = action.kind, action.peer
            if kind not in _COUNTERPART:
                continue
            if peer is None or not 0 <= peer < program.num_ranks or peer == rank:
                return [_unpeered(rank, step, action, program.num_ranks)]
            if kind is Kind.SEND or kind is Kind.SIGNAL:
                sent[(rank, peer)].append(_End(rank, step, action))
            else:
                received[(peer, rank)].append(_End(rank, step, action))
    found = []
    for channel in sorted(sent.keys() | received.keys()):
        mismatch = _first_mismatch(channel, sent.get(channel, []), received.get(channel, []))
        if mismatch is not None:
            found.append(mismatch)
    return sorted(found, key=Diagnostic.sort_key)


def _first_mismatch(
    channel: tuple[int, int], sends: list[_End], recvs: list[_End]
) -> Diagnostic | None:
    for send, recv in zip(sends, recvs, strict=False):
        if _other_end(send) != recv.action:
            return _mismatch(channel, send, recv)
    if len(sends) > len(recvs):
        return _unmatched(channel, sends[len(recvs)], f"rank {channel[1]} never receives it")
    if len(recvs) > len(sends):
        return _unmatched(channel, recvs[len(sends)], f"rank {channel[0]} never sends it")
    return None


def _other_end(end: _End) -> Action:
    """What the other rank must list to match `end`: `recv:OP<src` for `send:OP>dst`
    on rank src, `send:OP>dst` for `recv:OP<src` on rank dst, and so for signal/wait."""
    a = end.action
    return Action(_COUNTERPART[a.kind], a.mb, a.stage, a.pipeline, end.rank, a.of)


def _mismatch(channel: tuple[int, int], send: _End, recv: _End) -> Diagnostic:
    src, dst = channel
    labels = () if send.action.span is None else (Label(send.action.span, "sent here"),)
    return Diagnostic(
        "E0307",
        f"transfers from rank {src} to rank {dst} do not match: rank {src} sends "
        f"`{send.action}` (step {send.step}) where rank {dst} receives `{recv.action}` "
        f"(step {recv.step})",
        recv.action.span or send.action.span,
        labels,
        notes=(_FIFO,),
        help=f"on rank {dst}, receive what rank {src} sends in the order it sends it: "
        f"`{_other_end(send)}` here",
    )


def _unpeered(rank: int, step: int, action: Action, ranks: int) -> Diagnostic:
    return Diagnostic(
        "E0307",
        f"rank {rank} lists `{action}` (step {step}), whose other end is not another of "
        f"the program's {ranks} ranks",
        action.span,
        help="a transfer names the rank at its other end: `send:OP>DST`, `recv:OP<SRC`",
    )


def _unmatched(channel: tuple[int, int], end: _End, why: str) -> Diagnostic:
    src, dst = channel
    return Diagnostic(
        "E0307",
        f"transfers from rank {src} to rank {dst} do not match: rank {end.rank} lists "
        f"`{end.action}` (step {end.step}), but {why}",
        end.action.span,
        notes=(_FIFO,),
        help=f"add `{_other_end(end)}` to rank {end.action.peer}, or remove `{end.action}`",
    )


_FIFO = (
    "a channel delivers in the order it is sent: its k-th send or signal is its k-th recv or wait"
)
