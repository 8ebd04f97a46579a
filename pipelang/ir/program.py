"""`Program`, a whole schedule after expansion (every rank's ordered actions and what
they mean), with its placement (`Pipeline`), `after` edges (`Dependency`) and the weight
policy of asynchronous schedules (`WeightPolicy`); which of a rank's split backwards
run whole (`whole_backwards`); and the runtime's cut of a model's layers into stages
when none is given (`even_split`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pipelang.diagnostics import InternalError
from pipelang.ir import deps, placement
from pipelang.ir.action import STASH_KINDS, Action, Kind
from pipelang.ir.costs import BatchShapes, Chunks, CostModel
from pipelang.source import Span

OpKey = tuple[int | None, int | None, str | None, int | None]
"""A compute op's (micro-batch, stage, pipeline, chunk), without its kind."""


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """`layers` cut into `stages` contiguous parts as evenly as possible, the first ones
    one longer: the runtime's partition when none is given (`Program.partition` None,
    no `--partition`), which the calibration run and the synthesizer assume too."""
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if s < extra else 0) for s in range(stages))


def whole_backwards(actions: Iterable[Action]) -> frozenset[OpKey]:
    """The split backwards a rank runs whole: each (micro-batch, stage, pipeline, chunk)
    whose `W` comes right after its `B` in the rank's order, with nothing but receives
    between them. The runtime runs one whole backward at that B and nothing at its W
    (backends/rank_compute.py), and the memory count frees the forward all at B
    (`sim.memory`): the one rule both ask.

    A send between them (the input gradient B hands the stage before) or a signal
    keeps the pair split: run whole, the message would leave after W too, and the rank
    that waits for it would wait W longer (zbv at D = 4, N = 8: 46 of 64 pairs are
    adjacent but for that send, and fusing them too lengthens its simulated makespan at
    F = B = W = 1 by 12%, v-half's by 24%).
    A pair written `BW` (B with its W fused, `&W`) has its sends after the W anyway. A
    receive between them moves no message later; a `wait`, an eviction or any other
    action keeps them apart.

        whole_backwards([B0@0, W0@0, B1@1, send:B1@1>0, W1@1])  ->  {(0, 0, main, None)}
    """
    found: set[OpKey] = set()
    pending: Action | None = None  # the last B, while only receives follow it
    for action in actions:
        kind = action.kind
        if kind is Kind.RECV:
            continue
        if kind is Kind.W and pending is not None:
            key = (action.mb, action.stage, action.pipeline, action.chunk)
            if key == (pending.mb, pending.stage, pending.pipeline, pending.chunk):
                found.add(key)
        pending = action if kind is Kind.B else None
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A named placement of every stage on a rank; two or more pipelines are replicas."""

    name: str
    placement: tuple[int, ...]
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """How an asynchronous schedule versions each stage copy's weights (`weights ...`).

    Every forward reads the copy's newest version where it runs in its rank's order;
    `U` makes a new one. What a backward (and `W`, `R`) reads is the policy:

    - `stash`: the version its forward read (PipeDream's weight stashing), so a copy
      keeps every version a micro-batch in flight still needs;
    - `buffers` with `limit` K: the same, but at most K versions may be live at once
      (PipeDream-2BW: K = 2); more is E0314;
    - `latest`: the newest version, with no stash (PipeMare): one version.
    """

    mode: str
    limit: int | None = None
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def stashes(self) -> bool:
        """Whether a backward reads the version its forward read."""
        return self.mode != "latest"

    def text(self) -> str:
        """The declaration's argument: `stash`, `latest` or the number of buffers."""
        return str(self.limit) if self.mode == "buffers" else self.mode

    @staticmethod
    def parse(text: str) -> WeightPolicy:
        """Read `text()` back; raises ValueError on anything else."""
        if text in ("stash", "latest"):
            return WeightPolicy(text)
        if text.isdigit() and int(text) >= 1:
            return WeightPolicy("buffers", int(text))
        raise ValueError(f"not a weight policy: {text!r}")


@dataclass(frozen=True, slots=True)
class Dependency:
    """An extra `after` edge: `later` may not start before `earlier` ends."""

    earlier: Action
    later: Action
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True, slots=True)
class Program:
    """A whole schedule after expansion: per-rank ordered actions plus what they mean.

    `placement` of each pipeline maps stage -> rank; `assignment[mb]` names the pipeline
    micro-batch `mb` travels through; `kinds` are the compute kinds every (micro-batch,
    stage) must run exactly once.
    """

    name: str
    source: str
    params: tuple[tuple[str, int | bool], ...]
    num_ranks: int
    num_stages: int
    pipelines: tuple[Pipeline, ...]
    assignment: tuple[str, ...]
    kinds: tuple[Kind, ...]
    ranks: tuple[tuple[Action, ...], ...]
    after: tuple[Dependency, ...] = ()
    costs: CostModel = CostModel()
    order_span: Span | None = field(default=None, compare=False, repr=False)
    """Where the schedule's `order` is written; diagnostics about missing ops point here."""
    partition: tuple[int, ...] | None = None
    """Layers per stage from the schedule's `partition` line, for the runtime; None: the
    runtime cuts the model by `even_split`."""
    weights: WeightPolicy | None = None
    """The weight versioning of an asynchronous schedule (its ranks update their stage
    copies with `U` actions, and there is no `step`); None for a synchronous one."""
    frozen: tuple[int, ...] | None = None
    """The ranks that hold the model's frozen part (`frozen on ...`), ascending; None when
    the schedule has none. Each micro-batch's `P` runs on one of them."""
    chunks: Chunks | None = None
    """How micro-batches split into sequence chunks (`chunks C`); None: they do not, and
    compute actions name no chunk."""
    shapes: BatchShapes | None = None
    """Each micro-batch's samples and sequence length when they differ (`lengths`,
    `sizes`, `--lengths FILE`); None: every micro-batch has the runtime's one shape."""

    @property
    def num_microbatches(self) -> int:
        return len(self.assignment)

    def pipeline(self, name: str) -> Pipeline:
        for p in self.pipelines:
            if p.name == name:
                return p
        raise InternalError(f"no pipeline named {name!r}")

    def rank_of(self, stage: int, pipeline: str) -> int:
        """The rank that runs `stage` of `pipeline`."""
        return self.pipeline(pipeline).placement[stage]

    def replicas(self, stage: int) -> tuple[int, ...]:
        """Ranks holding a copy of `stage`, one entry per pipeline, in pipeline order."""
        return placement.replicas(self.pipelines, stage)

    def stage_copies(self, rank: int) -> tuple[tuple[int, str], ...]:
        """(stage, pipeline) copies of the weights that `rank` holds."""
        return placement.copies_by_rank(self.pipelines).get(rank, ())

    def first_eviction(self) -> Action | None:
        """The first evict, hold or load action (BPipe), in rank order; None if none."""
        return next((a for acts in self.ranks for a in acts if a.kind in STASH_KINDS), None)

    def compute_ops(self) -> Iterator[Action]:
        """Every op the schedule must run, in (micro-batch, stage, kind) order (a
        micro-batch's `P` first)."""
        frozen = self.frozen is not None
        chunks = (None,) if self.chunks is None else tuple(range(self.chunks.count))
        for mb, pipe in enumerate(self.assignment):
            if frozen:
                yield Action(Kind.P, mb, 0, pipe)
            for stage in range(self.num_stages):
                for chunk in chunks:
                    for kind in self.kinds:
                        yield Action(kind, mb, stage, pipe, chunk=chunk)

    def inputs_of(self, op: Action) -> tuple[Action, ...]:
        """The compute ops whose results `op` consumes (its data dependencies): the
        dependency rule (`deps.inputs`), the ops this program has."""
        if not op.kind.is_compute or op.stage is None:
            raise InternalError(f"{op} is not a compute op")
        chunks = None if self.chunks is None else self.chunks.count
        found = deps.inputs(
            op.kind, op.mb, op.stage, op.pipeline, op.chunk, self.num_stages, chunks
        )
        frozen = self.frozen is not None
        return tuple(
            Action(kind, mb, stage, pipe, chunk=chunk)
            for kind, mb, stage, pipe, chunk in found
            if kind in self.kinds or (frozen and kind is Kind.P)
        )

    def dump(self) -> str:
        """The text dump: one line per rank, actions as tokens (`Action.parse` reads each
        token back)."""
        width = len(str(self.num_ranks - 1))
        return "\n".join(
            f"rank {r:>{width}}: " + " ".join(a.text() for a in actions)
            for r, actions in enumerate(self.ranks)
        )

    def to_json(self) -> str:
        """The whole Program (comms included) as JSON, for the backends."""
        doc = {
            "format": "pipelang-program/1",
            "name": self.name,
            "source": self.source,
            "params": dict(self.params),
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "pipelines": [{"name": p.name, "placement": list(p.placement)} for p in self.pipelines],
            "assignment": list(self.assignment),
            "kinds": [k.value for k in self.kinds],
            "after": [[d.earlier.text(), d.later.text()] for d in self.after],
        }
        if self.partition is not None:
            doc["partition"] = list(self.partition)
        if self.weights is not None:
            doc["weights"] = self.weights.text()
        if self.frozen is not None:
            doc["frozen"] = list(self.frozen)
        if self.shapes is not None:
            doc["shapes"] = {
                "samples": list(self.shapes.samples),
                "lengths": list(self.shapes.lengths),
                "reference": self.shapes.reference(self.costs),
                "attention": self.costs.of("A"),
            }
        if self.chunks is not None:
            doc["chunks"] = {
                "count": self.chunks.count,
                "split": self.chunks.split,
                "attention": self.costs.of("A"),
            }
        # The ranks last, one a line, by json's C encoder (an indented dump is the
        # pure-Python one: seconds at 10^5 actions).
        ranks = ",\n  ".join(json.dumps([a.text() for a in actions]) for actions in self.ranks)
        return json.dumps(doc, indent=1)[:-2] + f',\n "ranks": [\n  {ranks}\n ]\n}}'

    @staticmethod
    def from_json(text: str) -> Program:
        """Read `to_json` back (source spans are not kept)."""
        doc = json.loads(text)
        if doc.get("format") != "pipelang-program/1":
            raise ValueError("not a pipelang program (missing format pipelang-program/1)")
        chunks, shapes = doc.get("chunks"), doc.get("shapes")
        costs: list[tuple[str, int | None, float]] = []
        for part in (chunks, shapes):
            if part is not None:
                costs.append(("A", None, float(part["attention"])))
        if shapes is not None:
            costs.append(("S", None, float(shapes["reference"])))
        return Program(
            name=doc["name"],
            source=doc["source"],
            params=tuple(doc["params"].items()),
            num_ranks=doc["num_ranks"],
            num_stages=doc["num_stages"],
            pipelines=tuple(Pipeline(p["name"], tuple(p["placement"])) for p in doc["pipelines"]),
            assignment=tuple(doc["assignment"]),
            kinds=tuple(Kind(k) for k in doc["kinds"]),
            ranks=tuple(tuple(Action.parse(t) for t in actions) for actions in doc["ranks"]),
            after=tuple(Dependency(Action.parse(a), Action.parse(b)) for a, b in doc["after"]),
            partition=tuple(doc["partition"]) if doc.get("partition") is not None else None,
            weights=WeightPolicy.parse(doc["weights"]) if "weights" in doc else None,
            frozen=tuple(doc["frozen"]) if doc.get("frozen") is not None else None,
            costs=CostModel().merged(CostModel(tuple(costs))),
            chunks=None if chunks is None else Chunks(chunks["count"], chunks["split"]),
            shapes=None
            if shapes is None
            else BatchShapes(tuple(shapes["samples"]), tuple(shapes["lengths"])),
        )
