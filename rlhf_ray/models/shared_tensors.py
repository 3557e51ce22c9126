"""Named tensors laid out in a file in shared memory, so that another process on the node maps the file and reads
them in place: the file's table of contents (`SharedTensors`: names, dtypes, shapes, offsets) is all that crosses
the process boundary. Used to hand weights from a learner to an engine on the same node, and from an engine to
its tensor-parallel workers."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch

Named = tuple[str, torch.Tensor]

ALIGN = 64
"""Byte alignment of every tensor in a file (whole cache lines; any dtype's element size divides it)."""


@dataclass(frozen=True)
class SharedTensors:
    """Where named tensors lie in a shared file: all a reader needs to map them."""

    path: str
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    nbytes: int
    """The file's bytes the tensors span (from 0)."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def staging_dir(nbytes: int) -> str:
    """/dev/shm when it has room for `nbytes` (container defaults are as small as 64 MB and a write past its end
    kills the writer with SIGBUS), else the temporary folder (a file in the page cache: still one copy, shared)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize >= 2 * nbytes:
            return shm
    return tempfile.gettempdir()


def owned_prefix(prefix: str) -> str:
    """`prefix` + this process's pid + '-': a file or folder named so is removed by `remove_orphans` once its process
    is gone (a process killed by a signal, as Ray kills actors, cannot remove its own)."""
    return f"{prefix}{os.getpid()}-"


def remove_orphans(directory: str, prefix: str) -> None:
    """Remove the files and folders in `directory` named by `owned_prefix(prefix)` whose process is gone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if (found := re.match(re.escape(prefix) + r"(\d+)-", name)) and not _alive(int(found.group(1))):
                path = os.path.join(directory, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def views(buffer, toc: SharedTensors) -> Iterator[Named]:
    """The named tensors as views into `buffer` (a mapping of the file)."""
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    for name, dtype, shape, offset in zip(toc.names, toc.dtypes, toc.shapes, toc.offsets):
        numel = int(torch.Size(shape).numel())
        yield name, flat[offset: offset + numel * dtype.itemsize].view(dtype).view(shape)


def map_file(toc: SharedTensors, writable: bool = False) -> mmap.mmap:
    """Map the file (copy-on-write unless `writable`: a reader that writes into a view changes only its own
    pages). Views of it (`views`) hold the mapping: it goes when the last of them and this object do (never close
    it under a live view, which would leave the view pointing at unmapped memory)."""
    with open(toc.path, "r+b" if writable else "rb") as file:
        return mmap.mmap(file.fileno(), toc.nbytes, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)


def mapped(toc: SharedTensors) -> Iterator[Named]:
    """Views of the tensors of a file, mapped copy-on-write."""
    return views(map_file(toc), toc)


class TensorFile:
    """A shared file that named tensors are appended to (one copy each), each at an aligned offset."""

    def __init__(self, directory: str, prefix: str = "rlhf-ray-weights-"):
        self.fd, self.path = tempfile.mkstemp(prefix=prefix, dir=directory)
        self.names: list[str] = []
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        self.offsets: list[int] = []
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor, purpose: str = "") -> None:
        """Append `tensor` (`purpose`, e.g. "for an engine", goes into the message of a failed write)."""
        offset = at = aligned(self.nbytes)
        data = memoryview(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy())
        try:
            while data:
                written = os.pwrite(self.fd, data, at)
                data, at = data[written:], at + written
        except OSError as e:
            raise OSError(e.errno, f"staging {name} ({tensor.numel() * tensor.element_size() / 2**20:.0f} MiB)"
                                   f"{' ' + purpose if purpose else ''} in {self.path}: {e.strerror}; give /dev/shm (or TMPDIR) room for one weight "
                                   f"chunk") from e
        self.names.append(name)
        self.dtypes.append(tensor.dtype)
        self.shapes.append(tuple(tensor.shape))
        self.offsets.append(offset)
        self.nbytes = at

    def seal(self) -> SharedTensors:
        os.close(self.fd)
        self.fd = -1
        return SharedTensors(self.path, self.names, self.dtypes, self.shapes, self.offsets, self.nbytes)

    def remove(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
