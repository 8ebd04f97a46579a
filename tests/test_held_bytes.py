"""Memory the tools predict (issue 41): each process's parameter, gradient and optimizer
bytes (pipelang/sim/state.py, backends/param_shapes.py) in `simulate --model`, with
`--dp K --shard`, `--optimizer` and `--mixed-precision`; and (slow) equal to what a gloo
run measures and logs (backends/metrics.py), byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelang.api import compile_schedule
from pipelang.sim.state import (
    HeldBytes,
    ModelParams,
    Param,
    padded_rows,
    param_bytes,
    rank_bytes,
    shard_rows,
)
from tests.helpers import pipelang_cmd, pipelang_here

ONE_F_ONE_B = ("1f1b", "-p", "D=2", "-p", "N=4")


def test_shard_rows_are_torch_chunks_and_every_shard_is_padded_to_the_first() -> None:
    assert [shard_rows(5, 2, i) for i in range(2)] == [3, 2]
    assert [shard_rows(5, 4, i) for i in range(4)] == [2, 2, 1, 0]  # torch.chunk: 3 chunks
    assert [shard_rows(8, 4, i) for i in range(4)] == [2] * 4
    assert [shard_rows(1, 3, i) for i in range(3)] == [1, 0, 0]
    assert padded_rows(5, 2) == 3 and padded_rows(5, 4) == 2 and padded_rows(1, 3) == 1


WEIGHT = Param(key=1, rows=5, numel=15, itemsize=4, trained=True)  # a 5 x 3 fp32 weight


def test_optimizer_kinds_keep_their_states_per_trained_parameter() -> None:
    assert param_bytes(WEIGHT, "sgd", mixed=False) == HeldBytes(60, 60, 60)
    assert param_bytes(WEIGHT, "adam", mixed=False) == HeldBytes(60, 60, 120)
    assert param_bytes(WEIGHT, "adamw", mixed=False) == HeldBytes(60, 60, 120)
    frozen = Param(key=2, rows=5, numel=15, itemsize=4, trained=False)
    assert param_bytes(frozen, "adam", mixed=False) == HeldBytes(60, 0, 0)


def test_mixed_precision_keeps_fp32_masters_gradients_and_states() -> None:
    bf16 = Param(key=1, rows=5, numel=15, itemsize=2, trained=True)
    # bf16 parameters; fp32 gradients (the masters'); fp32 master + Adam's two moments
    assert param_bytes(bf16, "adam", mixed=True) == HeldBytes(30, 60, 3 * 60)
    assert param_bytes(bf16, "sgd", mixed=True) == HeldBytes(30, 60, 2 * 60)


def test_sharded_mixed_precision_shards_the_fp32_masters_themselves() -> None:
    bf16 = Param(key=1, rows=5, numel=15, itemsize=2, trained=True)
    # fp32 shards (padded), fp32 gradients (padded), Adam's two moments, no master beside
    assert param_bytes(bf16, "adam", True, shards=2, index=1) == HeldBytes(36, 36, 2 * 24)


def test_shards_count_fsdp2_padding_in_parameters_and_gradients_only() -> None:
    # 5 rows over 2: both hold 3 rows of parameters and gradients (padded); the optimizer
    # state is made from the local shard itself, 3 rows and 2
    assert param_bytes(WEIGHT, "adam", False, shards=2, index=0) == HeldBytes(36, 36, 72)
    assert param_bytes(WEIGHT, "adam", False, shards=2, index=1) == HeldBytes(36, 36, 48)
    # 5 rows over 4: shards of 2 rows; the last process holds none of its own
    assert param_bytes(WEIGHT, "sgd", False, shards=4, index=3) == HeldBytes(24, 24, 0)


def test_processes_count_their_stage_copies_in_the_runs_order() -> None:
    program = compile_schedule("1f1b", {"D": "2", "N": "4"}).need_program()
    shared = Param(key=7, rows=2, numel=2, itemsize=4, trained=True)
    model = ModelParams(((WEIGHT, shared), (shared,)))
    assert rank_bytes(program, model, "sgd") == [HeldBytes(68, 68, 68), HeldBytes(8, 8, 8)]
    assert rank_bytes(program, model, "sgd", dp=2, shard=True) == [
        HeldBytes(40, 40, 40),  # 3 of WEIGHT's rows and 1 of shared's
        HeldBytes(4, 4, 4),
        HeldBytes(40, 40, 28),  # 2 of WEIGHT's rows (the optimizer's), the padding's 1 not
        HeldBytes(4, 4, 4),
    ]


# gpt:tiny under 1F1B at D = 2 with Adam, as a gloo run measures it (the slow test below)
TINY = {"": (671232, 663552), "--shard": (335616, 331776)}


@pytest.mark.parametrize("shard", sorted(TINY))
def test_simulate_gives_each_process_its_bytes(tmp_path: Path, shard: str) -> None:
    proc = pipelang_here(
        "simulate", *ONE_F_ONE_B, "--model", "gpt:tiny", "--dp", "2", *shard.split(), "--json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["memory"]
    first, last = TINY[shard]
    assert [(r["process"], r["rank"], r["replica"]) for r in rows] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1),
    ]  # fmt: skip
    assert [r["param_bytes"] for r in rows] == [first, last] * 2
    assert [r["grad_bytes"] for r in rows] == [first, last] * 2
    assert [r["optimizer_bytes"] for r in rows] == [2 * first, 2 * last] * 2
    for row in rows:
        parts = ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_activation_bytes")
        assert row["total_bytes"] == sum(row[k] for k in parts) and row["peak_activation_bytes"]


def test_simulate_text_table_names_the_layout(tmp_path: Path) -> None:
    proc = pipelang_here(
        "simulate", *ONE_F_ONE_B, "--model", "gpt:tiny", "--optimizer", "sgd",
        "--mixed-precision", "bfloat16", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "predicted bytes per process (gpt:tiny, sgd, bfloat16 with fp32 masters)" in proc.stdout
    # bf16 parameters, fp32 gradients, fp32 master + momentum
    assert "│    0 │    335,616 │   671,232 │ 1,342,464 │" in proc.stdout


STATE_USAGE = {
    "--optimizer sgd": "pipelang simulate: error: --optimizer says what each process's "
    "optimizer state holds, for the model: give --model too",
    "--optimizer sgd --mixed-precision bfloat16": "pipelang simulate: error: --optimizer and "
    "--mixed-precision say what each process's optimizer state holds, for the model: give "
    "--model too",
    "--model gpt:tiny --mixed-precision bfloat16 --dtype float16": "pipelang simulate: error: "
    "--mixed-precision bfloat16 keeps fp32 master weights and --dtype float16 puts everything "
    "in one dtype: give one of them",
}
PIPEDREAM = ("pipedream", "-p", "D=2", "-p", "N=4", "--model", "gpt:tiny")


def test_simulate_refuses_the_mixed_precision_the_run_refuses(tmp_path: Path) -> None:
    proc = pipelang_here("simulate", *PIPEDREAM, "--mixed-precision", "bfloat16", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "pipelang simulate: error: `pipedream` is asynchronous (`weights stash`) and updates "
        "its stages with `U`: its weight versions are not kept as fp32 masters yet; run it "
        "with --dtype instead of --mixed-precision"
    )


@pytest.mark.parametrize("options", sorted(STATE_USAGE))
def test_simulate_state_options_usage(tmp_path: Path, options: str) -> None:
    proc = pipelang_here("simulate", *ONE_F_ONE_B, *options.split(), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == STATE_USAGE[options]


ODD_MODEL = """
from torch import nn


