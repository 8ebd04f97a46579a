"""`pipelang profile` on a busy machine (issue 44 item 6): measurements repeat until their
runs are steady (a bounded number of them), every layer's spread is kept, and identical
layers measured apart (a block 100x slower than its twins) are warned of, naming them,
by `profile` and by `plan` reading the profile. The timer is a fake one: the same
answer on any machine."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import pipelang.backends.measure as measure
from pipelang.backends.measure import ProfileOptions, Runs, _timed
from pipelang.profile import LayerCost, Profile, load_profile, profile_from_dict
from tests.helpers import run_in_process


class FakeClock:
    """A `time` module whose clock moves `step` ms on each reading: every timed run
    takes `step` ms exactly (`step` may follow a list, one entry per run)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.step = 1.0
        self.steps: list[float] = []

    def perf_counter(self) -> float:
        step = self.steps.pop(0) if self.steps else self.step
        self.now += step / 1e3  # a run's end is one reading after its start
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(measure, "time", fake)
    yield fake


def runs_of(clock: FakeClock, options: ProfileOptions, steps: list[float]) -> Runs:
    clock.steps = [s for s in steps for _ in (0, 1)]  # both readings of a run
    (runs,) = _timed(options, torch.device("cpu"), lambda: [lambda: None])
    return runs


def test_unsteady_runs_repeat_up_to_the_most(clock: FakeClock) -> None:
    """Steady runs stop at --repeats; unsteady ones take more, `repeats` at a time, until
    steady, and never more than the most (4 x --repeats by default)."""
    options = ProfileOptions("gpt:tiny", repeats=4, warmup=0)
    steady = runs_of(clock, options, [1.0] * 40)
    assert len(steady.runs) == 4 and steady.steady
    # a busy spell in the first four runs, the next four agree: 8 runs, median 1
    settled = runs_of(clock, options, [50.0, 1.0, 1.0, 1.0] + [1.0] * 36)
    assert len(settled.runs) == 8 and settled.median == pytest.approx(1.0)
    busy = runs_of(clock, options, [1.0, 50.0] * 40)
    assert len(busy.runs) == 16 and not busy.steady
    assert busy.quartiles == pytest.approx((1.0, 50.0))
    most = ProfileOptions("gpt:tiny", repeats=4, warmup=0, max_repeats=6)
    assert len(runs_of(clock, most, [1.0, 50.0] * 40).runs) == 8  # a round is 4 runs


