"""Sequence chunks (Seq1F1B, TeraPipe): `chunks C`, ops `F(mb, chunk=c)`, the stdlib
`seq1f1b` schedule, and the runtime's chunked attention over cached keys and values.

Oracles: Seq1F1B's bubble (D-1)(F+B)/C, so its makespan N(F+B) + (D-1)(F+B)/C, and its
stage-0 activations (C+D-1)/C micro-batches, (C+D-1)/(C*D) of 1F1B's D (papers:
arXiv 2406.03488 and MindSpeed's seq1f1b notes, reference/seeds_wave2.md section 1); the
per-span cost formula of the authors' `split_solver.py` for the chunk shares; 1F1B
itself at C = 1; and for the runtime, the whole model's gradient on the whole sequence
(float64: equal to rounding) and `--check`, one process training unchunked.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
import torch

from pipelang import api
from pipelang.codes import CODES
from pipelang.compiler import SCHEDULE_DONE, Options, run_passes
from pipelang.ir import Action, Chunks, CostModel, Kind, Program
from pipelang.sim import memory
from pipelang.sim.timeline import Timeline
from tests.helpers import at, errors, run, stdlib, timeline


def compiled(text: str, **params: int | bool) -> tuple[Program, Timeline]:
    found = timeline(text, **params)
    return found.program, found


def seq1f1b(costs: str = "F = 1, B = 2, KV = 0", **params: int | bool) -> tuple[Program, Timeline]:
    """The stdlib schedule with a `cost` line (by default the paper's memory count, a
    chunk holding its own tokens only: KV = 0)."""
    head, brace, body = api.find_schedule("seq1f1b")[0].read_text().partition("{\n")
    return compiled(f"{head}{brace}    cost {costs}\n{body}", **params)


# ---- the paper's numbers -----------------------------------------------------------------------

SWEEP = [(D, N, C) for D in (1, 2, 4, 5) for N in (1, 3, 8) for C in (1, 2, 4, 7)]


@pytest.mark.parametrize(("D", "N", "C"), SWEEP)
def test_bubble_is_one_f_one_b_over_c(D: int, N: int, C: int) -> None:
    """Makespan N(F+B) + (D-1)(F+B)/C with F = 1, B = 2: the chunks pipeline like
    micro-batches C times smaller."""
    _, timeline = seq1f1b(D=D, N=N, C=C)
    assert timeline.makespan == pytest.approx(N * 3 + (D - 1) * 3 / C)


@pytest.mark.parametrize(("D", "N", "C"), [(D, N, C) for D, N, C in SWEEP if N * C >= C + D - 1])
def test_stage_0_holds_c_plus_d_minus_1_chunks(D: int, N: int, C: int) -> None:
    """Peak activations in micro-batches (a chunk counts its share of the tokens):
    (C+D-1)/C on stage 0, so (C+D-1)/(C*D) of 1F1B's D; rank r holds (C+D-1-r)/C."""
    _, timeline = seq1f1b(D=D, N=N, C=C)
    _, one_f_one_b = seq1f1b(D=D, N=N, C=1)
    for r in range(D):
        assert timeline.peak_activations(r) == pytest.approx((C + D - 1 - r) / C)
    assert one_f_one_b.peak_activations(0) == min(D, N)
    if N >= D:
        ratio = timeline.peak_activations(0) / one_f_one_b.peak_activations(0)
        assert ratio == pytest.approx((C + D - 1) / (C * D))


@pytest.mark.parametrize(("D", "C"), [(1, 1), (1, 4), (2, 2), (3, 4), (4, 4), (4, 7), (5, 8)])
@pytest.mark.parametrize("kv", [0.12, 0.5])
def test_chunks_past_the_first_also_hold_their_keys_and_values(D: int, C: int, kv: float) -> None:
    """Each chunk past the first saves the keys and values up to its end again, KV of a
    stage's activations times its end's token fraction. Rank r peaks with C + D - 1 - r
    chunks held: all of micro-batch 0 and the first D - 1 - r of micro-batch 1, so it
    holds (C+D-1-r)/C + KV (T(C) + T(D-1-r))/C, T(m) = 2 + 3 + ... + m."""
    _, timeline = seq1f1b(f"F = 1, B = 2, KV = {kv}", D=D, N=3, C=C)

    def t(m: int) -> int:
        return m * (m + 1) // 2 - 1 if m > 0 else 0

    for r in range(D):
        expected = (C + D - 1 - r) / C + kv * (t(C) + t(D - 1 - r)) / C
        assert timeline.peak_activations(r) == pytest.approx(expected)


