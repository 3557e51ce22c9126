"""Where a job's numbers go: a JSON-lines file, TensorBoard, Ray's metrics API (the Ray dashboard and its
Prometheus endpoint), and W&B when configured."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path

from rlhf_ray.config.run import LoggingSpec

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, output_dir: str | Path, spec: LoggingSpec, run_name: str):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.jsonl = (self.dir / METRICS_FILE).open("a")
        self.tb = None
        if spec.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        self.run_name = run_name
        self.gauges: dict[str, object] = {}
        self.last: dict[str, float] = {}  # each gauge's last value, set again every KEEP_ALIVE_S (see _keep_alive)
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.keeper: threading.Thread | None = None
        self.wandb = None
        if spec.wandb_project:
            import wandb

            self.wandb = wandb.init(project=spec.wandb_project, name=spec.wandb_run_name or run_name)

    def rewind(self, step: int) -> int:
        """On resume from the checkpoint of `step`: drop the lines of later steps (and later samples), which the
        run is about to redo, so each step appears once. The file is rewritten aside and renamed into place.
        Returns how many lines were dropped."""
        self.jsonl.close()
        dropped = _keep_lines(self.dir / "metrics.jsonl", "step", step)
        dropped += _keep_lines(self.dir / SAMPLES_FILE, "iteration", step)
        self.jsonl = (self.dir / METRICS_FILE).open("a")
        if dropped:
            log.info("resuming at step %d: dropped %d logged lines of the steps to be redone", step, dropped)
        return dropped

    def log(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        values = {f"{prefix}{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.spec.ray_metrics:
            self._to_ray(values)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def _to_ray(self, values: dict[str, float]) -> None:
        """One gauge per metric, tagged with the run, exported by Ray (needs a connected Ray driver)."""
        import ray
        from ray.util.metrics import Gauge

        if not ray.is_initialized():
            return
        with self.lock:
            for key, value in values.items():
                name = gauge_name(key)
                if name not in self.gauges:
                    self.gauges[name] = Gauge(name, description=f"rlhf_ray metric {key}", tag_keys=("run",))
                self.gauges[name].set(value, tags={"run": self.run_name})
                self.last[name] = value
        if self.keeper is None:
            self.keeper = threading.Thread(target=self._keep_alive, name="rlhf-ray-gauges", daemon=True)
            self.keeper.start()

    def _keep_alive(self) -> None:
        """Set every gauge to its last value again, every KEEP_ALIVE_S until close. Ray exports gauges through
        OpenTelemetry, which reports a value only in the export rounds after it was set: a gauge set once (an
        evaluation's numbers, every `eval_every` iterations) leaves Ray's endpoint one or two report intervals later
        (~2 s with RAY_metrics_report_interval_ms=1000, ~20 s by default), so a Prometheus scraping less often
        would miss it, and a dashboard would draw dots instead of a line. A Prometheus gauge holds its last value."""
        import ray

        while not self.closed.wait(KEEP_ALIVE_S):
            if not ray.is_initialized():
                continue
            try:
                with self.lock:
                    for name, value in self.last.items():
                        self.gauges[name].set(value, tags={"run": self.run_name})
            except Exception as e:  # Ray went down between the check and the call: the job is over
                log.debug("gauges no longer kept: %s", e)
                return

    def close(self) -> None:
        self.closed.set()
        if self.keeper is not None:
            self.keeper.join(timeout=10)
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


KEEP_ALIVE_S = 0.5
"""How often a job's gauges are set again (MetricsLogger._keep_alive): under Ray's fastest report interval."""


def gauge_name(key: str) -> str:
    """The Ray gauge a metric is exported as (`policy/clip_fraction` -> `rlhf_ray_policy_clip_fraction`); Ray's
    Prometheus endpoint adds the `ray_` prefix."""
    return "rlhf_ray_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TIMELINE_FILE = "timeline.json"
"""Ray's timeline of the run's actor calls (logging.timeline), a Chrome trace."""


def write_timeline(path: Path, since: float, report_interval_s: float = 1.0) -> None:
    """Ray's timeline of this job's tasks and actor calls from `since` (a time.time()) on, as a Chrome trace: a
    cluster's timeline holds every job it ran (a shared or long-lived cluster), so other jobs' calls and earlier
    ones are left out. Processes report their calls to Ray every `report_interval_s` (Ray's
    task_events_report_interval_ms): the last report is waited for first."""
    import ray

    time.sleep(2 * report_interval_s)
    job = ray.get_runtime_context().get_job_id()
    events = [e for e in ray.timeline() if e.get("ts", since * 1e6) >= since * 1e6
              and e.get("args", {}).get("task_id", job)[-len(job):] == job]  # a task id ends with its job's id
    path.write_text(json.dumps(events))


def _keep_lines(path: Path, key: str, last: int) -> int:
    """Keep the JSON lines of `path` whose `key` is at most `last` (and any line without one); atomic rewrite."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            value = json.loads(line).get(key)
        except (ValueError, AttributeError):
            value = None
        if isinstance(value, (int, float)) and value > last:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


def write_samples(path: Path, iteration: int, samples: list[dict], tokenizer) -> None:
    """Append rollout samples (Assembled.samples: a rollout's first rows) as readable JSON lines: iteration, prompt,
    answer (special tokens kept, so a missing or doubled end-of-text shows), reward and the dataset columns it was
    scored with."""
    if not samples:
        return
    with open(path, "a") as f:
        for s in samples:
            f.write(json.dumps({"iteration": iteration, "prompt": tokenizer.decode(s["prompt_ids"]),
                                "answer": tokenizer.decode(s["answer_ids"]), "reward": s["score"],
                                "columns": s["columns"]}) + "\n")
