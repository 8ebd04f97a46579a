"""A user's model loaded once in a child process first, where its failures can be seen.

`--model FILE.py:FUNC` (or `package.module:FUNC`) runs the user's code: at import, in
`FUNC()`, and in its forward, which pipelang runs once on the meta device to find what
each stage hands the next. Run in this process, that code could loop forever before any
`--timeout` applies, end the process with `os._exit(0)` (a run that trained nothing
would exit 0), or raise `KeyboardInterrupt` (a silent 130). So before this process runs
any of it, `vet` has a child process load the model exactly so (on the meta device:
nothing is computed or allocated) under a deadline (`--timeout` for `pipelang run`,
`DEADLINE` elsewhere, counted from when Python and torch are loaded), and turns a child
that hangs, dies or exits into a `ModelError` naming the model and what happened. Once a
model has passed, this process loads it itself (once per model name and shape). The child
is forked from the forkserver the ranks start from (backends/rank_server.py), which has
torch imported already: a fresh Python would spend 1.5-2 s of CPU importing it again.

The ranks a `pipelang run` launcher starts do not vet again (`trust`): the launcher did,
and it watches them (a rank that hangs in set-up is stopped after `--timeout`, one that
exits is named). A rank under torchrun has no such launcher and vets for itself.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelang.backends.model_error import ModelError
from pipelang.backends.rank_server import start
from pipelang.diagnostics import clip

if TYPE_CHECKING:
    from pipelang.backends.models import ModelSpec

START_SECONDS = 300.0
"""How long the child may take to start (the forkserver importing torch), before the deadline."""
DEADLINE = 60.0
"""How long loading a model may take in the child, unless `set_deadline` says (run's
--timeout, 60 s by default too)."""
_deadline: dict[str, tuple[float, str]] = {"": (DEADLINE, "the model's load deadline")}
_passed: set[tuple[object, ...]] = set()
_trusted: set[str] = set()


def set_deadline(seconds: float, name: str) -> None:
    """Give loading a model `seconds`, named `name` in the message (`--timeout`)."""
    _deadline[""] = (seconds, name)


def trust(name: str) -> None:
    """Load model `name` here without a child: a launcher that vetted it watches us."""
    _trusted.add(name)


def vet(spec: ModelSpec, load: Callable[[ModelSpec, str], str]) -> None:
    """Load `spec`'s model in a child process under the deadline, once per process, by
    `load(spec, result)` there (user_models.load_in_child: its error, "" when none);
    raises ModelError when the child fails, hangs or ends without a word."""
    key = (spec.name, spec.seq_len, spec.micro_batch_size, spec.dtype)
    if spec.name in _trusted or key in _passed:
        return
    seconds, deadline = _deadline[""]
    with tempfile.TemporaryDirectory(prefix="pipelang-model-") as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        loaded = type(spec)(*key)  # the model's name and shapes alone
        job = (load, loaded, str(result), str(log), dict(os.environ))
        child = start(_child, job, "model")
        try:
            status = _wait(child, Path(f"{result}.started"), seconds)
        finally:  # the deadline, or a signal to this process: the child goes too
            if child.is_alive():
                child.kill()
            child.join()
        if status is None:
            raise ModelError(
                f"`--model {spec.name}`: loading it (importing its module, calling its "
                f"function, running it once on the meta device) did not finish within "
                f"{seconds:g} s ({deadline}); does its code loop or wait as it loads?"
            )
        said = _read(result)
        if said is None:
            raise ModelError(_died(spec.name, status, log))
    if said:
        raise ModelError(said)
    _passed.add(key)


def _wait(child: Any, started: Path, seconds: float) -> int | None:
    """The child's exit status, or None when the model's code (from when the child says
    it `started` it, once torch has loaded its meta kernels) ran past `seconds`."""
    begun = time.monotonic()
    user: float | None = None
    while True:
        child.join(0.02)
        if child.exitcode is not None:
            return int(child.exitcode)
        now = time.monotonic()
        if user is None and started.exists():
            user = now
        if user is not None and now - user > seconds:
            return None
        if user is None and now - begun > START_SECONDS:
            raise ModelError(f"a process to load the model in did not start in {START_SECONDS:g} s")


def _read(result: Path) -> str | None:
    """What the child reported: "" when the model loaded, else the error; None when it
    said nothing (it died, or ended the process itself)."""
    try:
        return str(json.loads(result.read_text(encoding="utf-8"))["error"] or "")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _died(name: str, status: int, log: Path) -> str:
    """A child that ended without reporting, in words."""
    import signal

    if status < 0:
        how = f"was killed by {signal.Signals(-status).name}"
    else:
        how = f"ended the process (exit status {status}) before it finished"
    try:
        with log.open("rb") as file:
            file.seek(max(0, log.stat().st_size - 2000))
            lines = file.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        lines = []
    last = f"; its last words: `{lines[-1]}`" if lines else ""
    return clip(
        f"`--model {name}`: loading the model (importing its module, calling its function, "
        f"running it once on the meta device) {how}{last}; a model's code may not end the "
        "process"
    )


def _child(
    load: Callable[[ModelSpec, str], str],
    spec: ModelSpec,
    result: str,
    log: str,
    env: dict[str, str],
) -> None:
    """The child: `load` the model and write what went wrong ("" if nothing), in the
    caller's environment, its stderr to `log` and its stdout nowhere."""
    os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    error = load(spec, result)
    with open(result, "w", encoding="utf-8") as file:
        json.dump({"error": error}, file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
