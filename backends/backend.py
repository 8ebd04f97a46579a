"""The backends of `pipelang run`, one row each: everything the runtime asks of a
backend's name.

`BACKENDS` maps each name `--backend` takes to its row, a `Backend`; its order is
`--help`'s and `DEFAULT` is the default. The runtime reads a row's answers and never
compares names, so adding a backend is a class here and its row in `BACKENDS`
(docs/architecture.md, "Adding a backend"). This module imports nothing of the runtime
and torch only inside the methods that need it: `--help` reads the names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from pipelang.backends.config import RunConfig
    from pipelang.backends.torchrun_env import TorchrunEnv
    from pipelang.ir import Program


class Backend(Protocol):
    """What the runtime asks of a backend."""

    help: str
    """What `run --help` says of it, after its name."""
    processes: bool
    """How it spawns: True, a process per rank, which the launcher starts
    (`processes.launch`) or torchrun does; False, every rank a thread of this process
    (`local.run_local`, or with --graphs the stream executor)."""
    streams: bool
    """Whether its ranks run their stream program (`compile --dump-after streams`) eagerly
    rather than their action list; under --graphs every backend runs stream programs."""
    dist: str
    """torch.distributed's backend that its rank processes join (under torchrun too)."""
    cuda: bool
    """Whether each rank process computes on a GPU of its own (`device`)."""

    def device(self, local_rank: int) -> torch.device:
        """The device of the rank process whose LOCAL_RANK is `local_rank`."""
        ...

    def computes_on_gpu(self) -> bool:
        """Whether the run's ranks compute on a GPU (where the `--check` reference trains
        too, and what refuses a GPU's unsupported features)."""
        ...

    def world_problem(self, world: int, ranks: str, torchrun: TorchrunEnv | None) -> str | None:
        """Why `world` processes (`ranks` says them in words) cannot run here, started by
        the launcher (`torchrun` None) or as the process of a torchrun job; None when
        they can (a usage error, exit 2)."""
        ...


class Gloo:
    """Rank processes on the CPU, over gloo."""

    help = (
        "a CPU process per rank, running its stream program (`compile --dump-after "
        "streams`), receives posted early"
    )
    processes = True
    streams = True
    dist = "gloo"
    cuda = False

    def device(self, local_rank: int) -> torch.device:
        import torch

        return torch.device("cpu")

    def computes_on_gpu(self) -> bool:
        return False

    def world_problem(self, world: int, ranks: str, torchrun: TorchrunEnv | None) -> str | None:
        return None


class Nccl:
    """Rank processes each on a GPU of its own (local rank k on cuda:k), over NCCL."""

    help = "a GPU per rank, running its stream program as gloo does"
    processes = True
    streams = True
    dist = "nccl"
    cuda = True

    def device(self, local_rank: int) -> torch.device:
        import torch

        return torch.device("cuda", local_rank)

    def computes_on_gpu(self) -> bool:
        return True

    def world_problem(self, world: int, ranks: str, torchrun: TorchrunEnv | None) -> str | None:
        import torch

        have = torch.cuda.device_count()
        if torchrun is None and have < world:
            return (
                f"the nccl backend needs one GPU per rank: {ranks}, {have} GPUs here "
                "(use --backend gloo or local)"
            )
        if torchrun is not None and torchrun.local_rank >= have:
            return (
                f"LOCAL_RANK={torchrun.local_rank}: the nccl backend puts local rank k on "
                f"cuda:k, and this node has {have} GPUs"
            )
        return None


class Local(Gloo):
    """Every rank a thread of this process, on the GPU when there is one. Under torchrun
    its processes are gloo's, on the CPU (their device and world are Gloo's)."""

    help = "every rank a thread of this process, running its action list"
    processes = False
    streams = False

    def computes_on_gpu(self) -> bool:
        import torch

        return torch.cuda.is_available()


BACKENDS: dict[str, Backend] = {"gloo": Gloo(), "nccl": Nccl(), "local": Local()}
"""`--backend`'s choices, in `--help`'s order."""
DEFAULT = next(iter(BACKENDS))
"""The backend a run uses unless `--backend` names another."""


def spawning() -> tuple[str, ...]:
    """The backends whose ranks are processes of their own (`Backend.processes`)."""
    return tuple(name for name, row in BACKENDS.items() if row.processes)


def checkpoint_problem(name: str) -> str | None:
    """Why a run on backend `name` cannot save or resume checkpoints (each rank process
    writes and reads its own part); None when it can."""
    if BACKENDS[name].processes:
        return None
    return (
        "checkpoints (--save, --resume) need a process per rank: use --backend "
        f"{' or '.join(spawning())}, not {name}"
    )


def runs_streams(program: Program, config: RunConfig) -> bool:
    """Whether a run executes each rank's stream program, which its caller then compiles
    (`compiler.stream_program`) and hands it: always under `--graphs`, and eagerly on a
    backend whose ranks run stream programs (`Backend.streams`: gloo, nccl), except for a
    schedule that has none (`features.refusal(program, "stream programs")`: one that
    evicts activations), whose ranks run their action lists."""
    from pipelang.features import refusal

    if config.graphs:
        return True
    return BACKENDS[config.backend].streams and refusal(program, "stream programs") is None
