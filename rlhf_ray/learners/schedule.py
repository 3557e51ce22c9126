"""Which samples each rank trains on at each optimizer step: a pure function of (step, rank), so resuming at
step k replays nothing and skips nothing."""

from __future__ import annotations

import numpy as np

from rlhf_ray.data.split import stable_seed


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


def micro_batches(num_samples: int, global_batch: int, micro: int, world_size: int, rank: int, step: int,
                  seed: int) -> list[list[int]]:
    """Sample indices of this rank's micro-batches for optimizer step `step`. Each epoch is a fresh seeded
    permutation; the global batch of a step is one contiguous slice of it, dealt out micro-batch by micro-batch
    so that every rank gets distinct samples. A last partial global batch of an epoch is skipped."""
    per_epoch = steps_per_epoch(num_samples, global_batch)
    if per_epoch == 0:
        raise ValueError(f"{num_samples} training samples cannot fill one global batch of {global_batch}")
    epoch, within = divmod(step, per_epoch)
    order = np.random.default_rng(stable_seed(seed, "epoch", epoch)).permutation(num_samples)
    base = within * global_batch
    accum = global_batch // (micro * world_size)
    return [order[base + (a * world_size + rank) * micro: base + (a * world_size + rank + 1) * micro].tolist()
            for a in range(accum)]


def eval_share(num_rows: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """This rank's rows of an evaluation set (every world_size-th), and how many loss-free filler rows it adds so that
    every rank runs the same number of forwards: under ZeRO-3 each forward gathers parameters from all ranks, and a
    rank that stopped early would leave the others waiting."""
    mine = list(range(rank, num_rows, world_size))
    return mine, -(-num_rows // world_size) - len(mine)


def eval_batches_in_step(num_rows: int, rank: int, world_size: int, batch_size: int) -> list[list[int] | None]:
    """This rank's evaluation rows in batches of indices, then None for each forward it runs only to keep in step
    with the rank that has the most batches (a discarded forward of any row; see eval_share). For evaluations
    whose rows cannot be made loss-free (pairs)."""
    mine, fill = eval_share(num_rows, rank, world_size)
    batches: list[list[int] | None] = [mine[i: i + batch_size] for i in range(0, len(mine), batch_size)]
    most = -(-(len(mine) + fill) // batch_size)
    return batches + [None] * (most - len(batches))
