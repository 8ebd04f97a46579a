"""Memory the tools predict (issue 41): each process's parameter, gradient and optimizer
bytes (pipelang/sim/state.py, backends/param_shapes.py) in `simulate --model`, with
`--dp K --shard`, `--tp T`, `--optimizer` and `--mixed-precision`; and (slow) equal to
what a gloo run measures and logs (backends/metrics.py), byte for byte (`assert_predicted`,
which tests/test_tp.py's --tp runs call too)."""

from __future__ import annotations

import json
from collections.abc import Sequence
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
    tensor_part,
)
from tests.helpers import pipelang_here

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


def test_a_tensor_rank_holds_its_part_of_each_split_parameter() -> None:
    col = Param(key=1, rows=6, numel=18, itemsize=4, trained=True, split=0, size=6)
    assert tensor_part(col, 2, 1) == Param(1, 3, 9, 4, True)  # 3 of its 6 rows
    row = Param(key=2, rows=5, numel=30, itemsize=4, trained=True, split=1, size=6)
    assert tensor_part(row, 3, 0) == Param(2, 5, 10, 4, True)  # 2 of its 6 columns, all rows
    # a fused projection of 3 parts of 4 rows: 2 rows of each part
    fused = Param(key=3, rows=12, numel=24, itemsize=4, trained=True, split=0, size=12, parts=3)
    assert tensor_part(fused, 2, 0) == Param(3, 6, 12, 4, True)
    # uneven: torch.chunk's cut, unpadded (DTensor's local tensor); whole where not split
    assert tensor_part(Param(4, 5, 5, 4, True, split=0, size=5), 2, 1).numel == 2
    assert tensor_part(WEIGHT, 2, 1) == WEIGHT


def test_tensor_ranks_are_adjacent_and_shard_their_parts() -> None:
    program = compile_schedule("1f1b", {"D": "2", "N": "4"}).need_program()
    split = Param(key=1, rows=4, numel=8, itemsize=4, trained=True, split=0, size=4)
    whole = Param(key=2, rows=2, numel=2, itemsize=4, trained=True)
    model = ModelParams(((split,), (whole,)))
    # process = replica * R * T + rank * T + tensor: stage 0's 2 of 4 rows, stage 1 whole
    assert [h.params for h in rank_bytes(program, model, "sgd", tp=2)] == [16, 16, 8, 8]
    sharded = rank_bytes(program, model, "sgd", dp=2, shard=True, tp=2)
    assert [h.params for h in sharded] == [8, 8, 4, 4] * 2  # each part's 2 rows over 2


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


# gpt:tiny's and llama:tiny's stages under --tp 2, each tensor rank's part (the blocks'
# projections halved, the embedding, norms and head whole), as gloo runs
# measure them (the slow test below); under --dp 2 --shard too, each part halved again
SPLIT = {
    "--model gpt:tiny --tp 2": [374784, 374784, 367104, 367104],
    "--model llama:tiny --tp 2": [343552, 343552, 343808, 343808],
    "--model gpt:tiny --tp 2 --dp 2 --shard": [187392, 187392, 183552, 183552] * 2,
}


