"""The processes of a run as one grid: data-parallel copies x pipeline ranks x tensor ranks.

`--dp K` copies of the pipeline, each of the program's R ranks, each rank split over
`--tp T` tensor-parallel processes: K x R x T processes, numbered copy-major with the
tensor ranks adjacent (on a cluster they share a node):

    process = k * R * T + r * T + t      (copy k, program rank r, tensor rank t)

so at T = 1 it is the `--dp` numbering, `k * R + r`. This is the one place that numbers
them (`Grid`); the DeviceMesh of a tensor-parallel run, dimensions ("dp", "pp", "tp"), is
built here too (`device_mesh`), over the same numbering: `mesh["tp"]` is a rank's tensor
group, the processes (k, r, 0..T-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imports torch: only once a run starts
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("dp", "pp", "tp")
"""The mesh's dimensions, outermost first: copies, pipeline ranks, tensor ranks."""


@dataclass(frozen=True, slots=True)
class Grid:
    """K data-parallel copies (`dp`) of R pipeline ranks (`pp`), each split over T
    tensor ranks (`tp`)."""

    dp: int
    pp: int
    tp: int = 1

    @property
    def world(self) -> int:
        """The number of processes, K x R x T."""
        return self.dp * self.pp * self.tp

    def process(self, copy: int, rank: int, tensor: int = 0) -> int:
        """The process of program rank `rank` in copy `copy`, tensor rank `tensor`."""
        return (copy * self.pp + rank) * self.tp + tensor

    def coords(self, process: int) -> tuple[int, int, int]:
        """(copy, program rank, tensor rank) of `process`; `process` inverted."""
        copy, rest = divmod(process, self.pp * self.tp)
        rank, tensor = divmod(rest, self.tp)
        return copy, rank, tensor

    def program_rank(self, process: int) -> int:
        """The program rank `process` runs."""
        return self.coords(process)[1]

    def tensor_group(self, process: int) -> range:
        """The processes that split `process`'s stage copies with it (its own included)."""
        first = process - process % self.tp
        return range(first, first + self.tp)

    def hosts_problem(self, hosts: Sequence[str], path: str) -> str | None:
        """Why processes placed on `hosts` (by process) cannot run: a tensor group split
        over two hosts (its collectives run in every layer); None when each is on one."""
        from pipelang.backends.hosts import same_host

        if self.tp < 2 or len(hosts) != self.world:
            return None
        for first in range(0, self.world, self.tp):
            group = range(first, first + self.tp)
            apart = [p for p in group if not same_host(hosts[first], hosts[p])]
            if apart:
                shown = ", ".join(f"{p} on {hosts[p][:60]}" for p in (first, apart[0]))
                return (
                    f"--rank-hosts {path[:200]}: the tensor-parallel group of processes "
                    f"{first}-{first + self.tp - 1} (--tp {self.tp}) spans two hosts "
                    f"({shown}); a tensor group must sit on one host (its processes are "
                    f"numbered adjacent: copy x R x T + rank x T + tensor rank)"
                )
        return None


def device_mesh(grid: Grid, device_type: str) -> DeviceMesh:
    """The run's DeviceMesh over every process, dimensions `DIMS` sized (K, R, T): every
    process calls it, in the same place among its other process groups."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (grid.dp, grid.pp, grid.tp), mesh_dim_names=DIMS)
