"""Weight updates for a tensor-parallel vLLM engine, whose workers are processes of their own.

The engine actor lays each whole-layer chunk of the update once into a file in shared memory and sends the workers
only the chunk's table of contents (names, dtypes, shapes, offsets: a few KB). Each worker maps the file and hands
vLLM views into it; vLLM's weight loaders narrow every view to the worker's own shard and copy just that. So a
worker reads its shard and copies nothing else, the chunk exists once per node whatever the tensor-parallel size,
and no process ever holds the whole model. (Sending the chunk itself through `collective_rpc` would unpickle a
private copy of every whole tensor in every worker: tp_size + 1 copies of each chunk on the node.)

On GPUs the chunk passes through host memory: the workers copy their shards to their devices from it."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlhf_ray.models.weight_buckets import Named

ALIGN = 64
"""Byte alignment of every tensor in the file (whole cache lines; any dtype's element size divides it)."""


@dataclass(frozen=True)
class StagedChunk:
    """Where a chunk of named tensors lies in a shared file: all a worker needs to read it."""

    path: str
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    nbytes: int


def staging_dir(nbytes: int) -> str:
    """/dev/shm when it has room for `nbytes` (container defaults are as small as 64 MB and a write past its end
    kills the writer with SIGBUS), else the temporary folder (a file in the page cache: still one copy, shared)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize >= 2 * nbytes:
            return shm
    return tempfile.gettempdir()


def _layout(chunk: list[Named]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for _, tensor in chunk:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return offsets, end


def _views(buffer, toc: StagedChunk) -> Iterator[Named]:
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    for name, dtype, shape, offset in zip(toc.names, toc.dtypes, toc.shapes, toc.offsets):
        numel = int(torch.Size(shape).numel())
        yield name, flat[offset: offset + numel * dtype.itemsize].view(dtype).view(shape)


def _write(fd: int, tensor: torch.Tensor, offset: int) -> None:
    data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy())
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


@contextlib.contextmanager
def staged(chunk: list[Named], directory: str | None = None) -> Iterator[StagedChunk]:
    """Writes the chunk's tensors (any device) into a new shared file, yields its table of contents, and removes
    the file on exit, also when loading failed."""
    offsets, nbytes = _layout(chunk)
    fd, path = tempfile.mkstemp(prefix="rlhf-ray-weights-", dir=directory or staging_dir(nbytes))
    try:
        os.ftruncate(fd, nbytes)
        for (_, tensor), offset in zip(chunk, offsets):
            _write(fd, tensor, offset)
        os.close(fd)
        fd = -1
        yield StagedChunk(path, [n for n, _ in chunk], [t.dtype for _, t in chunk],
                          [tuple(t.shape) for _, t in chunk], offsets, nbytes)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)


def _mapping_bytes(path: str) -> dict[str, int]:
    """This process's mappings of `path` (/proc/self/smaps): `mapped`, the resident pages it touched (shared with
    the page cache); `copied`, pages it wrote and so copied for itself (anonymous pages of a copy-on-write map)."""
    totals = {"Rss": 0, "Anonymous": 0}
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                fields = line.split()
                if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                    inside = fields[-1] == path
                elif inside and fields[0].rstrip(":") in totals:
                    totals[fields[0].rstrip(":")] += int(fields[1]) * 1024
    except OSError:
        pass
    return {"mapped": totals["Rss"], "copied": totals["Anonymous"]}


def load_staged(worker, toc: StagedChunk) -> dict:
    """Runs inside a vLLM worker (collective_rpc): maps the shared file copy-on-write (a loader that writes into a
    view changes only its own pages) and reloads the chunk's tensors from views into it. Returns what this worker
    took from the file: `mapped` (bytes of the pages it touched, shared with the page cache) and `copied`
    (bytes it copied for itself: 0 unless a loader wrote into a view)."""
    import gc

    start = time.perf_counter()
    if not toc.nbytes:
        worker.reload_weights(weights_iterator=iter(()))
        return {"pid": os.getpid(), "tensors": 0, "staged": 0, "mapped": 0, "copied": 0, "seconds": 0.0}
    with open(toc.path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), toc.nbytes, access=mmap.ACCESS_COPY)
    try:
        worker.reload_weights(weights_iterator=_views(buffer, toc))
        taken = _mapping_bytes(toc.path)
    finally:
        gc.collect()  # views a loader dropped but did not free yet would keep the mapping open
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes when it does
            buffer.close()
    return {"pid": os.getpid(), "tensors": len(toc.names), "staged": toc.nbytes, **taken,
            "seconds": time.perf_counter() - start}