def slow_layer(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, slow: int | None) -> None:
    """Time layer `slow` (None: none) 100x slower than the others, each run 1 ms."""
    measured = measure._measure_layer
    count = [0]

    def one_layer(*args: object) -> LayerCost:
        clock.step = 100.0 if count[0] == slow else 1.0
        count[0] += 1
        return measured(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(measure, "_measure_layer", one_layer)


def profile(tmp_path: Path) -> tuple[int, str, str, Path]:
    out = tmp_path / "p.json"
    status, text, err = run_in_process(
        ["profile", "--model", "gpt:tiny", "-o", str(out), "--repeats", "2", "--warmup", "0"]
    )
    return status, text, err, out


PLAN: Callable[[Path], list[str]] = lambda tmp: [  # noqa: E731
    "plan", "--profile", str(tmp / "p.json"), "--topology", str(tmp / "t.yaml"),
    "--micro-batches", "4", "-o", str(tmp / "o.pipe"), "--schedules", "1f1b",
]  # fmt: skip


@pytest.mark.slow
def test_a_block_measured_100x_slower_is_named(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt:tiny: an embedding, six identical blocks (layers 1-6), a head. Block 4 timed
    100x slower: `profile` warns naming layer 4 against layers 1-3, 5-6, and `plan`
    on that profile says so too (it only said "lopsided")."""
    slow_layer(monkeypatch, clock, 4)
    status, text, err, out = profile(tmp_path)
    assert status == 0, err
    warning = (
        "warning: identical layers (`Block`) disagree beyond their spread: layer 4 took "
        "200 ms forward + backward, where layers 1-3, 5-6 took 2 ms (median); the machine "
        "was busy: profile again on a quiet machine, with --threads as a rank of the run gets"
    )
    assert warning in " ".join(err.split()), err
    assert "spread: 2 timed runs per measurement" in text
    layers = load_profile(out).layers
    assert layers[4].spread_ms == (200.0, 200.0) and layers[3].spread_ms == (2.0, 2.0)
    (tmp_path / "t.yaml").write_text(
        "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nintra_node: {bandwidth: 10GB/s}\n"
    )
    status, _, err = run_in_process(PLAN(tmp_path))
    assert status == 0, err
    assert "note: identical layers (`Block`) disagree beyond their spread: layer 4 took" in err
    assert "the plan divides the layers by these times, so it may be lopsided" in err


@pytest.mark.slow
def test_steady_identical_layers_are_not_warned_of(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_layer(monkeypatch, clock, None)
    status, _, err, out = profile(tmp_path)
    assert status == 0, err
    assert "warning" not in err and "disagree" not in err
    assert not load_profile(out).disagreements()


def layer(name: str, ms: float, spread: tuple[float, float] | None = None) -> LayerCost:
    return LayerCost(name, ms / 3, 2 * ms / 3, 0.0, 1e6, 1e6, 1e5, spread_ms=spread)


def test_disagreement_is_beyond_the_spread_and_by_structure() -> None:
    """Identical layers (name and bytes) further apart than 1.5x and their spreads'
    middle halves disagree; within the spreads, or layers of different bytes, do not;
    a layer whose runs spanned more than 2x is named as unsteady."""
    twins = [layer("Block", 1.0, (0.9, 1.1)), layer("Block", 2.0, (1.9, 2.1))]
    assert len(Profile("m", "cpu", "f", 1, 1, tuple(twins)).disagreements()) == 1
    wide = [layer("Block", 1.0, (0.8, 1.2)), layer("Block", 2.0, (1.0, 2.2))]
    found = Profile("m", "cpu", "f", 1, 1, tuple(wide)).disagreements()
    assert found == [
        "the runs of layer 1 stayed unsteady: the middle half of a layer's runs spans up to "
        "2.2x (layer 1, `Block`: 1-2.2 ms forward + backward); the machine was busy: profile "
        "again on a quiet machine, with --threads as a rank of the run gets"
    ]
    other = [layer("Block", 1.0), LayerCost("Block", 9.0, 9.0, 0.0, 1e6, 2e6, 1e5)]
    assert not Profile("m", "cpu", "f", 1, 1, tuple(other)).disagreements()
    close = [layer("Block", 1.0), layer("Block", 1.4)]  # no spread: the medians alone
    assert not Profile("m", "cpu", "f", 1, 1, tuple(close)).disagreements()
    (zero,) = Profile("m", "cpu", "f", 1, 1, (layer("B", 1.0, (0.0, 3.0)),)).disagreements()
    assert "the middle half of a layer's runs spans from 0 ms (layer 0, `B`: 0-3 ms" in zero


def test_the_spread_is_read_back_and_checked() -> None:
    doc = json.loads(Profile("m", "cpu", "f", 1, 1, (layer("B", 1.0, (0.5, 2.0)),)).to_json())
    assert doc["layers"][0]["spread_ms"] == [0.5, 2.0]
    assert profile_from_dict(doc).layers[0].spread_ms == (0.5, 2.0)
    for bad, message in (
        ([2.0, 0.5], "must be [least, most], not [2, 0.5]"),
        ([1.0], "must be [least, most] in ms"),
        (["x", 1.0], "must be a number, not 'x'"),
    ):
        doc["layers"][0]["spread_ms"] = bad
        with pytest.raises(Exception, match=message.replace("[", r"\[")):
            profile_from_dict(doc)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--repeats", "999999999999", "must be 1 to 1,000, not 999,999,999,999"),
        ("--max-repeats", "10001", "must be 1 to 10,000, not 10,001"),
        ("--warmup", "1001", "must be 0 to 1,000, not 1,001"),
        ("--calibrate-rounds", "101", "must be 1 to 100, not 101"),
        ("--threads", "0", "must be 1 to 1,024, not 0"),
    ],
)
def test_counts_past_what_runs_in_days_are_usage_errors(
    option: str, value: str, message: str, tmp_path: Path
) -> None:
    """`--repeats 999999999999` measured for ever."""
    status, _, err = run_in_process(
        ["profile", "--model", "gpt:tiny", "-o", str(tmp_path / "p.json"), option, value]
    )
    assert status == 2 and f"argument {option}: {message}" in err, err
