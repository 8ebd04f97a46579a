"""The runtime on a GPU: the CUDA paths that the CPU suite cannot reach.

Every test here is marked `gpu` and skips without CUDA (`pytest -m gpu` runs only these).
A skip is not evidence: these have to pass on a machine with a GPU before the CUDA
paths count as working. On one GPU the multi-rank schedules use the `local` backend
(every rank a thread of one process with its own CUDA stream; a message is a device
copy ordered by events); `nccl` needs a GPU per rank.

Oracle: `--check`, a single-process training run of the same model on the same
micro-batches, whose weights and losses the pipelined run must match.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run, stdlib

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEDULES = {
    "1f1b-D4-N8": ("1f1b", {"D": 4, "N": 8}),
    "chimera-D4-N8": ("chimera", {"D": 4, "N": 8}),
    "zb-h1-D4-N8": ("zb-h1", {"D": 4, "N": 8}),
    "interleaved-1f1b-D2-N4": ("interleaved-1f1b", {"D": 2, "N": 4, "v": 2}),
    "dualpipev-D2-N4": ("dualpipev", {"D": 2, "N": 4}),
    "chimera-fwd-double-D2-N4": ("chimera-fwd-double", {"D": 2, "N": 4}),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_local_on_cuda_matches_one_process(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    name, params = SCHEDULES[case]
    status = run(stdlib(name, **params), "--backend", "local", "--check", "--steps", "3")
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out


def test_local_on_cuda_with_data_parallel_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    program = stdlib("1f1b", D=2, N=4)
    status = run(program, "--backend", "local", "--dp", "2", "--check", "--optimizer", "adam")
    assert status == 0, capsys.readouterr().out


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_a_split_schedule_on_cuda_holds_what_simulate_says_and_frees_each_step(
    name: str,
) -> None:
    """On the GPU, as on the CPU (tests/test_weight_split.py, test_runtime.py): each
    rank's peak bytes of saved activations are `simulate --model`'s, and nothing of a
    step outlives it: the device memory after 2 and after 6 steps is the same."""
    import gc

    from pipelang.backends.config import RunConfig
    from pipelang.backends.local import run_local
    from pipelang.backends.measure import activation_peaks
    from pipelang.backends.models import plan_stages

    program = stdlib(name, D=4, N=8)
    left = []
    for steps in (2, 6):
        config = RunConfig(backend="local", steps=steps, count_activations=True)
        shapes = plan_stages(config.spec, program.num_stages, None).shapes
        outcome = run_local(program, config, shapes, lambda *_: None)
        measured = [r.peak_activation_bytes for r in outcome.results]
        assert measured == pytest.approx(activation_peaks(config.spec, program, program.costs))
        del outcome
        gc.collect()
        torch.cuda.synchronize()
        left.append(torch.cuda.memory_allocated())
    assert left[1] <= left[0]


def test_local_on_cuda_in_bfloat16_runs(capsys: pytest.CaptureFixture[str]) -> None:
    status = run(stdlib("chimera", D=4, N=4), "--backend", "local", "--dtype", "bfloat16")
    out = capsys.readouterr().out
    assert status == 0, out
    assert "steps/s" in out


def test_trace_on_cuda_has_every_action_in_order(tmp_path: Path) -> None:
    program = stdlib("1f1b", D=2, N=4)
    trace = tmp_path / "trace.json"
    assert run(program, "--backend", "local", "--steps", "2", "--trace", str(trace)) == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank, actions in enumerate(program.ranks):
        mine = [e for e in events if e["pid"] == rank]
        assert [e["name"] for e in mine] == [a.text() for a in actions] * 2
        assert all(e["dur"] >= 0 for e in mine)


GRAPHS = {
    "1f1b-D4-N8": ("1f1b", {"D": 4, "N": 8}),
    "interleaved-1f1b-D2-N4": ("interleaved-1f1b", {"D": 2, "N": 4, "v": 2}),
    "zbv-D2-N4": ("zbv", {"D": 2, "N": 4}),
    "chimera-D4-N4": ("chimera", {"D": 4, "N": 4}),
}


@pytest.mark.parametrize("model", ["gpt:tiny", "gpt:small"])
@pytest.mark.parametrize("case", list(GRAPHS))
def test_local_graphs_on_cuda_match_one_process(
    case: str, model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank's stream program in one process, one CUDA graph: 3 eager steps, one
    capture, replays; weights and losses match one process."""
    name, params = GRAPHS[case]
    options = ("--backend", "local", "--graphs", "--check", "--steps", "6", "--model", model)
    status = run(stdlib(name, **params), *options)
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    assert "captured as one CUDA graph" in captured.err
    assert "check OK" in captured.out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs a GPU per rank")
