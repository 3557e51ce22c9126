"""Preprocessing throughput (ours vs HF ``datasets.map``) and mmap reader memory for a corpus and one 10x larger.

Why: the pipeline claims (after KnowLM/Megatron) that mmap keeps reader memory flat whatever the corpus size,
and that sentence splitting + packing costs little over plain tokenization. Both are measured here on
synthetic text generated locally, with a byte-level BPE trained locally (no network).

    python benchmarks/bench_preprocess.py [--mb 10] [--scale 10] [--workers 2] [--write benchmarks/HISTORY.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process for both contenders
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, tree_pss, write_section  # noqa: E402

SECTION = "## Data: mmap corpus preprocessing and reader memory"
MB = 1 << 20


def make_text(path: Path, size_mb: float, seed: int) -> int:
    """Zipf-distributed pseudo-words in sentences of 3-40 words (a few over-long), 1-12 per paragraph."""
    rng = random.Random(0)  # one word list for every size, so the tokenizer fits all texts alike
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    vocab = ["".join(rng.choices(letters, k=rng.randint(1, 10))) for _ in range(30000)]
    rng = random.Random(seed)
    weights = [1 / (r + 1) for r in range(len(vocab))]
    pool = rng.choices(vocab, weights=weights, k=200_000)
    target, written = int(size_mb * MB), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            sents = []
            for _ in range(rng.randint(1, 12)):
                n = rng.randint(3, 40) if rng.random() > 0.01 else rng.randint(400, 900)
                start = rng.randrange(len(pool) - n)
                sents.append(" ".join(pool[start:start + n]).capitalize() + rng.choice(".....!?"))
            para = " ".join(sents) + "\n\n"
            f.write(para)
            written += len(para)
    return path.stat().st_size


def train_tokenizer(sample: str, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample.split("\n\n"), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(out)
    return out


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (pool workers are reaped when their pool closes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_ours(text: str, tok_dir: str, prefix: str, procs: int, max_len: int) -> dict:
    from rlhf_ray.data.preprocess import load_tokenizer, preprocess

    load_tokenizer(tok_dir)  # import transformers outside the timed region, as for datasets
    cpu0 = cpu_seconds()
    stats = preprocess([Path(text)], tok_dir, prefix, max_len=max_len, workers=procs, progress=False)
    return {"seconds": stats["seconds"], "cpu": cpu_seconds() - cpu0, "tokens": stats["tokens"],
            "documents": stats["documents"], "samples": stats["samples"]}


def run_datasets(text: str, tok_dir: str, cache: str, procs: int, max_len: int) -> dict:
    """Plain document tokenization with datasets (no splitting, packing or eos), same tokenizer and text, timed
    end to end like ours (load_dataset converts the text to Arrow, map tokenizes and writes its Arrow cache)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    ds = datasets.load_dataset("text", data_files=text, sample_by="paragraph", split="train", cache_dir=cache)
    cpu1, t1 = cpu_seconds(), time.perf_counter()
    out = ds.map(lambda b: tok(b["text"], add_special_tokens=False), batched=True,
                 num_proc=procs if procs > 1 else None, remove_columns=["text"])
    t2, cpu2 = time.perf_counter(), cpu_seconds()
    tokens = sum(len(x) for batch in out.iter(batch_size=10_000) for x in batch["input_ids"])
    return {"seconds": t2 - t0, "cpu": cpu2 - cpu0, "map_s": t2 - t1, "map_cpu": cpu2 - cpu1, "tokens": tokens,
            "documents": len(ds)}


