"""Colours: hue by op kind, shade by where the op runs (pipeline, or chunk of the rank).

Every compute op gets a *variant*: the pipeline it belongs to and, when a rank holds
several stages of that pipeline (interleaved, V-shaped), which of them (its chunk, in
stage order). Variants of one kind share a hue and differ in lightness, the first one
darkest, so Chimera's `down` ops are dark and its `up` ops light at a glance; ZB-V's
chunk 0 (on the way down the V) is dark and chunk 1 (on the way back) light.

    F  blue     B  orange     W  green     R  purple
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

from pipelang.ir import Action, Kind, Program, placement
from pipelang.ir.costs import SHARD_COSTS

KIND_HUE = {
    Kind.F: 212,
    Kind.B: 25,
    Kind.W: 128,
    Kind.R: 280,
    Kind.P: 180,
    Kind.GATHER: 50,
    Kind.REDUCE_SCATTER: 340,
}
"""Hue in degrees of each compute kind (and a sharded stage's collectives)."""

ALL_KINDS = (Kind.F, Kind.B, Kind.W, Kind.R, Kind.P, Kind.GATHER, Kind.REDUCE_SCATTER)
"""The kinds drawn as boxes, in the order legends list them: the compute kinds, then a
sharded stage's all-gather and reduce-scatter (`--shard`)."""

KIND_NAME = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.W: "weight grad",
    Kind.R: "recompute",
    Kind.P: "frozen forward",
    Kind.GATHER: "all-gather of a sharded stage",
    Kind.REDUCE_SCATTER: "reduce-scatter of a sharded stage",
}


def box_label(action: Action) -> str:
    """What a box says: its micro-batch (`3`, `3.1`), or `AG`, `RS` for a sharded
    stage's all-gather and reduce-scatter (a `reshard`, which takes no time, its kind)."""
    if action.kind is Kind.RESHARD:
        return action.kind.value
    return SHARD_COSTS.get(action.kind) or action.unit()


IDLE = "#e9ecf1"
IDLE_STROKE = "#c9ced8"
TRANSFER = "#4a4f57"
COMM_ACTION = "#30343b"


@dataclass(frozen=True, slots=True)
class Palette:
    """The variants of a Program and the fill of every (kind, variant).

    `variant[(pipeline, stage)]` is the variant index; `names[i]` says what variant i is
    (`down`, `chunk 1`, `up0 chunk 0`; empty when there is a single variant).
    """

    variant: dict[tuple[str | None, int | None], int]
    names: tuple[str, ...]

    def fill(self, kind: Kind, variant: int) -> str:
        """The `#rrggbb` fill of ops of `kind` in `variant`."""
        return shade(kind, variant, len(self.names))

    def of(self, action: Action) -> tuple[Kind, int]:
        """The (kind, variant) an op is coloured by."""
        return action.kind, self.variant[(action.pipeline, action.stage)]

    def legend(self, kinds: tuple[Kind, ...]) -> list[tuple[str, str]]:
        """(fill, label) for every kind and variant, variants of one kind side by side."""
        entries = []
        for kind in kinds:
            for index, name in enumerate(self.names):
                label = f"{kind.value} {name}".rstrip()
                entries.append((self.fill(kind, index), label))
        return entries


def palette(program: Program) -> Palette:
    """Number the variants of `program`: pipelines in order, chunks in stage order."""
    local = placement.local_stages(program.pipelines)
    chunk = {(name, stage): c for (name, _), held in local.items() for c, stage in enumerate(held)}
    most = max((len(held) for held in local.values()), default=1)
    index = {pipe.name: i for i, pipe in enumerate(program.pipelines)}
    variant: dict[tuple[str | None, int | None], int] = {
        (name, stage): index[name] * most + c for (name, stage), c in chunk.items()
    }
    many_pipes = len(program.pipelines) > 1
    names = []
    for pipe in program.pipelines:
        for c in range(most):
            parts = [pipe.name if many_pipes else "", f"chunk {c}" if most > 1 else ""]
            names.append(" ".join(p for p in parts if p))
    return Palette(variant, tuple(names))


def shade(kind: Kind, variant: int, count: int) -> str:
    """The fill of `kind` in `variant` of `count`: darkest first, lightest last."""
    if count <= 1:
        lightness = 0.50
    else:
        low, high = (0.34, 0.72) if count == 2 else (0.30, 0.78)
        lightness = low + (high - low) * variant / (count - 1)
    saturation = {Kind.B: 0.72, Kind.W: 0.50}.get(kind, 0.62)
    r, g, b = colorsys.hls_to_rgb(KIND_HUE.get(kind, 0) / 360, lightness, saturation)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def text_color(fill: str) -> str:
    """Black or white, whichever reads better on `fill` (`#rrggbb`)."""
    r, g, b = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    luminance = 0.2126 * r**2.2 + 0.7152 * g**2.2 + 0.0722 * b**2.2
    return "#111" if luminance > 0.28 else "#fff"
