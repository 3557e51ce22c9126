"""Weights in transit from a learner to the generation engines: named tensors packed into flat buckets of about
`bucket_bytes`, so a sync moves a few large objects instead of hundreds of small ones, and a receiver can load
one bucket at a time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

Named = tuple[str, torch.Tensor]


@dataclass
class Bucket:
    """Tensors of one dtype laid end to end in `flat`."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    flat: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def group_by_size(items: Iterable[tuple[str, int]], bucket_bytes: int) -> Iterator[list[str]]:
    """Consecutive names whose sizes add up to at most `bucket_bytes` (a larger single item is its own group)."""
    group, size = [], 0
    for name, nbytes in items:
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group


def pack(named: list[Named]) -> list[Bucket]:
    """One bucket per run of equal dtype (mixed-precision models keep each tensor's own dtype)."""
    buckets: list[Bucket] = []
    run: list[Named] = []
    for name, tensor in named:
        if run and tensor.dtype != run[0][1].dtype:
            buckets.append(_flatten(run))
            run = []
        run.append((name, tensor))
    if run:
        buckets.append(_flatten(run))
    return buckets


def _flatten(run: list[Named]) -> Bucket:
    flat = torch.cat([t.detach().reshape(-1).cpu() for _, t in run])
    return Bucket([n for n, _ in run], [tuple(t.shape) for _, t in run], flat)


def unpack(bucket: Bucket) -> Iterator[Named]:
    """Views into the bucket's flat tensor, no copies."""
    offset = 0
    for name, shape in zip(bucket.names, bucket.shapes):
        numel = 1
        for dim in shape:
            numel *= dim
        yield name, bucket.flat[offset: offset + numel].view(shape)
        offset += numel
