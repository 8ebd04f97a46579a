"""The asynchronous family: `pipedream`, `pipedream-2bw`, `pipemare`, and the language's
weight versions (`weights stash | latest | K`, the update op `U`).

Oracles: the comparison table of the Chimera paper (PipeDream: weights [Mθ, D·Mθ],
activations [Ma, D·Ma], bubble ≈ 0; 2BW: 2Mθ), the per-schedule facts in
shared/reference/dsl_and_schedules.md (PipeDream: stage s stashes D - s versions;
2BW: 2 versions, delay 1; PipeMare: one version, delay ≈ 2(D - i)), and counts derived
by hand from the 1F1B order these files write (warm-up min(D-s-1, N) forwards, then F, B,
update).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pipelang import api
from pipelang.compiler import Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.export import ExportError, to_json, to_torch_csv
from pipelang.import_torch import check_pipe
from pipelang.ir import Action, CostModel, Kind, Program
from pipelang.sim.timeline import Timeline
from pipelang.weights import weight_versions
from tests.helpers import at, errors, replay, run_in_process

UNIT = CostModel((("F", None, 1.0), ("B", None, 1.0), ("C", None, 0.0)))


def program(name: str, stop: str | None = None, **params: int) -> Program:
    options = Options({k: str(v) for k, v in params.items()})
    return run_passes(api.load_file(name), options, stop).need_program()


def timeline(name: str, **params: int) -> Timeline:
    prog = program(name, **params)
    return replay(prog, prog.costs.merged(UNIT))


def pipelang(*args: str) -> subprocess.CompletedProcess[str]:
    """`pipelang ARGS` in this process (tests/test_cli.py runs the command as a process)."""
    status, out, err = run_in_process(list(args))
    return subprocess.CompletedProcess(list(args), status, out, err)


SWEEP = [(D, N) for D in (1, 2, 3, 4, 6) for N in (D, 2 * D + 1, 4 * D)]

# ---- PipeDream: weight stashing ----------------------------------------------------------


@pytest.mark.parametrize(("D", "N"), SWEEP)
def test_pipedream_stage_s_keeps_d_minus_s_versions(D: int, N: int) -> None:
    """Stage s stashes one version per micro-batch in flight, D - s in the steady state,
    which a run reaches when N >= 2(D - 1) (the in-flight forwards all came after
    distinct updates); a shorter run keeps fewer."""
    t = timeline("pipedream", D=D, N=N)
    versions = [t.peak_weight_versions(s) for s in range(D)]
    if N >= 2 * (D - 1):
        assert versions == [D - s for s in range(D)]
    else:
        assert all(1 <= v <= D - s for s, v in enumerate(versions))
    # The table: weights in [Mθ, D·Mθ], activations in [Ma, D·Ma], both ends reached.
    activations = [t.peak_activations(s) for s in range(D)]
    assert activations == [D - s for s in range(D)]
    assert min(versions) == 1 and max(versions) <= D


@pytest.mark.parametrize(("D", "N"), SWEEP)
def test_pipedream_versions_read(D: int, N: int) -> None:
    """Stage s runs min(D-s-1, N) warm-up forwards, then F(j) after j - warm updates, so
    F(j) reads version max(0, j - warm); its backward reads the same version (stashed);
    the update after B(i) applies it to version i, a delay of i - version."""
    prog = program("pipedream", D=D, N=N)
    reads = weight_versions(prog).reads
    for s in range(D):
        warm = min(D - s - 1, N)
        for j in range(N):
            version = max(0, j - warm)
            assert reads[(Kind.F, j, s, "main")] == version
            assert reads[(Kind.B, j, s, "main")] == version
    delays = weight_versions(prog).delay
    assert list(delays) == [min(D - s - 1, N - 1) for s in range(D)]


# ---- PipeDream-2BW: two versions ---------------------------------------------------------


@pytest.mark.parametrize("D", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [-1, 0, 1, 3])
def test_2bw_keeps_two_versions_and_delay_one(D: int, extra: int) -> None:
    m = D + extra
    for N in (m, 3 * m, 3 * m + 1):
        t = timeline("pipedream-2bw", D=D, N=N, m=m)
        versions = [t.peak_weight_versions(s) for s in range(D)]
        delays = [t.weight_delay(s) for s in range(D)]
        # A stage with micro-batches in flight across an update (every one but the last)
        # holds the old version for them and the new one: the double buffer, 2Mθ.
        assert versions == ([2] * (D - 1) + [1] if m < N else [1] * D)
        # W(t+1) = W(t) - lr * grad f(W(t-1)): at most one update behind.
        assert delays == ([1] * (D - 1) + [0] if m < N else [0] * D)
        updates = [sum(a.kind is Kind.U for a in actions) for actions in t.program.ranks]
        assert updates == [-(-N // m)] * D  # one per group of m, the last possibly short


@pytest.mark.parametrize("D", [3, 4, 6])
def test_2bw_too_few_microbatches_per_update_needs_a_third_version(D: int) -> None:
    """With m = D - 2, stage 0 still holds micro-batches forwarded two versions ago when it
    updates: E0314 at the `U()`, with the policy and the oldest forward labelled."""
    with pytest.raises(PipelangError) as err:
        program("pipedream-2bw", D=D, N=4 * D, m=D - 2)
    (d,) = err.value.diagnostics
    assert d.code == "E0314"
    text = d.span.source.text if d.span is not None else ""
    assert at(text, d) == "U()"
    assert "3 versions are live" in d.message and "`weights 2` allows 2" in d.message
    labelled = {text[label.span.start : label.span.end] for label in d.labels}
    assert labelled == {"weights 2", "F(warm + i)"}


# ---- PipeMare: no stash -------------------------------------------------------------------


@pytest.mark.parametrize(("D", "N"), [(D, N) for D, N in SWEEP if N >= 2 * D])
def test_pipemare_one_version_and_delay_growing_with_distance(D: int, N: int) -> None:
    t = timeline("pipemare", D=D, N=N)
    assert [t.peak_weight_versions(s) for s in range(D)] == [1] * D
    assert [t.weight_delay(s) for s in range(D)] == [D - 1 - s for s in range(D)]
    reads = weight_versions(t.program).reads
    start = {(e.action.kind, e.action.mb, e.action.stage): e.start for e in t.events}
    j = N - 1 - D  # a micro-batch in the steady state
    for s in range(D):
        # No stash: the backward reads the newest weights, D - 1 - s updates later.
        assert reads[(Kind.B, j, s, "main")] - reads[(Kind.F, j, s, "main")] == D - 1 - s
        # In time (F = B = 1): the round trip to the last stage, 2(D - s) - 1 ≈ 2(D - i).
        assert start[(Kind.B, j, s)] - start[(Kind.F, j, s)] == 2 * (D - s) - 1


# ---- no flush: one run of N micro-batches -------------------------------------------------


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw", "pipemare"])
@pytest.mark.parametrize(("D", "N"), SWEEP)
def test_bubble_is_start_up_and_drain_only(name: str, D: int, N: int) -> None:
    t = timeline(name, D=D, N=N)
    assert t.makespan == 2 * (N + D - 1)
    assert t.bubble_ratio == pytest.approx((D - 1) / (N + D - 1))


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw", "pipemare"])
def test_no_flush_and_bubble_vanishes(name: str) -> None:
    D, K = 4, 16
    t = timeline(name, D=D, N=K * D)
    assert t.bubble_ratio < 0.05
    # K synchronous iterations of D micro-batches each flush the pipeline K times.
    flushed = replay(program("1f1b", D=D, N=D), UNIT).makespan * K
    assert t.makespan == 2 * (K * D + D - 1) < flushed
    compiled = program(name, D=D, N=K * D)
    kinds = {a.kind for actions in compiled.ranks for a in actions}
    assert Kind.STEP not in kinds and Kind.ALLREDUCE not in kinds and Kind.U in kinds


def test_synchronous_schedules_report_their_copies() -> None:
    for name, params in (("1f1b", {"D": 4, "N": 8}), ("chimera", {"D": 4, "N": 4})):
        t = timeline(name, **params)
        for r in range(4):
            assert t.peak_weight_versions(r) == t.weight_copies(r)
            assert t.weight_delay(r) == 0


# ---- the IR, exports, the command line ----------------------------------------------------


def test_ir_dump_shows_updates() -> None:
    done = pipelang("compile", "pipedream", "-p", "D=2", "-p", "N=2", "--dump-after", "validate")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        "rank 0: F0@0/main F1@0/main B0@0/main U0@0/main B1@0/main U1@0/main",
        "rank 1: F0@1/main B0@1/main U0@1/main F1@1/main B1@1/main U1@1/main",
    ]
    final = program("pipedream", D=2, N=2)
    assert [a.text() for a in final.ranks[1]] == [
        "recv:F0@0/main<0",
        "F0@1/main",
        "B0@1/main",
        "send:B0@1/main>0",
        "U0@1/main",
        "recv:F1@0/main<0",
        "F1@1/main",
        "B1@1/main",
        "send:B1@1/main>0",
        "U1@1/main",
    ]


def test_update_tokens_and_json_round_trip() -> None:
    action = Action.parse("U3@1/main")
    assert (action.kind, action.mb, action.stage, action.pipeline) == (Kind.U, 3, 1, "main")
    assert action.text() == "U3@1/main"
    for name in ("pipedream", "pipedream-2bw", "pipemare"):
        prog = program(name, D=3, N=7)
        back = Program.from_json(prog.to_json())
        assert back.weights == prog.weights and back.ranks == prog.ranks
    assert json.loads(program("1f1b").to_json()).get("weights") is None


def test_export_lists_updates_and_torch_csv_refuses() -> None:
    prog = program("pipedream-2bw", D=2, N=4, m=2)
    ops = json.loads(to_json(prog))["ranks"][1]["ops"]
    assert [(o["op"], o.get("mb", o.get("update"))) for o in ops] == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("U", 0),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
        ("U", 1),
    ]
    with pytest.raises(ExportError, match="no weight update"):
        to_torch_csv(prog)


def test_simulate_json_per_rank() -> None:
    done = pipelang("simulate", "pipedream", "-p", "D=4", "-p", "N=8", "--json")
    assert done.returncode == 0, done.stderr
    ranks = json.loads(done.stdout)["ranks"]
    assert [r["peak_weight_versions"] for r in ranks] == [4, 3, 2, 1]
    assert [r["weight_delay"] for r in ranks] == [3, 2, 1, 0]


@pytest.mark.slow
def test_run_refuses_asynchronous_schedules_with_dp_before_any_rank(tmp_path: Path) -> None:
    # asynchronous schedules run (tests/test_runtime_async.py), but not with --dp
    command = ["run", "pipedream", "--model", "gpt:tiny", "--dp", "2"]
    here = Path.cwd()
    os.chdir(tmp_path)
    try:
        done = pipelang(*command)
    finally:
        os.chdir(here)
    assert done.returncode == 1
    assert done.stderr.startswith("error: `pipedream` is asynchronous (`weights stash`)")
    assert "with --dp yet" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.slow
@pytest.mark.parametrize("code", ["E0313", "E0314"])
def test_explain(code: str) -> None:
    done = pipelang("explain", code)
    assert done.returncode == 0 and "weights" in done.stdout


# ---- bad programs -------------------------------------------------------------------------

ASYNC = """\
schedule a(D: int = 2, N: int = 3) {
    weights stash
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        for i in 0..N { F(i) B(i) U() }
    }
}
"""


def test_the_base_program_is_valid() -> None:
    prog = check_pipe(ASYNC, "t.pipe").need_program()
    assert prog.weights is not None and prog.weights.text() == "stash"


def test_update_in_a_synchronous_schedule() -> None:
    text = ASYNC.replace("    weights stash\n", "")
    (d,) = errors(text)
    assert (d.code, at(text, d)) == ("E0313", "U()")
    assert "synchronous" in d.message


def test_gradient_never_applied() -> None:
    text = ASYNC.replace("for i in 0..N { F(i) B(i) U() }", "for i in 0..N { F(i) B(i) }")
    found = errors(text)
    assert [(d.code, at(text, d)) for d in found] == [("E0313", "B(i)")] * 2
    assert found[0].message == "rank 0 never applies the gradient of `B2@0/main` and 2 more"


def test_last_gradient_never_applied() -> None:
    text = ASYNC.replace(
        "for i in 0..N { F(i) B(i) U() }",
        "for i in 0..N { F(i) B(i) if i < N - 1 { U() } }",
    )
    found = errors(text)
    assert {(d.code, d.message) for d in found} == {
        ("E0313", f"rank {r} never applies the gradient of `B2@{r}/main`") for r in (0, 1)
    }


@pytest.mark.parametrize(
    ("old", "new", "code", "culprit"),
    [
        ("U()", "U(0)", "E0103", "0"),
        ("B(i) U()", "B(i) & U()", "E0103", "U()"),
        ("U()", "U(stage=1)", "E0103", "U(stage=1)"),
        ("weights stash", "weights 0", "E0314", "weights 0"),
        ("weights stash", "weights stash\n    weights latest", "E0207", "weights latest"),
        ("    order rank r {\n", "    F(1, 0) after U()\n    order rank r {\n", "E0103", "U()"),
    ],
)
def test_bad_updates_and_policies(old: str, new: str, code: str, culprit: str) -> None:
    text = ASYNC.replace(old, new, 1)
    (d,) = errors(text)
    assert (d.code, at(text, d)) == (code, culprit)


def test_update_in_a_repeat_order() -> None:
    text = """\
