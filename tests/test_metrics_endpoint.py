"""Training metrics reach Ray's Prometheus endpoint (what the Ray dashboard and a Prometheus server read) while a
PPO job is still running: scraped over loopback during the run."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from rlhf_ray.jobs.ppo import run_ppo
from tests.test_ppo_job import ppo_job

pytestmark = pytest.mark.system

WANTED = ("reward_mean", "kl_mean", "policy_loss", "policy_entropy", "critic_loss", "time_sync", "sync_bytes",
          "buffer_staleness", "policy_version", "generate_tokens_per_s", "generate_engine_utilisation")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def test_training_metrics_are_scraped_from_the_endpoint_during_a_run(tmp_path, sft_model, rm_model, monkeypatch):
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "1000")
    port = free_port()
    job = ppo_job(tmp_path, sft_model, rm_model, "ppo.iterations=12", "ppo.rollout_batch_size=16",
                  "ppo.eval_prompts=8", "policy.micro_batch_size=16", "critic.micro_batch_size=16",
                  f"cluster.metrics_export_port={port}")
    results: list = []
    runner = threading.Thread(target=lambda: results.append(run_ppo(job)), daemon=True)
    runner.start()
    found: set[str] = set()
    text = ""
    while runner.is_alive() and len(found) < len(WANTED):
        text = scrape(port)
        found = {name for name in WANTED if f"ray_rlhf_ray_{name}{{" in text}
        time.sleep(0.5)
    scraped_while_running = runner.is_alive()
    runner.join(timeout=600)
    assert found == set(WANTED), f"missing {set(WANTED) - found}"
    assert scraped_while_running
    line = next(x for x in text.splitlines() if x.startswith("ray_rlhf_ray_policy_version{"))
    assert 'run="ppo-ppo"' in line and float(line.rsplit(" ", 1)[1]) >= 1
    assert results and results[0]["iterations"] == 12
