"""A `PipelineSchedule` in the user's own loop saves and loads `pipelang run`'s checkpoints
(pipelang/torch_state.py): `run --resume` goes on from the loop's, the loop from `run`'s,
bit for bit; and a checkpoint that does not fit is one PipelangError on every process.

Oracle: `pipelang run` itself, from scratch over the same steps with the same options; its
checkpoint of the last step and the resumed ones are compared entry by entry
(tests/helpers.read_checkpoint), parameters and optimizer states.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import pipelang
from pipelang.backends.checkpoint import held_by_model
from pipelang.backends.user_models import Boundary, PackedStage
from pipelang.torch import LrSchedule, PipelineSchedule
from tests.helpers import free_port, pipelang_cmd, read_checkpoint

ROOT = Path(__file__).resolve().parent.parent

MODEL = """\
import torch
from torch import nn

VOCAB, WIDTH = 64, 32


class First(nn.Module):
    def __init__(self, width=WIDTH):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.proj = nn.Linear(width, width)

    def forward(self, ids):
        h = self.embed(ids)
        return {"h": torch.tanh(self.proj(h)), "skip": (h, ids)}  # an integer tensor too


class Last(nn.Module):
    def __init__(self, width=WIDTH):
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x):
        h, ids = x["skip"]
        return self.head(torch.relu(self.mix(x["h"])) + h + ids.unsqueeze(-1).to(h.dtype) * 0.01)


def stages():
    return [First(), Last()]


def wider():
    return [First(48), Last(48)]
"""

LOOP = """\
import sys
import torch, torch.distributed as dist, pipelang
from pipelang.backends.data import synthetic_batch
from pipelang.torch import LrSchedule, PipelineSchedule
import model

steps, start, save, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
N, SIZE, SEQ = 4, 4, 8


def build(stage, factory=model.stages):
    torch.manual_seed(0)  # as `run` builds a user model: its seed, then FUNC()
    return factory()[stage]


def loss_fn(y, t):  # `run`'s: next-token cross-entropy on the logits, in fp32
    return torch.nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]), t.reshape(-1))


prog = pipelang.load("1f1b", D=2, N=N)
sched = PipelineSchedule(prog, build, loss_fn, mixed_precision="bfloat16")
lr = LrSchedule(1e-2, "cosine", warmup=1, floor=1e-3, steps=steps)
opt = sched.optimizer("adamw", lr=lr)
if start != "-":
    sched.load(start, opt)
