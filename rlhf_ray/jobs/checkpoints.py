"""Checkpoint folders of a job: written under a temporary name, renamed when complete, the last N kept.
A crash at any moment leaves the previous complete checkpoint as the newest one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step-(\d+)$")


class Checkpoints:
    def __init__(self, output_dir: str | Path, keep_last: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.committed: list[Path] = []
        """The checkpoints this object sealed (this job, every attempt), oldest first."""

    def complete(self) -> list[Path]:
        """Finished checkpoints, oldest first (a folder counts only once its state file is inside)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def resumable(self, resume: bool) -> Path | None:
        """Where an attempt starts: with `resume` the newest complete checkpoint; without it the newest one this
        job sealed itself, so an automatic restart of a run that started afresh (checkpoint.resume: false) goes
        on from its own last checkpoint, never from one an earlier run left in the folder."""
        if resume:
            return self.latest()
        done = set(self.complete())
        mine = [p for p in self.committed if p in done]
        return mine[-1] if mine else None

    def pruning_order(self) -> list[Path]:
        """Complete checkpoints, the first to go first: those this job did not seal (an earlier run's, by step),
        then its own, oldest first. A run started afresh (checkpoint.resume: false) in a folder holding an earlier
        run's later steps keeps its own newest checkpoints, not the earlier run's."""
        done = self.complete()
        mine = [p for p in self.committed if p in set(done)]
        return [p for p in done if p not in set(mine)] + mine

    def staging(self, step: int) -> Path:
        path = self.root / f".tmp-step-{step:08d}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, step: int, state: dict) -> Path:
        """Seal a staged checkpoint: state file last, then the atomic rename, then pruning of old ones."""
        tmp_state = staging / (STATE_FILE + ".tmp")
        tmp_state.write_text(json.dumps({"step": step, **state}, indent=2))
        os.replace(tmp_state, staging / STATE_FILE)
        final = self.root / f"step-{step:08d}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        self.committed = [p for p in self.committed if p != final] + [final]
        for old in self.pruning_order()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return final

    @staticmethod
    def state(path: Path) -> dict:
        return json.loads((path / STATE_FILE).read_text())
