"""The live progress line of a PPO job: after every iteration, where the run is and how it goes (reward, the
held-out reward and check of the latest evaluation where the job has a check, KL, entropy, samples/s, where the
iteration's time went, ETA). On a terminal the line is rewritten in place; anywhere
else (`ray job logs`, a pipe, a CI log) each iteration is a line of its own, with no cursor control."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rlhf_ray.jobs.held_out import Evaluation

SPLIT = (("gen", "time/generate_wait"), ("exp", "time/experience"), ("train", "time/train"), ("sync", "time/sync"))
"""The parts of an iteration's wall time the line shows, by their metric."""


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class Progress:
    def __init__(self, total: int, start: int, samples_per_iteration: int, enabled: bool = True,
                 stream: TextIO | None = None):
        self.total, self.done, self.samples = total, start, samples_per_iteration
        self.enabled, self.stream = enabled, stream or sys.stderr
        self.first, self.began = start, time.monotonic()
        self.in_place = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.width = 0
        self.held_out = ""
        self.engines: float | None = None
        """Engines that served the last iteration shown (an elastic pool's change shows on the line)."""

    def evaluated(self, step: int, held_out: Evaluation) -> None:
        """The held-out evaluation after `step` iterations: its reward and, with a check (a rule or gold function),
        the check's score, of greedy answers, show from the next line on with the iteration they were measured at
        (side by side: a reward that rises while the check falls is over-optimisation)."""
        greedy = held_out.greedy
        if greedy is None or greedy.check is None:
            self.held_out = ""
            return
        self.held_out = f"held-out reward {greedy.reward:.3f} check {greedy.check:.3f} (iter {step})"

    def line(self, step: int, metrics: dict[str, float]) -> str:
        """The line for `step` (iterations done) with that iteration's metrics."""
        parts = [f"iter {step}/{self.total}"]
        for label, key, form in (("reward", "reward/mean", "{:.3f}"), ("kl", "kl/mean", "{:.4f}"),
                                 ("entropy", "policy/entropy", "{:.2f}")):
            if key in metrics:
                parts.append(f"{label} {form.format(metrics[key])}")
            if key == "reward/mean" and self.held_out:
                parts.append(self.held_out)
        wall = metrics.get("time/iteration")
        if wall:
            parts.append(f"{self.samples / wall:.1f} samples/s")
            parts.append(" ".join(f"{label} {metrics[key]:.1f}s" for label, key in SPLIT if key in metrics))
        engines = metrics.get("generate/engines")
        if engines is not None and self.engines is not None and engines != self.engines:
            parts.append(f"engines {self.engines:g} -> {engines:g}")
        done = step - self.first
        if 0 < done and step < self.total:
            parts.append(f"eta {duration((time.monotonic() - self.began) / done * (self.total - step))}")
        return "  ".join(parts)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        text = self.line(step, metrics)
        self.engines = metrics.get("generate/engines", self.engines)
        if self.in_place:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.in_place and self.width:
            self.stream.write("\n")
            self.stream.flush()
