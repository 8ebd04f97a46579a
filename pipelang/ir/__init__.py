"""The IR: a `Program` is, for every rank, the ordered list of `Action`s it runs.

One action type serves every stage of the compiler. Each action has a one-token text
form that `Action.parse` reads back; IR dumps, golden files and error grids use it:

    F3@1/down               forward of micro-batch 3 on stage 1 of pipeline `down`
    &B0@3/down              B0@3/down, started together with the action before it
                            (an overlapped pair `F(3, 1) & B(0, 3)`, or a full backward)
    send:F3@1/down>2        send what F3@1/down produced to rank 2
    recv:F3@1/down<1        receive what F3@1/down produced from rank 1
    signal:F2@1/down>0      tell rank 0 that F2@1/down finished (an `after` dependency)
    wait:F2@1/down<1        wait until rank 1 says F2@1/down finished
    allreduce@1/down        sum stage 1's gradients over every replica of stage 1
    gather@1/down           all-gather stage 1's sharded parameters (--shard); its
                            second gather of the step is gather1@1/down, ...
    reshard@1/down          drop stage 1's gathered parameters, keep its shard (--shard)
    reduce_scatter@1/down   sum stage 1's gradients over its --dp copies, a shard each
    step                    run the optimizer on every stage copy this rank holds
    E3@0/main>3             evict the activations F3@0/main kept to rank 3 (BPipe)
    H3@0/main               on the partner: hold what E3@0/main evicts until it is loaded
    L3@0/main               load those activations back (before B3@0/main needs them)
    F3.1@0/main             forward of chunk 1 of micro-batch 3 on stage 0, in a schedule
                            that splits micro-batches into sequence chunks (`chunks C`)
    P3@0/main               the frozen (non-trainable) part's forward of micro-batch 3,
                            whose output is the input of F3@0/main (DiffusionPipe)
    U2@1/main               the third weight update (number 2) of stage 1 of pipeline
                            `main`: it makes version 3 (asynchronous schedules only)

The package: `action.py` (op kinds, `Action` and its text form), `costs.py` (the cost
model, chunks, shapes, and the one rule for a cost entry), `deps.py` (the dependency
rule: which op waits for which), `placement.py` (which rank holds which stage, and every
question asked of it), `program.py` (`Program`).
"""

from pipelang.ir.action import (
    COMM_KINDS,
    COMPUTE_KINDS,
    GRAPH_KINDS,
    SHARD_KINDS,
    STASH_KINDS,
    Action,
    Kind,
)
from pipelang.ir.costs import (
    COST_KINDS,
    KV_SHARE,
    MAX_TIME,
    MW_SHARE,
    BatchShapes,
    Chunks,
    CostModel,
    cost_name_problem,
    cost_problem,
    shape_work,
    stage_problem,
)
from pipelang.ir.program import Dependency, Pipeline, Program, WeightPolicy

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "COST_KINDS",
    "GRAPH_KINDS",
    "KV_SHARE",
    "MAX_TIME",
    "MW_SHARE",
    "SHARD_KINDS",
    "STASH_KINDS",
    "Action",
    "BatchShapes",
    "Chunks",
    "CostModel",
    "Dependency",
    "Kind",
    "Pipeline",
    "Program",
    "WeightPolicy",
    "cost_name_problem",
    "cost_problem",
    "shape_work",
    "stage_problem",
]
