"""Every diagnostic code, with the explanation `pipelang explain CODE` prints."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Code:
    """One diagnostic code: a title and a paragraph or two on causes and fixes."""

    code: str
    title: str
    explanation: str


CODES: dict[str, Code] = {
    c.code: c
    for c in (
        # 00xx: reading and parsing
        Code(
            "E0001",
            "syntax error",
            "The text does not follow the grammar of `.pipe` files. "
            "The caret marks the first token that could not continue the program; the "
            "message lists what was expected there. See docs/language.md for the grammar.",
        ),
        Code(
            "E0002",
            "unexpected end of file",
            "The file ends in the middle of a construct, "
            "usually a missing `}` or an unfinished expression. Check that every `{` has "
            "its `}`.",
        ),
        Code(
            "E0003",
            "unreadable file",
            "The file could not be read as UTF-8 text (binary "
            "data, a directory, or a missing file).",
        ),
        Code(
            "E0004",
            "import not found",
            'An `import "path.pipe"` names a file that does not '
            "exist. Paths are relative to the importing file; a bare stdlib name such as "
            '`import "1f1b"` is looked up in the standard library.',
        ),
        Code(
            "E0005",
            "import cycle",
            "A file imports itself, directly or through other files. "
            "Imports bring in `fn` definitions only, so a cycle is never needed: move the shared "
            "functions into a file of their own.",
        ),
        Code(
            "E0006",
            "no schedule in file",
            "The file has no `schedule` block, or has more than "
            "one. A `.pipe` file that is run or checked holds exactly one schedule; files "
            "meant only for `import` hold `fn` definitions.",
        ),
        Code(
            "E0007",
            "malformed torch CSV",
            "`pipelang import-torch` reads torch's compute-only "
            "CSV schedule: one row per rank, cells like `2F0` (stage 2, forward, micro-batch 0) "
            "with kinds F, I (input gradient), W (weight gradient) and B (full backward); empty "
            "cells are idle steps and communication cells are dropped. A cell that is none of "
            "these, an overlapped `OVERLAP_F_B` pair, or a mix of full and split backwards "
            "cannot be imported.",
        ),
        # 01xx: names, types, evaluation
        Code(
            "E0101",
            "unknown name",
            "An identifier is used that is neither a parameter, a "
            "`let`, a loop variable, a `fn`, nor a builtin (`min`, `max`). Check the spelling; "
            "names are case-sensitive.",
        ),
        Code(
            "E0102",
            "duplicate definition",
            "A parameter, pipeline, `fn` or `let` is defined twice in the same scope.",
        ),
        Code(
            "E0103",
            "wrong arguments",
            "A function or op is called with the wrong number or "
            "kind of arguments. Ops take `(mb)` or `(mb, stage)`; named arguments are "
            "`mb=` and `stage=`.",
        ),
        Code(
            "E0104",
            "division by zero",
            "An integer `//` or `%` has a zero right-hand side for the parameter values given.",
        ),
        Code(
            "E0105",
            "type mismatch",
            "A boolean was used where an integer is needed or the "
            "other way round (for example `if N` instead of `if N > 0`).",
        ),
        Code(
            "E0106",
            "schedule too large",
            "Expanding the schedule would create more ops or "
            "loop iterations than the compiler's limit. The limit keeps a mistyped parameter "
            "(N=10**9) from exhausting memory; pass smaller parameters.",
        ),
        Code(
            "E0107",
            "unknown pipeline",
            "A `microbatches` assignment or a pipeline index names a "
            "pipeline that is not declared.",
        ),
        # 02xx: parameters
        Code(
            "E0201",
            "missing parameter",
            "A schedule parameter has no default and was not given. Give it with `-p NAME=VALUE`.",
        ),
        Code(
            "E0202",
            "unknown parameter",
            "`-p NAME=VALUE` names a parameter the schedule does "
            "not declare. `pipelang list` shows each stdlib schedule's parameters.",
        ),
        Code(
            "E0203",
            "parameter of the wrong type",
            "A parameter value does not parse as the "
            "declared type: `int` takes an integer such as `8`, `bool` takes `true` or `false`.",
        ),
        Code(
            "E0204",
            "requirement failed",
            'A `require COND : "message"` in the schedule is false '
            "for the parameter values given. The message says what the schedule needs.",
        ),
        Code(
            "E0205",
            "bad placement",
            "A pipeline's placement is not a function from every stage "
            "`0..S` to a rank `0..R`: a stage is missing, placed twice, or sent to a negative "
            "rank; or two pipelines disagree on the number of stages.",
        ),
        Code(
            "E0206",
            "bad micro-batch assignment",
            "Each micro-batch `0..N` must be assigned to "
            "exactly one pipeline by `microbatches`; one is unassigned, assigned twice or "
            "negative, or there are none.",
        ),
        Code(
            "E0207",
            "missing or repeated declaration",
            "A schedule needs at least one "
            "`pipeline`, exactly one `microbatches` and exactly one `order` (`order rank`, "
            "`order greedy` or `order repeat`), and at most one `ops`.",
        ),
        Code(
            "E0208",
            "bad partition",
            "`partition 3, 5, 4, 4` says how many of the model's layers each stage holds, "
            "in stage order: it needs one count per stage and every count at least 1. "
            "(Whether the counts add up to the model's layers is checked when `pipelang "
            "run` builds the model.) `pipelang plan` writes this line for you.",
        ),
        Code(
            "E0209",
            "bad cost",
            "A `cost` entry sets the time of an op kind, for every stage (`F = 2`) or for "
            "one (`F[3] = 2`). The stage must be one of the schedule's, 0 up to its stages "
            "less one, and a time at most 10^15 (so that sums of times stay finite); an "
            "entry that could not take effect is an error rather than ignored.",
        ),
        Code(
            "E0210",
            "bad frozen part",
            "`frozen on rank EXPR` and `frozen on ranks A..B` name the ranks that hold the "
            "model's frozen (non-trainable) part, whose forward `P(mb)` makes the input of "
            "each micro-batch's stage 0. Every rank named must be one of the schedule's "
            "(`0..R`, the ranks the placement uses), and together the lines must name at "
            "least one. A schedule with frozen work cannot be asynchronous (`weights`) or "
            "use `order repeat` (which places ops by stage, while a `P` may run on any "
            "holder) yet: write its order with `order rank` or `order greedy`.",
        ),
        Code(
            "E0211",
            "bad sequence chunks",
            "`chunks C` splits every micro-batch into C sequence chunks (`equal tokens`, the "
            "default, or `equal compute`), so C must be at least 1. A chunked micro-batch's "
            "ops wait on each other on one stage (a chunk's forward reads the keys and "
            "values of the chunks before it; backwards run last chunk first), which an "
            "`order repeat` block, one micro-batch's ops placed by stage, cannot express: "
            "write the order with `order rank` or `order greedy`. Chunks do not combine "
            "with frozen work, evictions (`E`, `L`) or asynchronous weights yet.",
        ),
        Code(
            "E0212",
            "bad micro-batch shapes",
            "`lengths L0, L1, ...` gives each micro-batch's sequence length in tokens and "
            "`sizes S0, S1, ...` its number of samples (default 1 each), for micro-batches "
            "of different shapes (DynaPipe). Each gives exactly one value per micro-batch, "
            "every value at least 1, and `sizes` needs `lengths`. A `--lengths FILE` (one "
            "`LENGTH` or `SAMPLES LENGTH` line per micro-batch, as `pipelang pack` writes "
            "it) stands for both lines and must also list as many micro-batches as the "
            "schedule has: set N to its count.",
        ),
        Code(
            "E0213",
            "bad sequence list",
            "`pipelang pack --sequences FILE` reads one sequence length in tokens per line "
            "(a whole number from 1 to 10^15; `#` starts a comment, blank lines are "
            "skipped). A line with another word, a number out of range, or a file that "
            "lists no sequence cannot be packed.",
        ),
        # 03xx: the order
        Code(
            "E0301",
            "op on the wrong rank",
            "An op is listed in the order of a rank that does "
            "not hold its stage for the op's pipeline. The placement decides where an op runs; "
            "the order only decides when.",
        ),
        Code(
            "E0302",
            "duplicated op",
            "The same op (kind, micro-batch, stage) appears twice in "
            "the orders. Each op runs exactly once.",
        ),
        Code(
            "E0303",
            "missing op",
            "An op the schedule must run never appears in any rank's "
            "order. Every micro-batch needs an F and a B on every stage of its pipeline "
            "(and W, R where `ops` declares them).",
        ),
        Code(
            "E0304",
            "backward before its forward",
            "A rank runs B of a (micro-batch, stage) "
            "before its F; the backward needs the activations the forward saved.",
        ),
        Code(
            "E0305",
            "weight gradient before its backward",
            "A rank runs W of a (micro-batch, "
            "stage) before its B (or R after B, or R before F); W needs the output gradient "
            "B received.",
        ),
        Code(
            "E0306",
            "deadlock",
            "The ops wait on each other in a cycle: each needs a result "
            "that another one in the cycle produces later in its rank's order. The diagnostic "
            "lists the cycle with the source line of each op and a rank x step grid. Reorder "
            "one of the ranks so that the cycle is broken.",
        ),
        Code(
            "E0307",
            "mismatched transfers",
            "A lowered program (one with `send`/`recv` "
            "actions, such as a `schedule.json` edited by hand) lists the two ends of its "
            "transfers on one channel (one directed pair of ranks) in different orders, or "
            "lists an end with no partner. A channel delivers in the order it is sent, so "
            "its k-th send (or signal) must match its k-th recv (or wait): same op, recv for "
            "send, wait for signal. The compiler never makes this mistake: a rank may consume "
            "what another sends in any order, and `insert-comms` receives in the sender's "
            "order: each recv goes right before the first op that needs it, or earlier when a "
            "message sent after it is needed sooner. Every runtime that reads a "
            "`schedule.json` (a rank file, `python -m pipelang.backends`) checks this "
            "before it starts any rank.",
        ),
        Code(
            "E0308",
            "too many activations in flight",
            "A rank holds more activations (forwards "
            "whose backward has not run) than `--max-activations` allows.",
        ),
        Code(
            "E0309",
            "op kind not declared",
            "The order uses `W` or `R`, but the schedule's "
            "`ops` line does not declare it. Add `ops F, B, W` (split backward) or `ops F, B, "
            "R` (recompute).",
        ),
        Code(
            "E0310",
            "slot collision",
            "In a `repeat` order two ops land on the same rank in the "
            "same slot; the block's offsets must give each rank at most one op per slot.",
        ),
        Code(
            "E0311",
            "greedy policy stuck",
            "The greedy policy reached a point where no rank can "
            "run a ready op without breaking its in-flight `cap`, and ops remain. Raise the cap "
            "or change the priority.",
        ),
        Code(
            "E0312",
            "collectives in different orders",
            "Two ranks run the same pair of "
            "gradient allreduces in opposite orders; each would wait for the other forever.",
        ),
        Code(
            "E0313",
            "weight update misplaced",
            "A weight update `U` belongs to an asynchronous schedule: one that declares how "
            "it versions its weights (`weights stash`, `weights latest` or `weights K`). "
            "Such a schedule has one pipeline (no replicas to synchronise), and every "
            "gradient it computes must be applied: each stage copy needs a `U` after its "
            "last backward (or weight-gradient op) on its rank. Declare `weights ...`, or "
            "remove the `U`; add a `U()` after the last backward of each stage.",
        ),
        Code(
            "E0314",
            "too many weight versions",
            "With `weights K` a stage copy may hold at most K versions of its weights at "
            "once: the newest, plus every older version a micro-batch in flight still "
            "needs for its backward (weight stashing). An update that makes version v+1 "
            "while micro-batches forwarded on K older versions still await their backward "
            "would need K + 1. Update less often (accumulate over more micro-batches: "
            "PipeDream-2BW needs about as many as there are stages), or allow more versions "
            "(`weights stash` keeps as many as needed).",
        ),
        Code(
            "E0315",
            "evicted activations not loaded back in order",
            "`E(i) -> rank p` sends the activations `F(i)` kept to rank p (BPipe) and "
            "`L(i)` takes them back. On the rank that runs the forward, each evicted "
            "forward needs exactly this order: `F(i)`, then `E(i) -> rank p`, then `L(i)`, "
            "then the ops that need the activations (`R(i)`, `B(i)`). An `E` that is never "
            "loaded back, an `L` with no `E`, an `E` before its forward, an `L` before its "
            "`E`, or a backward (or recompute) before the `L` is this error. Move the `L` "
            "right before the backward, or the `E` right after the forward.",
        ),
        Code(
            "E0316",
            "bad eviction partner",
            "`E(i) -> rank p` evicts activations to rank p, which must be another rank of "
            "the schedule: not the evicting rank itself, and within `0..R` (the ranks the "
            "placement uses). BPipe pairs rank r with `D - 1 - r`.",
        ),
        Code(
            "E0317",
            "frozen forward on a rank without the frozen part",
            "`P(mb)` runs the model's frozen part, so it must be listed on a rank that the "
            "schedule's `frozen` lines name; any of them will do (its output is sent to "
            "the rank of the micro-batch's stage 0). List it on a holder, or add the rank "
            "to `frozen`.",
        ),
        Code(
            "E0318",
            "forward before its frozen forward",
            "With a frozen part, a micro-batch's forward on stage 0 reads the output of its "
            "`P`. Where both are on one rank, the `P` must come first in that rank's order, "
            "or the rank would wait for itself.",
        ),
        Code(
            "E0319",
            "op with a wrong chunk",
            "In a schedule with `chunks C`, every F, B, W and R names its chunk: "
            "`F(i, chunk=c)` with c in 0..C (the chunks of a micro-batch are separate ops). "
            "In a schedule without `chunks`, no op names one, and a frozen forward `P` runs "
            "on a whole micro-batch.",
        ),
        Code(
            "E0320",
            "chunks out of order",
            "With sequence chunks, a chunk's forward on a stage reads the keys and values "
            "that the forwards of the chunks before it made there, and its backward hands "
            "their gradients back to them. So on each stage a micro-batch's forwards run "
            "in chunk order (0, 1, ...) and its backwards in reverse (last chunk first), "
            "as Seq1F1B does. List them in that order.",
        ),
        Code(
            "E0321",
            "schedule cannot be sharded",
            "`--dp K --shard` shards each stage copy over its K data-parallel copies: the "
            "compiler adds an all-gather (`gather@s/p`) before the copy's first op of the "
            "step and one reduce-scatter (`reduce_scatter@s/p`) after its last backward. "
            "It does not shard yet a schedule with replicas of a stage (several "
            "pipelines), asynchronous weights, recompute (`R`), a frozen part, sequence "
            "chunks, evictions or a split backward (`W`); the message names which. Run "
            "such a schedule without --shard.",
        ),
        Code(
            "E0322",
            "shard ops out of place",
            "Under `--dp K --shard` a stage copy must be gathered whenever its rank runs "
            "one of its ops. The compiler gathers it before its first op of the step "
            "unless the order writes `gather()` first; after a `reshard()` (which drops "
            "the gathered parameters) the order must write `gather()` again before the "
            "copy's next op. A `reshard()` needs a gathered copy (the reduce-scatter "
            "after the copy's last backward reshards it already), a `gather()` a copy "
            "that is not gathered and an op that uses it before the next reshard. "
            "`gather()` and `reshard()` need --shard: compile with --dp K --shard, or "
            "drop them.",
        ),
        # 04xx: the planner's inputs (`pipelang profile`, `pipelang plan`)
        Code(
            "E0401",
            "bad profile",
            "The file given to `pipelang plan --profile` is not a profile that `pipelang "
            "profile` writes: it is not JSON, lacks the `format: pipelang-profile/1` marker, "
            "or a layer lacks a field (`forward_ms`, `backward_input_ms`, "
            "`backward_weight_ms`, `activation_bytes`, `weight_bytes`, `output_bytes`; "
            "`backward_ms`, `sgd_step_ms`, `adam_step_ms` are optional) or gives a "
            "negative or non-numeric value, or the optional `runtime` calibration is not "
            "an object of such numbers. Write it again with `pipelang profile "
            "--model M -o PROFILE.json`; docs/planner.md describes every field.",
        ),
        Code(
            "E0402",
            "bad topology",
            "The file given to `pipelang plan --topology` is not a cluster description the "
            "planner reads: not YAML, a missing or unknown key, a size, bandwidth or "
            "latency without a unit it knows (`80GiB`, `300GB/s`, `100Gbit/s`, `2us`), or "
            "a link naming a device that is not listed. Either list `devices` (and "
            "`links`, with a `default_link`), or use the shorthand `nodes`, "
            "`gpus_per_node`, `memory`, `intra_node`, `inter_node`; see docs/planner.md.",
        ),
        Code(
            "E0403",
            "no plan fits",
            "`pipelang plan` found no candidate (schedule, parameters, partition) that runs "
            "under the memory cap on every device, or none at all that the model and the "
            "cluster allow (more stages than layers, a schedule's `require` failing). The "
            "message lists each candidate's reason. Raise `--max-memory`, give more "
            "devices, or use a smaller micro-batch when profiling.",
        ),
        Code(
            "E0404",
            "calibration run failed",
            "`pipelang profile --calibrate BACKEND` runs the model under `pipelang run` "
            "(1F1B on `--calibrate-ranks` ranks, with `--trace`) to measure what the "
            "runtime adds per action and per message, and that run failed; the notes show "
            "the end of its error. Check that `pipelang run` works for this model and "
            "backend, or profile without `--calibrate`.",
        ),
        # 05xx: stream programs (`--dump-after streams`, `pipelang check-streams`)
        Code(
            "E0501",
            "unreadable stream program",
            "A line of the file given to `pipelang check-streams` is not a stream program "
            "op. Each op line is `rR.STREAM OP [reads SLOT=VALUE ...] [writes SLOT=VALUE "
            "...] [updates gS/PIPE ...]`, where STREAM is compute, sendP, recvP or reduceS "
            "and OP is `record eN`, `wait eN` or an action token (`F0@1/main`, "
            "`send:F0@1/main>2`, `allreduce@1/main`, `step`); lines starting with `#` are "
            "comments. `pipelang compile SCHED --dump-after streams` writes this form; "
            "docs/runtime.md describes it.",
        ),
        Code(
            "E0502",
            "race on a slot",
            "Two ops touch the same buffer slot from different streams and nothing orders "
            "them: a read that may run before the write of the value it expects "
            "(read-after-write), a write that may run before the previous value's last "
            "read (write-after-read), or two unordered writes. On a GPU this reads garbage "
            "or half-written data, silently. Order them with `record eN` after the first "
            "op on its stream and `wait eN` before the second on the other; the check "
            "covers two iterations back to back, so a race across the iteration boundary "
            "counts too.",
        ),
        Code(
            "E0503",
            "stream program deadlock",
            "No stream can move: each waits for an event not yet recorded, a channel's "
            "other end, or the other members of an allreduce, in a cycle. A CUDA graph "
            "capture of this program would hang on replay (captured NCCL calls have no "
            "timeout). The labels show where every stream is stuck.",
        ),
        Code(
            "E0504",
            "channel out of order",
            "A channel delivers its messages in the order they were sent: the k-th send "
            "on `rA.sendB` meets the k-th receive on `rB.recvA`. Here the two ops that "
            "meet name different messages (or a send meets something that is not a "
            "receive). Reorder the sends or the receives so both ends agree.",
        ),
        Code(
            "E0505",
            "event used before it is recorded",
            "`wait eN` holds its stream until `record eN` has run, but only if the record "
            "was issued first: CUDA treats waiting on an event never recorded as already "
            "complete, and a capture would miss the edge. Every `wait eN` must come after "
            "its `record eN` in its process's lines, and every event is recorded once.",
        ),
        Code(
            "E0506",
            "cannot lower to streams",
            "The program uses something the `streams` pass does not lower yet: evicted "
            "activations (`E`, `H`, `L`, BPipe). Run it without --graphs (the eager "
            "runtime runs evictions on the CPU).",
        ),
        Code(
            "E0507",
            "stream not forked or joined",
            "A captured iteration must start every side stream from the compute stream "
            "(its first op waits for an event of the compute stream, through the "
            "process's own record/wait pairs) and end with the compute stream waiting "
            "for every side stream. A chain through another rank does not count: a "
            "meeting of a send and a receive is not an edge of a CUDA graph.",
        ),
        # 06xx: synthesis (`pipelang synthesize`)
        Code(
            "E0601",
            "cap below what any order meets",
            "`pipelang synthesize --max-activations M` asks for an order in which no rank "
            "holds more than M micro-batches of activations, and no order can: when a "
            "micro-batch's last forward runs, none of its backwards has run yet, so every "
            "rank holds that micro-batch's forwards on all the stages it has of its "
            "pipeline (two on a V). The message names the least cap; raise M to it or "
            "more, or use a placement with fewer stages per rank.",
        ),
        Code(
            "E0602",
            "schedule synthesize cannot order",
            "`pipelang synthesize` orders the F, B and W ops of synchronous schedules. It "
            "does not handle a frozen part (`frozen on`), sequence chunks, micro-batches "
            "of different shapes, recomputation (`R`) or asynchronous weights (`weights`) "
            "yet. Synthesize on a placement without them (a file of `pipeline` and "
            "`microbatches` lines will do).",
        ),
        Code(
            "E0604",
            "profile or topology does not fit the placement",
            "`pipelang synthesize --profile P.json` gives each stage the times of its "
            "layers: the schedule's `partition` line, else the layers split evenly. The "
            "profile needs at least one layer per stage, and as many layers as a "
            "`partition` line adds up to. With `--topology`, rank r runs on the "
            "topology's device r, so it needs a device per rank.",
        ),
        Code(
            "E0605",
            "too many ops to synthesize",
            "`pipelang synthesize` gives the solver every op of the iteration (micro-batches "
            "x stages x op kinds), and the solver's memory grows with them: it takes at "
            "most 8,192 ops (D = 16, N = 128 with B and W split is 6,144, about 650 MB). "
            "Synthesize for fewer micro-batches or stages.",
        ),
        Code(
            "E0603",
            "solver not installed",
            "`pipelang synthesize` searches with OR-Tools' CP-SAT solver, an optional "
            "dependency. Install it with `pip install 'pipelang[synth]'` (or `pip install "
            "ortools`).",
        ),
    )
}
