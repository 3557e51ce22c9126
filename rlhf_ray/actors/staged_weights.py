"""Weight updates for a tensor-parallel vLLM engine, whose workers are processes of their own.

The engine actor lays each whole-layer chunk of the update once into a file in shared memory and sends the workers
only the chunk's table of contents (names, dtypes, shapes, offsets: a few KB). Each worker maps the file and hands
vLLM views into it; vLLM's weight loaders narrow every view to the worker's own shard and copy just that. So a
worker reads its shard and copies nothing else, the chunk exists once per node whatever the tensor-parallel size,
and no process ever holds the whole model. (Sending the chunk itself through `collective_rpc` would unpickle a
private copy of every whole tensor in every worker: tp_size + 1 copies of each chunk on the node.)

On GPUs the chunk passes through host memory: the workers copy their shards to their devices from it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

from rlhf_ray.models.shared_tensors import SharedTensors, TensorFile, map_file, staging_dir, views
from rlhf_ray.models.weight_buckets import Named, layer_of


def staged_chunks(stream: Iterable[Named], chunk_bytes: int, directory: str | None = None) -> Iterator[SharedTensors]:
    """The stream written into shared files as it arrives, chunks of about `chunk_bytes` that never split a layer's
    tensors (vLLM reloads a layer once all of its tensors came, within one call: one call per chunk). Yields each
    complete chunk's table of contents; its file is removed when the next is asked for or the generator closes
    (also after a failure). Only the tensor being written is held, never a chunk: buffers the transport received
    into (a GPU's, for the collective transport) are released as soon as they are written."""
    chunk: TensorFile | None = None
    try:
        for name, tensor in stream:
            if chunk is not None and chunk.nbytes >= chunk_bytes and layer_of(name) != layer_of(chunk.names[-1]):
                yield chunk.seal()
                chunk.remove()
                chunk = None
            if chunk is None:
                chunk = TensorFile(directory or staging_dir(chunk_bytes))
            chunk.add(name, tensor, "for a tensor-parallel engine's workers")
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


def load_staged(worker, toc: SharedTensors) -> dict:
    """Runs inside a vLLM worker (collective_rpc): maps the shared file copy-on-write (a loader that writes into a
    view changes only its own pages) and reloads the chunk's tensors from views into it. Returns what this worker
    took from the file: `mapped` (bytes of the pages it touched, shared with the page cache) and `copied`
    (bytes it copied for itself: 0 unless a loader wrote into a view)."""
    start = time.perf_counter()
    if not toc.nbytes:
        worker.reload_weights(weights_iterator=iter(()))
        return {"pid": os.getpid(), "tensors": 0, "staged": 0, "mapped": 0, "copied": 0, "seconds": 0.0}
    buffer = map_file(toc)
    worker.reload_weights(weights_iterator=views(buffer, toc))
    taken = _mapping_bytes(toc.path)
    del buffer  # the mapping goes with the last view the loader kept
    return {"pid": os.getpid(), "tensors": len(toc.names), "staged": toc.nbytes, **taken,
            "seconds": time.perf_counter() - start}
