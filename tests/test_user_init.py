"""`--init layers` (issue 41 item 1): a user's model made on the meta device, each rank
materializing only its stages' layers by their modules' `reset_parameters()` under the
layer's seed; and the per-rank byte counts a run reports (item 4, measured).

Oracles: `--check`'s one-process reference (bitwise), the layers built whole against the
layers built alone, the tensors' bytes counted here from the model's shapes, and the
peak resident memory of a child process that builds the whole model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipelang.backends.models import ModelSpec
from pipelang.cli import main
from tests.helpers import assert_clean, pipelang_here, run, stdlib

MODELS = """
import torch
from torch import nn


class Scale(nn.Module):  # holds a parameter itself, and says how to set it
    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))
        self.register_buffer("shift", torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.gain, 0.5, 1.5)
        self.shift.fill_(0.25)

    def forward(self, x):
        return x * self.gain + self.shift


class Bare(nn.Module):  # a parameter, and no reset_parameters()
    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.gain


class Half(Scale):  # a reset_parameters() that leaves its buffer unset
    def reset_parameters(self):
        nn.init.ones_(self.gain)


class Exits(Scale):  # its reset_parameters() ends the process, off the meta device
    def reset_parameters(self):
        if not self.gain.is_meta:
            raise SystemExit(3)


def exits():
    return nn.Sequential(nn.Embedding(64, 16), Exits(16), nn.Linear(16, 64))


class Split(nn.Module):  # torch's pipeline() splits it: its modules lose their class
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

    def forward(self, ids):
        from torch.distributed.pipelining import pipe_split

        x = self.emb(ids)
        pipe_split()
        return self.head(x)


def split():
    return Split()


def layers():
    return nn.Sequential(
        nn.Embedding(64, 16),
        nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), Scale(16)),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Linear(16, 64),
    )


def bare():
    return nn.Sequential(nn.Embedding(64, 16), nn.Sequential(nn.Linear(16, 16), Bare(16)),
                         nn.Linear(16, 64))


def half():
    return nn.Sequential(nn.Embedding(64, 16), Half(16), nn.Linear(16, 64))


def reads():  # reads a value as it builds: no value on the meta device
    emb = nn.Embedding(64, 16)
    width = int(emb.weight.abs().sum().item()) % 7 + 16
    return nn.Sequential(emb, nn.Linear(16, width), nn.Linear(width, 64))


def tied():  # the head is the embedding
    emb, head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(16, 16), nn.Tanh(), head)
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    return list(layer.state_dict().values())


def test_a_layer_built_alone_equals_the_same_layer_built_with_all(models: Path) -> None:
    """Layer i depends on the seed and i alone; the rest stay on meta; the factory's own
    init (`--init factory`) is another, and stays the default."""
    spec = ModelSpec("models.py:layers", seed=3, init="layers")
    whole = spec.build()
    part = spec.build(layers=[1, 3])
    for i, layer in enumerate(part.layers):
        tensors = _tensors(layer)
        assert all(t.is_meta for t in tensors) == (i not in (1, 3))
        if i in (1, 3):
            assert all(map(torch.equal, tensors, _tensors(whole.layers[i])))
    scale = whole.layers[1][2]
    assert torch.equal(scale.shift, torch.full((16,), 0.25))  # a buffer its reset sets
    other = ModelSpec("models.py:layers", seed=4, init="layers").build(layers=[3])
    assert not torch.equal(other.layers[3].weight, whole.layers[3].weight)
    factory = ModelSpec("models.py:layers", seed=3).build()
    assert not torch.equal(factory.layers[3].weight, whole.layers[3].weight)
    assert ModelSpec("models.py:layers").init == "factory"


def test_a_tied_weight_takes_its_first_uses_value(models: Path) -> None:
    spec = ModelSpec("models.py:tied", init="layers")
    whole = spec.build()
    assert whole.layers[3].weight is whole.layers[0].weight  # one tensor, as FUNC made it
    alone = spec.build(layers=[3])  # layer 0 not held: its value made aside
    assert torch.equal(alone.layers[3].weight, whole.layers[0].weight)


