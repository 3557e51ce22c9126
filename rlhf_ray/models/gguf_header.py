"""A GGUF file's header read without its values: the architecture, the tensor count, and a check that every
tensor's data lies inside the file. gguf's GGUFReader turns every metadata value into numpy views (SmolLM2's
49k-entry vocabulary: ~5 s a file); a job checks its GGUF sources before anything starts, so this reads the same
layout with struct over a memory map and skips what it does not need (~0.1 s).

Layout (GGUF v2/v3, little-endian, or big-endian where the version reads so): magic, version u32, tensor count u64, metadata count u64; metadata entries
(key string, value type u32, value); tensor entries (name string, dims u32 + u64 each, type u32, offset u64); the
data, aligned to `general.alignment` (default 32)."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class GGUFHeaderError(ValueError):
    """The file is not laid out as GGUF says (cut short, or a field out of range)."""


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str
    tensors: int


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes):
        self.data, self.at, self.order = data, 0, "<"

    def values(self, fmt: str) -> tuple:
        fmt = self.order + fmt
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFHeaderError(f"ends at byte {len(self.data)}, inside the header (reading byte {self.at})")
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values

    def take(self, fmt: str):
        return self.values(fmt)[0]

    def string(self) -> str:
        size = self.take("Q")
        if self.at + size > len(self.data):
            raise GGUFHeaderError(f"a string of {size} bytes at byte {self.at} runs past the end")
        text = bytes(self.data[self.at:self.at + size]).decode("utf-8", errors="replace")
        self.at += size
        return text

    def skip_value(self, kind: int) -> None:
        if kind in _FIXED:
            self.at += _FIXED[kind]
        elif kind == _STRING:
            size = self.take("Q")  # read before the += below reads self.at
            self.at += size
        elif kind == _ARRAY:
            item, count = self.values("IQ")
            if item in _FIXED:
                self.at += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise GGUFHeaderError(f"unknown value type {kind} at byte {self.at}")
        if self.at > len(self.data):
            raise GGUFHeaderError(f"a value runs past the end (byte {self.at} of {len(self.data)})")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The header of a GGUF file; a GGUFHeaderError when it is cut short or a tensor's data is outside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        magic, version = cursor.values("4sI")
        swapped = struct.unpack(">I", struct.pack("<I", version))[0]
        if magic == b"GGUF" and version not in (2, 3) and swapped in (2, 3):
            cursor.order, version = ">", swapped  # a big-endian file
        if magic != b"GGUF" or version not in (2, 3):
            raise GGUFHeaderError(f"magic {magic!r}, version {version}: not GGUF v2 or v3")
        n_tensors, n_values = cursor.values("QQ")
        architecture, alignment = None, 32
        for _ in range(n_values):
            key, kind = cursor.string(), cursor.take("I")
            if key == "general.architecture" and kind == _STRING:
                architecture = cursor.string()
            elif key == "general.alignment" and kind == _UINT32:
                alignment = cursor.take("I")
                if alignment == 0:
                    raise GGUFHeaderError("general.alignment is 0")
            else:
                cursor.skip_value(kind)
        ends = 0
        for _ in range(n_tensors):
            name = cursor.string()
            dims = cursor.values(f"{cursor.take('I')}Q")
            kind, offset = cursor.values("IQ")
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except ValueError:
                raise GGUFHeaderError(f"tensor {name!r} has an unknown type {kind}") from None
            ends = max(ends, offset + math.prod(dims) // block * block_bytes)
        start = -(-cursor.at // alignment) * alignment
        if start + ends > len(data):
            raise GGUFHeaderError(f"its tensors need {start + ends} bytes but the file has {len(data)}")
        if architecture is None:
            raise GGUFHeaderError("it names no general.architecture")
        return GGUFHeader(architecture, n_tensors)