@pytest.mark.parametrize("layout", sorted(SPLIT))
def test_simulate_gives_each_tensor_rank_its_part(tmp_path: Path, layout: str) -> None:
    proc = pipelang_here("simulate", *ONE_F_ONE_B, *layout.split(), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["memory"]
    held = SPLIT[layout]
    assert [(r["replica"], r["rank"], r["tensor"]) for r in rows] == [
        (k, r, t) for k in range(len(held) // 4) for r in range(2) for t in range(2)
    ]
    assert [r["param_bytes"] for r in rows] == held
    assert [r["grad_bytes"] for r in rows] == held
    assert [r["optimizer_bytes"] for r in rows] == [2 * b for b in held]


def test_simulate_tp_counts_one_tensor_ranks_activations(tmp_path: Path) -> None:
    proc = pipelang_here(
        "simulate", *ONE_F_ONE_B, "--model", "gpt:tiny", "--tp", "2", cwd=tmp_path
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "predicted bytes per process (gpt:tiny, adam, split over --tp 2)" in proc.stdout
    # one tensor rank's saved activations (a gloo run counts 1,987,072 and 1,190,916:
    # benchmarks/memory_by_layout.py), not the whole stage's 3,172,928 and 1,783,812
    first = "│       0 │    0 │           0 │    374,784 │   374,784 │   749,568 │   1,987,136 │"
    last = "│       3 │    1 │           1 │    367,104 │   367,104 │   734,208 │   1,190,916 │"
    assert first in proc.stdout and last in proc.stdout, proc.stdout


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
TP_USAGE = {
    "--tp 2": "pipelang simulate: error: --tp 2 says what each process holds of the "
    "model's parameters: give --model too",
    "--tp 3 --model gpt:tiny": "pipelang simulate: error: --tp 3: gpt:tiny has 4 attention "
    "heads, which 3 tensor ranks cannot split evenly; give a --tp that divides 4",
    "--tp 2 --model gpt:tiny --mixed-precision bfloat16": "pipelang simulate: error: --tp "
    "with --mixed-precision: tensor-parallel stages keep no fp32 masters yet; run it without "
    "one of them",
    "--tp 2 --model odd.py:model": "pipelang simulate: error: --tp 2 with --model "
    "`odd.py:model`: a model of your own is split by its tp(module, mesh) hook, which "
    "simulate does not run, so what each tensor rank holds is not predicted; simulate it "
    "without --tp, or measure it with `pipelang run --tp --log`",
}


@pytest.mark.parametrize("options", sorted(TP_USAGE))
def test_simulate_tp_refuses_what_it_cannot_predict(tmp_path: Path, options: str) -> None:
    (tmp_path / "odd.py").write_text(ODD_MODEL)
    proc = pipelang_here("simulate", *ONE_F_ONE_B, *options.split(), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == TP_USAGE[options]


def test_simulate_tp_refuses_the_schedules_the_run_refuses(tmp_path: Path) -> None:
    proc = pipelang_here(
        "simulate", "zb-h1", "-p", "D=2", "-p", "N=4", "--model", "gpt:tiny", "--tp", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "pipelang simulate: error: `zb_h1` splits W off its backward (`W`): --tp does not "
        "split a tensor-parallel stage's backward yet (W would differentiate the local "
        "shards, not the DTensor parameters); use a schedule without W, such as 1f1b"
    )


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
    "--mixed-precision bfloat16 --optimizer adamw",
    "--model odd.py:model --dp 2 --shard --mixed-precision bfloat16",  # fp32, padded shards
    "--model odd.py:tied --dp 2",  # the tied weight's summed gradient replaces none
]
"""Each a rule of its own (the suite's time is short: `--dp 2` alone and SGD's one state
are the fast tests' arithmetic, measured in benchmarks/memory_by_layout.py, as are
gpt:tiny's `--dp 2 --shard`, whose rules the sharded runs here take; gpt:tiny's `--tp 2`
is the test after, with its activations; llama:tiny's `--tp 2` and gpt:tiny's `--dp 2
--shard --tp 2` are asserted on tests/test_tp.py's runs of them)."""


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_predicted_bytes_equal_the_run_measured(tmp_path: Path, layout: str) -> None:
    (tmp_path / "odd.py").write_text(ODD_MODEL)
    options = layout.split() if "--model" in layout else ["--model", "gpt:tiny", *layout.split()]
    log = tmp_path / "log.jsonl"
    run = pipelang_here(
        "run", *ONE_F_ONE_B, "--backend", "gloo", "--steps", "2", "--log", str(log), *options,
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert_predicted(tmp_path, options, json.loads(log.read_text().splitlines()[-1]))


def assert_predicted(cwd: Path, options: Sequence[str], measured: dict[str, list[int]]) -> None:
    """`pipelang simulate 1f1b -p D=2 -p N=4 OPTIONS --json` predicts each process's
    bytes as a run of that layout measured them (`measured`: its last --log line), to the
    byte: the same tensors."""
    sim = pipelang_here("simulate", *ONE_F_ONE_B, "--json", *options, cwd=cwd)
    assert sim.returncode == 0, sim.stderr
    rows = json.loads(sim.stdout)["memory"]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert [row[key] for row in rows] == measured[key], key


@pytest.mark.slow
def test_tp_bytes_and_one_tensor_ranks_activations_equal_the_run_measured() -> None:
    """gpt:tiny --tp 2 predicted and run as benchmarks/memory_by_layout.py does (the run
    counting each process's saved activations, DTensors' by their local tensors): the
    parameters, gradients and optimizer state to the byte, the activations one tensor
    rank's, measured on the stage cut to its parts (64 bytes of 1,987,072 apart on
    rank 0; equal on rank 1)."""
    from benchmarks.memory_by_layout import measured, predicted

    model, layout = ["--model", "gpt:tiny"], ["--tp", "2"]
    rows = predicted(list(ONE_F_ONE_B), model, layout)
    found = sorted(measured(list(ONE_F_ONE_B), model, layout, 2), key=lambda r: r.rank)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert [row[key] for row in rows] == [getattr(r, key) for r in found], key
    active = [
        (row["peak_activation_bytes"], r.peak_activation_bytes)
        for row, r in zip(rows, found, strict=True)
    ]
    assert all(abs(guess - got) <= 64 for guess, got in active), active
