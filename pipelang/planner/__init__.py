"""The planner: choose schedule, partition and device mapping for a model on a cluster.

    topology.py    the cluster: devices, memory, links (YAML)
    units.py       sizes, bandwidths and latencies written with units
    partition.py   the exact DP that cuts layers into stages
    mapping.py     ranks onto devices, heavy traffic on fast links
    costs.py       traffic, gradient allreduce and peak memory of a plan
    model.py       one plan compiled and simulated; bound.py its lower bound
    families.py    the schedules it tries, the memory each optimizer keeps per weight
    search.py      candidates, the simulator as cost model, memory, ranking
    plans.py       the inputs, candidates and plans; budget.py keeps --time-budget
    write.py       the winner as a `.pipe` file
    demo.py        a model with one layer four times heavier, to plan for

What it plans from, a model's per-layer costs, is `pipelang/profile.py` (the runtime
measures it: `pipelang profile`); the commands are `pipelang/cli/plan.py` and
`pipelang/cli/profile.py`.

docs/planner.md explains the search and its cost model.
"""
