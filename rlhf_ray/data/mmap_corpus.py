"""Token corpus on disk as PREFIX.bin + PREFIX.idx, read through numpy memmaps.

Why this format: a training process must be able to open a corpus of billions of tokens without reading it
into RAM (only the pages of the samples actually touched are loaded, and they are page cache the OS can drop),
and a corpus must be self-describing so that a wrong dtype or a half-written file is refused instead of being
read as garbage.

Layout (all little-endian, whatever the machine):

* ``PREFIX.bin``: the token ids of every sample back to back, ``uint16`` when the vocabulary has at most
  65535 entries, else ``uint32``. No header, no separators.
* ``PREFIX.idx``: a 24-byte header ``magic (8 bytes) | version (uint32) | dtype code (uint32) |
  number of samples N (uint64)``, then N + 1 ``int64`` offsets counted in tokens, so that sample ``i`` is
  ``bin[off[i]:off[i + 1]]``, ``off[0] == 0`` and ``off[N]`` is the number of tokens in ``.bin``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType
from typing import Iterator, Sequence

import numpy as np

from rlhf_ray.data.errors import DataError

MAGIC = b"RRMMIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQ")
HEADER_BYTES = _HEADER.size  # 24, so the offsets that follow are 8-byte aligned
_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_OFFSET_DTYPE = np.dtype("<i8")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the file for vocabularies up to 65535 entries (LLaMA-1/2, GPT-2); larger ones need uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return _DTYPES[1] if vocab_size <= 65535 else _DTYPES[2]


def corpus_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx). The suffix is appended, never substituted, so a prefix may contain dots."""
    prefix = os.fspath(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def _dtype_code(dtype: np.dtype) -> int:
    return next(code for code, dt in _DTYPES.items() if dt == dtype)


class MMapCorpus:
    """Read-only view of a corpus: ``len()``, ``corpus[i]`` -> the token ids of sample i (a read-only array view
    into the memory map, no copy), ``num_tokens``, ``dtype``, ``sizes``.

    Opening checks the header and that ``.bin`` holds exactly ``off[N]`` tokens (cheap: two reads). ``verify()``
    additionally checks that the offsets never decrease, which touches the whole index. Pickling sends only the
    prefix, so a corpus can be passed to DataLoader workers or Ray actors and is re-opened there."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = corpus_paths(self.prefix)
        self._open()

    def _open(self) -> None:
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError("corpus file not found (expected PREFIX.bin and PREFIX.idx)", where=str(path))
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise DataError(f"index too short for its {HEADER_BYTES}-byte header ({len(head)} bytes)",
                            where=str(self.idx_path))
        magic, version, code, n = _HEADER.unpack(head)
        if magic != MAGIC:
            raise DataError(f"not a corpus index: bad magic {magic!r} (expected {MAGIC!r})", where=str(self.idx_path))
        if version != VERSION:
            raise DataError(f"unsupported corpus index version {version} (this reader knows {VERSION})",
                            where=str(self.idx_path))
        if code not in _DTYPES:
            raise DataError(f"unknown token dtype code {code}", where=str(self.idx_path))
        self.dtype: np.dtype = _DTYPES[code]
        expected = HEADER_BYTES + (n + 1) * _OFFSET_DTYPE.itemsize
        actual = self.idx_path.stat().st_size
        if actual != expected:
            raise DataError(f"index holds {actual} bytes but its header announces {n} samples ({expected} bytes); "
                            f"the file is truncated or corrupt", where=str(self.idx_path))
        self._offsets = np.memmap(self.idx_path, dtype=_OFFSET_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n + 1,))
        self._len = int(n)
        self.num_tokens = int(self._offsets[-1])
        if int(self._offsets[0]) != 0 or self.num_tokens < 0:
            raise DataError("corrupt index: offsets must start at 0", where=str(self.idx_path))
        bin_bytes = self.bin_path.stat().st_size
        want = self.num_tokens * self.dtype.itemsize
        if bin_bytes < want:
            raise DataError(f"truncated: {bin_bytes} bytes, but the index needs {self.num_tokens} tokens of "
                            f"{self.dtype.name} ({want} bytes)", where=str(self.bin_path))
        if bin_bytes > want:
            raise DataError(f"{bin_bytes} bytes, more than the {want} bytes the index describes; .bin and .idx "
                            f"do not belong together", where=str(self.bin_path))
        # numpy cannot map an empty file; an empty corpus gets an empty array instead.
        self._bin = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
                     if self.num_tokens else np.empty(0, dtype=self.dtype))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range for a corpus of {self._len} samples ({self.prefix})")
        start, stop = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._bin[start:stop].view(np.ndarray)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self._len):
            yield self[i]

    @property
    def sizes(self) -> np.ndarray:
        """Sample lengths in tokens (int64, computed from the offsets: N * 8 bytes in RAM)."""
        return np.diff(self._offsets).astype(np.int64)

    def verify(self, block: int = 1 << 20) -> None:
        """Full index check: offsets never decrease. Reads the index in blocks so memory stays bounded."""
        for start in range(0, self._len, block):
            part = np.asarray(self._offsets[start:start + block + 1])
            if (np.diff(part) < 0).any():
                bad = start + int(np.argmax(np.diff(part) < 0))
                raise DataError(f"corrupt index: offset of sample {bad + 1} is before that of sample {bad}",
                                where=str(self.idx_path))

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return f"MMapCorpus({self.prefix!r}, samples={self._len}, tokens={self.num_tokens}, dtype={self.dtype.name})"


SCAN_TOKENS = 1 << 26
"""How many tokens of a corpus `open_for_tokenizer` checks for out-of-range ids (128 MiB of uint16: about a second)."""


def open_for_tokenizer(prefix: str | os.PathLike, tokenizer_size: int | None) -> MMapCorpus:
    """Open a corpus that a job will train on, refusing (DataError naming the file) a missing or half-written file,
    an empty corpus, and, given the model's tokenizer size (len(tokenizer)), a corpus written with another
    tokenizer: its token dtype is not the one `rlhf-ray preprocess` picks for this tokenizer, or one of its first
    SCAN_TOKENS ids is out of the vocabulary (the model would index past its embedding)."""
    corpus = MMapCorpus(prefix)
    if len(corpus) == 0:
        raise DataError("the corpus has no samples", where=str(corpus.idx_path))
    if tokenizer_size is None:
        return corpus
    want = token_dtype(tokenizer_size)
    if corpus.dtype != want:
        raise DataError(f"token dtype {corpus.dtype.name}, but preprocess writes {want.name} for this model's "
                        f"tokenizer ({tokenizer_size} entries): the corpus was written with another tokenizer; "
                        f"write it again with `rlhf-ray preprocess --tokenizer <the model's folder>`",
                        where=str(corpus.idx_path))
    head = corpus._bin[:SCAN_TOKENS]
    if head.size and (top := int(head.max())) >= tokenizer_size:
        raise DataError(f"token id {top} is out of this model's vocabulary ({tokenizer_size} entries): the corpus "
                        f"was written with another tokenizer", where=str(corpus.bin_path))
    return corpus


class CorpusWriter:
    """Streams samples into PREFIX.bin.tmp / PREFIX.idx.tmp and publishes them only on a clean close.

    Memory stays bounded: tokens and offsets go to disk as they arrive (the header is patched at the end).
    Publishing is crash-safe for readers: an existing PREFIX.idx is removed first, then ``.bin`` and ``.idx``
    are renamed in that order, so a visible ``.idx`` always matches the ``.bin`` next to it. Leaving the
    ``with`` block by an exception deletes the temporary files and leaves any previous corpus untouched
    (unless the crash falls between the two renames, where the old index is already gone and the reader
    reports a missing ``.idx``). Two writers must not target the same prefix at once."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int):
        self.prefix = os.fspath(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        self.bin_path, self.idx_path = corpus_paths(self.prefix)
        self._tmp_bin = Path(str(self.bin_path) + ".tmp")
        self._tmp_idx = Path(str(self.idx_path) + ".tmp")
        self.num_samples = 0
        self.num_tokens = 0
        self._bin = self._idx = None

    def __enter__(self) -> "CorpusWriter":
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")
        self._idx = open(self._tmp_idx, "wb")
        self._idx.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), 0))
        self._idx.write(np.zeros(1, dtype=_OFFSET_DTYPE).tobytes())
        return self

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}): min {int(ids.min())}, "
                             f"max {int(ids.max())} ({self.prefix})")

    def add(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one sample."""
        arr = np.asarray(ids)
        self.add_packed(arr, np.array([arr.size], dtype=np.int64))

    def add_packed(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append many samples at once: ``tokens`` is their concatenation, ``lengths`` their sizes. This is the
        fast path for the preprocessor (one write per chunk instead of one per sample)."""
        if self._bin is None:
            raise RuntimeError("CorpusWriter must be used as a context manager (with CorpusWriter(...) as w:)")
        tokens = np.asarray(tokens).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if (lengths < 0).any() or int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {tokens.size} tokens were given")
        self._check_ids(tokens)
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._idx.write((self.num_tokens + np.cumsum(lengths)).astype(_OFFSET_DTYPE).tobytes())
        self.num_samples += lengths.size
        self.num_tokens += tokens.size

    def abort(self) -> None:
        """Drop everything written so far."""
        for f in (self._bin, self._idx):
            if f is not None:
                f.close()
        self._bin = self._idx = None
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Finish the header, flush to disk and publish PREFIX.bin / PREFIX.idx."""
        self._idx.seek(0)
        self._idx.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), self.num_samples))
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._bin = self._idx = None
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
