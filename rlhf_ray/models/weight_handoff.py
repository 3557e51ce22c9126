"""The colocated weight handoff (`weight_sync.transport: ipc`): an engine on the learner's node (CPU) or on the
learner's GPU takes the weights from the learner's memory, with no trip through the object store.

On CPU the learner rank's parameters live in a file in shared memory (`ParameterFile`; a learner whose optimizer
updates them in place: ZeRO-0 in fp32, no LoRA). An engine maps the file and copies each tensor once, straight
into its own weights: one copy of the model per sync, the engine's own. Tensors that are not in that file
(gathered under ZeRO-3, LoRA-merged, buffers, parameters that DeepSpeed's mixed-precision optimizers flattened)
are written bucket by bucket into a file of their own, removed when the next bucket is asked for.

On a GPU each bucket is flattened on the device and handed over as a CUDA IPC handle; the engine opens it and
copies device to device. A bucket lives on the learner until the next one is asked for, so a sync never holds
more than one bucket beyond the model."""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from rlhf_ray.models.shared_tensors import (SharedTensors, TensorFile, aligned, mapped, owned_prefix,
                                            remove_orphans, staging_dir)
from rlhf_ray.models.weight_buckets import Named, dtype_runs, flatten, split_flat

PREFIX = "rlhf-ray-handoff-"
"""Files of the handoff are named `owned_prefix(PREFIX)`: a later learner removes those of dead writers."""


@dataclass(frozen=True)
class CudaBuffer:
    """A flat bucket on the learner's GPU: the CUDA IPC handle to open it (`torch.multiprocessing.reductions`'
    rebuild function and its arguments) and the named tensors laid end to end in it."""

    rebuild: tuple
    names: list[str]
    shapes: list[tuple[int, ...]]


@dataclass(frozen=True)
class HandoffPart:
    """One bucket of a handoff: where an engine finds its tensors in the learner's memory."""

    files: list[SharedTensors] = field(default_factory=list)
    """CPU: tensors in files in shared memory."""
    cuda: list[CudaBuffer] = field(default_factory=list)
    """GPU: flat buffers on the learner's device."""
    nbytes: int = 0
    """Bytes of the tensors the engine reads."""
    copied: int = 0
    """Bytes the learner copied to hand them over (0 where they were read in place)."""
    last: bool = False
    """The sync's last part: the driver asks for no more (its closing call frees this one without waiting)."""


class ParameterFile:
    """A module's parameters moved into one file in shared memory: each parameter's `data` becomes a view into
    the file's mapping, so the optimizer's in-place updates land there and readers see them."""

    def __init__(self, module: torch.nn.Module):
        params = list(module.named_parameters())  # tied weights once
        offsets, end = [], 0
        for _, p in params:
            offsets.append(aligned(end))
            end = offsets[-1] + p.numel() * p.element_size()
        self.nbytes = max(end, 1)
        directory = staging_dir(self.nbytes)
        remove_orphans(directory, PREFIX)
        fd, self.path = tempfile.mkstemp(prefix=f"{owned_prefix(PREFIX)}params-", dir=directory)
        try:
            os.ftruncate(fd, self.nbytes)
            self.buffer = mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_WRITE)  # shared with every mapper
        finally:
            os.close(fd)
        atexit.register(self.close)
        self.flat = torch.frombuffer(self.buffer, dtype=torch.uint8)
        with torch.no_grad():
            for (_, p), offset in zip(params, offsets):
                view = self.flat[offset: offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p.data)
                p.data = view

    def locate(self, tensor: torch.Tensor) -> int | None:
        """The byte offset of `tensor` in the file, if it is a contiguous tensor that lies in it."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        offset = tensor.data_ptr() - self.flat.data_ptr()
        return offset if 0 <= offset and offset + tensor.numel() * tensor.element_size() <= self.nbytes else None

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # the mapping stays valid for as long as the parameters use it


class HandoffSender:
    """Learner rank 0's side: buckets of named tensors -> `HandoffPart`s. On CPU with `parameters` (the module's
    parameters moved into shared memory), tensors found there are handed over in place."""

    def __init__(self, parameters: ParameterFile | None = None):
        self.parameters = parameters

    def parts(self, groups: Iterable[list[Named]]) -> Iterator[HandoffPart]:
        for group in groups:
            on_gpu = any(t.is_cuda for _, t in group)
            yield from (self._cuda_part(group) if on_gpu else self._file_part(group))

    def _file_part(self, group: list[Named]) -> Iterator[HandoffPart]:
        in_place: list[tuple[str, torch.Tensor, int]] = []
        copy: TensorFile | None = None
        try:
            for name, tensor in group:
                offset = self.parameters.locate(tensor) if self.parameters else None
                if offset is not None:
                    in_place.append((name, tensor, offset))
                    continue
                if copy is None:
                    copy = TensorFile(staging_dir(sum(t.numel() * t.element_size() for _, t in group)),
                                      prefix=owned_prefix(PREFIX))
                copy.add(name, tensor, "for an engine on this node")
            files = []
            if in_place:
                files.append(SharedTensors(self.parameters.path, [n for n, _, _ in in_place],
                                           [t.dtype for _, t, _ in in_place], [tuple(t.shape) for _, t, _ in in_place],
                                           [o for _, _, o in in_place], self.parameters.nbytes))
            copied = 0
            if copy is not None:
                files.append(copy.seal())
                copied = copy.nbytes
            yield HandoffPart(files=files, nbytes=sum(t.numel() * t.element_size() for _, t in group), copied=copied)
        finally:
            if copy is not None:
                copy.remove()

    def _cuda_part(self, group: list[Named]) -> Iterator[HandoffPart]:
        from torch.multiprocessing.reductions import reduce_tensor

        device = next(t.device for _, t in group if t.is_cuda)
        flats = [(run, flatten(run, device)) for run in dtype_runs(group)]
        torch.cuda.synchronize(device)  # the copies are done before another process reads them
        buffers = [CudaBuffer(reduce_tensor(flat), [n for n, _ in run], [tuple(t.shape) for _, t in run])
                   for run, flat in flats]
        nbytes = sum(flat.numel() * flat.element_size() for _, flat in flats)
        yield HandoffPart(cuda=buffers, nbytes=nbytes, copied=nbytes)
        del flats, buffers  # the engines have loaded it: the learner's caching allocator takes the memory back

    def close(self) -> None:
        if self.parameters is not None:
            self.parameters.close()


def received(part: HandoffPart) -> Iterator[Named]:
    """The engine's side: the part's named tensors, read in place from the learner's memory (the views keep their
    mapping or buffer open for as long as the engine holds them)."""
    for toc in part.files:
        yield from mapped(toc)
    for buffer in part.cuda:
        rebuild, args = buffer.rebuild
        args = list(args)
        args[6] = torch.cuda.current_device()  # the storage's device, as this process numbers it (the same GPU)
        flat = rebuild(*args)
        yield from split_flat(flat, buffer.names, buffer.shapes)
