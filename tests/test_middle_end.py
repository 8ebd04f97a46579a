"""build-dag, insert-comms and insert-sync on Programs built straight from IR text, and
the lowered stdlib schedules whose ranks consume transfers out of send order."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pipelang import api
from pipelang.compiler import Options, run_passes
from pipelang.ir import Action, Kind, Program
from pipelang.ir.graph import build_dag, op_graph
from pipelang.passes import insert_comms as insert_comms_module
from pipelang.passes.insert_sync import _deadlocks, insert_sync
from pipelang.passes.validate import validate
from pipelang.passes.validate.lowered import check_lowered
from tests.helpers import chimera_4, gpipe, interleaved, one_f_one_b, program_from_dump, with_comms

# ---- build-dag -----------------------------------------------------------------------------


def edges(program: Program) -> set[tuple[str, str, str]]:
    dag = build_dag(program)
    action = dag.nodes.data("action")
    return {(action[u].text(), action[v].text(), why) for u, v, why in dag.edges(data="why")}


def test_dag_of_1f1b_d2_n1_has_order_and_data_edges() -> None:
    program = program_from_dump(["F0@0/main B0@0/main", "F0@1/main B0@1/main"])
    assert edges(program) == {
        ("F0@0/main", "B0@0/main", "data"),  # also program order; data wins
        ("F0@1/main", "B0@1/main", "data"),
        ("F0@0/main", "F0@1/main", "data"),
        ("B0@1/main", "B0@0/main", "data"),
    }


def test_dag_nodes_carry_rank_and_step() -> None:
    dag = build_dag(program_from_dump(one_f_one_b(2, 2)))
    nodes = {
        data["action"].text(): (data["rank"], data["step"]) for _, data in dag.nodes(data=True)
    }
    assert nodes["B0@0/main"] == (0, 2)
    assert nodes["F1@1/main"] == (1, 2)
    assert dag.number_of_nodes() == 8


def test_dag_order_edges_link_consecutive_ops_of_a_rank() -> None:
    found = edges(program_from_dump(one_f_one_b(2, 2)))
    order = {(u, v) for u, v, why in found if why == "order"}
    assert order == {
        ("F0@0/main", "F1@0/main"),
        ("F1@0/main", "B0@0/main"),
        ("B0@0/main", "B1@0/main"),
        ("B0@1/main", "F1@1/main"),
    }


def test_dag_split_backward_and_recompute_edges() -> None:
    program = program_from_dump(["F0@0/main R0@0/main B0@0/main W0@0/main"], kinds="FBWR")
    assert edges(program) == {
        ("F0@0/main", "R0@0/main", "data"),
        ("R0@0/main", "B0@0/main", "data"),
        ("F0@0/main", "B0@0/main", "data"),
        ("B0@0/main", "W0@0/main", "data"),
    }


def test_dag_data_edges_match_inputs_of() -> None:
    lines = [
        "F0@0/main F1@0/main R0@0/main B0@0/main W0@0/main R1@0/main B1@0/main W1@0/main",
        "F0@1/main R0@1/main B0@1/main F1@1/main R1@1/main B1@1/main W0@1/main W1@1/main",
    ]
    program = program_from_dump(lines, kinds="FBWR")
    dag = build_dag(program)
    action = dag.nodes.data("action")
    for node in dag.nodes:
        data_inputs = {action[u] for u, _, why in dag.in_edges(node, data="why") if why == "data"}
        assert data_inputs == set(program.inputs_of(action[node])), action[node]


def test_dag_after_edges_and_absent_endpoints() -> None:
    program = program_from_dump(
        ["F0@0/main B0@0/main", "F0@1/main"],  # B0@1 is missing: no edge to or from it
        after=[("F0@1/main", "B0@0/main")],
    )
    assert edges(program) == {
        ("F0@0/main", "B0@0/main", "data"),
        ("F0@0/main", "F0@1/main", "data"),
        ("F0@1/main", "B0@0/main", "after"),
    }


# ---- insert-comms --------------------------------------------------------------------------

GOLDEN_1F1B_D2_N2 = """\
rank 0: F0@0/main send:F0@0/main>1 F1@0/main send:F1@0/main>1 recv:B0@1/main<1 B0@0/main \
recv:B1@1/main<1 B1@0/main
rank 1: recv:F0@0/main<0 F0@1/main B0@1/main send:B0@1/main>0 recv:F1@0/main<0 F1@1/main \
B1@1/main send:B1@1/main>0"""


def test_insert_comms_1f1b_d2_n2_golden() -> None:
    assert with_comms(program_from_dump(one_f_one_b(2, 2))).dump() == GOLDEN_1F1B_D2_N2


def test_insert_comms_keeps_spans() -> None:
    program = program_from_dump(one_f_one_b(2, 2))
    out = with_comms(program)
    send = out.ranks[0][1]
    recv = out.ranks[1][0]
    assert send.text() == "send:F0@0/main>1" and send.span == program.ranks[0][0].span
    assert recv.text() == "recv:F0@0/main<0" and recv.span == program.ranks[1][0].span


def channel_traffic(program: Program) -> dict[tuple[int, int, str], list[str]]:
    """(src, dst, 'sent' | 'received') -> the ops named, in order."""
    traffic: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    for rank, actions in enumerate(program.ranks):
        for a in actions:
            if a.kind in (Kind.SEND, Kind.SIGNAL):
                traffic[(rank, a.peer, "sent")].append(a.op().text())
            elif a.kind in (Kind.RECV, Kind.WAIT):
                traffic[(a.peer, rank, "received")].append(a.op().text())
    return traffic


CASES = {
    "chimera D=4 N=4": chimera_4(),
    "1f1b D=4 N=8": program_from_dump(one_f_one_b(4, 8)),
    "gpipe D=3 N=5": program_from_dump(gpipe(3, 5)),
    "interleaved D=4 N=8 v=2": program_from_dump(
        interleaved(4, 8, 2), pipelines={"main": [s % 4 for s in range(8)]}
    ),
}


@pytest.mark.parametrize("program", CASES.values(), ids=CASES.keys())
def test_insert_comms_channels_are_fifo(program: Program) -> None:
    traffic = channel_traffic(with_comms(program))
    channels = {(src, dst) for src, dst, _ in traffic}
    assert channels
    for src, dst in channels:
        assert traffic[(src, dst, "sent")] == traffic[(src, dst, "received")], (src, dst)


@pytest.mark.parametrize("program", CASES.values(), ids=CASES.keys())
def test_insert_comms_moves_every_cross_rank_input(program: Program) -> None:
    out = with_comms(program)
    for rank, actions in enumerate(out.ranks):
        received: set[str] = set()
        for i, a in enumerate(actions):
            if a.kind is Kind.RECV:
                received.add(a.op().text())
            if not a.kind.is_compute:
                continue
            for needed in program.inputs_of(a):
                if program.rank_of(needed.stage or 0, needed.pipeline or "") != rank:
                    assert needed.text() in received, (rank, a.text(), needed.text())
            sends = [b for b in actions[i + 1 :] if b.kind is Kind.SEND and b.op() == a]
            for send in sends:
                assert actions.index(send) <= i + len(sends), "sends follow their producer"


def test_insert_comms_after_dependency_becomes_signal_and_wait() -> None:
    program = program_from_dump(one_f_one_b(2, 2), after=[("B0@0/main", "F1@1/main")])
    out = with_comms(program).dump().splitlines()
    assert "B0@0/main signal:B0@0/main>1 recv:B1@1/main<1" in out[0]
    # Both transfers from rank 0 feed F1@1: they are received in channel order.
    assert "recv:F1@0/main<0 wait:B0@0/main<0 F1@1/main" in out[1]
    assert validate(program, op_graph(program), None) == []


def test_insert_comms_sends_once_per_receiving_rank() -> None:
    program = program_from_dump(
        one_f_one_b(2, 1), after=[("F0@0/main", "B0@1/main")]
    )  # F0@1 and B0@1 both wait for F0@0
    out = with_comms(program)
    assert [a.text() for a in out.ranks[0]].count("send:F0@0/main>1") == 1
    assert [a.text() for a in out.ranks[0] if a.kind is Kind.SIGNAL] == []
    assert out.ranks[1][0].text() == "recv:F0@0/main<0"


def test_insert_comms_same_rank_dependencies_get_nothing() -> None:
    program = program_from_dump(
        ["F0@0/main F0@1/main B0@1/main B0@0/main"], pipelines={"main": (0, 0)}
    )
    assert with_comms(program).ranks == program.ranks


def test_insert_comms_output_parses_back() -> None:
    out = with_comms(chimera_4())
    for actions in out.ranks:
        assert tuple(Action.parse(a.text()) for a in actions) == actions


RECEIVED_OUT_OF_ORDER = [
    "F0@0/main F1@0/main F2@0/main B0@0/main B1@0/main B2@0/main",
    "F1@1/main F0@1/main F2@1/main B2@1/main B0@1/main B1@1/main",
]


def test_insert_comms_receives_in_send_order() -> None:
    """The recv of message k goes before the first consumer of k or of any later message:
    rank 1 needs F1 first, so F0 is received before F1@1 too; rank 0 needs B2 last but
    it is sent first, so it is received before B0@0."""
    out = with_comms(program_from_dump(RECEIVED_OUT_OF_ORDER)).dump().splitlines()
    assert out == [
        "rank 0: F0@0/main send:F0@0/main>1 F1@0/main send:F1@0/main>1 F2@0/main "
        "send:F2@0/main>1 recv:B2@1/main<1 recv:B0@1/main<1 B0@0/main recv:B1@1/main<1 "
        "B1@0/main B2@0/main",
        "rank 1: recv:F0@0/main<0 recv:F1@0/main<0 F1@1/main F0@1/main recv:F2@0/main<0 "
        "F2@1/main B2@1/main send:B2@1/main>0 B0@1/main send:B0@1/main>0 B1@1/main "
        "send:B1@1/main>0",
    ]


def test_receiving_before_each_consumer_would_cross(monkeypatch: pytest.MonkeyPatch) -> None:
    """Receiving right before each consumer would cross; `check_lowered` catches it, and
    the real placement passes it."""
    program = program_from_dump(RECEIVED_OUT_OF_ORDER)
    assert check_lowered(with_comms(program)) == []
    monkeypatch.setattr(
        insert_comms_module,
        "_receive_steps",
        lambda graph, sent: [graph.steps[m.consumer] for m in sent],
    )
    mismatches = check_lowered(with_comms(program))
    assert mismatches and {m.code for m in mismatches} == {"E0307"}
    assert any(m.message.startswith("transfers from rank 1 to rank 0 ") for m in mismatches)


# ---- insert-sync ---------------------------------------------------------------------------


def test_insert_sync_chimera_eager_allreduce_for_every_replicated_copy() -> None:
    out = insert_sync(with_comms(chimera_4())).dump().splitlines()
    # Rank 0 holds stage 0 of `down` and stage 3 of `up`: stage 3 finishes first (after
    # B3u) and syncs there, stage 0 at the end (Chimera Fig. 4b).
    assert " B3@3/up send:B3@3/up>1 allreduce@3/up recv:B0@1/down<1 " in out[0]
    assert out[0].endswith(" B1@0/down allreduce@0/down step")
    assert out[3].endswith(" B3@0/up allreduce@0/up step")
    for rank, line in enumerate(out):
        tokens = line.split()
        allreduces = sorted(t for t in tokens if t.startswith("allreduce"))
        expected = sorted(f"allreduce@{s}/{p}" for s, p in chimera_4().stage_copies(rank))
        assert allreduces == expected
        assert tokens[-1] == "step" and tokens.count("step") == 1


def test_insert_sync_single_pipeline_gets_only_a_step() -> None:
    program = with_comms(program_from_dump(one_f_one_b(3, 4)))
    out = insert_sync(program)
    for before, after in zip(program.ranks, out.ranks, strict=True):
        assert after == (*before, Action(Kind.STEP))


def allreduce_stages(program: Program, rank: int) -> list[int | None]:
    return [a.stage for a in program.ranks[rank] if a.kind is Kind.ALLREDUCE]


def test_insert_sync_makes_conflicting_orders_agree() -> None:
    # Rank 0 finishes stage 1 (of `b`) first, rank 1 finishes stage 0 (of `b`) first;
    # both ranks are in both allreduce groups, so eager sync would cross.
    program = program_from_dump(
        ["F0@0/a F1@1/b B1@1/b B0@0/a", "F1@0/b F0@1/a B1@0/b B0@1/a"],
        pipelines={"a": (0, 1), "b": (1, 0)},
        assignment=("a", "b"),
    )
    assert validate(program, op_graph(program), None) == []
    out = insert_sync(with_comms(program))
    assert allreduce_stages(out, 0) == allreduce_stages(out, 1) == [1, 0]
    assert not _deadlocks(out.ranks)


def test_deadlock_check_sees_allreduces_in_opposite_orders() -> None:
    crossed = [
        (Action.parse("allreduce@0/a"), Action.parse("allreduce@1/b")),
        (Action.parse("allreduce@1/a"), Action.parse("allreduce@0/b")),
    ]
    assert _deadlocks(crossed)
    assert not _deadlocks([crossed[0], crossed[0]])


# ---- stdlib schedules, lowered: channels match and nothing deadlocks -----------------------

LOWERED = [
    *(("zbv", dict(D=D, N=N), True) for D in range(2, 7) for N in range(2 * D, 3 * D + 1)),
    *(("interleaved-zb", dict(D=2, N=N, v=v), True) for N in (4, 6) for v in (2, 3)),
    ("interleaved-zb", dict(D=4, N=8, v=2), False),
    *(("chimera", dict(D=D, N=D, f=f), False) for D in (4, 8) for f in (1, 2)),
    ("1f1b", dict(D=4, N=8), False),
    ("interleaved-1f1b", dict(D=4, N=8, v=2), False),
]


def hoisted(program: Program) -> int:
    """How many recvs stand before a compute op that does not consume them."""
    count = 0
    for actions in program.ranks:
        for i, a in enumerate(actions):
            if a.kind is Kind.RECV:
                consumer = next(b for b in actions[i + 1 :] if b.kind.is_compute)
                count += a.op() not in program.inputs_of(consumer)
    return count


@pytest.mark.parametrize(
    ("name", "params", "crosses"),
    LOWERED,
    ids=[f"{n}-" + "-".join(f"{k}{v}" for k, v in p.items()) for n, p, _ in LOWERED],
)
def test_lowered_stdlib_does_not_deadlock(name: str, params: dict[str, int], crosses: bool) -> None:
    """zbv and interleaved-zb at D=2 consume out of send order (their recvs are hoisted);
    the lowered program, sends, recvs and allreduce meetings included, still runs."""
    options = Options({k: str(v) for k, v in params.items()})
    lowered = run_passes(api.load_file(name), options, "insert-comms").need_program()
    assert (hoisted(lowered) > 0) == crosses
    assert check_lowered(lowered) == []
    assert not _deadlocks(lowered.ranks)
    assert not _deadlocks(insert_sync(lowered).ranks)


@pytest.mark.parametrize(
    ("name", "params"),
    [("chimera", {"D": 4, "N": 4}), ("zbv", {"D": 2, "N": 4}), ("interleaved-1f1b", {"D": 2})],
)
def test_stage_copies_are_each_ranks_stages_in_pipeline_order(
    name: str, params: dict[str, int]
) -> None:
    """The per-rank index behind `stage_copies` (built once per program, so that asking
    every rank is linear) answers as a scan of every pipeline's placement does."""
    program = api.compile_schedule(name, {k: str(v) for k, v in params.items()}).need_program()
    for rank in range(program.num_ranks):
        scanned = tuple(
            (s, p.name) for p in program.pipelines for s, r in enumerate(p.placement) if r == rank
        )
        assert program.stage_copies(rank) == scanned
    assert program.stage_copies(program.num_ranks + 5) == ()