def model():  # first dimensions 37, 7, 5: FSDP2 pads each to a multiple of 2
    return nn.Sequential(
        nn.Embedding(37, 10), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 5), nn.Linear(5, 37)
    )


def tied():  # the embedding and the head share their weight across the two stages
    embedding, head = nn.Embedding(37, 8), nn.Linear(8, 37, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), head)
"""

LAYOUTS = [
    "--dp 2 --shard",
    "--mixed-precision bfloat16 --optimizer adamw",
    "--model odd.py:model --dp 2 --shard --mixed-precision bfloat16",  # fp32, padded shards
    "--model odd.py:tied --dp 2",  # the tied weight's summed gradient replaces none
]
"""Each a rule of its own (the suite's time is short: `--dp 2` alone and SGD's one state
are the fast tests' arithmetic, measured in benchmarks/memory_by_layout.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_predicted_bytes_equal_the_run_measured(tmp_path: Path, layout: str) -> None:
    (tmp_path / "odd.py").write_text(ODD_MODEL)
    options = layout.split() if "--model" in layout else ["--model", "gpt:tiny", *layout.split()]
    log = tmp_path / "log.jsonl"
    run = pipelang_cmd(
        "run", *ONE_F_ONE_B, "--backend", "gloo", "--steps", "2", "--log", str(log), *options,
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    measured = json.loads(log.read_text().splitlines()[-1])
    sim = pipelang_here("simulate", *ONE_F_ONE_B, "--json", *options, cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    rows = json.loads(sim.stdout)["memory"]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert [row[key] for row in rows] == measured[key], key  # exact: the same tensors