def child(*argv: str) -> dict:
    """Run one measurement in a fresh process, so imports, caches and memory of one cannot help another.
    Its peak memory is sampled from out here (twice a second), so the sampling costs the child no CPU."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--_child", *argv], stdout=out, stderr=subprocess.DEVNULL)
        ps, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, tree_pss(ps))
            except psutil.Error:
                pass
            time.sleep(0.5)
        if proc.returncode:
            raise RuntimeError(f"benchmark child {argv} failed with exit code {proc.returncode}")
        out.seek(0)
        return {**json.loads(out.read().strip().splitlines()[-1]), "peak_pss_mb": peak / MB}


def reader_probe(prefix: str, mode: str) -> dict:
    """Open a corpus, read every sample once, return the memory growth of this (fresh) process."""
    def mem() -> dict:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        kb = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731
        return {"rss": psutil.Process().memory_info().rss / MB, "anon": kb("RssAnon"), "file": kb("RssFile")}

    from rlhf_ray.data.mmap_corpus import MMapCorpus

    before = mem()
    t0 = time.perf_counter()
    corpus = MMapCorpus(prefix)
    if mode == "mmap":
        total = sum(int(s.sum(dtype=np.int64)) for s in corpus)
    else:  # the contrast: load .bin and the offsets into RAM, as a naive reader would
        data = np.fromfile(corpus.bin_path, dtype=corpus.dtype)
        off = np.asarray(corpus._offsets).copy()
        total = sum(int(data[off[i]:off[i + 1]].sum(dtype=np.int64)) for i in range(len(corpus)))
    seconds = time.perf_counter() - t0
    after = mem()
    return {"samples": len(corpus), "tokens": corpus.num_tokens, "checksum": total, "seconds": seconds,
            "bin_mb": corpus.bin_path.stat().st_size / MB, **{f"d_{k}": after[k] - before[k] for k in before}}


def versions() -> str:
    import datasets
    import tokenizers
    import transformers

    return (f"Python {platform.python_version()}, numpy {np.__version__}, tokenizers {tokenizers.__version__}, "
            f"transformers {transformers.__version__}, datasets {datasets.__version__}")


def render(res: dict, args: argparse.Namespace, command: str) -> str:
    lines = [SECTION, "",
             f"Machine: {machine()}. {versions()}. Date: {datetime.date.today().isoformat()}. "
             f"Load average before/after: {res['load'][0]:.2f} / {res['load'][1]:.2f} (the machine is shared).",
             "", f"Command: `{command}`", "",
             f"Synthetic English-like text (Zipf pseudo-words, sentences of 3-40 words, 1% of 400-900 words), "
             f"byte-level BPE with 8192 tokens trained locally, `max_len={args.max_len}`, "
             f"`TOKENIZERS_PARALLELISM=false` so each process uses one core. Every row runs in a fresh process.",
             "", "**Preprocessing throughput**, text file to tokens on disk. ours = `rlhf_ray.data.preprocess`: "
             "read, split into sentences, tokenize, pack, write .bin/.idx. datasets = "
             "`load_dataset('text', sample_by='paragraph')` then `map(lambda b: tok(b['text'], "
             "add_special_tokens=False), batched=True, num_proc=N)`, which only tokenizes whole documents; its "
             "map alone is shown in brackets. "
             f"Small corpus: best of {args.repeats} runs (shortest wall time; shortest CPU times). "
             "CPU = user + system of the process and its workers; tokens per CPU-second is the per-core rate, "
             "the figure contention on a shared machine distorts least.", "",
             "| corpus | text MB | tool | processes | wall s | tokens | tokens/s | tokens/s per process "
             "| tokens per CPU-s | peak PSS MB (whole run) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["throughput"]:
        m = (f" ({r['map_s']:.2f})", f" ({r['tokens'] / r['map_cpu']:,.0f})") if "map_s" in r else ("", "")
        lines.append(f"| {r['corpus']} | {r['text_mb']:.0f} | {r['tool']} | {r['procs']} | {r['seconds']:.2f}{m[0]} | "
                     f"{r['tokens']:,} | {r['tokens'] / r['seconds']:,.0f} | "
                     f"{r['tokens'] / r['seconds'] / r['procs']:,.0f} | {r['tokens'] / r['cpu']:,.0f}{m[1]} | "
                     f"{r['peak_pss_mb']:.0f} |")
    lines += ["", "**Reader memory** while reading every sample once (fresh process per row; growth from before "
              "opening the corpus to after the last sample; RSS = anonymous + file-backed pages). "
              "mmap = `MMapCorpus`; in-RAM = the same loop over `np.fromfile` of the .bin, for contrast.", "",
              "| corpus | samples | tokens | .bin MB | reader | RSS growth MB | anonymous MB | file-backed MB | "
              "seconds |", "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in res["reader"]:
        lines.append(f"| {r['corpus']} | {r['samples']:,} | {r['tokens']:,} | {r['bin_mb']:.1f} | {r['mode']} | "
                     f"{r['d_rss']:.1f} | {r['d_anon']:.1f} | {r['d_file']:.1f} | {r['seconds']:.2f} |")
    lines += ["", *res["notes"]]
    return "\n".join(lines) + "\n"


def best(runs: list[dict]) -> dict:
    """Fastest wall time, with the lowest CPU times seen among the repeats."""
    out = dict(min(runs, key=lambda r: r["seconds"]))
    for key in ("cpu", "map_s", "map_cpu"):
        if key in out:
            out[key] = min(r[key] for r in runs)
    out["pss_range"] = (min(r["peak_pss_mb"] for r in runs), max(r["peak_pss_mb"] for r in runs))
    return out


def args_repeats(tp: dict) -> int:
    return max(r.get("repeats", 1) for r in tp.values())


def notes(res: dict, procs: int) -> list[str]:
    tp = {(r["corpus"], r["tool"], r["procs"]): r for r in res["throughput"]}
    rd = {(r["corpus"], r["mode"]): r for r in res["reader"]}
    out = []
    for corpus, p in sorted({("small", 1), ("small", procs), ("large", procs)}, reverse=True):
        if (corpus, "datasets", p) not in tp:
            continue
        ours, ds = tp[(corpus, "ours", p)], tp[(corpus, "datasets", p)]
        rate = ours["tokens"] / ours["cpu"]
        out.append(f"- {corpus} corpus, {p} process(es): ours / datasets = {ds['seconds'] / ours['seconds']:.2f}x "
                   f"wall-clock speed and {rate / (ds['tokens'] / ds['cpu']):.2f}x tokens per CPU-second end to "
                   f"end; {rate / (ds['tokens'] / ds['map_cpu']):.2f}x against its map alone.")
    small, large = rd[("small", "mmap")], rd[("large", "mmap")]
    out.append(f"- mmap reader, {large['tokens'] / small['tokens']:.1f}x more tokens: anonymous memory grew "
               f"{small['d_anon']:.1f} MB vs {large['d_anon']:.1f} MB; the file-backed part "
               f"({small['d_file']:.1f} vs {large['d_file']:.1f} MB) is the page cache of the pages read, shared "
               f"with the OS and dropped under memory pressure, not memory the reader holds.")
    ram = rd[("large", "in-RAM")]
    out.append(f"- in-RAM reader on the large corpus: anonymous memory grew {ram['d_anon']:.1f} MB, i.e. with the "
               f"corpus size.")
    if ("large", "ours", procs) in tp:
        a, b = tp[("small", "ours", procs)], tp[("large", "ours", procs)]
        lo, hi = a["pss_range"]
        out.append(f"- ours, peak PSS of the whole run (main + workers): small corpus {lo:.0f}-{hi:.0f} MB over "
                   f"its {args_repeats(tp)} runs, large corpus {b['peak_pss_mb']:.0f} MB for {b['text_mb'] / a['text_mb']:.0f}x the input. Most of "
                   f"it is the main process's transformers import and tokenizer; each worker holds one chunk.")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=10.0, help="size of the small synthetic text (MB)")
    parser.add_argument("--scale", type=int, default=10, help="the large corpus is this many times larger")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes (max)")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="runs per small-corpus measurement (best kept)")
    parser.add_argument("--skip-large-datasets", action="store_true", help="do not run datasets.map on the large text")
    parser.add_argument("--workdir", help="keep files here instead of a temporary directory")
    parser.add_argument("--write", metavar="MD", help="replace/append our section in this markdown file")
    parser.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        kind, *rest = args._child
        fn = {"ours": run_ours, "datasets": run_datasets}.get(kind)
        result = fn(rest[0], rest[1], rest[2], int(rest[3]), args.max_len) if fn else reader_probe(*rest)
        print(json.dumps(result))
        return 0

    command = "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])
    res: dict = {"throughput": [], "reader": [], "load": [os.getloadavg()[0]]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        sizes = {"small": args.mb, "large": args.mb * args.scale}
        texts = {name: work / f"{name}.txt" for name in sizes}
        for i, (name, mb) in enumerate(sizes.items()):
            make_text(texts[name], mb, seed=i)
        with open(texts["small"], encoding="utf-8") as f:
            tok_dir = str(train_tokenizer(f.read(4 * MB), work / "tokenizer"))
        plan = [("small", p, args.repeats) for p in sorted({1, args.workers})] + [("large", args.workers, 1)]
        for corpus, procs, repeats in plan:
            for tool in ("ours", "datasets"):
                if corpus == "large" and tool == "datasets" and args.skip_large_datasets:
                    continue
                runs = []
                for r in range(repeats):
                    target = work / (f"{corpus}_{procs}" if tool == "ours" else f"hf_cache_{corpus}_{procs}_{r}")
                    runs.append(child(tool, str(texts[corpus]), tok_dir, str(target), str(procs)))
                    print(f"{corpus} {tool} procs={procs} run {r}: {runs[-1]}", file=sys.stderr)
                res["throughput"].append({"corpus": corpus, "text_mb": texts[corpus].stat().st_size / MB,
                                          "tool": tool, "procs": procs, "repeats": repeats, **best(runs)})
        for corpus in sizes:
            for mode in ("mmap", "in-RAM"):
                row = child("probe", str(work / f"{corpus}_{args.workers}"), mode)
                res["reader"].append({"corpus": corpus, "mode": mode, **row})
        res["load"].append(os.getloadavg()[0])
    res["notes"] = notes(res, args.workers)
    text = render(res, args, command)
    print(text)
    if args.write:
        write_section(Path(args.write), SECTION, text)
        print(f"wrote {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
