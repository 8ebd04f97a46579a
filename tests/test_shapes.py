"""Micro-batches of different shapes (DynaPipe): `lengths` and `sizes`, `--lengths FILE`,
the cost model's shape terms, `pipelang pack`, and the runtime's shaped micro-batches.

Oracles: on one rank the makespan is the sum of the micro-batches' F + B, each
`O + (1 - O)((1 - A) n/S + A s l^2/S^2)` of the reference's; micro-batches all of the
reference's shape simulate exactly as an unshaped schedule; the dynamic program's cut
equals the best of every contiguous cut (brute force); `--check` equals one process
training the same micro-batches.
"""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from pipelang import api
from pipelang.codes import CODES
from pipelang.ir import BatchShapes, CostModel, Program
from pipelang.pack import (
    _cut,
    _Model,
    evaluate,
    fixed_batches,
    pack,
    packed_sequences,
    with_reference,
)
from tests.helpers import at, errors, run, run_in_process, timeline


def source(shapes: str, costs: str = "cost F = 1, B = 2", n: int = 4, d: int = 2) -> str:
    return f"""\
schedule t(D: int = {d}, N: int = {n}) {{
    {costs}
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    {shapes}
    order rank r {{
        let warm = min(D - r - 1, N)
        for i in 0..warm {{ F(i) }}
        for i in 0..N - warm {{ F(warm + i)  B(i) }}
        for i in N - warm..N {{ B(i) }}
    }}
}}
"""


# ---- the cost and memory model ------------------------------------------------------------


@pytest.mark.parametrize(("attention", "fixed"), [(0.0, 0.0), (0.3, 0.0), (0.5, 0.1)])
def test_one_rank_takes_the_sum_of_the_shapes_times(attention: float, fixed: float) -> None:
    samples, lengths = (4, 2, 8, 1), (512, 1024, 256, 2048)
    text = source(
        f"lengths {', '.join(map(str, lengths))}\n    sizes {', '.join(map(str, samples))}",
        f"cost F = 1, B = 2, A = {attention}, O = {fixed}",
        d=1,
    )
    found = timeline(text)
    expected = 0.0
    for s, n in zip(samples, lengths, strict=True):
        scaled = (1 - attention) * s * n / 2048 + attention * s * n * n / 2048**2
        expected += 3 * (fixed + (1 - fixed) * scaled)
    assert found.makespan == pytest.approx(expected)


def test_reference_shapes_simulate_as_unshaped() -> None:
    shaped = timeline(source("lengths 64, 64, 64, 64, 64, 64", n=6, d=3))
    plain = timeline(source("", n=6, d=3))
    assert shaped.makespan == plain.makespan
    assert [e[1:] for e in shaped.events] == [e[1:] for e in plain.events]


def test_activations_count_tokens_over_the_reference() -> None:
    """1F1B on 2 ranks holds micro-batches 0 and 1 on rank 0 at once: (4*512 + 2*1024)
    tokens over a reference of 2048 (the longest length)."""
    found = timeline(source("lengths 512, 1024, 256, 2048\n    sizes 4, 2, 8, 1"))
    assert found.peak_activations(0) == pytest.approx((4 * 512 + 2 * 1024) / 2048)


def test_json_keeps_the_shapes() -> None:
    program = api.compile_schedule(
        "1f1b", {"D": "2", "N": "3"}, shapes=((2, 8), (1, 16), (4, 4))
    ).need_program()
    back = Program.from_json(program.to_json())
    assert back.shapes == program.shapes == BatchShapes((2, 1, 4), (8, 16, 4))
    assert back.costs.of("S") == 16


# ---- the language ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shapes", "code", "points_at"),
    [
        ("lengths 512, 1024", "E0212", "lengths 512, 1024"),
        ("lengths 1, 2, 3, 4\n    sizes 1, 1", "E0212", "sizes 1, 1"),
        ("lengths 1, 2, 0, 4", "E0212", "0"),
        ("sizes 1, 2, 3, 4", "E0212", "sizes"),
        ("lengths 1, 2, 3, 4\n    lengths 1, 2, 3, 4", "E0207", "lengths"),
    ],
)
def test_shapes_that_do_not_match_are_an_error(shapes: str, code: str, points_at: str) -> None:
    text = source(shapes)
    found = errors(text)
    assert found[0].code == code, found[0]
    assert at(text, found[0]).startswith(points_at)
    assert code in CODES