def test_one_chunk_is_1f1b() -> None:
    """At C = 1 the order is 1F1B's, op for op (each op naming chunk 0)."""
    chunked = stdlib("seq1f1b", D=4, N=8, C=1)
    plain = stdlib("1f1b", D=4, N=8)
    assert [[a._replace(chunk=None) for a in r] for r in chunked.ranks] == [
        list(r) for r in plain.ranks
    ]


def paper_span_cost(length: float, end: float, h: int = 64, heads: int = 4, f: int = 256) -> float:
    """The per-layer cost of a span of `length` tokens ending at position `end`, as the
    authors' split_solver.py writes it (reference/seeds_wave2.md section 1)."""
    dh = h // heads
    return (
        8 * length * h * heads * dh
        + end * length * (4 * dh + 3) * heads
        - length**2 * (4 * dh + 3) * heads / 2
        + 4 * length * h * f
    )


@pytest.mark.parametrize("C", [2, 4, 5])
def test_chunk_shares_follow_the_papers_span_cost(C: int) -> None:
    """With A = the attention share of the whole sequence's cost, `Chunks.work` is the
    paper's span cost over the whole's, for equal tokens; `equal compute` cuts spans of
    equal paper cost, later ones shorter."""
    L, dh, heads = 4096.0, 16, 4
    whole = paper_span_cost(L, L)
    # attention's share: the quadratic terms, end*length - length^2/2 at end = length = L
    attention = L * L / 2 * (4 * dh + 3) * heads / whole
    tokens = Chunks(C, "tokens")
    for c, share in enumerate(tokens.work(attention)):
        start, end = c * L / C, (c + 1) * L / C
        assert share == pytest.approx(paper_span_cost(end - start, end) / whole)
    compute = Chunks(C, "compute")
    bounds = compute.bounds(attention)
    for c in range(C):
        start, end = bounds[c] * L, bounds[c + 1] * L
        assert paper_span_cost(end - start, end) / whole == pytest.approx(1 / C)
    lengths = compute.tokens(attention)
    assert all(a > b for a, b in itertools.pairwise(lengths))


def test_equal_compute_evens_out_the_chunks_that_attention_makes_uneven() -> None:
    """With attention half the work, equal tokens make later chunks longer to run, and
    the pipeline stalls on them; equal compute restores the even bubble, at the price of
    more held tokens (its early chunks are the long ones)."""
    _, tokens = seq1f1b("F = 1, B = 2, A = 0.5, KV = 0", D=4, N=8, C=4)
    _, compute = seq1f1b("F = 1, B = 2, A = 0.5, KV = 0", D=4, N=8, C=4, balanced=True)
    assert compute.makespan == pytest.approx(8 * 3 + 3 * 3 / 4)
    assert tokens.makespan > compute.makespan * 1.05
    # Stage 0 holds 7 chunks once warm: micro-batch 0 and chunks 0-2 of micro-batch 1.
    # Then each B of micro-batch 0 (last chunk first) trades for the next F; B0.2 for
    # F2.0 trades a short chunk for the longest one, so with equal compute the peak is
    # all of micro-batch 0 + chunks 0, 1 of 1 + chunk 0 of 2: 1 + 2 l0 + l1.
    lengths = Chunks(4, "compute").tokens(0.5)
    assert lengths[0] > 1 / 4 > lengths[3]
    assert compute.peak_activations(0) == pytest.approx(1 + 2 * lengths[0] + lengths[1])
    assert tokens.peak_activations(0) == pytest.approx(1 + 3 / 4)


# ---- the language ----------------------------------------------------------------------------


def source(decl: str, order: str, extra: str = "") -> str:
    return f"""\
schedule t(D: int = 2, N: int = 2, C: int = 2) {{
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    {decl}
    {extra}
    {order}
}}
"""


ONE_F_ONE_B = """order rank r {
        for u in 0..N * C { F(u // C, chunk=u % C) }
        for u in 0..N * C { B(u // C, chunk=C - 1 - u % C) }
    }"""


def test_tokens_parse_back_and_json_keeps_the_chunks() -> None:
    program = api.load_program("seq1f1b", {"D": "2", "N": "2", "C": "3", "balanced": "true"})
    for actions in program.ranks:
        for action in actions:
            assert Action.parse(action.text()) == action
    assert Action.parse("send:F3.1@0/main>1") == Action(Kind.SEND, 3, 0, "main", 1, Kind.F, chunk=1)
    back = Program.from_json(program.to_json())
    assert back.chunks == program.chunks and back.ranks == program.ranks
    assert back.costs.of("A") == program.costs.of("A")