while opt.steps < stop:  # `run`'s batches: micro-batch m of step k, from --seed 0
    batches = [synthetic_batch(0, opt.steps, m, SIZE, SEQ, 64, "cpu") for m in range(N)]
    sched.step(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    sched.clip_grad_norm_(0.5)
    opt.step()
    opt.zero_grad()
sched.save(save, optimizer=opt)
other = PipelineSchedule(prog, lambda s: build(s, model.wider), loss_fn)
try:  # another model: rank 0's stage has its entries under other shapes, rank 1's too
    other.load(save)
except pipelang.PipelangError as err:
    # one write per line: unbuffered (PYTHONUNBUFFERED), print writes the text and its
    # newline apart, and the other rank's line can land between them
    sys.stdout.write(f"rank {dist.get_rank()}: {err.diagnostics[0].message}\\n")
    sys.stdout.flush()
dist.destroy_process_group()
"""

OPTIONS = [
    *("1f1b", "-p", "D=2", "-p", "N=4", "--model", "model.py:stages", "--seq-len", "8"),
    *("--optimizer", "adamw", "--lr", "1e-2", "--lr-schedule", "cosine", "--warmup-steps", "1"),
    *("--min-lr", "1e-3", "--clip-grad", "0.5", "--mixed-precision", "bfloat16", "--steps", "4"),
]


def _loop(where: Path, start: str, save: str, stop: int) -> str:
    """The user's loop under torchrun, 2 gloo processes: from `start` ("-": the seed) to
    step `stop` of 4, saved under `save`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    command += ["--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", free_port(), "loop.py", "4", start, save, str(stop)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=where
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _equal(a: Path, b: Path) -> None:
    mine, theirs = read_checkpoint(a), read_checkpoint(b)
    assert sorted(mine) == sorted(theirs)
    assert any(k.startswith("optim.") for k in mine)
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []


@pytest.mark.slow
def test_the_users_loop_and_run_resume_each_other_bit_for_bit(tmp_path: Path) -> None:
    """A dict (with an integer tensor) between the stages, the user's loop with
    `clip_grad_norm_`, bf16 and the cosine schedule with warm-up: 2 steps in the loop,
    then `run --resume` to 4, equal to `run` from scratch to 4, and the loop resumed from
    `run`'s step 2 to 4 equal too, parameters and AdamW's moments bit for bit. Loading
    another model's checkpoint is the same one error on both processes (rank 0 would
    otherwise wait in DCP's collective read for rank 1)."""
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "loop.py").write_text(LOOP)
    scratch = pipelang_cmd("run", *OPTIONS, "--save", "run", "--save-every", "2", cwd=tmp_path)
    assert scratch.returncode == 0, scratch.stderr
    out = _loop(tmp_path, "-", "loop", 2)
    _equal(tmp_path / "loop" / "step-2", tmp_path / "run" / "step-2")
    resumed = pipelang_cmd("run", *OPTIONS, "--resume", "loop", "--save", "resumed", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "note:" not in resumed.stdout + resumed.stderr  # the same learning rate
    _equal(tmp_path / "resumed" / "step-4", tmp_path / "run" / "step-4")
    _loop(tmp_path, "run/step-2", "back", 4)
    _equal(tmp_path / "back" / "step-4", tmp_path / "run" / "step-4")
    said = {line for line in out.splitlines() if line.startswith("rank ")}
    message = (
        "`loop/step-2`: `model.0.embed.weight` is [64, 32] float32 there and [64, 48] "
        "float32 in this run (saved from `PipelineSchedule of __main__:build`)"
    )
    assert said == {f"rank 0: {message}", f"rank 1: {message}"}


def test_a_packed_stage_is_named_as_the_users_module_names_it() -> None:
    """The entries of a user's stage that pipelang wraps to pack a dict are named as the
    stage module names its parameters (`model.3.proj.weight`, not `model.3.stage.proj.
    weight`), so the user's loop, which never wraps it so, names them alike."""
    torch.manual_seed(0)
    inner = nn.Sequential()
    inner.add_module("proj", nn.Linear(2, 2))
    packed = PackedStage(inner, None, Boundary.of({"a": torch.zeros(1)}, "here"), True)
    held = held_by_model(nn.Sequential(packed), None, 3)
    assert held.names == ["3.proj.weight", "3.proj.bias"]


# ---- one process: both stages of an interleaved 1F1B (D = 1, v = 2) ----------------------


class _Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _sched(width: int = 8) -> PipelineSchedule:
    def build(stage: int) -> nn.Module:
        torch.manual_seed(stage)
        return _Stage(width)

    prog = pipelang.load("interleaved-1f1b", D=1, N=2, v=2)
    return PipelineSchedule(prog, build, nn.functional.mse_loss)


def _trained(tmp_path: Path) -> tuple[PipelineSchedule, Path]:
    """A schedule trained one step with AdamW and saved under tmp_path/ck."""
    sched = _sched()
    opt = sched.optimizer("adamw", lr=LrSchedule(0.1, "linear", floor=0.01, steps=5))
    sched.step(torch.randn(4, 8), torch.randn(4, 8))
    opt.step()
    return sched, sched.save(tmp_path / "ck", optimizer=opt)


def test_save_and_load_restore_the_parameters_and_the_optimizer(
    tmp_path: Path, one_process: None
) -> None:
    sched, path = _trained(tmp_path)
    assert path == tmp_path / "ck" / "step-1" and (path / "pipelang.json").is_file()
    fresh = _sched()
    opt = fresh.optimizer("adamw", lr=LrSchedule(0.1, "linear", floor=0.01, steps=5))
    assert fresh.load(tmp_path / "ck", opt) == 1 and opt.steps == 1
    assert opt.lr == LrSchedule(0.1, "linear", floor=0.01, steps=5).lr(1)
    for a, b in zip(fresh.parameters(), sched.parameters(), strict=True):
        assert torch.equal(a, b)
    assert read_checkpoint(path).keys() >= {"model.1.lin.weight", "optim.1.lin.bias.exp_avg"}


def _error(call: object) -> str:
    """The one line of the PipelangError `call()` raises, raised with nothing chained
    (no traceback through pipelang's insides)."""
    with pytest.raises(pipelang.PipelangError) as caught:
        call()  # type: ignore[operator]
    err = caught.value
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    assert len(err.diagnostics) == 1
    return err.diagnostics[0].message


def test_loading_what_is_no_fitting_checkpoint_is_one_error(
    tmp_path: Path, one_process: None
) -> None:
    _, path = _trained(tmp_path)
    (tmp_path / "empty").mkdir()
    assert _error(lambda: _sched().load(tmp_path / "empty")) == (
        f"`{tmp_path / 'empty'}`: no checkpoint there (a `step-K` directory with "
        "pipelang.json, as `--save` writes)"
    )
    assert _error(lambda: _sched().load(tmp_path / "none")) == (
        f"`{tmp_path / 'none'}`: no such directory"
    )
    said = _error(lambda: _sched(width=6).load(path))
    assert said.startswith(
        f"`{path}`: `model.0.lin.weight` is [8, 8] float32 there and [6, 6] float32 in this "
        "run (saved from `PipelineSchedule of "
    ) and said.endswith("test_user_loop_resume:_sched.<locals>.build`)")
    other = tmp_path / "other"
    shutil.copytree(path, other)
    shard = next(other.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    said = _error(lambda: _sched().load(other))
    assert "is cut short: it has 100 bytes" in said and "saved from" not in said
    sgd = _sched()
    assert _error(lambda: sgd.load(path, sgd.optimizer("sgd", lr=0.1))) == (
        f"`{path}` was saved with the optimizer adamw: it cannot resume sgd's state (load "
        "it with optimizer=None for the parameters alone)"
    )
    plain = _sched()
    plain.save(tmp_path / "plain", step=1)
    adam = _sched()
    assert "saved with the optimizer none (parameters only)" in _error(
        lambda: adam.load(tmp_path / "plain", adam.optimizer("adamw"))
    )


def test_bad_optimizer_and_save_arguments_are_one_error(tmp_path: Path, one_process: None) -> None:
    sched = _sched()
    assert _error(lambda: sched.optimizer("x" * 10_000)).startswith("optimizer `'xxx")
    assert len(_error(lambda: sched.optimizer("x" * 10_000))) < 200
    assert _error(lambda: sched.optimizer("adamw", lr=float("nan"))) == (
        "lr=`nan`: give a finite number above 0"
    )
    assert _error(lambda: sched.optimizer("adam", betas=(0.9, 1.0))) == (
        "betas[1]=`1.0`: give a finite number at least 0 and below 1"
    )
    assert _error(lambda: sched.save(tmp_path, step=True)) == (
        "save: step=`True`: give a positive whole number"
    )
    (tmp_path / "step-1").write_text("not a checkpoint")
    assert _error(lambda: sched.save(tmp_path, step=1)) == (
        f"`{tmp_path / 'step-1'}` is there and is not a directory: not written over"
    )


# ---- at exit: no thread of torch's is left holding what pipelang handed it -----------------

EXIT = """\
import os, sys, weakref
import torch
import torch.distributed as dist

def init():
    dist.init_process_group("gloo", store=dist.FileStore("store", 1), rank=0, world_size=1)

if sys.argv[1] == "init-first":
    init()
import pipelang
from pipelang.torch import PipelineSchedule
if sys.argv[1] == "import-first":
    init()
world = weakref.ref(dist.group.WORLD)
prog = pipelang.load("interleaved-1f1b", D=1, N=2, v=2)
sched = PipelineSchedule(prog, lambda s: torch.nn.Linear(4, 4), torch.nn.functional.mse_loss)
opt = sched.optimizer("adamw")
sched.step(torch.randn(4, 4), torch.randn(4, 4))
opt.step()
sched.save("ck", optimizer=opt)
try:
    PipelineSchedule(prog, lambda s: torch.nn.Linear(2, 2), torch.nn.functional.mse_loss).load("ck")
except pipelang.PipelangError:
    pass
dist.destroy_process_group()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(world() is None, sorted(n for n in names if "gloo" in n))
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["import-first", "init-first"])
def test_destroy_process_group_ends_every_gloo_thread_after_save_and_load(
    tmp_path: Path, order: str
) -> None:
    """After `save` and `load` (DCP, imported once the process group is up), the user's
    `dist.destroy_process_group()` frees the default group: no gloo thread lives on into
    the interpreter's exit, where one letting go of a collective's tensor aborted the
    script ("terminate called without an active exception"): torch's
    distributed/nn/functional.py, which DCP imports, held the group in its defaults."""
    (tmp_path / "exit.py").write_text(EXIT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "exit.py", order],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "True []"


def test_pipelangs_collectives_leave_no_tensor_to_torchs_threads(
    one_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When `clip_grad_norm_` and a checkpoint's agreement (`_agree`, every process's
    one error) return, gloo's worker thread holds none of the tensors they handed to a
    collective (each at one reference, the recorder's): a tensor it let go of last,
    after the script's end, aborted the process. (Before, about half of the calls
    returned while the worker still held the tensor: 40 rounds catch it.)"""
    import torch.distributed as dist

    from pipelang.backends.transport import uses
    from pipelang.torch_state import _agree

    handed: list[torch.Tensor] = []

    def recorded(name: str) -> object:
        real = getattr(dist, name)

        def call(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            handed.append(tensor)
            return real(tensor, *args, **kwargs)

        return call

    for name in ("all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, recorded(name))

    def held_after(call: Callable[[], object]) -> list[int]:
        """The references to each tensor `call` handed to a collective, as it returns."""
        del handed[:]
        with contextlib.suppress(pipelang.PipelangError):
            call()
        return uses(handed)

    sched = _sched()
    sched.step(torch.randn(4, 8), torch.randn(4, 8))
    for _ in range(40):
        assert held_after(lambda: sched.clip_grad_norm_(0.5)) == [1]
        assert held_after(lambda: _agree(None, sched.device)) == [1]
        assert held_after(lambda: _agree("a problem", sched.device)) == [1, 1, 1]