def test_a_lengths_file_stands_for_the_lines(tmp_path: Path) -> None:
    path = tmp_path / "l.txt"
    path.write_text("# samples length\n4 512\n2 1024\n\n256\n")
    status, _, err = run_in_process(
        ["simulate", "1f1b", "-p", "D=2", "-p", "N=3", "--lengths", str(path)]
    )
    assert status == 0, err
    status, _, err = run_in_process(
        ["check", "1f1b", "-p", "D=2", "-p", "N=4", "--lengths", str(path)]
    )
    assert status == 1 and "E0212" in err and "gives 3 micro-batches" in err
    # without -p N, N is the file's number of micro-batches (1f1b's default is 4)
    status, out, err = run_in_process(["simulate", "1f1b", "-p", "D=2", "--lengths", str(path)])
    assert status == 0 and "N=3" in out, err
    # and viz draws them: 4 x 512 and 2 x 1024 tokens take 8 times the 256 tokens' time
    status, out, err = run_in_process(["viz", "1f1b", "-p", "D=2", "--lengths", str(path)])
    assert status == 0 and "N=3" in out, err
    rank0 = next(line for line in out.splitlines() if line.startswith("rank 0"))
    cells = rank0.split("|")[1].split()
    spans = {}
    for i, cell in enumerate(cells):
        if cell.startswith("F"):
            spans[cell] = 1 + next(
                (k for k, c in enumerate(cells[i + 1 :]) if c != "-"), len(cells) - i - 1
            )
    assert spans["F0"] == spans["F1"] == 8 * spans["F2"], rank0
    path.write_text("4 512 9\n")  # a bad value inside a file: exit 1 (docs/language.md)
    status, _, err = run_in_process(["check", "1f1b", "--lengths", str(path)])
    assert status == 1 and "E0212" in err and "l.txt:1:1" in err


# ---- pack ----------------------------------------------------------------------------------------


def brute_force(order: list[int], model: _Model, t_max: float, bound: int) -> float:
    """The least sum of times over every contiguous cut whose runs fit both bounds."""
    best = math.inf
    n = len(order)
    for cuts in itertools.product((False, True), repeat=n - 1):
        starts = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        total = 0.0
        for a, b in itertools.pairwise(starts):
            count, length = b - a, order[a]
            t = model.time(count, length)
            if count * length > bound or t > t_max:
                break
            total += t
        else:
            best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_cut_is_the_best_contiguous_cut(seed: int) -> None:
    rng = random.Random(seed)
    order = sorted((rng.randint(1, 64) for _ in range(8)), reverse=True)
    model = _Model(3.0, 0.3, 64.0, 0.1)
    bound = rng.choice((64, 128, 256))
    t_max = rng.choice((0.5, 1.0, 3.0))
    cut = _cut(order, model, t_max, bound, 4)
    expected = brute_force(order, model, t_max, bound)
    if cut is None:
        assert expected == math.inf
        return
    assert sum(s for s, _ in cut) == len(order)
    assert sum(model.time(s, n) for s, n in cut) == pytest.approx(expected)


def long_tail(count: int = 96, seed: int = 0) -> list[int]:
    """Lognormal lengths (median 256, sigma 1), clipped to 16..4096."""
    rng = random.Random(seed)
    return [max(16, min(4096, round(rng.lognormvariate(math.log(256), 1.0)))) for _ in range(count)]


COSTS = CostModel((("F", None, 1.0), ("B", None, 2.0), ("A", None, 0.3), ("O", None, 0.05)))


@pytest.mark.slow
def test_pack_beats_fixed_batches_and_packing_within_the_cap() -> None:
    lengths = long_tail()
    cap = 4 * max(lengths)
    best = pack(lengths, "1f1b", {"D": "4"}, COSTS, cap)  # its default work bound
    assert best.peak_tokens <= cap * (1 + 1e-6)
    assert sum(s for s, _ in best.shapes) == len(lengths)
    costs = with_reference(COSTS, lengths)
    for shapes in [fixed_batches(lengths, k) for k in (1, 2, 4, 8)] + [
        packed_sequences(lengths, max(lengths))
    ]:
        other = evaluate("1f1b", {"D": "4"}, shapes, costs, sum(lengths))
        assert other is not None
        if other.peak_tokens <= cap:
            assert best.makespan <= other.makespan


def test_baselines_place_every_sequence() -> None:
    lengths = [300, 20, 50, 1000, 80, 7]
    assert fixed_batches(lengths, 4) == ((4, 1000), (2, 80))
    packed = packed_sequences(lengths, 1000)
    assert packed == ((1, 1000), (1, 1000))  # 1000 | 300 + 80 + 50 + 20 + 7