def test_nccl_matches_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    program = stdlib("1f1b", D=2, N=4)
    assert run(program, "--backend", "nccl", "--check") == 0
    assert "check OK" in capsys.readouterr().out


def test_nccl_graphs_capture_a_one_rank_iteration(capsys: pytest.CaptureFixture[str]) -> None:
    """`--graphs` over nccl on one GPU: a one-rank program (NCCL refuses two ranks on one
    GPU), 3 eager steps, one capture of the whole iteration with the capturable Adam,
    replays; the weights match one process."""
    program = stdlib("1f1b", D=1, N=4)
    status = run(program, "--backend", "nccl", "--graphs", "--check", "--steps", "6")
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_graphs_capture_sends_and_receives(capsys: pytest.CaptureFixture[str]) -> None:
    status = run(
        stdlib("1f1b", D=2, N=4), "--backend", "nccl", "--graphs", "--check", "--steps", "6"
    )
    assert status == 0, capsys.readouterr().out


# ---- training options on a GPU (issue 17): bf16 masters, clipping, checkpoints ----------


@pytest.mark.parametrize("graphs", [(), ("--graphs",)])
def test_local_on_cuda_mixed_precision_and_clipping_match_one_process(
    graphs: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16 compute with fp32 masters and a global-norm clip; with --graphs the clip's
    sum and the master updates are inside the captured iteration."""
    options = ("--backend", "local", "--mixed-precision", "bfloat16", "--clip-grad", "0.5")
    status = run(stdlib("chimera", D=4, N=4), *options, *graphs, "--check", "--steps", "5")
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out


def test_nccl_one_rank_saves_and_resumes_in_graph_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP over an NCCL process group with CUDA tensors; the resumed run loads into the
    static tensors a captured graph then replays (capturable Adam, masters, clipping)."""
    program = stdlib("1f1b", D=1, N=4)
    options = ("--backend", "nccl", "--graphs", "--mixed-precision", "bfloat16")
    options += ("--clip-grad", "1.0")
    assert run(program, *options, "--steps", "4", "--save", str(tmp_path)) == 0
    capsys.readouterr()
    resumed = ("--steps", "8", "--resume", str(tmp_path), "--check")
    assert run(program, *options, *resumed) == 0
    assert "check OK" in capsys.readouterr().out


def test_a_plan_from_this_gpus_profile_runs_on_it(tmp_path: Path) -> None:
    """Issue 20's GPU topology example, end to end: profile `gpt:small` on this GPU,
    plan it for a node of two GPUs of this kind (no note that the profile is from
    another kind), and run the written plan on the local backend against one process."""
    from tests.helpers import pipelang_cmd

    proc = pipelang_cmd(
        "profile", "--model", "gpt:small", "--device", "cuda", "--repeats", "3",
        "-o", "p.json", cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "t.yaml").write_text(
        f"nodes: 1\ngpus_per_node: 2\nmemory: 40GiB\nkind: {torch.cuda.get_device_name()}\n"
        "intra_node: {bandwidth: 300GB/s, latency: 2us}\n"
    )
    proc = pipelang_cmd(
        "plan", "--profile", "p.json", "--topology", "t.yaml", "--micro-batches", "8",
        "-o", "best.pipe", cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "another kind" not in proc.stderr
    proc = pipelang_cmd(
        "run", "best.pipe", "--model", "gpt:small", "--backend", "local", "--check",
        "--steps", "3", cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "predicted" in proc.stdout + proc.stderr
