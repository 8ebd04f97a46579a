"""The planner: choose schedule, partition and device mapping for a model on a cluster.

    profile.py     `pipelang profile`: per-layer times and memory, measured
    topology.py    the cluster: devices, memory, links (YAML)
    partition.py   the exact DP that cuts layers into stages
    mapping.py     ranks onto devices, heavy traffic on fast links
    costs.py       traffic, gradient allreduce and peak memory of a plan
    search.py      candidates, the simulator as cost model, memory, ranking
    write.py       the winner as a `.pipe` file
    command.py     the two commands
    demo.py        a model with one layer four times heavier, to plan for

docs/planner.md explains the search and its cost model.
"""