def test_pack_refuses_what_cannot_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        pack([10, 5000], "1f1b", {"D": "2"}, COSTS, 4096)


@pytest.mark.slow
def test_pack_command_writes_what_simulate_reads(tmp_path: Path) -> None:
    sequences = tmp_path / "seqs.txt"
    sequences.write_text("".join(f"{n}\n" for n in long_tail(40)))
    out = tmp_path / "packed.txt"
    args = ["pack", "1f1b", "-p", "D=2", "--sequences", str(sequences), "--max-tokens", "8192"]
    status, text, err = run_in_process([*args, "--cost", "F=1,B=2,A=0.3,O=0.05", "-o", str(out)])
    assert status == 0, err
    count = len(out.read_text().splitlines())
    assert f"-p N={count}" in text
    status, text, err = run_in_process(
        ["simulate", "1f1b", "-p", "D=2", "-p", f"N={count}", "--lengths", str(out), "--json"]
    )
    assert status == 0, err
    status, text, err = run_in_process([*args, "-p", "N=4"])
    assert status == 2 and "leave N out" in err


# ---- the runtime ---------------------------------------------------------------------------------

SHAPED = source("lengths 24, 48, 12, 40\n    sizes 4, 2, 8, 1")

CHUNKED = """\
schedule t(D: int = 2, N: int = 2) {
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    lengths 16, 32
    chunks 2
    order rank r {
        for i in 0..N { F(i, chunk=0)  F(i, chunk=1) }
        for i in 0..N { B(i, chunk=1)  B(i, chunk=0) }
    }
}
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "options"),
    [("local", ()), ("gloo", ()), ("gloo", ("--graphs",)), ("local", ("--graphs",))],
)
def test_check_equals_training_the_same_micro_batches(
    backend: str, options: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "shaped.pipe"
    path.write_text(SHAPED)
    program = api.load_program(str(path))
    status = run(program, "--backend", backend, "--steps", "2", "--check", *options)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "check OK" in out and "(bitwise equal)" in out


@pytest.mark.parametrize(
    ("text", "options", "message"),
    [
        (SHAPED, ("--seq-len", "30"), "micro-batches of 48 tokens"),
        (CHUNKED, (), "cannot run the two together"),
    ],
)
def test_shapes_the_runtime_cannot_run_are_refused(
    text: str,
    options: tuple[str, ...],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "shaped.pipe"
    path.write_text(text)
    status = run(api.load_program(str(path)), "--backend", "local", "--steps", "1", *options)
    err = capsys.readouterr().err
    assert status == 1 and message in err, err


@pytest.mark.slow
def test_pack_equals_brute_force_on_small_inputs() -> None:
    """Issue 29 item 11: over every contiguous cut of the sorted lengths in every order of
    the micro-batches, simulated here, the fastest that fits is what `pack` finds (up to
    5 sequences it searches them all), and `pack` never refuses when one fits."""
    rng = random.Random(7)
    for count in (3, 4, 4, 5):
        lengths = [rng.randint(10, 1000) for _ in range(count)]
        params = {"D": str(rng.choice([2, 3, 4]))}
        cap = rng.randint(max(lengths), 3 * sum(lengths))
        costs = with_reference(COSTS, lengths)
        order = sorted(lengths, reverse=True)
        best = math.inf
        for cuts in itertools.product((False, True), repeat=len(order) - 1):
            starts = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [len(order)]
            runs = [(b - a, order[a]) for a, b in itertools.pairwise(starts)]
            for shapes in set(itertools.permutations(runs)):
                found = evaluate("1f1b", params, shapes, costs, sum(lengths))
                if found is not None and found.peak_tokens <= cap * (1 + 1e-6):
                    best = min(best, found.makespan)
        if best == math.inf:
            with pytest.raises(ValueError, match="no packing keeps every rank within"):
                pack(lengths, "1f1b", params, COSTS, cap)
        else:
            assert pack(lengths, "1f1b", params, COSTS, cap).makespan <= best * 1.02


def test_pack_moves_each_different_order_once() -> None:
    """Moving one micro-batch: equal micro-batches give nothing new (2,000 equal ones
    once spun through 4 million copies of one order), distinct ones every order one
    move away."""
    from pipelang.pack import _moves

    assert list(_moves(((1, 5),) * 2000)) == []
    a, b, c = (1, 9), (2, 5), (4, 1)
    moved = list(_moves((a, b, c)))
    assert (a, b, c) not in moved and len(moved) == 6  # two places for each of three
    assert set(moved) == {(b, a, c), (b, c, a), (a, c, b), (c, a, b)}
