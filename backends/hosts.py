"""`--rank-hosts FILE`: the host each process must run on, checked before training.

A plan's header maps ranks to devices (`rank 0 -> node0.gpu0`); which process gets which
RANK is the launcher's choice. torchrun's static rendezvous (`--node-rank K
--master-addr ...`) numbers processes node by node, RANK = K x procs per node + local
rank; the c10d rendezvous hands node ranks out in arrival order, so rank 0 may land on
any node. The file says where each process must be, one host per line in rank order
(`--dp` copies included: K x R lines), `#` comments and blank lines ignored. Every
process sends its host name to every other at start, and all of them stop with the same
message when one runs elsewhere, before a step is taken.
"""

from __future__ import annotations

import socket
from pathlib import Path

from pipelang.diagnostics import clip

MAX_BYTES = 1 << 20


class HostsError(Exception):
    """The hosts file cannot be read, or a process runs on another host than it says."""


def read_hosts(path: str) -> list[str]:
    """The host names of a `--rank-hosts` file, in rank order."""
    file = Path(path)
    try:
        if file.stat().st_size > MAX_BYTES:
            raise HostsError(f"--rank-hosts {_shown(path)}: over 1 MiB, not a list of hosts")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise HostsError(f"--rank-hosts {_shown(path)}: cannot read it ({_shown(reason)})") from err
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 1:
            raise HostsError(
                f"--rank-hosts {_shown(path)}:{number}: one host name per line (rank order), "
                f"found {len(words)} words"
            )
        hosts.append(words[0])
    return hosts


SHOWN = 200
"""The longest path or host name a message shows whole."""


def _shown(text: str) -> str:
    """A path or name as a message shows it: whole up to SHOWN characters, else cut in
    the middle as `clip` cuts a quoted piece."""
    return text if len(text) <= SHOWN else clip(f"`{text}`")


def this_host() -> str:
    """This machine's name as `hostname` prints it."""
    return socket.gethostname()


def same_host(wanted: str, actual: str) -> bool:
    """Whether `actual` is the host `wanted` names: equal, or equal up to the domain
    (`node3` and `node3.cluster.local`), case-insensitive."""
    a, b = wanted.lower(), actual.lower()
    return a == b or (a.split(".", 1)[0] == b.split(".", 1)[0] and ("." not in a or "." not in b))


def mismatch(path: str, hosts: list[str], actual: list[str]) -> str | None:
    """What is wrong with processes on `actual` (by rank) against the file's `hosts`;
    None when every process is where the file says."""
    if len(hosts) != len(actual):
        return (
            f"--rank-hosts {_shown(path)} names {len(hosts)} hosts, the run has {len(actual)} "
            "processes (one line per rank, --dp copies included)"
        )
    wrong = [r for r, (w, a) in enumerate(zip(hosts, actual, strict=True)) if not same_host(w, a)]
    if not wrong:
        return None
    shown = ", ".join(
        f"rank {r} runs on {_shown(actual[r])}, not {_shown(hosts[r])}" for r in wrong[:4]
    )
    more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
    return (
        f"--rank-hosts {_shown(path)}: {shown}{more}. Launch with torchrun's static rendezvous "
        "(--node-rank K --master-addr HOST0 --master-port P on node K), which numbers the "
        "processes node by node; the c10d rendezvous numbers nodes in arrival order"
    )