@pytest.mark.parametrize(
    ("decl", "order", "extra", "code", "points_at"),
    [
        ("chunks 0", ONE_F_ONE_B, "", "E0211", "0"),
        ("chunks C", ONE_F_ONE_B, "frozen on rank 0", "E0211", "chunks C"),
        ("chunks C", ONE_F_ONE_B, "weights stash", "E0211", "chunks C"),
        ("chunks C", "order repeat i { F(stage=0) @ 0 }", "", "E0211", "order repeat"),
        ("chunks C", "order rank r { F(0) }", "", "E0319", "F(0)"),
        ("", "order rank r { F(0, chunk=0) }", "", "E0319", "F(0, chunk=0)"),
        ("chunks C", "order rank r { F(0, chunk=C) }", "", "E0319", "F(0, chunk=C)"),
        ("chunks C", "order rank r { E(0, chunk=0) -> rank 1 }", "", "E0211", "E(0, chunk=0)"),
        ("chunks C", ONE_F_ONE_B.replace("C - 1 - u % C", "u % C"), "", "E0320", "B(u"),
    ],
)
def test_bad_chunks_are_an_error_at_their_source(
    decl: str, order: str, extra: str, code: str, points_at: str
) -> None:
    text = source(decl, order, extra)
    found = errors(text)
    assert found[0].code == code, found[0]
    assert at(text, found[0]).startswith(points_at)
    assert code in CODES


def test_a_greedy_order_places_chunks_too() -> None:
    """`order greedy` replays the chunked ops with their shares of F and B; the cap
    counts chunks; `chunk` is a priority key."""
    text = source(
        "chunks C",
        "order greedy { prefer B, F  priority mb, chunk  cap C + D - 1 - rank }",
        "cost F = 1, B = 2, KV = 0",
    )
    program, timeline = compiled(text, D=3, N=4, C=2)
    assert sum(1 for r in program.ranks for a in r if a.kind.is_compute) == 3 * 4 * 2 * 2
    assert timeline.makespan <= 4 * 3 * 2  # well within serial time
    assert max(timeline.peak_activations(r) for r in range(3)) <= (2 + 3 - 1) / 2


def test_max_activations_counts_chunks_as_their_share() -> None:
    text = source("chunks C", ONE_F_ONE_B, "cost KV = 0")
    assert compiled(text, C=4)[1].peak_activations(0) == 2  # all of both micro-batches
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.pipe"
        path.write_text(text)
        done = run_passes(api.load_file(str(path)), Options({"C": "4"}), SCHEDULE_DONE)
        assert done.program is not None
        from pipelang.passes.validate import validate

        assert done.graph is not None
        found = validate(done.program, done.graph, max_activations=1)
    assert [d.code for d in found] == ["E0308", "E0308"]  # one per rank
    assert "rank 0 holds 1.25 activations after `F1.0@0/main`" in found[0].message


def test_costs_scale_by_each_chunks_work() -> None:
    time = CostModel((("F", None, 2.0), ("A", None, 0.5))).timer(Chunks(2, "tokens"))
    first, second = (time(Action(Kind.F, 0, 0, "main", chunk=c)) for c in (0, 1))
    # (1 - A) * 1/2 + A * 1/4 and (1 - A) * 1/2 + A * 3/4, of F = 2
    assert (first, second) == (pytest.approx(0.75 * 2 / 2), pytest.approx(1.25 * 2 / 2))


# ---- the runtime ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("C", [2, 4])
def test_saved_bytes_are_what_the_memory_count_says(C: int, one_torch_thread: None) -> None:
    """Each rank's measured peak bytes of saved activations (local backend, gpt:tiny) are
    within 10% of the simulator's: its count of held micro-batches, a chunk its tokens
    plus the keys and values it saves again (`KV`), times each stage's bytes as
    `pipelang profile` measures them. Without `KV` the count is 20-28% short at C = 4."""
    from pipelang.backends.config import RunConfig
    from pipelang.backends.local import run_local
    from pipelang.backends.measure import ProfileOptions, measure
    from pipelang.backends.models import plan_stages

    config = RunConfig(backend="local", steps=1, count_activations=True)
    layers = measure(ProfileOptions("gpt:tiny", repeats=1, warmup=0)).layers
    program = stdlib("seq1f1b", D=4, N=8, C=C)
    plan = plan_stages(config.spec, program.num_stages, None)
    kept = [sum(layers[i].activation_bytes for i in bounds) for bounds in plan.bounds]
    outcome = run_local(program, config, plan.shapes, lambda *_: None)
    share, w = memory.shares(program), memory.w_share(program)
    for result, actions in zip(outcome.results, program.ranks, strict=True):
        simulated = memory.peak_bytes(actions, w, kept, share=share)
        assert result.peak_activation_bytes == pytest.approx(simulated, rel=0.1)


