"""Training metrics reach Ray's Prometheus endpoint (what the Ray dashboard and a Prometheus server read) while a
PPO job is still running, and a real Prometheus (Debian's `prometheus` package), configured by the project's
deploy/prometheus/prometheus.yml, scrapes them: every panel of the shipped Grafana dashboard
(deploy/grafana/rlhf_ray.json) gets the run's series back from Prometheus' HTTP API. One job serves both tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from rlhf_ray.jobs.ppo import run_ppo
from tests.test_ppo_job import ppo_job

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
WANTED = ("reward_mean", "kl_mean", "policy_loss", "policy_entropy", "critic_loss", "time_sync", "sync_bytes",
          "buffer_staleness", "policy_version", "generate_tokens_per_s", "generate_engine_utilisation")
RUN = "ppo-ppo"  # the job's run label: its kind and its output folder's name
ONCE = "gauge-set-once"  # the run label of a logger that logs one line before the job and nothing after


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    try:
        return urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return ""


def start_prometheus(session_dir: str, folder: Path) -> tuple[subprocess.Popen, int]:
    """Prometheus on loopback with the shipped scrape config, its discovery file pointed at this Ray session's (the
    config's comment says to, for a Ray with its own temp dir: another Ray on the machine may own /tmp/ray's link),
    scraping each second."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (discovery,) = config["scrape_configs"][0]["file_sd_configs"]
    discovery["files"] = [str(Path(session_dir) / "prom_metrics_service_discovery.json")]
    # Read the targets and scrape them each second instead of each 5 s: the test waits for a first scrape and, after
    # its job, for every panel's series, seconds of an idle machine at the shipped intervals; the rest as shipped.
    config["global"]["scrape_interval"] = discovery["refresh_interval"] = "1s"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen([shutil.which("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "w"))
    return proc, port


def scraped_once(port: int, timeout_s: float = 120.0) -> bool:
    """Wait until Prometheus has scraped a target of Ray's discovery file successfully (a loaded machine starts it
    slowly: a job that ends before the first scrape leaves no series). False if it has not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = get(f"http://127.0.0.1:{port}/api/v1/targets")
        if text and any(t.get("health") == "up" for t in json.loads(text)["data"]["activeTargets"]):
            return True
        time.sleep(1)
    return False


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory, sft_model, rm_model):
    """A 12-iteration PPO job (critic, reward model, held-out evaluations) with its metrics endpoint scraped by hand
    during the run, and, where Debian's prometheus is installed, a Prometheus scraping it too. The test holds the
    job's Ray (`cluster.shared`, whose head writes the discovery file) from before the job until Prometheus has
    every panel's series, and the job's logger open (its gauges kept) until then: the tiny job's 12 iterations take
    ~2 s, so its gauges would otherwise go before a scrape at the shipped 5-s interval about half of the time (every
    panel empty in two fresh CI runs). Yields what was seen."""
    from rlhf_ray import cluster
    from rlhf_ray.config.run import LoggingSpec
    from rlhf_ray.jobs.metrics import MetricsLogger
    from tests.conftest import _SESSION_RAY

    _SESSION_RAY.close()  # this job's Ray has a shape of its own: a dashboard, a fixed metrics port
    tmp = tmp_path_factory.mktemp("metrics")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_metrics_report_interval_ms", "1000")
    # The job's 12 tiny iterations take ~2 s, less than a scrape interval, and its gauges leave the endpoint a report
    # interval after its logger closes; a real job's gauges live for minutes. Its logger is closed by the test once
    # Prometheus has every panel's series (or the wait is over), so a scrape falls inside the job's life.
    kept: list[MetricsLogger] = []
    close = MetricsLogger.close
    mp.setattr(MetricsLogger, "close", lambda self: kept.append(self) if self.run_name == RUN else close(self))
    port = free_port()
    job = ppo_job(tmp, sft_model, rm_model, "ppo.iterations=12", "ppo.rollout_batch_size=16", "ppo.eval_prompts=8",
                  "ppo.eval_every=4", "policy.micro_batch_size=16", "critic.micro_batch_size=16",
                  f"cluster.metrics_export_port={port}", "cluster.dashboard=true", f"cluster.dashboard_port={free_port()}")
    seen = {"found": set(), "text": "", "while_running": False, "prometheus": None, "started": time.time()}
    prometheus = None
    try:
        with cluster.shared(job.cluster):
            import ray

            if shutil.which("prometheus"):
                prometheus = start_prometheus(ray._private.worker._global_node.get_session_dir_path(),
                                              tmp / "prometheus")
                # Prometheus starts while the job does (~6 s to its first scrape; the job's gauges are kept until
                # every panel has its series, so the job need not wait for it)
                first_scrape = threading.Thread(
                    target=lambda: seen.update(scraped=scraped_once(prometheus[1])), daemon=True)
                first_scrape.start()
            results: list = []
            once = MetricsLogger(tmp / "once", LoggingSpec(tensorboard=False), run_name=ONCE)
            once.log(0, {"eval/once": 1.0})  # like an evaluation's numbers: set, then nothing for a while
            seen["once_set"] = time.monotonic()
            runner = threading.Thread(target=lambda: results.append(run_ppo(job)), daemon=True)
            runner.start()
            while runner.is_alive() and len(seen["found"]) < len(WANTED):
                text = get(f"http://127.0.0.1:{port}/metrics")
                if text:
                    seen["text"], seen["found"] = text, {n for n in WANTED if f"ray_rlhf_ray_{n}{{" in text}
                    seen["once_seen"] = time.monotonic() if f'run="{ONCE}"' in text else seen.get("once_seen")
                time.sleep(0.2)
            seen["while_running"] = runner.is_alive()
            once.close()
            runner.join(timeout=600)
            seen["results"] = results
            if prometheus is not None:
                seen["prometheus"] = prometheus[1]
                first_scrape.join(timeout=130)
                deadline = time.monotonic() + 90  # scrapes every 1 s; the job's last gauges are reported each 1 s
                while empty_panels(seen) and time.monotonic() < deadline:
                    time.sleep(2)
            for logger in kept:
                close(logger)
        yield seen
    finally:
        for logger in kept:
            if not logger.closed.is_set():
                close(logger)
        mp.undo()
        if prometheus is not None:
            prometheus[0].terminate()
            prometheus[0].wait(timeout=30)


def test_training_metrics_are_scraped_from_the_endpoint_during_a_run(scraped_run):
    assert scraped_run["found"] == set(WANTED), f"missing {set(WANTED) - scraped_run['found']}"
    assert scraped_run["while_running"]
    line = next(x for x in scraped_run["text"].splitlines() if x.startswith("ray_rlhf_ray_policy_version{"))
    assert f'run="{RUN}"' in line and float(line.rsplit(" ", 1)[1]) >= 1
    assert scraped_run["results"] and scraped_run["results"][0]["iterations"] == 12


def test_a_gauge_set_once_stays_on_the_endpoint_until_its_job_ends(scraped_run):
    """Ray's gauges leave its endpoint a report interval or two after they were set (OpenTelemetry exports a
    value in the rounds after it changes): an evaluation's numbers, set every `eval_every` iterations, would be
    missed by a Prometheus that scrapes less often. The job's logger keeps every gauge at its last value."""
    assert scraped_run["once_seen"] is not None, f"the gauge of {ONCE} never reached the endpoint"
    kept = scraped_run["once_seen"] - scraped_run["once_set"]
    assert kept > 10, f"the job took only {kept:.1f} s: too short to tell (report interval: 1 s)"


def draw_panels():
    """deploy/grafana/draw_panels.py, the shipped script that reads the dashboard's queries from Prometheus."""
    spec = importlib.util.spec_from_file_location("draw_panels", ROOT / "deploy/grafana/draw_panels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of the shipped dashboard."""
    return draw_panels().queries(json.loads((ROOT / "deploy/grafana/rlhf_ray.json").read_text()))


def empty_panels(scraped_run) -> list[str]:
    """`title: query` of every dashboard query that Prometheus has no series of the run for, since the run began."""
    prometheus, query_range = f"http://127.0.0.1:{scraped_run['prometheus']}", draw_panels().query_range
    empty = []
    for title, expr in dashboard_queries():
        try:
            series = query_range(prometheus, expr.replace("$run", RUN), scraped_run["started"], time.time(), 1, 5)
        except (OSError, RuntimeError):
            series = []
        if not [s for s in series if s["metric"].get("run") == RUN and s["values"]]:
            empty.append(f"{title}: {expr}")
    return empty


def test_every_dashboard_panel_gets_the_runs_series_from_a_real_prometheus(scraped_run):
    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus package is not installed (scripts/test.sh installs it in CI: "
                    "apt-get install prometheus)")
    assert scraped_run["prometheus"] is not None, "Prometheus did not start before the job ended"
    assert scraped_run.get("scraped"), "Prometheus had not scraped Ray's metrics agent within 120 s"
    base = f"http://127.0.0.1:{scraped_run['prometheus']}/api/v1/"
    targets = json.loads(get(base + "targets"))["data"]["activeTargets"]
    assert targets, "Prometheus found no targets in Ray's service-discovery file"  # (down now: the job's Ray ended)
    assert len({title for title, _ in dashboard_queries()}) >= 12
    empty = empty_panels(scraped_run)
    assert not empty, "dashboard panels whose query returned no series for the run:\n" + "\n".join(empty)
