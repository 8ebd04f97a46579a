"""Sharded stages (`--dp K --shard`, issue 41): the `insert-shard` pass and its dump, the
simulator's `AG` and `RS` costs, `viz`, the refusals, and (slow) a gloo run checked
against one process, each rank holding half the parameter bytes of `--dp 2`; checkpoints
of sharded stages, resumed in the same layout, unsharded, on one copy and by another
schedule, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelang import PipelangError, api
from pipelang.ir import Action, Kind
from tests.helpers import pipelang_here, read_checkpoint

ONE_F_ONE_B = ("1f1b", "-p", "D=2", "-p", "N=4")


def test_insert_shard_dump(tmp_path: Path) -> None:
    proc = pipelang_here(
        "compile", *ONE_F_ONE_B, "--dp", "2", "--shard", "--dump-after", "insert-shard",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2:] == [
        "rank 0: gather@0/main F0@0/main F1@0/main B0@0/main F2@0/main B1@0/main F3@0/main "
        "B2@0/main B3@0/main reduce_scatter@0/main",
        "rank 1: gather@1/main F0@1/main B0@1/main F1@1/main B1@1/main F2@1/main B2@1/main "
        "F3@1/main B3@1/main reduce_scatter@1/main",
    ]


def test_insert_shard_lowered_program_keeps_the_reduce_after_the_sends() -> None:
    program = api.compile_schedule("1f1b", {"D": "2", "N": "2"}, dp=2, shard=2).need_program()
    assert [a.text() for a in program.ranks[1][-3:]] == [
        "send:B1@1/main>0",
        "reduce_scatter@1/main",
        "step",
    ]


def test_interleaved_gathers_each_copy_before_its_first_op() -> None:
    program = api.compile_schedule(
        "interleaved-1f1b", {"D": "2", "N": "4", "v": "2"}, dp=2, shard=2, stop_after="insert-shard"
    ).need_program()
    for rank, actions in enumerate(program.ranks):
        for stage in (rank, rank + 2):
            gather = actions.index(Action(Kind.GATHER, None, stage, "main"))
            first = min(i for i, a in enumerate(actions) if a.kind.is_compute and a.stage == stage)
            assert gather == first - 1
            reduce = actions.index(Action(Kind.REDUCE_SCATTER, None, stage, "main"))
            last = max(i for i, a in enumerate(actions) if a.kind is Kind.B and a.stage == stage)
            assert reduce == last + 1


@pytest.mark.parametrize("sched", ["1f1b", "gpipe", "zb-h1", "chimera", "bpipe"])
def test_without_shard_no_op_is_added(sched: str) -> None:
    holds = api.compile_schedule(sched, stop_after="insert-holds").need_program()
    shard = api.compile_schedule(sched, dp=2, stop_after="insert-shard").need_program()
    assert shard.dump() == holds.dump()


def test_shard_tokens_read_back() -> None:
    for token in ("gather@1/main", "reduce_scatter@0/up"):
        assert Action.parse(token).text() == token


def test_simulate_times_the_gather_and_the_reduce_scatter(tmp_path: Path) -> None:
    def makespan(*more: str) -> float:
        proc = pipelang_here(
            "simulate", *ONE_F_ONE_B, "--cost", "AG=1,RS=2", "--json", *more, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr
        return float(json.loads(proc.stdout)["makespan"])

    assert makespan() == 10  # F = B = 1: 1F1B at D = 2, N = 4
    assert makespan("--dp", "2") == 10
    # AG before rank 0's first F delays everything by 1; RS after rank 0's last B by 2
    assert makespan("--dp", "2", "--shard") == 13


def test_viz_draws_the_shard_ops(tmp_path: Path) -> None:
    proc = pipelang_here(
        "viz", *ONE_F_ONE_B, "--dp", "2", "--shard", "--cost", "AG=1,RS=2", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "one_f_one_b(D=2, N=4): simulated · makespan 13 · bubble ratio 0.154 · costs F=1 B=1 "
        "C=0 AG=1 RS=2",
        "rank 0 | AG F0 F1 .  B0 F2 B1 F3 B2 .  B3 RS -",
        "rank 1 | AG .  F0 B0 F1 B1 F2 B2 F3 B3 RS -  .",
    ]
    out = tmp_path / "v.json"
    assert pipelang_here("viz", *ONE_F_ONE_B, "--dp", "2", "--shard", "-o", str(out),
                         cwd=tmp_path).returncode == 0  # fmt: skip
    names = {e.get("name") for e in json.loads(out.read_text())["traceEvents"]}
    assert {"gather@0/main", "reduce_scatter@1/main"} <= names


# ---- refusals ---------------------------------------------------------------------------


def test_shard_without_dp_is_a_usage_error(tmp_path: Path) -> None:
    for command in (["simulate"], ["compile", "--dump-after", "insert-shard"], ["viz"]):
        proc = pipelang_here(*command, *ONE_F_ONE_B, "--shard", cwd=tmp_path)
        assert proc.returncode == 2
        assert proc.stderr.strip().endswith(
            "--shard shards each stage over its --dp copies: give --dp 2 or more with it"
        ), proc.stderr


REFUSED = {
    "zb-h1": "`zb_h1` splits W off its backward (`W`): --shard does not split a sharded "
    "stage's backward yet (its W would read the gathered weights after B); use a schedule "
    "without W, such as 1f1b",
    "chimera": "`chimera` has 2 pipelines (`down`, `up`): --shard shards each stage over its "
    "--dp copies only; a stage with replicas in the schedule is not sharded yet; use a "
    "schedule of one pipeline",
    "pipedream": "`pipedream` is asynchronous (`weights stash`) and updates its stages with "
    "`U`: --shard sums the gradients once per step, and an asynchronous schedule updates "
    "its stages at each `U` instead; use a synchronous schedule",
    "bpipe": "`bpipe` evicts activations to partner ranks (`E2@0/main>3`): --shard does not "
    "evict a sharded stage's activations yet",
}


@pytest.mark.parametrize("sched", sorted(REFUSED))
def test_schedules_the_runtime_cannot_shard_are_refused(sched: str) -> None:
    with pytest.raises(PipelangError) as caught:
        api.compile_schedule(sched, dp=2, shard=2, stop_after="insert-shard")
    (diagnostic,) = caught.value.diagnostics
    assert diagnostic.code == "E0321"
    assert diagnostic.message == REFUSED[sched]


RUN = ("run", *ONE_F_ONE_B, "--dp", "2", "--shard", "--steps", "1")

RUN_REFUSED = {
    "--backend local": "error: --shard needs a process per rank (FSDP2 shards over process "
    "groups): use --backend gloo or nccl, not local",
}


@pytest.mark.parametrize("options", sorted(RUN_REFUSED))
def test_run_refuses_what_sharding_does_not_take_yet(tmp_path: Path, options: str) -> None:
    proc = pipelang_here(*RUN, *options.split(), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == RUN_REFUSED[options]


def test_run_shard_without_dp_is_a_usage_error(tmp_path: Path) -> None:
    proc = pipelang_here("run", *ONE_F_ONE_B, "--shard", "--backend", "gloo", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pipelang run: error: --shard shards each stage over its --dp copies: give --dp 2 or "
        "more with it"
    )


@pytest.mark.slow
def test_sharded_1f1b_over_gloo_checks_bit_for_bit_holding_half_the_bytes(tmp_path: Path) -> None:
    def run(*more: str) -> dict[str, list[int]]:
        log = tmp_path / f"log{len(more)}.jsonl"
        proc = pipelang_here(
            "run", *ONE_F_ONE_B, "--dp", "2", "--backend", "gloo", "--steps", "2", "--check",
            "--log", str(log), *more, cwd=tmp_path, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "check OK" in proc.stdout and "(bitwise equal)" in proc.stdout, proc.stdout
        last = json.loads(log.read_text().splitlines()[-1])
        return {key: last[key] for key in ("param_bytes", "grad_bytes", "optimizer_bytes")}

    whole, sharded = run(), run("--shard")
    for key, each in whole.items():
        # the shards of gpt:tiny's stages: half, but for the padding of odd first dimensions
        assert [2 * b for b in sharded[key]] == pytest.approx(each, rel=0.01), key


# ---- --clip-grad ------------------------------------------------------------------------


def gloo(*args: str, cwd: Path) -> str:
    """`pipelang run ARGS --backend gloo` (its ranks processes; the launcher this one); its
    standard output."""
    proc = pipelang_here("run", *args, "--backend", "gloo", cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def same_state(one: Path, two: Path) -> None:
    """Checkpoints `one` and `two` hold the same entries, bit for bit."""
    first, second = read_checkpoint(one), read_checkpoint(two)
    assert sorted(first) == sorted(second)
    assert any(key.endswith(".exp_avg_sq") for key in first)  # Adam's state is there
    assert [k for k in first if not torch.equal(first[k], second[k])] == []


def test_the_norm_of_sharded_gradients_counts_each_copys_shard() -> None:
    """--check repeats the norm as the sharded run takes it: each data-parallel copy of a
    stage's first rank counts its dim-0 piece of each gradient (FSDP2's cut)."""
    from pipelang.backends.summation import accumulation, shard_piece

    program = api.compile_schedule("1f1b", {"D": "2", "N": "2"}, dp=2, shard=2).need_program()
    whole, sharded = accumulation(program, 2), accumulation(program, 2, shard=True)
    assert whole is not None and sharded is not None
    assert (whole.norms, whole.shards) == ([[0], [1], [], []], 1)
    assert (sharded.norms, sharded.shards) == ([[0], [1], [0], [1]], 2)
    grad = torch.arange(15.0).reshape(3, 5)
    assert [shard_piece(grad, k, 2).tolist() for k in (0, 1)] == [
        grad[:2].tolist(),
        grad[2:].tolist(),
    ]
    assert shard_piece(torch.ones(1), 1, 2).shape == (0,)  # FSDP2 leaves copy 1 empty


@pytest.mark.slow
def test_clip_grad_on_sharded_stages_checks_bit_for_bit(tmp_path: Path) -> None:
    """The global norm is the sum of every copy's shards' squares (each stage counted
    once), and --check's reference, which clips by the same sum, agrees bit for bit; the
    norm is far above 0.05, so every step clips."""
    log = tmp_path / "log.jsonl"
    clip = ("--clip-grad", "0.05", "--log", str(log), "--check")
    out = gloo(*ONE_F_ONE_B, "--dp", "2", "--shard", "--steps", "2", *clip, cwd=tmp_path)
    assert "check OK" in out and "(bitwise equal)" in out, out
    norms = [json.loads(line)["grad_norm"] for line in log.read_text().splitlines()]
    assert len(norms) == 2 and min(norms) > 1


# ---- --mixed-precision -------------------------------------------------------------------


@pytest.mark.slow
def test_mixed_precision_shards_the_fp32_masters(tmp_path: Path) -> None:
    """--mixed-precision with --shard: the shards are the fp32 masters, gathered in bf16;
    --check is bitwise, and the checkpoint (fp32 masters, Adam's state) is bit for bit
    the unsharded --dp 2 run's."""
    mixed = ("--mixed-precision", "bfloat16", "--steps", "2")
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    out = gloo(*ONE_F_ONE_B, "--dp", "2", "--shard", *mixed, "--check", "--save", str(sharded),
               cwd=tmp_path)  # fmt: skip
    assert "check OK" in out and "(bitwise equal)" in out, out
    gloo(*ONE_F_ONE_B, "--dp", "2", *mixed, "--save", str(plain), cwd=tmp_path)
    same_state(sharded / "step-2", plain / "step-2")
    assert read_checkpoint(sharded / "step-2")["model.7.lm.weight"].dtype == torch.float32


# ---- checkpoints ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps of 1F1B with --dp 2 --shard, saved after steps 2 and 4."""
    path = tmp_path_factory.mktemp("sharded")
    run = (*ONE_F_ONE_B, "--dp", "2", "--shard", "--steps", "4", "--save-every", "2")
    gloo(*run, "--save", str(path / "ckpt"), cwd=path)
    return path / "ckpt"


@pytest.mark.slow
def test_sharded_checkpoints_resume_bit_for_bit_sharded_or_not(
    sharded: Path, tmp_path: Path
) -> None:
    """Each process writes its shards of every entry, named as in the whole model; the
    run resumed from step 2, sharded or not (the same sums at K = 2), ends at step 4
    with the parameters and optimizer state of the run that did not stop."""
    from pipelang.backends.checkpoint_read import read_metadata

    entries = read_metadata(sharded / "step-2").state_dict_metadata
    qkv = entries["optim.1.qkv.weight.exp_avg"]
    assert [(list(c.offsets), list(c.sizes)) for c in qkv.chunks] == [  # type: ignore[union-attr]
        ([0, 0], [96, 64]),
        ([96, 0], [96, 64]),
    ]
    assert len(list((sharded / "step-2").glob("*.distcp"))) == 4  # one file per process
    plain = tmp_path / "plain"
    gloo(*ONE_F_ONE_B, "--dp", "2", "--steps", "2", "--save", str(plain), cwd=tmp_path)
    same_state(sharded / "step-2", plain / "step-2")
    for name, source, more in [
        ("same", sharded / "step-2", ["--shard"]),
        ("unsharded", sharded / "step-2", []),
        ("sharded", plain / "step-2", ["--shard"]),
    ]:
        resumed = ("--steps", "4", "--resume", str(source), "--save", str(tmp_path / name))
        gloo(*ONE_F_ONE_B, "--dp", "2", *more, *resumed, cwd=tmp_path)
        same_state(sharded / "step-4", tmp_path / name / "step-4")


@pytest.mark.slow
def test_sharded_checkpoints_resume_on_one_copy_and_another_schedule(
    sharded: Path, tmp_path: Path
) -> None:
    """--dp 2 --shard resumed with --dp 1, and --dp 1 resumed by GPipe and interleaved
    1F1B with --dp 2 --shard: each rank reads its part, and --check's reference, which
    resumes the same checkpoint in one process, agrees bit for bit."""
    one = tmp_path / "one"
    resumed = ("--steps", "3", "--resume", str(sharded / "step-2"), "--check")
    out = gloo(*ONE_F_ONE_B, *resumed, "--save", str(one), cwd=tmp_path)
    assert "check OK" in out and "(bitwise equal)" in out, out
    for schedule in (("gpipe",), ("interleaved-1f1b", "-p", "v=2")):
        resumed = ("--steps", "4", "--resume", str(one / "step-3"), "--check")
        sizes = ("-p", "D=2", "-p", "N=4", "--dp", "2", "--shard")
        out = gloo(*schedule, *sizes, *resumed, cwd=tmp_path)
        assert "check OK" in out and "(bitwise equal)" in out, out