def test_init_layers_trains_bitwise_like_its_check_reference(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = stdlib("1f1b", D=3, N=4)
    model = ("--model", "models.py:layers", "--init", "layers", "--backend", "local")
    assert run(program, *model, "--check", "--steps", "3") == 0
    out = capsys.readouterr().out
    assert "check OK" in out and "(bitwise equal)" in out


@pytest.mark.parametrize(
    ("func", "message"),
    [
        (
            "bare",
            "error: `--model models.py:bare`: --init layers initializes each module by its "
            "reset_parameters(), and `1.1` (Bare) holds parameters or buffers itself but "
            "has none: give Bare a `reset_parameters(self)` that sets them, or use "
            "--init factory",
        ),
        (
            "half",
            "error: rank 0 failed during setup: ModelError: `--model models.py:half`: "
            "--init layers: no reset_parameters() sets "
            "`1.shift` (of Half) in full; make its module's reset_parameters() set it, or "
            "use --init factory",
        ),
        (
            "exits",
            "error: rank 0 failed during setup: ModelError: `--model models.py:exits`: "
            "--init layers: `1` (Exits) reset_parameters() failed: called sys.exit(3)",
        ),
        (
            "split",
            "error: `--model models.py:split`: --init layers calls the modules' "
            "reset_parameters(), which the stages torch's pipeline() splits off do not keep "
            "(their modules become torch.export's InterpreterModule); return a list of stage "
            "modules or an nn.Sequential, or use --init factory",
        ),
        (
            "reads",
            "error: `--model models.py:reads`: `reads()` failed: RuntimeError: "
            "Tensor.item() cannot be called on meta tensors (pipelang calls it on the meta "
            "device, where tensors hold no values, to find the stages' boundaries and to "
            "build it under --init layers: it may not read a value)",
        ),
    ],
)
def test_a_model_init_layers_cannot_set_is_refused_with_one_line(
    func: str, message: str, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--model", f"models.py:{func}"]
    assert main([*argv, "--init", "layers", "--backend", "local", "--steps", "1"]) == 1
    assert capsys.readouterr().err.strip() == message


def test_init_is_for_a_model_of_ones_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "1f1b", "-p", "D=2", "--model", "gpt:tiny", "--init", "layers"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pipelang run: error: --init is for a model of your own (--model FILE.py:FUNC); gpt "
        "models are always made on the meta device, each rank materializing only its layers"
    )


def test_the_log_and_the_table_give_each_ranks_tensor_bytes(models: Path) -> None:
    """Counted here from the shapes: rank 0 holds layers 0-2 (embedding 64x16; linear
    16x16 + 16, norm 2x16, scale 16; its buffer is no parameter), rank 1 layers 3-4
    (16x16 + 16, 16x64 + 64); SGD's momentum is one tensor per parameter."""
    log = models / "m.jsonl"
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--model", "models.py:layers"]
    options = ["--optimizer", "sgd", "--backend", "local", "--steps", "2", "--log", str(log)]
    proc = pipelang_here(*argv, *options, cwd=models)
    assert proc.returncode == 0
    params = [4 * (64 * 16 + 16 * 16 + 16 + 2 * 16 + 16), 4 * (16 * 16 + 16 + 16 * 64 + 64)]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert line["param_bytes"] == line["grad_bytes"] == line["optimizer_bytes"] == params


def test_the_summary_shows_each_ranks_tensor_bytes() -> None:
    from rich.console import Console

    from pipelang.backends.rank_base import RankResult
    from pipelang.backends.report import summary

    result = RankResult(0, [(0, "main", 0)], param_bytes=5376, grad_bytes=3 * 2**20)
    table = summary(stdlib("1f1b", D=1, N=1), [result], [1.0], "m.py:f", "local", 8)
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "┃ peak memory ┃ parameters ┃ gradients ┃ optimizer ┃" in text
    assert "│     0.0 MiB │    5.2 KiB │   3.0 MiB │   0.0 KiB │" in text


BIG = """
from torch import nn


def big():  # 8 layers of 128 MiB in fp32: 1 GiB
    wide, narrow = 8192, 4096
    layers = [nn.Embedding(wide, narrow)]
    for i in range(6):
        layers.append(nn.Linear(narrow, wide) if i % 2 == 0 else nn.Linear(wide, narrow))
    layers.append(nn.Linear(narrow, wide))
    return nn.Sequential(*layers)
"""

BUILD_WHOLE = """
import resource, sys
sys.path.insert(0, ".")
import big
model = big.big()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _descendants(root: int) -> list[int]:
    """The processes under `root` now (from /proc), `root` not among them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _watch_peaks(proc: subprocess.Popen[str], peaks: dict[int, int]) -> None:
    """Until `proc` ends, each process under it by its peak resident memory so far
    (VmHWM, bytes), read every 0.1 s: a process's whole life, its end included."""
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peaks[pid] = max(peaks.get(pid, 0), int(line.split()[1]) * 1024)
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_sharded_ranks_each_hold_an_eighth_of_a_model_no_rank_could_build_whole(
    tmp_path: Path,
) -> None:
    """Issue 41's test: 8 layers of 128 MiB (1 GiB in fp32) under --init layers over
    D = 4 stages, `--dp 2 --shard` (8 processes, each stage copy FSDP2-sharded over its
    2 data-parallel copies), gloo, 2 steps, `--check`: it checks bit for bit against
    one process (K = 2), each process's measured parameter bytes are an eighth of the
    model's (within 10%), SGD's gradients and momentum as many, and each process's peak
    resident memory stays below that of one process that merely builds the whole model,
    measured beside it: its training (`peak_memory`, read at each step's end) by more
    than an eighth of the model, and its whole life (VmHWM, watched from here: --check
    then gathers its stage's whole weights and sends them to the reference) too.
    The order keeps each stage gathered through its step (no `reshard()`): with one
    micro-batch a stage's backward needs its whole parameters anyway, and its unreduced
    gradients are the peak. Measured on the 2-core VM: 1,047-1,052 MiB per process in
    training, 1,177-1,182 MiB in all, against 1,245 MiB whole."""
    (tmp_path / "big.py").write_text(BIG)
    child = subprocess.run(
        [sys.executable, "-c", BUILD_WHOLE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    whole_peak = int(child.stdout)
    total = 8 * 4096 * 8192 * 4
    log = tmp_path / "m.jsonl"
    # one micro-batch per copy: with more, the second's weight gradient is a new tensor
    # before it is added into the unreduced gradient, a layer (128 MiB) more at the peak
    argv = ["run", "1f1b", "-p", "D=4", "-p", "N=1", "--model", "big.py:big", "--init", "layers"]
    small = ["--micro-batch-size", "1", "--seq-len", "4", "--optimizer", "sgd", "--steps", "2"]
    shard = ["--dp", "2", "--shard", "--check", "--backend", "gloo", "--log", str(log)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelang.cli", *argv, *small, *shard],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        errors="replace",
        env={**os.environ, "COLUMNS": "100"},
    )
    peaks: dict[int, int] = {}
    watcher = threading.Thread(target=_watch_peaks, args=(proc, peaks), daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        watcher.join()
    assert_clean(out, err)
    assert proc.returncode == 0, err
    assert "check OK: 30 parameter tensors" in out
    assert "(bitwise equal)" in out
    last = json.loads(log.read_text().splitlines()[-1])
    ranks = sorted(p for p in peaks.values() if p > total / 2)  # not the forkserver, ...
    print(f"whole model built in one process: peak RSS {whole_peak / 2**20:,.0f} MiB")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_memory"):
        print(key, [f"{n / 2**20:,.0f} MiB" for n in last[key]])
    print("whole life (VmHWM)", [f"{n / 2**20:,.0f} MiB" for n in ranks])
    assert len(last["param_bytes"]) == len(ranks) == 8
    for process in range(8):
        assert abs(last["param_bytes"][process] - total / 8) <= 0.1 * total / 8
        assert last["grad_bytes"][process] == last["param_bytes"][process]
        assert last["optimizer_bytes"][process] == last["param_bytes"][process]
        assert last["peak_memory"][process] < whole_peak
        # at its peak a process holds its shard, its momentum, its stage gathered and
        # the stage's unreduced gradients: 6/8 of the model against the whole build's
        # 8/8, room for more than an eighth more; gloo's own reduce-scatter, which copied
        # the gradients once more, left less (1,180 MiB against 1,245 MiB)
        assert last["peak_memory"][process] + total / 8 < whole_peak
        # and at the end: its stage's whole weights, serialized once, not held beside
        # the serialized bytes' pickle (1,433 MiB when they were)
        assert ranks[process] < whole_peak
