"""What a job spends checking its GGUF sources before anything starts: check_gguf (the header read of
models/gguf_header.py) against gguf's GGUFReader, which the check used before and which parses every metadata
value, side by side on the packaged SmolLM2 file (alternating, `--repeats` times each, after one warm-up of both);
and the whole model-source resolution of the GRPO quickstart (policy and reference name `package:smollm2`: four
checks) with the import already cached, as every job after the first finds it.

Run: python benchmarks/bench_gguf_check.py [--repeats 3] [--write benchmarks/HISTORY.md]
"""

from __future__ import annotations

import argparse
from importlib import metadata
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, publish, today, versions  # noqa: E402

SECTION = "## GGUF source checks before a job starts"


def full_reader(path: Path) -> tuple[str, int]:
    """The check as it was: every metadata field parsed by gguf's reader."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode(), len(reader.tensors)


@contextlib.contextmanager
def old_check():
    """models/sources.py's check_gguf answered by the full reader, as before the header read."""
    from rlhf_ray.models import sources
    from rlhf_ray.models.gguf_header import GGUFHeader

    header = sources.read_gguf_header

    def full(path):
        arch, tensors = full_reader(path)
        return GGUFHeader(arch, tensors)

    sources.read_gguf_header = full
    try:
        yield
    finally:
        sources.read_gguf_header = header


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, default=None)
    args = parser.parse_args()

    from rlhf_ray.config import load_job
    from rlhf_ray.models.packaged import MODELS_DIR_ENV, packaged_gguf
    from rlhf_ray.models.sources import check_gguf, materialize_gguf, resolve_model_sources

    file = packaged_gguf("smollm2")
    full_reader(file), check_gguf(file)  # imports and page cache warm for both
    old, new = [], []
    for _ in range(args.repeats):
        seconds, (arch, tensors) = timed(full_reader, file)
        old.append(seconds)
        seconds, info = timed(check_gguf, file)
        new.append(seconds)
        assert (info["architecture"], info["tensors"]) == (arch, tensors)
    with tempfile.TemporaryDirectory() as models:
        print("importing the packaged SmolLM2 once (the cached import every later job finds) ...", flush=True)
        materialize_gguf(None, "package:smollm2", models)
        os.environ[MODELS_DIR_ENV] = models
        job = load_job(ROOT / "configs/quickstart/grpo.yaml", [f"output_dir={models}/out"])
        resolve_old, resolve_new = [], []
        for _ in range(args.repeats):
            with old_check():
                resolve_old.append(timed(resolve_model_sources, job)[0])
            resolve_new.append(timed(resolve_model_sources, job)[0])
    text = "\n".join([
        SECTION, "",
        f"Measured {today()} on {machine()}; {versions('transformers')}, gguf {metadata.version('gguf')}. `python "
        f"benchmarks/bench_gguf_check.py --repeats {args.repeats}`.", "",
        f"Every job checks the GGUF file of each role that names one before anything starts (`rlhf-ray validate` "
        f"and the CLI's preflight once per role, the model-source resolution twice). On the packaged SmolLM2 file "
        f"({file.stat().st_size / 1e6:.0f} MB, 272 tensors, a 49k-entry vocabulary), alternating, median of "
        f"{args.repeats}:", "",
        "| check | seconds |", "|---|---|",
        f"| gguf's GGUFReader (every metadata value parsed; the check before 2026-11-29) | "
        f"{statistics.median(old):.2f} |",
        f"| `check_gguf`: the header read (models/gguf_header.py) | {statistics.median(new):.3f} |", "",
        f"Ratio {statistics.median(old) / statistics.median(new):.0f}x. The GRPO quickstart's whole model-source "
        f"resolution (policy and reference: four checks, the import cached), alternating, median of "
        f"{args.repeats}: {statistics.median(resolve_old):.1f} s with the full reader, "
        f"{statistics.median(resolve_new):.2f} s with the header read. Every SmolLM2 job (recipes, the quickstart, "
        f"the test suite's) starts that much sooner.", "",
    ])
    return publish(text, args.write, SECTION)


if __name__ == "__main__":
    raise SystemExit(main())
