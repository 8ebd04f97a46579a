"""The runtime: run a compiled Program for real on torch.

- `models`: the models a run trains (`gpt:tiny|small|medium`, or `module:callable`), each an
  ordered list of layers cut into contiguous stages, and the synthetic dataset.
- `executor`: what each op of a rank's program does, one call on its runtime per op
  kind (a table), run every step; `codegen` writes the same calls as one plain Python
  program per rank (`compile -o`).
- `runtime`: `RankRuntime`, the `rt` those calls go to (F, B, W, R, send, recv,
  allreduce, step).
- `transport`: how ranks move tensors: torch.distributed (gloo, nccl) or in one process.
- `launch`: `pipelang run`: checks, launches the ranks, watches them, reports.
- `backend`: the backends (`--backend`), one row each in `BACKENDS`.
- `reference`: the single-process training `--check` compares with.

The run's choices live here, where the CLI reads them without importing torch.
"""

OPTIMIZERS = ("sgd", "adam", "adamw")
DTYPES = ("float32", "bfloat16", "float16")
