"""What each consumer of a compiled schedule can run: one table of the features a Program
may use against the consumers that read one, from which every refusal and its message
comes.

A *feature* is something a schedule may declare that not every consumer handles:
replicas (several pipelines), recompute, asynchronous weights, a frozen part, sequence
chunks, micro-batch shapes, evicted activations, a split backward (`W`), sharded stages
(`--shard`: the compiler's `gather` and `reduce_scatter`). A *consumer* is what reads a compiled
Program: torch's CSV format (`export --format torch-csv`), `PipelineSchedule` (the
training-loop API), `synthesize` (which reads a placement's declarations), the stream
programs (the `streams` pass, and so `--graphs`, gloo and nccl), and the runtime's
options and paths that cannot take a feature yet (`--dp`, `--shard`, `--tp`, `--mixed-precision`,
`--clip-grad`, checkpoints, a GPU, and the runtime's own chunks and evictions, which
cannot take recompute). `refusal(program, consumer)` says why a consumer cannot run a
program, or None; `refuse` raises it as a diagnostic:

    refusal(seq1f1b, "torch-csv")
  =>
    "`seq1f1b` splits every micro-batch into 4 sequence chunks (`chunks`): torch's CSV
    format has no sequence chunks"

A feature a consumer gains is one line out of `REFUSED`.

Which features a schedule may declare together at all (chunks with a frozen part,
asynchronous weights or evictions; a frozen part with asynchronous weights) is not here:
that is the language's rule, which no Program breaks (E0210, E0211 at the declarations,
`passes/layout.py` and `orders.Layout.op`).
"""

from __future__ import annotations

from collections.abc import Callable

from pipelang.diagnostics import fail
from pipelang.ir import SHARD_KINDS, Kind, Program
from pipelang.source import Span


def _pipelines(p: Program) -> str | None:
    if len(p.pipelines) < 2:
        return None
    names = ", ".join(f"`{pipeline.name}`" for pipeline in p.pipelines)
    return f"has {len(p.pipelines)} pipelines ({names})"


def _async(p: Program) -> str | None:
    if p.weights is None:
        return None
    return f"is asynchronous (`weights {p.weights.text()}`) and updates its stages with `U`"


def _chunks(p: Program) -> str | None:
    if p.chunks is None:
        return None
    return f"splits every micro-batch into {p.chunks.count} sequence chunks (`chunks`)"


def _evictions(p: Program) -> str | None:
    evicts = p.first_eviction()
    return None if evicts is None else f"evicts activations to partner ranks (`{evicts}`)"


def _sharded(p: Program) -> str | None:
    if not any(a.kind in SHARD_KINDS for actions in p.ranks for a in actions):
        return None
    return "shards its stages over their --dp copies (`--shard`)"


USES: dict[str, Callable[[Program], str | None]] = {
    "pipelines": _pipelines,
    "recompute": lambda p: "recomputes forwards (`R`)" if Kind.R in p.kinds else None,
    "weights": _async,
    "frozen": lambda p: None if p.frozen is None else "runs a frozen part with `P`",
    "chunks": _chunks,
    "shapes": lambda p: (
        None
        if p.shapes is None
        else "gives each micro-batch its own shape (`lengths`, `sizes` or --lengths)"
    ),
    "evictions": _evictions,
    "split": lambda p: "splits W off its backward (`W`)" if Kind.W in p.kinds else None,
    "sharded": _sharded,
}
"""Each feature: how a program uses it, in words, or None when it does not."""

_CSV = "torch's CSV format"
_LOOP = "PipelineSchedule"
_SYNTH = "`synthesize` does not order {} yet; it orders the F, B and W ops of synchronous schedules"

