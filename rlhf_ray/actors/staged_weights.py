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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from rlhf_ray.models.weight_buckets import Named, layer_of

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


def _views(buffer, toc: StagedChunk) -> Iterator[Named]:
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    for name, dtype, shape, offset in zip(toc.names, toc.dtypes, toc.shapes, toc.offsets):
        numel = int(torch.Size(shape).numel())
        yield name, flat[offset: offset + numel * dtype.itemsize].view(dtype).view(shape)


class _ChunkFile:
    """A shared file that named tensors are appended to, each at an aligned offset."""

    def __init__(self, directory: str):
        self.fd, self.path = tempfile.mkstemp(prefix="rlhf-ray-weights-", dir=directory)
        self.names: list[str] = []
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        self.offsets: list[int] = []
        self.nbytes = 0
        self.layer: str | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        offset = at = -(-self.nbytes // ALIGN) * ALIGN
        data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy())
        try:
            while data:
                written = os.pwrite(self.fd, data, at)
                data, at = data[written:], at + written
        except OSError as e:
            raise OSError(e.errno, f"staging {name} ({tensor.numel() * tensor.element_size() / 2**20:.0f} MiB) for "
                                   f"a tensor-parallel engine's workers in {self.path}: {e.strerror}; give /dev/shm "
                                   f"(or TMPDIR) room for one weight chunk") from e
        self.names.append(name)
        self.dtypes.append(tensor.dtype)
        self.shapes.append(tuple(tensor.shape))
        self.offsets.append(offset)
        self.nbytes = at
        self.layer = layer_of(name)

    def seal(self) -> StagedChunk:
        os.close(self.fd)
        self.fd = -1
        return StagedChunk(self.path, self.names, self.dtypes, self.shapes, self.offsets, self.nbytes)

    def remove(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def staged_chunks(stream: Iterable[Named], chunk_bytes: int, directory: str | None = None) -> Iterator[StagedChunk]:
    """The stream written into shared files as it arrives, chunks of about `chunk_bytes` that never split a layer's
    tensors (vLLM reloads a layer once all of its tensors came, within one call: one call per chunk). Yields each
    complete chunk's table of contents; its file is removed when the next is asked for or the generator closes
    (also after a failure). Only the tensor being written is held, never a chunk: buffers the transport received
    into (a GPU's, for the collective transport) are released as soon as they are written."""
    chunk: _ChunkFile | None = None
    try:
        for name, tensor in stream:
            if chunk is not None and chunk.nbytes >= chunk_bytes and layer_of(name) != chunk.layer:
                yield chunk.seal()
                chunk.remove()
                chunk = None
            if chunk is None:
                chunk = _ChunkFile(directory or staging_dir(chunk_bytes))
            chunk.add(name, tensor)
        if chunk is not None:
            yield chunk.seal()
    finally:
        if chunk is not None:
            chunk.remove()


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
