"""A reward served over HTTP (`reward.http`), called from the reward role's actors like a reward function.

The protocol is one JSON POST per batch of answers:

    request:  {"prompts": [str, ...], "answers": [str, ...], "columns": {"answer": [...], ...}}
    response: {"scores": [float, ...]}                       (one per answer, in order)

A batch that times out, cannot connect or gets a non-2xx reply is sent again (`retries` times, waiting 0.5 s, 1 s,
2 s...); after the last try the job fails naming the URL, the batch and the last error. A reply that is not one
finite score per answer fails at once. There is never a silent 0. `python -m rlhf_ray.reward_server` serves any
reward function this way (the reference server, used by the tests on 127.0.0.1).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from rlhf_ray.config.ppo_job import HttpRewardSpec


class RemoteRewardError(RuntimeError):
    """The reward server did not give one finite score per answer, after the retries where retrying can help."""


class HttpReward:
    """Callable like a reward function: `scores = reward(prompts, answers, **columns)`."""

    def __init__(self, spec: HttpRewardSpec):
        self.spec = spec
        self.requests = 0  # sent, retries included (for tests and logs)

    def check(self) -> None:
        """An empty batch, once: a server that is down, unreachable or replies with something else than
        {"scores": []} is named before the job starts anything."""
        self._batch([], [], {}, 0, 0, 0)

    def __call__(self, prompts: list[str], answers: list[str], **columns: list) -> list[float]:
        size = self.spec.batch_size
        batches = [(lo, min(lo + size, len(answers))) for lo in range(0, len(answers), size)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.spec.concurrency, len(batches)))) as pool:
            parts = list(pool.map(lambda b: self._batch(prompts, answers, columns, *b, len(answers)), batches))
        return [score for part in parts for score in part]

    def _batch(self, prompts, answers, columns, lo: int, hi: int, total: int) -> list[float]:
        body = json.dumps({"prompts": prompts[lo:hi], "answers": answers[lo:hi],
                           "columns": {name: values[lo:hi] for name, values in columns.items()}}).encode()
        where = (f"reward.http: POST {self.spec.url} for answers {lo}-{hi - 1} of {total}" if total else
                 f"reward.http.url: the check before the job (an empty batch to {self.spec.url})")
        last = ""
        for attempt in range(self.spec.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            self.requests += 1
            request = urllib.request.Request(self.spec.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.spec.timeout_s) as reply:
                    payload = reply.read()
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code} {exc.reason}: {exc.read()[:200].decode(errors='replace')}"
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"no reply within {self.spec.timeout_s:g} s" if "timed out" in str(reason) else str(reason)
                continue
            return _scores(payload, hi - lo, where)
        raise RemoteRewardError(f"{where} failed after {self.spec.retries + 1} tries: {last}")


def _scores(payload: bytes, expected: int, where: str) -> list[float]:
    try:
        scores = [float(v) for v in json.loads(payload)["scores"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise RemoteRewardError(f"{where}: the reply is not {{\"scores\": [numbers]}} ({type(exc).__name__}: {exc}; "
                                f"got {payload[:200]!r})") from None
    if len(scores) != expected:
        raise RemoteRewardError(f"{where}: the reply has {len(scores)} scores for {expected} answers")
    if not all(math.isfinite(s) for s in scores):
        raise RemoteRewardError(f"{where}: the reply has a non-finite score: {scores}")
    return scores
