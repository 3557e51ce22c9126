"""`ppo.keep_best`: the policy of the best held-out evaluation, exported beside the last one. One job: after each
evaluation, export the policy when its score beats the best so far; across a resume, keep the best only where the
folder still holds it."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf_ray.config.jobs import BEST_MODEL_DIR

log = logging.getLogger(__name__)
RECORD_FILE = "best.json"


@dataclass(frozen=True)
class Best:
    """The best evaluation so far: its iteration (0: the starting policy), the metric and its score."""

    iteration: int
    metric: str
    value: float


class BestModel:
    """Exports the policy (by `export(folder)`) to `<out>/best_model` whenever an evaluation's `metric` beats the
    best so far; best.json beside it names the iteration. Off (every call a no-op) when `metric` is None."""

    def __init__(self, out: Path, metric: str | None, export: Callable[[str], object]):
        self.out, self.metric, self.export = Path(out), metric, export
        self.best: Best | None = None

    @property
    def folder(self) -> Path:
        return self.out / BEST_MODEL_DIR

    @property
    def record(self) -> Path:
        return self.out / RECORD_FILE

    def start_fresh(self) -> None:
        """A run from the start: a best model an earlier run left in this output_dir is not this run's."""
        if self.metric is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.record.unlink(missing_ok=True)
        self.best = None

    def resume(self, saved: dict | None) -> None:
        """Resume with the best a checkpoint saved (`state()` then). The folder holds it unless iterations after that
        checkpoint (redone now) exported a better one before the stop: that model is not this run's any more and
        the one it replaced is gone, so the best restarts from the resumed policy's next evaluation."""
        if self.metric is None:
            return
        self.best = Best(**saved) if saved else None
        on_disk = json.loads(self.record.read_text()) if self.record.is_file() else None
        if self.best is not None and on_disk == asdict(self.best) and self.folder.is_dir():
            return
        if self.best is not None or on_disk is not None:
            log.warning("ppo.keep_best: %s holds iteration %s, the checkpoint's best is %s: the best model is "
                        "tracked again from the resumed run's next evaluation", self.folder,
                        on_disk and on_disk.get("iteration"), self.best and self.best.iteration)
        self.start_fresh()

    def state(self) -> dict | None:
        """What a checkpoint keeps, for `resume`."""
        return None if self.best is None else asdict(self.best)

    def consider(self, iteration: int, scores: dict[str, float]) -> bool:
        """After an evaluation: export the policy if its score beats the best so far. Returns whether it did."""
        if self.metric is None or self.metric not in scores:
            return False
        value = scores[self.metric]
        if value != value or (self.best is not None and value <= self.best.value):  # nan never wins
            return False
        staging = self.out / f".tmp-{BEST_MODEL_DIR}"
        shutil.rmtree(staging, ignore_errors=True)
        self.export(str(staging))
        self.record.unlink(missing_ok=True)  # no record while the folder changes: a stop in between resumes afresh
        shutil.rmtree(self.folder, ignore_errors=True)
        os.replace(staging, self.folder)
        self.best = Best(iteration, self.metric, value)
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self.best)))
        os.replace(tmp, self.record)
        log.info("ppo.keep_best: iteration %d, %s %.4f, exported to %s", iteration, self.metric, value, self.folder)
        return True
