"""Raw text -> mmap corpus (PREFIX.bin/.idx): split into sentences, tokenize, pack greedily, stream to disk.

Inputs, by suffix: ``.jsonl``/``.json``/``.ndjson`` hold one JSON object per line (text under ``json_key``;
blank lines skipped; a malformed line fails with ``file:line``). Anything else is UTF-8 text with one document
per paragraph, paragraphs separated by blank lines, so a document keeps its inner newlines (one-document-per-
line files must be blank-line separated or converted to JSONL). A document is held in memory whole.

Packing keeps KnowLM's goal (whole sentences where possible, as few and as long samples as possible) without
its overlapping backward fill, which duplicated tokens: a document's sentences are tokenized one by one and
packed next-fit into samples of at most ``max_len`` tokens. Samples never span documents nor overlap, so a
document's samples concatenate back to exactly its sentence encodings (+ eos, counted in the last sentence).
An over-long sentence is cut into ``max_len`` pieces; its remainder packs on. No sample is dropped, however
short (blank documents are skipped and counted). Tokenizers that prefix every encoded text with a space
(SentencePiece dummy prefix) encode sentences differently from running text: detected, warned, and reported
as stats ``sentence_split_exact``.

Memory is bounded: documents are read lazily in chunks, at most ``2 * workers`` chunks are in flight, and
results are written in input order, so the output is byte-identical whatever the worker count.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
import time
from collections import deque
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from rlhf_ray.data.errors import DataError
from rlhf_ray.data.mmap_corpus import CorpusWriter, token_dtype

log = logging.getLogger(__name__)
JSON_SUFFIXES = {".jsonl", ".json", ".ndjson"}
_CHUNK_CHARS = 1 << 22  # also cut a chunk at ~4M characters, so a few long documents cannot blow up a chunk

# A sentence ends (every character stays in exactly one sentence): 1. after . ! ? (repeated, with closing
# quotes/brackets) when spaces then text follow, the spaces starting the next sentence as byte-level BPE
# tokenizes running text; 2. after CJK 。！？ (with closing quotes and newlines), no space needed; 3. after a
# run of newlines. Deliberately simple ("Dr. Smith" is split: only a slightly earlier cut point). The leading
# lookahead lets the regex engine skip to candidate characters (2-3x faster).
SENTENCE_END = re.compile(r"""(?=[.!?。！？\n])"""
                          r"""(?:[.!?]+["')\]”’]*(?=[ \t]+\S)|[。！？]+[”’」』）]*\n*|\n+)""")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` whose concatenation is exactly ``text`` (no character is lost or added)."""
    pieces, start = [], 0
    for match in SENTENCE_END.finditer(text):
        if match.end() > start:
            pieces.append(text[start:match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def pack_lengths(sentence_lengths: Iterable[int], max_len: int) -> list[int]:
    """Sample lengths of one document under next-fit packing. With every sentence <= max_len, next-fit over a
    sequence that may only be cut between items yields the fewest samples, and any two consecutive samples
    together exceed max_len (the second starts with the item that did not fit into the first)."""
    out: list[int] = []
    cur = 0  # length of the sample being filled
    for n in sentence_lengths:
        if cur and cur + n > max_len:
            out.append(cur)
            cur = 0
        if n > max_len:  # cur is 0 here: full pieces alone, the remainder keeps packing
            full, cur = divmod(n, max_len)
            out.extend([max_len] * full)
        else:
            cur += n
    if cur:
        out.append(cur)
    return out


def _decoded_lines(path: Path) -> Iterator[tuple[int, str, int]]:
    """(line number, text with '\\n' line ends, raw byte count). Binary reading gives byte counts for the
    progress bar and a file:line for undecodable bytes."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"not valid UTF-8 ({exc.reason} at byte {exc.start} of the line)",
                                where=f"{path}:{lineno}") from None
            if line.endswith("\r\n"):
                line = line[:-2] + "\n"
            yield lineno, line, len(raw)


def _json_documents(path: Path, key: str) -> Iterator[tuple[str, int]]:
    for lineno, line, nbytes in _decoded_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"malformed JSON ({exc.msg} at column {exc.colno}); expected one object per line",
                            where=where) from None
        text = row.get(key) if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise DataError(f"no string field {key!r} (set --json-key to the field holding the text)",
                            where=where, field=key)
        yield text, nbytes


def _text_documents(path: Path) -> Iterator[tuple[str, int]]:
    lines: list[str] = []
    nbytes = 0
    for _, line, size in _decoded_lines(path):
        nbytes += size
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines).rstrip("\n"), nbytes
            lines, nbytes = [], 0
    if lines:
        yield "".join(lines).rstrip("\n"), nbytes


def iter_documents(path: Path, json_key: str = "text") -> Iterator[tuple[str, int]]:
    """(document text, input bytes it came from) for one file, in file order."""
    path = Path(path)
    return _json_documents(path, json_key) if path.suffix.lower() in JSON_SUFFIXES else _text_documents(path)


_STATE: dict[str, Any] = {}


def _init_encoder(tokenizer: Any, max_len: int, eos_id: int | None, dtype: str, single_thread: bool) -> None:
    if single_thread:  # one process per core; the tokenizer's own thread pool would oversubscribe
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if isinstance(tokenizer, str):  # a tokenizers JSON file written by _results
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer)
    _STATE.update(tokenizer=tokenizer, max_len=max_len, eos_id=eos_id, dtype=np.dtype(dtype))


def encode_chunk(docs: list[str]) -> dict[str, Any]:
    """Documents -> their packed samples: all tokens concatenated plus the sample lengths."""
    tok, max_len, eos = _STATE["tokenizer"], _STATE["max_len"], _STATE["eos_id"]
    per_doc = [split_sentences(d) for d in docs]
    flat = list(chain.from_iterable(per_doc))
    if hasattr(tok, "encode_batch_fast"):  # a tokenizers.Tokenizer: no HF wrapper cost per call
        ids = [e.ids for e in tok.encode_batch_fast(flat, add_special_tokens=False)]
    else:
        ids = tok(flat, add_special_tokens=False)["input_ids"]
    streams: list[Iterable[int]] = []
    lengths: list[int] = []
    cut = pos = 0
    for sents in per_doc:
        doc_ids, pos = ids[pos:pos + len(sents)], pos + len(sents)
        sizes = [len(x) for x in doc_ids]
        streams.extend(doc_ids)
        if eos is not None:
            sizes[-1] += 1
            streams.append((eos,))
        cut += sum(n > max_len for n in sizes)
        lengths.extend(pack_lengths(sizes, max_len))
    tokens = np.fromiter(chain.from_iterable(streams), dtype=_STATE["dtype"], count=sum(lengths))
    return {"tokens": tokens, "lengths": np.asarray(lengths, dtype=np.int64), "documents": len(docs),
            "sentences": len(ids), "cut_sentences": cut}


def _chunks(inputs: list[Path], json_key: str, chunk_docs: int, stats: dict) -> Iterator[tuple[list[str], int]]:
    docs: list[str] = []
    chars = nbytes = 0
    for path in inputs:
        for text, size in iter_documents(path, json_key):
            nbytes += size
            if not text.strip():
                stats["empty_documents"] += 1
                continue
            docs.append(text)
            chars += len(text)
            if len(docs) >= chunk_docs or chars >= _CHUNK_CHARS:
                yield docs, nbytes
                docs, chars, nbytes = [], 0, 0
    if docs or nbytes:
        yield docs, nbytes


def _results(chunks: Iterator[tuple[list[str], int]], workers: int, init_args: tuple) -> Iterator[tuple[dict, int]]:
    """Encoded chunks in input order, at most ``2 * workers`` in flight (``Pool.imap``'s feeder thread would
    read the whole input ahead when tokenizing is slower than reading). Workers are spawned (forking a threaded
    parent such as a Ray worker is unsafe) and get the tokenizer as a file path: a dead worker then raises
    BrokenProcessPool, where a large pickled payload would block CPython's spawn forever."""
    if workers <= 1:
        _init_encoder(*init_args, single_thread=False)
        yield from ((encode_chunk(docs), nbytes) for docs, nbytes in chunks)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    encoder, *rest = init_args
    with tempfile.TemporaryDirectory(prefix="rlhf_ray_preprocess_") as tmp:
        if hasattr(encoder, "to_str"):
            Path(tmp, "tokenizer.json").write_text(encoder.to_str(), encoding="utf-8")
            encoder = str(Path(tmp, "tokenizer.json"))
        with ProcessPoolExecutor(workers, mp.get_context("spawn"), initializer=_init_encoder,
                                 initargs=(encoder, *rest, True)) as pool:
            pending: deque = deque()
            try:
                for docs, nbytes in chunks:
                    pending.append((pool.submit(encode_chunk, docs), nbytes))
                    if len(pending) >= 2 * workers:
                        job, n = pending.popleft()
                        yield job.result(), n
                for job, n in pending:
                    yield job.result(), n
            except BrokenProcessPool as exc:
                raise RuntimeError("a preprocessing worker died. Workers are spawned, which re-imports the main "
                                   "script: guard the call with `if __name__ == '__main__':`, or use workers=1"
                                   ) from exc
            finally:
                for job, _ in pending:
                    job.cancel()


def load_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise DataError("tokenizer directory not found", where=str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _pick_encoder(tok: Any) -> tuple[Any, bool]:
    """(what workers encode with, whether sentence-by-sentence encoding equals encoding running text).
    The tokenizers.Tokenizer behind a fast HF tokenizer is cheap to ship to workers and skips the wrapper's
    per-call cost; it is used only if it gives the ids of ``tok(text, add_special_tokens=False)`` on a probe."""
    probe = ["Hello world. Next one!\nLast", "Hello world.", " Next one!\n", "Last", " Ünïcode 你好。", " \ttabs!"]
    ids = tok(probe, add_special_tokens=False)["input_ids"]
    backend = getattr(tok, "backend_tokenizer", None)
    fast = hasattr(backend, "encode_batch_fast") and \
        [e.ids for e in backend.encode_batch_fast(probe, add_special_tokens=False)] == ids
    return (backend if fast else tok), ids[0] == ids[1] + ids[2] + ids[3]


def preprocess(inputs: list[Path], tokenizer_dir: str | os.PathLike, out_prefix: str | os.PathLike,
               max_len: int = 512, workers: int | None = None, json_key: str = "text", append_eos: bool = True,
               chunk_docs: int = 256, progress: bool = True) -> dict[str, Any]:
    """Tokenize and pack ``inputs`` into ``out_prefix``.bin/.idx. On any error nothing new is left on disk.
    ``workers=None`` uses every available core; 1 runs in this process. ``seconds`` in the returned stats runs
    from the first read to the published corpus (loading the tokenizer excluded)."""
    from tqdm import tqdm

    inputs = [Path(p) for p in inputs]
    for path in inputs:
        if not path.is_file():
            raise DataError("input file not found", where=str(path))
    workers = len(os.sched_getaffinity(0)) if workers is None else workers
    if min(max_len, chunk_docs, workers) < 1:
        raise ValueError(f"max_len, chunk_docs and workers must be >= 1 (got {max_len}, {chunk_docs}, {workers})")
    tok = load_tokenizer(tokenizer_dir)
    eos_id = tok.eos_token_id if append_eos else None
    if append_eos and eos_id is None:
        raise DataError("the tokenizer has no eos token; set one or pass --no-eos", where=str(tokenizer_dir))
    vocab_size = len(tok)  # len() counts added tokens, vocab_size does not
    dtype = token_dtype(vocab_size)
    encoder, exact = _pick_encoder(tok)
    init_args = (encoder, max_len, eos_id, dtype.str)
    if not exact:
        log.warning("%s: encoding sentence by sentence differs from encoding running text (e.g. a prefix space "
                    "added to every sentence); samples are still exact concatenations of the sentence "
                    "encodings", tokenizer_dir)

    stats: dict[str, Any] = {"documents": 0, "empty_documents": 0, "sentences": 0, "cut_sentences": 0,
                             "samples": 0, "tokens": 0, "input_bytes": 0}
    start = time.perf_counter()
    total_bytes = sum(p.stat().st_size for p in inputs)
    chunks = _chunks(inputs, json_key, chunk_docs, stats)
    with CorpusWriter(out_prefix, vocab_size) as writer, \
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=not progress) as bar:
        for result, nbytes in _results(chunks, workers, init_args):
            writer.add_packed(result["tokens"], result["lengths"])
            for key in ("documents", "sentences", "cut_sentences"):
                stats[key] += result[key]
            stats["input_bytes"] += nbytes
            bar.update(nbytes)
    seconds = time.perf_counter() - start
    stats.update(samples=writer.num_samples, tokens=writer.num_tokens, seconds=round(seconds, 3),
                 tokens_per_s=round(writer.num_tokens / seconds, 1) if seconds > 0 else 0.0, workers=workers,
                 dtype=dtype.name, max_len=max_len, out_prefix=os.fspath(out_prefix), sentence_split_exact=exact)
    return stats


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``rlhf-ray preprocess``; ``parser`` is the subcommand's own parser."""
    parser.add_argument("--input", nargs="+", required=True, type=Path, metavar="FILE",
                        help="text files (documents separated by blank lines) or .jsonl files (one object per line)")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", help="local HF tokenizer directory")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--max-len", type=int, default=512, metavar="N", help="tokens per sample at most (512)")
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="processes (default: all cores)")
    parser.add_argument("--json-key", default="text", metavar="K", help="field holding the text in JSONL (text)")
    parser.add_argument("--no-eos", dest="append_eos", action="store_false",
                        help="do not append the tokenizer's eos id to each document")
    parser.add_argument("--chunk-docs", type=int, default=256, metavar="N", help="documents per worker task (256)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run_preprocess(args: argparse.Namespace) -> int:
    """Run from parsed arguments; prints the stats as JSON. Bad input raises DataError (a ValueError)."""
    stats = preprocess(args.input, args.tokenizer, args.out, max_len=args.max_len, workers=args.workers,
                       json_key=args.json_key, append_eos=args.append_eos, chunk_docs=args.chunk_docs,
                       progress=not args.quiet)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_preprocess(add_preprocess_arguments(argparse.ArgumentParser(
        prog="python -m rlhf_ray.data.preprocess", description=__doc__.splitlines()[0])).parse_args()))
