"""Which checkpoints a run resumes, writes over and deletes, under `--save DIR`.

A run has an id (`RunConfig.run_id`), written into each of its checkpoints' `pipelang.json`
and, before a save begins, into `step-K/pipelang.run` (so a save cut short is known as
its own too). A run resumed from a checkpoint goes on with that checkpoint's lineage:
the runs it descends from, each with the last step of that run on its way
(`RunConfig.lineage`). The checkpoints of *this run* are those it wrote and those of its
lineage up to the step where each was taken over: `--keep-last` deletes only those
(`prune`), so another run's `step-K` under the same DIR is never deleted, nor a
checkpoint of a branch that was abandoned.

`--save DIR` holding any `step-K` is refused unless the run is given `--resume`
(`resolve`): a new run would mix its checkpoints with another's, and `--resume auto`
says "go on from the latest of them" (or start afresh when none is complete: the
command line of a requeued job is the same for its first run and its resumes).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipelang.backends.checkpoint_read import (
    INFO,
    STEP_DIR,
    CheckpointError,
    Info,
    is_complete,
    read_info,
    read_inside,
)

OWNER = "pipelang.run"
"""The id of the run writing a `step-K`, written before its save begins."""
AUTO = "auto"
"""`--resume auto`: the latest complete checkpoint under `--save`, or a fresh start."""
Lineage = tuple[tuple[str, int], ...]


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The `step-K` directories under `root`, by step (a link named so is passed over:
    neither resumed nor deleted through)."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        named = STEP_DIR.fullmatch(entry.name)
        if named and entry.is_dir() and not entry.is_symlink():
            found.append((int(named[1]), entry))
    return sorted(found)


def _step_entries(root: Path) -> list[str]:
    """The names of every entry called `step-K` under `root` (a directory or not), by K."""
    try:
        names = [entry.name for entry in root.iterdir()]
    except OSError:
        return []
    steps = [(int(m[1]), name) for name in names if (m := STEP_DIR.fullmatch(name))]
    return [name for _, name in sorted(steps)]


def find(path: str, named: str | None = None) -> tuple[Path, int]:
    """The checkpoint `--resume path` names and its step: `path` itself when it is one,
    else the latest complete `step-K` under it. CheckpointError (status 2) when there is
    none, naming the path as `named` (default `--resume path`); status 1 when the one
    found is not a good checkpoint."""
    named = named if named is not None else f"`--resume {path}`"
    root = Path(path)
    if is_complete(root):
        return root, read_info(root).step
    try:
        root.stat()
    except OSError as err:  # missing, a name too long, a loop of links
        raise CheckpointError(f"{named}: {_no_such(err)}", 2) from None
    if not root.is_dir():
        raise CheckpointError(f"{named}: not a directory", 2)
    found = latest(root)
    if found is not None:
        return found
    if STEP_DIR.fullmatch(root.name):
        raise CheckpointError(
            f"{named}: that checkpoint was cut short (it has no {INFO}, which is written last)",
            2,
        )
    raise CheckpointError(
        f"{named}: no checkpoint there (a `step-K` directory with {INFO}, as `--save` writes)",
        2,
    )


def _no_such(err: OSError) -> str:
    if isinstance(err, FileNotFoundError):
        return "no such directory"
    return f"cannot be read ({err.strerror or err})"


def latest(root: Path) -> tuple[Path, int] | None:
    """The latest complete `step-K` under `root` and its step, or None."""
    complete = [(step, d) for step, d in step_dirs(root) if is_complete(d)]
    if not complete:
        return None
    found = complete[-1][1]
    return found, read_info(found).step


@dataclass(frozen=True, slots=True)
class Resume:
    """How a run starts, as its checkpoint options say: the checkpoint it resumes (None:
    from step 0), the run's id and lineage, and with `--resume auto` the line that says
    which."""

    path: Path | None
    step: int
    run_id: str | None
    lineage: Lineage
    said: str | None = None


def resolve(save: str | None, resume: str | Path | None, steps: int) -> Resume:
    """The start of a run of `steps` steps with `--save save` and `--resume resume`
    (either may be None; `resume` a Path is a path, even `./auto`, and the string `auto`
    is `--resume auto`): CheckpointError with status 2 when the command line names no
    checkpoint, would mix this run's checkpoints with another's, or leaves no step to
    run."""
    start = _resolve(save, resume)
    if start.step >= steps:
        raise CheckpointError(
            f"`--resume {resume}` is at step {start.step} and --steps {steps} counts from "
            f"step 0: nothing is left to run (give --steps more than {start.step})",
            2,
        )
    return start


def _resolve(save: str | None, resume: str | Path | None) -> Resume:
    run_id = uuid.uuid4().hex[:16] if save is not None else None
    if isinstance(resume, Path):
        resume = str(resume) if str(resume) != AUTO else f"./{AUTO}"
    if resume == AUTO:
        if save is None:
            raise CheckpointError(
                "--resume auto goes on from the latest checkpoint under --save DIR: give "
                "--save (or a checkpoint's path to --resume)",
                2,
            )
        found = latest(Path(save))
        if found is None:
            said = f"--resume auto: no complete checkpoint in {save} yet: starting at step 0"
            return Resume(None, 0, run_id, (), said)
        said = f"--resume auto: resuming from {found[0]} (step {found[1]})"
        return Resume(found[0], found[1], run_id, lineage(found[0]), said)
    if resume is not None:
        path, step = find(resume)
        return Resume(path, step, run_id, lineage(path))
    if save is not None:
        held = _step_entries(Path(save))
        if held:
            names = ", ".join(held[-3:])
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            raise CheckpointError(
                f"--save {save} already holds checkpoints ({names}{more}) of an earlier "
                "run: give --resume auto to go on from the latest of them, or another "
                "--save directory to start afresh",
                2,
            )
    return Resume(None, 0, run_id, ())


def lineage(path: Path) -> Lineage:
    """The lineage of a run resumed from checkpoint `path`: the checkpoint's own, and its
    run up to its step (none for a checkpoint without a run id)."""
    info = read_info(path)
    run = info.get("run")
    return (*info.lineage, (run, info.step)) if run is not None else ()


def owner(directory: Path) -> str | None:
    """The id of the run that wrote checkpoint `directory`, None if it cannot be told."""
    try:
        if is_complete(directory):
            return read_info(directory).get("run")
        text = read_inside(directory, OWNER, 64).decode("ascii").strip()
    except (CheckpointError, UnicodeDecodeError):
        return None
    return text if text.isalnum() else None


def mark(directory: Path, run_id: str | None) -> None:
    """Say that run `run_id` is writing checkpoint `directory` (made here)."""
    directory.mkdir(parents=True, exist_ok=True)
    if run_id is not None:
        temporary = directory / f".{OWNER}.{os.getpid()}"
        temporary.write_text(run_id + "\n")
        temporary.replace(directory / OWNER)


def may_overwrite(directory: Path, run_id: str | None, lineage: Lineage) -> bool:
    """Whether this run may write over `directory`: it is not there, or this run's or its
    lineage's (a save of an abandoned branch of the same training), or its writer is not
    known (a checkpoint from before run ids)."""
    if not os.path.lexists(directory):
        return True
    if directory.is_symlink() or not directory.is_dir():
        return False
    writer = owner(directory)
    return writer is None or writer == run_id or any(writer == r for r, _ in lineage)


def prune(root: str, keep: int, run_id: str | None, lineage: Lineage = ()) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints of this run under `root`
    (run by the first process, right after a newer one is complete), and any of its
    cut-short `step-K` older than its newest complete one (it can never be resumed);
    what it deleted. Another run's checkpoints, and those whose run cannot be told, are
    kept."""
    if run_id is None:
        return []
    ours = []
    for step, directory in step_dirs(Path(root)):
        writer = owner(directory)
        if writer == run_id or any(writer == r and step <= last for r, last in lineage):
            ours.append((step, directory))
    complete = [(step, d) for step, d in ours if is_complete(d)]
    if not complete:
        return []
    newest = complete[-1][0]
    kept = {d for _, d in complete[-keep:]}
    gone = [d for step, d in ours if d not in kept and step < newest]
    for directory in gone:
        (directory / INFO).unlink(missing_ok=True)  # incomplete first: never half-resumed
        shutil.rmtree(directory, ignore_errors=True)
    return gone


__all__ = [
    "AUTO",
    "OWNER",
    "Info",
    "Resume",
    "find",
    "latest",
    "lineage",
    "mark",
    "may_overwrite",
    "owner",
    "prune",
    "resolve",
    "step_dirs",
]
