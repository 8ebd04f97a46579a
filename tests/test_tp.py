"""Tensor parallelism (`--tp T`, issue 41): the process numbering of backends/mesh.py, the
refusals, and (slow) gloo runs of gpt:tiny and llama:tiny with --tp 2 checked against one
process, each rank holding about half of its stage's parameter bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelang.backends.config import RunConfig
from pipelang.backends.mesh import Grid
from pipelang.backends.preflight import tp_refusal
from tests.helpers import free_port, pipelang_here, read_checkpoint
from tests.test_held_bytes import assert_predicted

ONE_F_ONE_B = ("1f1b", "-p", "D=2", "-p", "N=4")


# ---- the numbering ----------------------------------------------------------------------


def test_process_numbering_is_copy_major_with_tensor_ranks_adjacent() -> None:
    grid = Grid(dp=2, pp=3, tp=2)
    assert grid.world == 12
    order = [grid.coords(p) for p in range(grid.world)]
    assert order == [(k, r, t) for k in range(2) for r in range(3) for t in range(2)]
    assert [grid.process(*c) for c in order] == list(range(12))
    assert grid.process(1, 2, 1) == 1 * 3 * 2 + 2 * 2 + 1
    assert grid.program_rank(9) == 1 and grid.tensor_group(9) == range(8, 10)


def test_without_tp_the_numbering_is_dp_s() -> None:
    grid = Grid(dp=3, pp=4)
    assert [grid.process(k, r) for k in range(3) for r in range(4)] == list(range(12))
    assert grid.coords(7) == (1, 3, 0)


def test_a_tensor_group_split_over_two_hosts_is_refused() -> None:
    grid = Grid(dp=1, pp=2, tp=2)
    assert grid.hosts_problem(["a", "a.x", "b", "b"], "h.txt") is None
    assert grid.hosts_problem(["a", "b", "b", "b"], "h.txt") == (
        "--rank-hosts h.txt: the tensor-parallel group of processes 0-1 (--tp 2) spans two "
        "hosts (0 on a, 1 on b); a tensor group must sit on one host (its processes are "
        "numbered adjacent: copy x R x T + rank x T + tensor rank)"
    )


def test_rank_hosts_splitting_a_tensor_group_stops_the_run(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("here\nelsewhere\nhere\nhere\n")
    proc = pipelang_here(
        "run", *ONE_F_ONE_B, "--tp", "2", "--backend", "gloo", "--rank-hosts", str(hosts),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "the tensor-parallel group of processes 0-1 (--tp 2) spans two hosts" in proc.stderr


# ---- refusals ---------------------------------------------------------------------------

REFUSED = {
    "--tp 3": "error: --tp 3: gpt:tiny has 4 attention heads, which 3 tensor ranks cannot "
    "split evenly; give a --tp that divides 4",
    "--tp 4 --model llama:tiny --backend gloo": "error: --tp 4: llama:tiny has 2 key/value "
    "heads, which 4 tensor ranks cannot split evenly; give a --tp that divides 2",
    "--tp 2 --backend local": "error: --tp needs a process per tensor rank (DTensor over "
    "process groups): use --backend gloo or nccl, not local",
    "--tp 2 --backend gloo --graphs": "error: --tp with --graphs: a tensor-parallel stage "
    "is not captured in a stream program yet; run it without one of them",
    "--tp 2 --backend gloo --mixed-precision bfloat16": "error: --tp with --mixed-precision: "
    "tensor-parallel stages keep no fp32 masters yet; run it without one of them",
    "--tp 2 --backend gloo --trace t.json": "error: --tp with --trace: the trace does not "
    "name a tensor rank's actions yet; run it without one of them",
}


@pytest.mark.parametrize("options", sorted(REFUSED))
def test_run_refuses_what_tp_does_not_take(tmp_path: Path, options: str) -> None:
    proc = pipelang_here("run", *ONE_F_ONE_B, *options.split(), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == REFUSED[options]


def test_run_refuses_a_split_backward_with_tp(tmp_path: Path) -> None:
    proc = pipelang_here("run", "zb-h1", "--tp", "2", "--backend", "gloo", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: `zb_h1` splits W off its backward (`W`): --tp does not split a "
        "tensor-parallel stage's backward yet (W would differentiate the local shards, not "
        "the DTensor parameters); use a schedule without W, such as 1f1b"
    )


def test_tp_splits_the_llama_family_of_hugging_face_models_not_gpt2(tmp_path: Path) -> None:
    """Its config.json says what --tp splits: the heads, key/value heads and MLP features
    of a Llama-family model; GPT-2's fused Conv1D projections are refused."""
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 96}
    llama = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
    llama |= {"intermediate_size": 128, **sizes}
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 96}
    for name, config in (("llama", llama), ("gpt2", gpt2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    model = f"hf:{tmp_path / 'llama'}"
    assert tp_refusal(RunConfig(model=model, backend="gloo", tp=2)) is None
    assert tp_refusal(RunConfig(model=model, backend="gloo", tp=4)) == (
        f"--tp 4: {model} has 2 key/value heads, which 4 tensor ranks cannot split evenly; "
        "give a --tp that divides 2"
    )
    gpt2_model = f"hf:{tmp_path / 'gpt2'}"
    said = tp_refusal(RunConfig(model=gpt2_model, backend="gloo", tp=2))
    assert said is not None and said.startswith("--tp with --model `hf:")  # the path, cut
    assert said.endswith(
        ": GPT-2's fused Conv1D projections are not split yet; the Llama family's (llama, "
        "qwen2, mistral) are"
    )
    assert tp_refusal(RunConfig(model=gpt2_model, backend="gloo")) is None
    assert tp_refusal(RunConfig(model="m.py:build", backend="gloo", tp=2)) is None
    assert tp_refusal(RunConfig(model="m.py:build", backend="local", tp=2)) == (
        "--tp needs a process per tensor rank (DTensor over process groups): use --backend "
        "gloo or nccl, not local"
    )


USER_MODEL = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def model():
    return nn.Sequential(
        nn.Embedding(64, 16), MLP(16), MLP(16), nn.LayerNorm(16), nn.Linear(16, 64)
    )


def tp(module, mesh):  # each MLP's first projection column-, its second row-parallel
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    if isinstance(module, MLP):
        parallelize_module(module, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
"""


def test_the_hook_is_found_beside_a_function_or_a_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tp` is looked up in the module FUNC was loaded from (a class has no globals of
    its own), and it is that module's: the classes the model was built from."""
    from pipelang.backends.tensor_parallel import user_hook
    from pipelang.backends.user_models import load_factory

    klass = "\n\nclass Model(nn.Sequential):\n    def __init__(self):\n"
    klass += "        super().__init__(*model())\n"
    (tmp_path / "mine.py").write_text(USER_MODEL + klass)
    monkeypatch.chdir(tmp_path)
    for name in ("mine.py:model", "mine.py:Model"):
        built = load_factory(name)()
        hook = user_hook(name)
        assert hook is not None and hook.__name__ == "tp"
        assert hook.__globals__["MLP"] is type(built[1])  # type: ignore[attr-defined, index]


def test_tp_refuses_a_model_of_your_own_without_its_hook(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text(USER_MODEL.replace("def tp(", "def split("))
    (tmp_path / "odd.py").write_text(USER_MODEL.replace("def tp(", "tp = 3\ndef split("))
    for name, said in [
        (
            "mine.py:model",
            "error: --tp 2 with --model `mine.py:model`: `mine.py` defines no function "
            "`tp(module, mesh)` beside `model`, which --tp calls to split each layer of a "
            "stage over its tensor ranks (docs/runtime.md, Tensor parallelism); define one, "
            "or run without --tp",
        ),
        ("odd.py:model", "error: `--model odd.py:model`: `tp` beside it is int, not a "
         "function `tp(module, mesh)`"),
    ]:  # fmt: skip
        proc = pipelang_here(
            "run", *ONE_F_ONE_B, "--model", name, "--tp", "2", "--backend", "gloo", cwd=tmp_path
        )
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == said


# ---- runs -------------------------------------------------------------------------------


def tp_run(tmp_path: Path, model: str, *more: str) -> tuple[str, dict[str, list[int]]]:
    """1F1B at D = 2, N = 4 on `model` over gloo with --check and --log; its standard
    output and the last log line's per-rank bytes."""
    log = tmp_path / f"{model.replace(':', '-')}{len(more)}.jsonl"
    proc = pipelang_here(
        "run", *ONE_F_ONE_B, "--model", model, "--backend", "gloo", "--steps", "2", "--check",
        "--log", str(log), *more, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    last = json.loads(log.read_text().splitlines()[-1])
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "grad_norm")
    return proc.stdout, {key: last[key] for key in keys}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama:tiny"])  # gpt:tiny's split: the checkpoint tests
def test_tp2_trains_within_the_tolerance_holding_about_half(tmp_path: Path, model: str) -> None:
    """--tp 2 checks within the tolerance holding about half of each stage, as simulate
    predicts to the byte; and resumes the checkpoint of a run without --tp (another
    layout), checked within the tolerance again."""
    _, whole = tp_run(tmp_path, model, "--save", str(tmp_path / "whole"))
    out, split = tp_run(tmp_path, model, "--tp", "2")
    assert "check OK" in out and "(bitwise equal)" not in out, out
    assert_predicted(tmp_path, ["--model", model, "--tp", "2"], split)  # simulate's bytes
    assert "4 processes (2 ranks x --tp 2)" in out, out
    # ranks 0, 1 split stage 0; 2, 3 stage 1: the blocks' bytes halve, the embedding,
    # norms and head stay whole on each (about 55% of gpt:tiny's and llama:tiny's stages)
    for key in ("param_bytes", "grad_bytes"):
        stages = whole[key]
        assert split[key][0] == split[key][1] and split[key][2] == split[key][3]
        for rank, held in enumerate(split[key]):
            assert 0.5 * stages[rank // 2] < held < 0.6 * stages[rank // 2], (key, rank)
    # the norm counts what every tensor rank holds whole once
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    resumed = ("--resume", str(tmp_path / "whole" / "step-2"), "--steps", "3", "--check")
    out = gloo(*ONE_F_ONE_B, "--model", model, "--tp", "2", *resumed, cwd=tmp_path)
    assert "check OK" in out, out


@pytest.mark.slow
def test_tp2_with_dp2_trains_within_the_tolerance(tmp_path: Path) -> None:
    out, split = tp_run(tmp_path, "gpt:tiny", "--tp", "2", "--dp", "2", "--clip-grad", "0.5")
    assert "check OK" in out, out
    assert "8 processes (--dp 2 x 2 ranks x --tp 2)" in out, out
    assert len(split["param_bytes"]) == 8


@pytest.mark.slow
def test_tp2_under_torchrun_counts_each_loss_once(tmp_path: Path) -> None:
    """Every tensor rank of the last stage computes the same losses; rank 0's sum of the
    ranks' reports takes tensor rank 0's."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    command += ["--master-port", free_port(), "--no-python", "--", "pipelang", "run"]
    command += [*ONE_F_ONE_B, "--tp", "2", "--backend", "gloo", "--steps", "2", "--check"]
    proc = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "largest loss difference 0;" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sched", ["seq1f1b -p D=2 -p N=4 -p C=2", "chimera -p D=2"])
def test_tp2_runs_chunks_and_replicas(tmp_path: Path, sched: str) -> None:
    """Sequence chunks (the --check reference runs them on one process, without --tp) and
    a stage's replicas (summed per tensor rank) under --tp 2."""
    proc = pipelang_here(
        "run", *sched.split(), "--tp", "2", "--backend", "gloo", "--steps", "2", "--check",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "check OK" in proc.stdout, proc.stdout


# ---- checkpoints ------------------------------------------------------------------------


def gloo(*args: str, cwd: Path) -> str:
    """`pipelang run ARGS --backend gloo` (its ranks processes; the launcher this one); its
    standard output."""
    proc = pipelang_here("run", *args, "--backend", "gloo", cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc.stdout


def unequal(one: Path, two: Path) -> list[str]:
    """The entries of checkpoints `one` and `two` (the same names) that differ in a bit."""
    first, second = read_checkpoint(one), read_checkpoint(two)
    assert sorted(first) == sorted(second)
    assert any(key.endswith(".exp_avg_sq") for key in first)  # Adam's state is there
    return [key for key in first if not torch.equal(first[key], second[key])]


@pytest.mark.slow
def test_tp_checkpoints_resume_bit_for_bit_and_under_other_layouts(tmp_path: Path) -> None:
    """--tp 2 saves the whole model's entries (a fused projection's rows as plain boxes):
    resumed under --tp 2 it ends bit for bit as the run that did not stop; the entries
    are a --tp 1 run's within --check's tolerance; resumed under --tp 1, --check's
    reference (which reads the checkpoint whole, in one process) agrees bit for bit; and
    a --tp 1 checkpoint resumes under --tp 2 by GPipe, checked within the tolerance."""
    from pipelang.backends.checkpoint_read import read_metadata

    split, whole = tmp_path / "split", tmp_path / "whole"
    run = (*ONE_F_ONE_B, "--tp", "2", "--steps", "4", "--save-every", "2")
    gloo(*run, "--save", str(split), cwd=tmp_path)
    qkv = read_metadata(split / "step-2").state_dict_metadata["optim.1.qkv.weight.exp_avg"]
    assert [(list(c.offsets), list(c.sizes)) for c in qkv.chunks] == [  # type: ignore[union-attr]
        ([0, 0], [96, 64]),
        ([96, 0], [96, 64]),
    ]
    resumed = ("--steps", "4", "--resume", str(split / "step-2"))
    gloo(*ONE_F_ONE_B, "--tp", "2", *resumed, "--save", str(tmp_path / "again"), cwd=tmp_path)
    assert unequal(split / "step-4", tmp_path / "again" / "step-4") == []
    gloo(*ONE_F_ONE_B, "--steps", "2", "--save", str(whole), cwd=tmp_path)
    tp, plain = read_checkpoint(split / "step-2"), read_checkpoint(whole / "step-2")
    for key, value in plain.items():  # the same tensors, but for TP's summation order
        assert torch.allclose(tp[key], value, atol=1.6e-4, rtol=1e-4), key
    assert "model.1.qkv.weight" in unequal(split / "step-2", whole / "step-2")
    resumed = ("--steps", "3", "--resume", str(split / "step-2"), "--check")
    out = gloo(*ONE_F_ONE_B, *resumed, cwd=tmp_path)
    assert "check OK" in out and "(bitwise equal)" in out, out
    resumed = ("--steps", "3", "--resume", str(whole / "step-2"), "--check")
    out = gloo("gpipe", "-p", "D=2", "-p", "N=4", "--tp", "2", *resumed, cwd=tmp_path)
    assert "check OK" in out, out


@pytest.mark.slow
def test_sharded_tp_holds_a_quarter_checks_and_resumes_across_layouts(tmp_path: Path) -> None:
    """--dp 2 --shard --tp 2 at D = 2 (8 processes, FSDP2 over the "dp" dimension of
    tensor-parallel stages): --check holds within the tolerance and each process holds
    about a quarter of its stage's parameter bytes (the blocks' split over dp x tp, the
    embedding and head over dp); its checkpoint is bit for bit the unsharded --dp 2
    --tp 2 run's, which resumes under it bit for bit as the run that did not stop; and
    resumed under --dp 2 --shard without --tp, --check agrees bit for bit."""
    _, whole = tp_run(tmp_path, "gpt:tiny")
    sharded, plain, log = tmp_path / "sharded", tmp_path / "plain", tmp_path / "log.jsonl"
    layout = ("--dp", "2", "--shard", "--tp", "2")
    run = ("--steps", "3", "--save-every", "2", "--check", "--log", str(log))
    out = gloo(*ONE_F_ONE_B, *layout, *run, "--save", str(sharded), cwd=tmp_path)
    assert "check OK" in out and "8 processes (--dp 2 x 2 ranks x --tp 2)" in out, out
    last = json.loads(log.read_text().splitlines()[-1])
    assert_predicted(tmp_path, ["--model", "gpt:tiny", *layout], last)  # simulate's bytes
    held = last["param_bytes"]
    assert [held[p] for p in (0, 1, 4, 5)] == [held[0]] * 4  # stage 0's processes
    for process, part in enumerate(held):  # gpt:tiny: 28%
        stage = whole["param_bytes"][process // 2 % 2]  # process = k * 4 + r * 2 + t
        assert 0.25 * stage < part < 0.3 * stage, process
    gloo(*ONE_F_ONE_B, "--dp", "2", "--tp", "2", "--steps", "2", "--save", str(plain), cwd=tmp_path)
    assert unequal(sharded / "step-2", plain / "step-2") == []
    resumed = ("--steps", "3", "--resume", str(plain / "step-2"), "--save", str(tmp_path / "again"))
    gloo(*ONE_F_ONE_B, *layout, *resumed, cwd=tmp_path)
    assert unequal(sharded / "step-3", tmp_path / "again" / "step-3") == []
    resumed = ("--steps", "3", "--resume", str(sharded / "step-2"), "--check")
    out = gloo(*ONE_F_ONE_B, "--dp", "2", "--shard", *resumed, cwd=tmp_path)
    assert "check OK" in out and "(bitwise equal)" in out, out


@pytest.mark.slow
def test_tp_splits_a_model_of_your_own_by_its_hook(tmp_path: Path) -> None:
    """`tp(module, mesh)` beside FUNC splits each layer it knows (the MLPs, on stage 0):
    --check holds, stage 0's processes hold 60% of its bytes (the embedding whole); a
    hook that fails is named with the layer it failed on."""
    (tmp_path / "mine.py").write_text(USER_MODEL)
    _, whole = tp_run(tmp_path, "mine.py:model")
    out, split = tp_run(tmp_path, "mine.py:model", "--tp", "2")
    assert "check OK" in out, out
    assert split["param_bytes"] == [12672, 12672, 4480, 4480]
    assert whole["param_bytes"] == [21120, 4480]
    raising = "def tp(module, mesh):\n    if isinstance(module, nn.LayerNorm):\n"
    raising += "        raise ValueError('no plan for LayerNorm')\n"
    (tmp_path / "bad.py").write_text(USER_MODEL.replace("def tp(module, mesh):", raising))
    proc = pipelang_here(
        "run", *ONE_F_ONE_B, "--model", "bad.py:model", "--tp", "2", "--backend", "gloo",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert (
        "failed during setup: ModelError: `--model bad.py:model`: tp(module, mesh) failed on "
        "layer 3: ValueError: no plan for LayerNorm"
    ) in proc.stderr, proc.stderr
