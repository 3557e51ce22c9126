"""Weights in transit from a learner to the generation engines: named tensors packed into flat buckets of about
`bucket_bytes`, so a sync moves a few large objects instead of hundreds of small ones, and a receiver can load
one bucket at a time.

A bucket's bytes are a numpy uint8 array: Ray stores and reads numpy buffers without pickling them, so a bucket
crosses the object store with one copy in (pack) and the receiver reads it in place (no copy out)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

Named = tuple[str, torch.Tensor]


@dataclass
class Bucket:
    """Tensors of one dtype laid end to end in `data` (raw bytes)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


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


def dtype_runs(named: list[Named]) -> Iterator[list[Named]]:
    """Consecutive runs of tensors of one dtype (mixed-precision models keep each tensor's own dtype)."""
    run: list[Named] = []
    for name, tensor in named:
        if run and tensor.dtype != run[0][1].dtype:
            yield run
            run = []
        run.append((name, tensor))
    if run:
        yield run


def flatten(run: list[Named], device: torch.device | None = None) -> torch.Tensor:
    """One flat tensor of a same-dtype run (one copy, on `device` or the tensors' own)."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to(device or t.device) for _, t in run])


def pack(named: list[Named]) -> list[Bucket]:
    """Buckets for the object store. The tensors are read, never kept: callers may pass live (e.g. just
    gathered) parameters."""
    buckets = []
    for run in dtype_runs(named):
        data = flatten(run).cpu().view(torch.uint8).numpy()  # the same bytes, as numpy (bf16 has no numpy dtype)
        buckets.append(Bucket([n for n, _ in run], [tuple(t.shape) for _, t in run], run[0][1].dtype, data))
    return buckets


def split_flat(flat: torch.Tensor, names: list[str], shapes: list[tuple[int, ...]]) -> Iterator[Named]:
    """Views of a flat tensor as the named tensors laid end to end in it."""
    offset = 0
    for name, shape in zip(names, shapes):
        numel = int(torch.Size(shape).numel())
        yield name, flat[offset: offset + numel].view(shape)
        offset += numel


def unpack(bucket: Bucket) -> Iterator[Named]:
    """Views into the bucket's bytes, no copies (read-only when they live in the object store: load, don't
    modify)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the views are only read
        flat = torch.from_numpy(bucket.data).view(bucket.dtype)
    yield from split_flat(flat, bucket.names, bucket.shapes)


def layer_of(name: str) -> str:
    """The decoder layer a parameter belongs to ('model.layers.3' for 'model.layers.3.mlp.up_proj.weight'), or
    the name itself outside the numbered layers (embeddings, final norm, head)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def whole_layers(units: list[list[str]]) -> list[list[str]]:
    """Consecutive units (lists of names) of one decoder layer merged: a bucket never splits a layer, so an engine
    can reload each bucket on its own (vLLM reloads a layer once all of its tensors came, within one call)."""
    merged: list[list[str]] = []
    for unit in units:
        if merged and layer_of(merged[-1][0]) == layer_of(unit[0]) != unit[0]:
            merged[-1] = merged[-1] + unit
        else:
            merged.append(list(unit))
    return merged
