"""Weight prediction (XPipe, `--predict-weights`): how close asynchronous training gets
to synchronous training, with and without it.

    python benchmarks/weight_prediction.py [--steps 40] [--seed 0]

For PipeDream and PipeDream-2BW (D=4, N=8, gpt:tiny, micro-batch 4, the synthetic data of
`pipelang run`), with SGD (momentum 0.9) and Adam at their default learning rates, three
trainings from the same seed: the synchronous counterpart, asynchronous with stale
weights, and asynchronous with predicted weights. The synchronous counterpart makes the
same updates from the same micro-batches without staleness: the same schedule on one
stage (D=1: PipeDream is then SGD or Adam on one micro-batch at a time, 2BW on the mean
of each group of m = 4), so what differs is staleness alone. It prints, for the two
asynchronous ones:

- `weights`: the distance of the final weights to the synchronous run's, relative to how
  far the synchronous run moved them: ||W - W_sync|| / ||W_sync - W_0||;
- `loss`: the mean absolute difference of the per-step losses from the synchronous run's;
- the final step's loss of all three.

The trainings are the one-process replays that `--check` compares runs with
(backends/async_reference.py); tests/test_runtime_async.py shows `pipelang run` equals
them bitwise, with and without prediction.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from pipelang.api import load_program
from pipelang.backends.async_reference import train_async_reference
from pipelang.backends.config import RunConfig
from pipelang.backends.reference import Reference
from pipelang.backends.runtime import full_model_names

CASES = ("pipedream", "pipedream-2bw")
D, N = 4, 8


def distance(
    run: Reference, sync: Reference, start: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(relative weight distance, mean absolute loss difference) of `run` to `sync`."""
    apart = sum(float((run.weights[k] - sync.weights[k]).pow(2).sum()) for k in sync.weights)
    moved = sum(float((sync.weights[k] - start[k]).pow(2).sum()) for k in sync.weights)
    losses = [abs(a - b) for a, b in zip(run.losses, sync.losses, strict=True)]
    return (apart / moved) ** 0.5, sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    print(f"D={D} N={N} gpt:tiny, {args.steps} steps, seed {args.seed}")
    print(
        "| schedule | optimizer | stale: weights | stale: loss | predicted: weights "
        "| predicted: loss | final loss: sync, stale, predicted |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for optimizer in ("sgd", "adam"):
        config = RunConfig(backend="local", steps=args.steps, optimizer=optimizer, seed=args.seed)
        start = full_model_names(config.spec.build())
        for name in CASES:
            group = {"m": str(D)} if name == "pipedream-2bw" else {}
            one_stage = load_program(name, {"D": "1", "N": str(N), **group})
            sync = train_async_reference(config, one_stage, cpu)
            program = load_program(name, {"D": str(D), "N": str(N), **group})
            cells, finals = [], [sync.losses[-1]]
            for predict in (False, True):
                run = dataclasses.replace(config, predict_weights=predict)
                trained = train_async_reference(run, program, cpu)
                weights, loss = distance(trained, sync, start)
                cells += [f"{weights:.4f}", f"{loss:.4f}"]
                finals.append(trained.losses[-1])
            cells.append(", ".join(f"{f:.3f}" for f in finals))
            print(f"| {name} | {optimizer} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
