"""Resume a learner group from a checkpoint written by another number of ranks.

A ZeRO-1/2/3 checkpoint holds each rank's partition of the optimizer state (and under ZeRO-3 of the weights), cut
for the world size that wrote it; DeepSpeed refuses to load it on another one. DeepSpeed's universal format stores
every parameter's fp32 weight and optimizer moments whole, one folder per parameter, and any world size loads it.
The driver converts a checkpoint once, when a group of another size resumes from it (next to the original, written
aside and renamed), and the ranks load that. A checkpoint without partitioned optimizer files (fp32 ZeRO-0: the
torch optimizer's whole state is in the model file) loads on any world size as it is."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_TAG = "state"
"""The tag (sub-folder) the learners save DeepSpeed's engine state under."""
UNIVERSAL_TAG = "state_universal"
"""The same state in DeepSpeed's universal format, written when a group of another size resumes."""


def saved_ranks(directory: Path) -> int:
    """How many ranks wrote the checkpoint (each leaves its RNG state)."""
    return len(list(Path(directory).glob("rng_rank*.pt")))


def is_partitioned(directory: Path) -> bool:
    """The engine state holds per-rank optimizer partitions (ZeRO 1-3, or a bf16 / fp16 optimizer)."""
    return any((Path(directory) / ENGINE_TAG).glob("*optim_states.pt"))


def universal_copy(directory: Path, timeout_s: float) -> str:
    """The tag of the checkpoint's universal copy, converting it first if it has none yet. DeepSpeed's converter
    runs in a fresh process (its worker pool forks, which can deadlock a process that already runs torch threads)
    and is stopped after `timeout_s`."""
    directory = Path(directory)
    final = directory / UNIVERSAL_TAG
    if (final / "zero").is_dir():
        return UNIVERSAL_TAG
    staging = directory / f".{UNIVERSAL_TAG}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    workers = max(1, min(4, len(os.sched_getaffinity(0))))
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(directory / ENGINE_TAG), "--output_folder", str(staging), "--num_extract_workers", str(workers),
               "--num_merge_workers", str(max(1, workers // 2)), "--inject_missing_state"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        problem = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        problem = f"it took longer than {timeout_s:.0f} s"
    if problem is not None:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"{directory}: converting the checkpoint of {saved_ranks(directory)} ranks to DeepSpeed's "
                           f"universal format (to resume on another number of ranks) failed: {problem}; resume "
                           f"with the number of ranks that wrote it")
    (directory / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; the learners name the tag
    os.replace(staging, final)
    return UNIVERSAL_TAG


def load_group_checkpoint(group, directory: Path, role: str) -> list:
    """Every rank of `group` loads `directory`; converted to the universal format first when it was written by
    another number of ranks and holds partitioned state."""
    written, ranks = saved_ranks(directory), len(group)
    if written in (0, ranks) or not is_partitioned(directory):
        return group.call("load_checkpoint", str(directory))
    log.info("%s: resuming on %d ranks from %s, written by %d: converting it to DeepSpeed's universal format",
             role, ranks, directory, written)
    return group.call("load_checkpoint", str(directory), universal_copy(directory, group.call_timeout_s))
