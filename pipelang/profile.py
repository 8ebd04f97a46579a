"""Per-layer costs of a model: what `pipelang profile` measures (`pipelang.backends.measure`,
which says how) and `pipelang plan` reads.

For every layer of the model (in order, as the runtime cuts it into stages), on one
micro-batch: the forward time, the whole backward, and the backward split into the input
gradient (`B`) and the weight gradient (`W`), the bytes the forward saves for the
backward (activations), the bytes of its parameters, and the bytes of its output (what a
stage boundary after this layer sends), and the time of the optimizer step on its
parameters (SGD with momentum and Adam, as the runtime's `step` runs them). What a run
adds to the layers' own times, the runtime's host work per action and per message, is
measured apart (`pipelang.backends.calibrate`) and kept as `runtime`.

This module is the profile's data and its reading (`load_profile`, every field checked);
it imports no torch. It sits below both its writer, the runtime (`backends/measure.py`,
`backends/calibrate.py`), and its readers, the planner and the synthesizer, so that
neither imports the other for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipelang.diagnostics import clip, fail
from pipelang.readers import MAX_BYTES, ReadError, file_error, number, read_json, read_source
from pipelang.source import one_line

FORMAT = "pipelang-profile/1"
MAX_LAYERS = 1024
"""The most layers a profile lists (checked before the planner's work, which grows with
the square of the layers)."""
MAX_TEXT = 1000
"""The most characters of a profile's name or label (its model, device, a layer's name)."""
MAX_MS = 1e9
"""The longest time a profile gives one layer or runtime cost, in milliseconds (11 days):
sums over every op of a plan stay far inside the simulator's 10^15."""
LAYER_FIELDS = (
    "forward_ms",
    "backward_input_ms",
    "backward_weight_ms",
    "activation_bytes",
    "weight_bytes",
    "output_bytes",
)


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer on one micro-batch: times in milliseconds, sizes in bytes."""

    name: str
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    activation_bytes: float
    weight_bytes: float
    output_bytes: float
    backward_ms: float | None = None
    """The whole backward as one pass (input and weight gradients together); split in
    two, as zero-bubble schedules run it, it costs more (the weight pass walks the graph
    again). None in a hand-written profile: then the sum of the two parts."""
    sgd_step_ms: float | None = None
    """The optimizer step on this layer's parameters with SGD and momentum (the update,
    then clearing the gradients); None in a profile that did not measure it (then 0)."""
    adam_step_ms: float | None = None
    """The same with Adam."""
    w_activation_bytes: float | None = None
    """Of `activation_bytes`, what a split backward keeps after B for W (each weighted
    op's saved input and its output gradient, backends/weight_split.py); None in an
    older or hand-written profile (then `ir.MW_SHARE` of the activations)."""
    spread_ms: tuple[float, float] | None = None
    """The range of the middle half of the timed runs of forward + whole backward (the
    sum of each one's quartiles): how steady the measurement was; None in an older or
    hand-written profile (then the medians alone are compared)."""
    runs: int | None = None
    """How many timed runs the measurement took (more while they were unsteady)."""

    def step_ms(self, optimizer: str) -> float:
        """The optimizer step's time for `optimizer` (`sgd` or `adam`); 0 if unmeasured."""
        value = self.sgd_step_ms if optimizer == "sgd" else self.adam_step_ms
        return value or 0.0

    @property
    def full_backward_ms(self) -> float:
        if self.backward_ms is not None:
            return self.backward_ms
        return self.backward_input_ms + self.backward_weight_ms

    @property
    def time_ms(self) -> float:
        """Forward + whole backward: what identical layers should agree on."""
        return self.forward_ms + self.full_backward_ms

    @property
    def structure(self) -> tuple[object, ...]:
        """What identical layers (a transformer's blocks) share: their name and bytes."""
        return (
            self.name,
            self.activation_bytes,
            self.weight_bytes,
            self.output_bytes,
            self.w_activation_bytes,
        )

    @property
    def unsteady(self) -> bool:
        """Whether the middle half of its runs spans more than UNSTEADY times over (and
        more than 0.05 ms: the timer's jitter on a quick layer)."""
        if self.spread_ms is None:
            return False
        low, high = self.spread_ms
        return high > UNSTEADY * low and high - low > 0.05

    def apart_from(self, other: LayerCost) -> bool:
        """Whether this layer's time and `other`'s are more than DISAGREE apart and
        beyond both measurements' spreads (their middle halves do not meet)."""
        slow, fast = (self, other) if self.time_ms >= other.time_ms else (other, self)
        if slow.time_ms <= DISAGREE * fast.time_ms:
            return False
        return (slow.spread_ms or (slow.time_ms,))[0] > (fast.spread_ms or (0, fast.time_ms))[1]


@dataclass(frozen=True, slots=True)
class Profile:
    """A model's layers as measured on one device, with what was measured on."""

    model: str
    device: str
    dtype: str
    micro_batch_size: int
    seq_len: int
    layers: tuple[LayerCost, ...]
    torch: str = ""
    threads: int = 0
    repeats: int = 0
    runtime: RuntimeCosts | None = None
    """What the runtime adds per action and per message, from a calibration run; None
    when not calibrated (then the planner counts only the layers' own times)."""
    device_name: str = ""
    """What the device is (`NVIDIA H100 80GB HBM3`, `cpu`); "" in older profiles."""

    def measured_on(self, kind: str) -> bool:
        """Whether this profile was measured on a device of `kind` (a topology's word
        for it, `H100`, `cpu`): the kind appears in its device or device name."""
        return kind.lower() in f"{self.device} {self.device_name}".lower()

    def to_json(self) -> str:
        doc = {"format": FORMAT, **asdict(self)}
        doc["layers"] = [asdict(layer) for layer in self.layers]
        if self.runtime is None:
            del doc["runtime"]
        return json.dumps(doc, indent=1)

    def disagreements(self) -> list[str]:
        """What says this profile was measured on a busy machine, in words naming the
        layers: per kind of identical layers (`LayerCost.structure`), those whose time is
        apart from the kind's median layer's (`LayerCost.apart_from`); and layers whose
        runs stayed unsteady (`LayerCost.unsteady`)."""
        unsteady = [i for i, layer in enumerate(self.layers) if layer.unsteady]
        found = [_unsteady(self.layers, unsteady)] if unsteady else []
        kinds: dict[tuple[object, ...], list[int]] = {}
        for index, layer in enumerate(self.layers):
            kinds.setdefault(layer.structure, []).append(index)
        for indices in kinds.values():
            if len(indices) < 2:
                continue
            ranked = sorted(indices, key=lambda i: self.layers[i].time_ms)
            middle = self.layers[ranked[(len(ranked) - 1) // 2]]
            apart = [i for i in indices if self.layers[i].apart_from(middle)]
            if apart:
                found.append(_disagreement(self.layers, indices, apart, middle))
        return found

    def notes(self) -> list[str]:
        """What this profile lacks that the cost model would use (each counted as 0), and
        identical layers it measured far apart (`disagreements`)."""
        notes = [
            f"{text}; the plan divides the layers by these times, so it may be lopsided"
            for text in self.disagreements()
        ]
        if any(c.sgd_step_ms is None or c.adam_step_ms is None for c in self.layers):
            notes.append(
                "the profile has no optimizer step times (`sgd_step_ms`, `adam_step_ms`): "
                "the step is counted as 0 ms"
            )
        if self.runtime is None:
            notes.append(
                "the profile has no `runtime` calibration: the runtime's host work per action "
                "and per message is counted as 0 (`pipelang profile --calibrate gloo`)"
            )
        return notes


@dataclass(frozen=True, slots=True)
class RuntimeCosts:
    """What a run of the runtime adds to the layers' own times, measured from the trace of
    a short run (`pipelang.backends.calibrate`); times in milliseconds."""

    backend: str
    """The backend the calibration ran on (`gloo`, `local`, `nccl`)."""
    ranks: int
    """Ranks of the calibration run (all on this machine)."""
    action_ms: float
    """Host time between two actions of a rank: the generated line's call and the
    runtime's bookkeeping (the median gap in the trace)."""
    send_ms: float
    """Host time of a send on the sender (the median duration of a send action)."""
    recv_ms: float
    """Host time of a receive whose message was already sent (median duration)."""
    message_ms: float
    """Time from the end of a send until the receiver can have the message, beyond
    `recv_ms`, measured on receives that waited; the link's own time on this backend
    and machine, at `message_bytes`."""
    message_bytes: float
    """Size of the calibration run's messages."""
    compute_scale: float
    """Compute actions' time in the run over the profile's time for the same layers:
    how much slower a layer runs beside the other ranks (shared cores, memory, the
    transport's threads, other load on the machine) than alone."""
    rounds: int = 1
    """Calibration runs the values are the medians of."""
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per field, the least and the most that one run measured (empty for one run)."""

    def described(self) -> str:
        """The costs in one line, with each one's spread over the runs."""

        def one(key: str, value: float) -> str:
            low, high = self.spread.get(key, (value, value))
            return f"{value:.3f} ms" + (f" ({low:.3f}-{high:.3f})" if low != high else "")

        runs = f", median of {self.rounds} runs" if self.rounds > 1 else ""
        low, high = self.spread.get("compute_scale", (self.compute_scale,) * 2)
        scale = f"x{self.compute_scale:.2f}" + (f" (x{low:.2f}-x{high:.2f})" if low != high else "")
        return (
            f"runtime ({self.backend}, {self.ranks} ranks{runs}): "
            f"{one('action_ms', self.action_ms)} per action, "
            f"send {one('send_ms', self.send_ms)}, receive {one('recv_ms', self.recv_ms)}, "
            f"message {one('message_ms', self.message_ms)}, compute {scale} beside the other ranks"
        )


DISAGREE = 1.5
"""Identical layers whose times are further apart than this factor (and beyond their
spreads) disagree: a quiet machine measures a model's blocks within 10-20%."""


def _disagreement(
    layers: tuple[LayerCost, ...], indices: list[int], apart: list[int], middle: LayerCost
) -> str:
    """One kind of identical layers measured apart, in words (`disagreements`)."""

    def timed(layer: LayerCost) -> str:
        low, high = layer.spread_ms or (layer.time_ms, layer.time_ms)
        spread = f" (middle half {low:.3g}-{high:.3g})" if low != high else ""
        return f"{layer.time_ms:.3g} ms{spread}"

    rest = [i for i in indices if i not in apart]
    slowest = max(apart, key=lambda i: layers[i].time_ms)
    fastest = min(apart, key=lambda i: layers[i].time_ms)
    shown = [timed(layers[i]) for i in dict.fromkeys((fastest, slowest))]
    name = one_line(middle.name).replace("`", "'")
    return clip(
        f"identical layers (`{name}`) disagree beyond their spread: "
        f"{_numbered(apart)} took {' to '.join(shown)} forward + backward, where "
        f"{_numbered(rest)} took {timed(middle)} (median); {BUSY}"
    )


UNSTEADY = 2.0
"""A layer whose middle half of runs spans more than this factor was measured unsteadily."""

BUSY = (
    "the machine was busy: profile again on a quiet machine, with --threads as a rank of "
    "the run gets"
)


def _unsteady(layers: tuple[LayerCost, ...], indices: list[int]) -> str:
    """Layers whose runs stayed unsteady, in words (`disagreements`)."""
    worst = max(indices, key=lambda i: _span(layers[i]))
    layer = layers[worst]
    low, high = layer.spread_ms or (0.0, 0.0)
    name = one_line(layer.name).replace("`", "'")
    runs = f" after {layer.runs} runs" if layer.runs else ""
    return clip(
        f"the runs of {_numbered(indices)} stayed unsteady{runs}: the middle half of a "
        f"layer's runs spans {_factor(_span(layer))} (layer {worst}, `{name}`: "
        f"{low:.3g}-{high:.3g} ms forward + backward); {BUSY}"
    )


def _factor(span: float) -> str:
    return f"up to {span:.3g}x" if span < math.inf else "from 0 ms"


def _span(layer: LayerCost) -> float:
    low, high = layer.spread_ms or (1.0, 1.0)
    return high / low if low > 0 else math.inf


def _numbered(indices: list[int]) -> str:
    """`layer 4` or `layers 1-3, 5` (at most 8 ranges named)."""
    ranges: list[list[int]] = []
    for i in indices:
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    words = [str(a) if a == b else f"{a}-{b}" for a, b in ranges[:8]]
    more = f" and {len(ranges) - 8} more" if len(ranges) > 8 else ""
    return f"layer{'s' * (len(indices) > 1)} {', '.join(words)}{more}"


def load_profile(path: Path) -> Profile:
    """Read and check a profile JSON file; every problem is E0401."""
    source = read_source(path, "E0401")
    try:
        doc = read_json(source.text)
    except ReadError as err:
        problem = ReadError(f"cannot read the profile `{path}`: {err}", err.offset)
        raise file_error("E0401", source, problem) from None
    return profile_from_dict(doc, str(path))


def profile_from_dict(doc: object, where: str = "the profile") -> Profile:
    """A Profile from its JSON object, every field checked."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail(
            "E0401",
            f'`{where}` is not a pipelang profile (no `"format": "{FORMAT}"`)',
            help="write one with `pipelang profile --model M -o PROFILE.json`",
        )
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        raise fail("E0401", f"`{where}` has no `layers` list")
    if len(layers) > MAX_LAYERS:
        raise fail("E0401", f"`{where}` has {len(layers):,} layers; the planner takes {MAX_LAYERS}")
    costs = tuple(_layer(entry, i, where) for i, entry in enumerate(layers))
    if not sum(c.forward_ms + c.backward_input_ms + c.backward_weight_ms for c in costs) > 0:
        raise fail("E0401", f"`{where}`: every layer takes 0 ms; a plan needs some time to divide")
    return Profile(
        model=_text(doc.get("model", "?"), where, "model"),
        device=_text(doc.get("device", "?"), where, "device"),
        dtype=_text(doc.get("dtype", "float32"), where, "dtype"),
        micro_batch_size=_whole(doc.get("micro_batch_size", 0), where, "micro_batch_size"),
        seq_len=_whole(doc.get("seq_len", 0), where, "seq_len"),
        layers=costs,
        torch=_text(doc.get("torch", ""), where, "torch"),
        threads=_whole(doc.get("threads", 0), where, "threads"),
        repeats=_whole(doc.get("repeats", 0), where, "repeats"),
        runtime=_runtime(doc.get("runtime"), where),
        device_name=_text(doc.get("device_name", ""), where, "device_name"),
    )


RUNTIME_FIELDS = ("action_ms", "send_ms", "recv_ms", "message_ms", "message_bytes")


def _runtime(entry: object, where: str) -> RuntimeCosts | None:
    """The `runtime` object of a profile (None when absent), every field checked."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise fail("E0401", f"`{where}`: `runtime` must be an object")
    values = {
        key: _number(
            entry.get(key, 0.0),
            f"`{where}`: `runtime.{key}`",
            MAX_BYTES if key.endswith("_bytes") else MAX_MS,
        )
        for key in RUNTIME_FIELDS
    }
    scale = _number(entry.get("compute_scale", 1.0), f"`{where}`: `runtime.compute_scale`")
    if scale <= 0:
        raise fail("E0401", f"`{where}`: `runtime.compute_scale` must be more than 0")
    spread_entry = entry.get("spread", {})
    if not isinstance(spread_entry, dict):
        raise fail("E0401", f"`{where}`: `runtime.spread` must be an object")
    spread = {}
    for key, pair in spread_entry.items():
        what = f"`{where}`: `runtime.spread.{key}`"
        if key not in (*RUNTIME_FIELDS, "compute_scale") or not isinstance(pair, list):
            raise fail("E0401", f"{what} must be [least, most] of a runtime field")
        if len(pair) != 2:
            raise fail("E0401", f"{what} must be [least, most]")
        spread[str(key)] = (_number(pair[0], what, MAX_BYTES), _number(pair[1], what, MAX_BYTES))
    return RuntimeCosts(
        backend=_text(entry.get("backend", "?"), where, "runtime.backend"),
        ranks=_whole(entry.get("ranks", 0), where, "runtime.ranks"),
        compute_scale=scale,
        rounds=max(1, _whole(entry.get("rounds", 1), where, "runtime.rounds")),
        spread=spread,
        **values,
    )


def _number(value: object, what: str, most: float = MAX_MS) -> float:
    """`value` as a number from 0 to `most`, else E0401 naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail("E0401", f"{what} must be a number, not {_shown(value)}")
    try:
        return number(float(value), what, 0, most)
    except ReadError as err:
        raise fail("E0401", str(err)) from None


def _shown(value: object) -> str:
    """A JSON value as a message shows it: its repr, past 60 characters cut."""
    text = one_line(repr(value))
    return text if len(text) <= 60 else f"{text[:45]}... ({len(text):,} characters)"


def _spread(value: object, what: str) -> tuple[float, float] | None:
    """A layer's `spread_ms`, [least, most] (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise fail("E0401", f"{what} must be [least, most] in ms")
    low, high = (_number(v, what) for v in value)
    if low > high:
        raise fail("E0401", f"{what} must be [least, most], not [{low:g}, {high:g}]")
    return low, high


def _text(value: object, where: str, key: str) -> str:
    """A name or label of the profile (its model, device, a layer's name) as text, at
    most MAX_TEXT characters: what a plan's header and the messages repeat."""
    text = str(value)
    if len(text) > MAX_TEXT:
        raise fail(
            "E0401",
            f"`{where}`: `{key}` is {len(text):,} characters long; a profile's names are at "
            f"most {MAX_TEXT:,}",
        )
    return text


def _whole(value: object, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail("E0401", f"`{where}`: `{key}` must be a whole number, not {_shown(value)}")
    return value


def _layer(entry: object, index: int, where: str) -> LayerCost:
    if not isinstance(entry, dict):
        raise fail("E0401", f"`{where}`: layer {index} is not an object")
    values: dict[str, float] = {}
    for key in LAYER_FIELDS:
        if key not in entry:
            raise fail(
                "E0401",
                f"`{where}`: layer {index} has no `{key}`",
                help="every layer needs " + ", ".join(f"`{k}`" for k in LAYER_FIELDS),
            )
        most = MAX_MS if key.endswith("_ms") else MAX_BYTES
        values[key] = _number(entry[key], f"`{where}`: layer {index} `{key}`", most)
    optional: dict[str, float | None] = {}
    for key in ("backward_ms", "sgd_step_ms", "adam_step_ms", "w_activation_bytes"):
        value = entry.get(key)
        what = f"`{where}`: layer {index} `{key}`"
        most = MAX_MS if key.endswith("_ms") else MAX_BYTES
        optional[key] = None if value is None else _number(value, what, most)
    return LayerCost(
        name=_text(entry.get("name", f"layer{index}"), where, f"layers[{index}].name"),
        spread_ms=_spread(entry.get("spread_ms"), f"`{where}`: layer {index} `spread_ms`"),
        runs=None
        if entry.get("runs") is None
        else _whole(entry["runs"], where, f"layers[{index}].runs"),
        backward_ms=optional["backward_ms"],
        sgd_step_ms=optional["sgd_step_ms"],
        adam_step_ms=optional["adam_step_ms"],
        w_activation_bytes=optional["w_activation_bytes"],
        **values,
    )