@pytest.mark.parametrize("model", ["gpt:tiny", "llama:tiny"])
def test_chunked_gradients_equal_the_whole_sequences(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank, float64: the chunks' forwards over cached keys and values (Llama's
    rotated from each chunk's first position) and their backwards in reverse give the
    gradient of the model on the whole sequence."""
    from pipelang.backends import models
    from pipelang.backends.config import RunConfig
    from pipelang.backends.runtime import RankRuntime

    monkeypatch.setitem(models.DTYPES, "float64", torch.float64)
    program = stdlib("seq1f1b", D=1, N=1, C=3)
    config = RunConfig(model=model, dtype="float64")

    class Still:
        def end_step(self) -> None: ...

    rt = RankRuntime(program, 0, config, Still(), torch.device("cpu"))  # type: ignore[arg-type]
    rt.begin_step(0)
    for c in range(3):
        rt.forward(mb=0, stage=0, pipeline="main", chunk=c)
    for c in reversed(range(3)):
        rt.backward(mb=0, stage=0, pipeline="main", chunk=c)
    assert rt.chunk_bounds == (0, 11, 21, 32)
    got = dict(rt.copies[(0, "main")].module.named_parameters())
    model = config.spec.build()
    whole = torch.nn.Sequential(*model.layers)
    ids, targets = model.batch(0, 0, torch.device("cpu"))
    model.loss(whole(ids), targets).backward()
    for name, param in whole.named_parameters():
        assert param.grad is not None and got[name].grad is not None
        torch.testing.assert_close(got[name].grad, param.grad, rtol=1e-10, atol=1e-12)


SPLIT = """\
schedule split(D: int = 2, N: int = 2, C: int = 2) {
    ops F, B, W
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    chunks C
    order rank r {
        for u in 0..N * C { F(u // C, chunk=u % C) }
        for u in 0..N * C { B(u // C, chunk=C - 1 - u % C)  W(u // C, chunk=C - 1 - u % C) }
    }
}
"""

CHIMERA = """\
schedule chunked_chimera(D: int = 2, N: int = 2, C: int = 2) {
    cost F = 1, B = 2
    pipeline down: stage s in 0..D -> rank s
    pipeline up: stage s in 0..D -> rank D - 1 - s
    microbatches i in 0..N // 2 -> down, i in N // 2..N -> up
    chunks C
    order greedy { prefer B, F  priority mb, chunk }
}
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("what", "backend", "options"),
    [
        ("seq1f1b", "local", ()),
        ("seq1f1b", "gloo", ()),
        ("seq1f1b", "gloo", ("--graphs",)),
        ("split", "gloo", ()),
        ("chimera", "gloo", ()),
    ],
)
def test_check_equals_unchunked_training(
    what: str,
    backend: str,
    options: tuple[str, ...],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Seq1F1B, a split backward (W after each chunk's B) and Chimera's two directions
    over chunks, each against one process training on whole sequences. (SGD: Adam
    turns rounding in near-zero gradients into visible steps, reference.py.)"""
    if what == "seq1f1b":
        program = stdlib("seq1f1b", D=2, N=2, C=3)
    else:
        path = tmp_path / "t.pipe"
        path.write_text(SPLIT if what == "split" else CHIMERA)
        program = api.load_program(str(path))
    status = run(
        program, "--backend", backend, "--steps", "2", "--optimizer", "sgd", "--check", *options
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--model", "pipelang.planner.demo:unbalanced_short"), "runs on the built-in models"),
        (("--seq-len", "2"), "more than its 2 tokens"),
    ],
)
def test_chunks_the_runtime_cannot_run_are_refused(
    options: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = run(stdlib("seq1f1b", D=2, N=2), "--backend", "local", "--steps", "1", *options)
    err = capsys.readouterr().err
    assert status == 1 and message in err, err


def test_torch_csv_has_no_chunks() -> None:
    from pipelang.export import ExportError, to_torch_csv

    with pytest.raises(ExportError, match="no sequence chunks"):
        to_torch_csv(stdlib("seq1f1b", D=2, N=2))
