"""A reward served over HTTP (`reward.http`), called from the reward role's actors like a reward function.

The protocol is one JSON POST per batch of answers:

    request:  {"prompts": [str, ...], "answers": [str, ...], "columns": {"answer": [...], ...}}
    response: {"scores": [float, ...]}                       (one per answer, in order)

A batch that times out, cannot connect or gets a non-2xx reply is sent again (`retries` times, waiting 0.5 s, 1 s,
2 s...); after the last try the job fails naming the URL, the batch and the last error. A reply that is not one
finite score per answer fails at once, and so does a refused token (HTTP 401 or 403). There is never a silent 0.
`python -m rlhf_ray.reward_server` serves any reward function this way (the reference server).

Between machines: an https URL, and a bearer token (`Authorization: Bearer ...`) read on the driver's host from
`token_env` or `token_file` and handed to the reward actors with their arguments (not their environment, which the
dashboard shows).
"""

from __future__ import annotations

import json
import math
import os
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from rlhf_ray.config.ppo_job import HttpRewardSpec


class RemoteRewardError(RuntimeError):
    """The reward server did not give one finite score per answer, after the retries where retrying can help."""


def credentials(spec: HttpRewardSpec) -> dict[str, str | None]:
    """The bearer token (token_env or token_file) and the CA certificate (ca_file) `spec` names, read here, on the
    driver's host: HttpReward's keyword arguments. Nothing named: None each."""
    token = ca = None
    if spec.token_env:
        token = os.environ.get(spec.token_env, "").strip()
        if not token:
            raise RemoteRewardError(f"reward.http.token_env: the environment variable {spec.token_env} is not set "
                                    "(or empty) where the job starts; export it there")
    for field, path in (("token_file", spec.token_file), ("ca_file", spec.ca_file)):
        if path is None:
            continue
        try:
            text = open(path, encoding="utf-8").read().strip()
        except OSError as exc:
            raise RemoteRewardError(f"reward.http.{field}: cannot read {path}: {exc}") from None
        if not text:
            raise RemoteRewardError(f"reward.http.{field}: {path} is empty")
        token, ca = (text, ca) if field == "token_file" else (token, text)
    return {"token": token, "ca": ca}


class HttpReward:
    """Callable like a reward function: `scores = reward(prompts, answers, **columns)`."""

    def __init__(self, spec: HttpRewardSpec, token: str | None = None, ca: str | None = None):
        """`token`, `ca`: from credentials(spec), read where the job starts."""
        self.spec = spec
        self.requests = 0  # sent, retries included (for tests and logs)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.tls = ssl.create_default_context(cadata=ca) if spec.url.startswith("https://") else None

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
            request = urllib.request.Request(self.spec.url, data=body, method="POST", headers=self.headers)
            try:
                with urllib.request.urlopen(request, timeout=self.spec.timeout_s, context=self.tls) as reply:
                    payload = reply.read()
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code} {exc.reason}: {exc.read()[:200].decode(errors='replace')}"
                if exc.code in (401, 403):  # retrying cannot help
                    sent = "with the token from reward.http" if "Authorization" in self.headers else "without a token"
                    raise RemoteRewardError(f"{where}: the server refused the request {sent} ({last}); set "
                                            "reward.http.token_env or token_file to the server's token")
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