schedule a(D: int = 2, N: int = 2) {
    weights stash
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order repeat k every 2 {
        for s in 0..D { F(stage=s) @ s  B(stage=s) @ 2 * D - 1 - s  U(stage=s) @ 2 * D - s }
    }
}
"""
    (d,) = errors(text)
    assert (d.code, at(text, d)) == ("E0103", "U(stage=s) @ 2 * D - s")


def test_asynchronous_schedule_with_replicas() -> None:
    text = """\
schedule a(D: int = 2, N: int = 2) {
    weights latest
    pipeline down: stage s in 0..D -> rank s
    pipeline up: stage s in 0..D -> rank D - 1 - s
    microbatches 0..1 -> down, 1..2 -> up
    order rank r {
        if r == 0 { F(0, 0) F(1, 1) B(1, 1) B(0, 0) U(stage=0) U(stage=1) }
        else { F(1, 0) F(0, 1) B(0, 1) B(1, 0) U(stage=0) U(stage=1) }
    }
}
"""
    found = errors(text)
    assert [(d.code, at(text, d)) for d in found] == [("E0313", "weights latest")]


def test_one_buffer_forbids_stashing() -> None:
    """`weights 1` holds one version: fine when each micro-batch finishes before the next
    update (GPipe-like), E0314 when PipeDream's in-flight forwards would need the old one."""
    text = ASYNC.replace("weights stash", "weights 1")
    assert check_pipe(text, "t.pipe").need_program().weights is not None
    pipedream = api.load_file("pipedream").source.text.replace("weights stash", "weights 1")
    found = errors(pipedream)
    assert {d.code for d in found} == {"E0314"}
    # Ranks 0..2 of D = 4 hold forwards across their first update; rank 3 holds none.
    assert sorted(d.message.split()[6] for d in found) == ["0", "1", "2"]


def test_split_backward_keeps_the_version_until_w() -> None:
    """With `ops F, B, W`, a micro-batch holds its version until its W."""
    text = """\
schedule a(D: int = 1, N: int = 2) {
    ops F, B, W
    weights stash
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    order rank r {
        F(0) B(0) F(1) U() B(1) W(0) W(1) U()
    }
}
"""
    prog = check_pipe(text, "t.pipe").need_program()
    versions = weight_versions(prog)
    # U0 applies nothing yet (W0 has not run) but makes version 1 while F0 and F1 still
    # hold version 0: two live. W0 reads version 0, and U1 applies it to version 1.
    assert versions.peak == (2,)
    assert versions.reads[(Kind.W, 0, 0, "main")] == 0
    assert versions.delay == (1,)