REFUSED: dict[str, dict[str, str]] = {
    "torch-csv": {
        "pipelines": f"{_CSV} holds one pipeline (torch has no replicas or directions)",
        "recompute": f"{_CSV} has no recompute op `R`",
        "weights": f"{_CSV} has no weight update",
        "frozen": f"{_CSV} has no frozen (forward-only) work",
        "chunks": f"{_CSV} has no sequence chunks",
        "shapes": f"{_CSV} has one micro-batch shape",
        "evictions": f"{_CSV} cannot evict activations to another rank",
    },
    "PipelineSchedule": {
        "weights": f"{_LOOP} runs synchronous schedules only",
        "frozen": f"{_LOOP} does not run frozen work yet (`pipelang run` does)",
        "chunks": f"{_LOOP} does not run chunks yet (`pipelang run` does, on its GPT)",
        "shapes": f"{_LOOP} splits a batch into equal ones (`pipelang run` runs shapes)",
        "evictions": f"{_LOOP} does not move evicted activations yet",
    },
    "synthesize": {
        "frozen": _SYNTH.format("a frozen part"),
        "chunks": _SYNTH.format("sequence chunks"),
        "shapes": _SYNTH.format("micro-batches of different shapes"),
        "recompute": _SYNTH.format("recomputation"),
        "weights": _SYNTH.format("asynchronous weights"),
    },
    "stream programs": {
        "evictions": "evictions are not lowered to stream programs yet; run it without --graphs",
        "sharded": "sharded stages are not lowered to stream programs yet; run it without --graphs",
    },
    "--shard": {
        "pipelines": "--shard shards each stage over its --dp copies only; a stage with "
        "replicas in the schedule is not sharded yet; use a schedule of one pipeline",
        "weights": "--shard sums the gradients once per step, and an asynchronous schedule "
        "updates its stages at each `U` instead; use a synchronous schedule",
        "recompute": "--shard does not recompute a sharded stage's forward yet",
        "frozen": "--shard does not run a frozen part yet",
        "chunks": "--shard does not run sequence chunks yet",
        "evictions": "--shard does not evict a sharded stage's activations yet",
        "split": "--shard does not split a sharded stage's backward yet (its W would read "
        "the gathered weights after B); use a schedule without W, such as 1f1b",
    },
    "--tp": {
        "weights": "--tp splits each stage's blocks over its tensor ranks, and an "
        "asynchronous schedule's weight versions are not split yet; use a synchronous schedule",
        "split": "--tp does not split a tensor-parallel stage's backward yet (W would "
        "differentiate the local shards, not the DTensor parameters); use a schedule "
        "without W, such as 1f1b",
        "evictions": "--tp does not evict a tensor-parallel stage's activations yet",
        "frozen": "--tp does not split a frozen part yet",
    },
    "--dp": {
        "weights": "the runtime cannot run an asynchronous schedule with --dp yet: each "
        "stage copy updates on its own at every `U`, and the data-parallel copies would "
        "need their gradients summed before each update; run it without --dp",
    },
    "--mixed-precision": {
        "weights": "its weight versions are not kept as fp32 masters yet; run it with "
        "--dtype instead of --mixed-precision",
    },
    "--clip-grad": {
        "weights": "each stage updates on its own at its `U`, so there is no one step at "
        "which to take the global gradient norm; run it without --clip-grad",
    },
    "checkpoints": {
        "weights": "its ranks hold several versions of their weights, which checkpoints do "
        "not save yet; run it without --save and --resume",
    },
    "a GPU": {
        "evictions": "evictions have run only on the CPU so far (gloo, or local without a "
        "GPU); the CUDA path is untested, so it is refused rather than trusted; see "
        "docs/runtime.md",
    },
    "the runtime's evictions": {
        "recompute": "a forward that will be recomputed saves nothing to evict, and the "
        "runtime does not move a recomputed forward's input yet",
    },
    "the runtime's chunks": {
        "shapes": "it has sequence chunks too, and the runtime cannot run the two together yet",
        "recompute": "the runtime cannot recompute a chunk over its cached keys and values yet",
    },
}
"""Per consumer, the features it cannot run and why."""


def refusal(program: Program, consumer: str) -> str | None:
    """Why `consumer` (a key of `REFUSED`) cannot run `program`: the first feature the
    program uses that the consumer refuses, or None."""
    found = _refused(program, consumer)
    return None if found is None else found[1]


def refuse(program: Program, consumer: str, code: str, span: Span | None = None) -> None:
    """Raise `refusal` as diagnostic `code` where `consumer` cannot run `program`: at
    `span`, else where the program uses the feature (its first eviction, say)."""
    found = _refused(program, consumer)
    if found is not None:
        feature, message = found
        raise fail(code, message, span or _where(program, feature))


def _refused(program: Program, consumer: str) -> tuple[str, str] | None:
    """The first feature `program` uses that `consumer` refuses, and the refusal's words."""
    for feature, why in REFUSED[consumer].items():
        use = USES[feature](program)
        if use is not None:
            return feature, f"`{program.name}` {use}: {why}"
    return None


def _where(program: Program, feature: str) -> Span | None:
    """Where `program`'s source uses `feature`, where one place says it."""
    if feature == "evictions":
        evicts = program.first_eviction()
        return None if evicts is None else evicts.span
    declared = {"weights": program.weights, "chunks": program.chunks, "shapes": program.shapes}
    return getattr(declared.get(feature), "span", None)
