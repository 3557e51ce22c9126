"""The SFT quickstart submitted with `ray job submit` to a head started by `ray start --head` on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlhf_ray.cluster import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.system
RAY = str(Path(sys.executable).parent / "ray")
SUBMIT_TIMEOUT_S = 420  # the job takes ~30 s on 2 cores


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    dashboard = free_port()
    temp_dir = tmp_path_factory.mktemp("ray")
    # the ports Ray fixes by default get free ones (the job agent's 52365: another Ray on the machine, or one still
    # shutting down, would leave this head's agent without its HTTP server)
    start = [RAY, "start", "--head", f"--port={free_port()}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={free_port()}",
             f"--metrics-export-port={free_port()}", "--num-cpus=2", "--disable-usage-stats",
             f"--temp-dir={temp_dir}"]
    subprocess.run(start, env=env, check=True, timeout=180, capture_output=True)
    try:
        yield f"http://127.0.0.1:{dashboard}", env, temp_dir
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, timeout=120, capture_output=True)


def _diagnosis(address: str, env: dict, job_id: str, temp_dir: Path) -> str:
    """What a stalled submission leaves to read: the job's status and driver log, the tails of the head's own logs
    (the job agent, the runtime-env agent, the raylet), and the processes that held the CPUs meanwhile."""
    top = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True)
    parts = ["$ ps (busiest first)\n" + "\n".join(line[:160] for line in top.stdout.splitlines()[:12])]
    for what in (["status", job_id], ["logs", job_id]):
        try:
            got = subprocess.run([RAY, "job", *what, "--address", address], env=env, capture_output=True,
                                 text=True, timeout=60, cwd=ROOT)
            parts.append(f"$ ray job {' '.join(what)}\n{got.stdout[-3000:]}{got.stderr[-1500:]}")
        except subprocess.TimeoutExpired:
            parts.append(f"$ ray job {' '.join(what)}: no answer in 60 s")
    for name in ("dashboard_agent.log", "runtime_env_agent.log", "raylet.out", "dashboard.log"):
        log = temp_dir / "session_latest" / "logs" / name
        if log.is_file():
            parts.append(f"--- {name} (tail)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


@pytest.mark.timeout(900)
def test_sft_quickstart_through_ray_job_submit(ray_head, tmp_path, tiny_model):
    address, env, temp_dir = ray_head
    env = {**env, "RAY_AUTH_MODE": "token"}  # the token `ray start --head` wrote is read by the client in token mode
    job_id = f"sft-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "sft"
    entrypoint = [sys.executable, "-m", "rlhf_ray.cli", "sft", "--config", "configs/quickstart/sft.yaml",
                  "--set", f"model.path={tiny_model}", "--set", f"output_dir={out}", "--set", "train.max_steps=10",
                  "--set", "logging.progress=false"]
    submit = [RAY, "job", "submit", "--address", address, "--submission-id", job_id, "--working-dir", ".",
              "--runtime-env", "deploy/runtime_env.yaml", "--"]
    try:  # a stall is reported with what the head logged, inside pytest's own timeout
        result = subprocess.run(submit + entrypoint, env=env, capture_output=True, text=True,
                                timeout=SUBMIT_TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired as stalled:
        printed = stalled.stdout or b""  # bytes even with text=True
        printed = printed.decode(errors="replace") if isinstance(printed, bytes) else printed
        pytest.fail(f"`ray job submit` did not end in {SUBMIT_TIMEOUT_S} s; it printed:\n{printed[-3000:]}\n"
                    f"{_diagnosis(address, env, job_id, temp_dir)}", pytrace=False)
    assert result.returncode == 0, (result.stdout[-3000:] + result.stderr[-3000:]
                                    + _diagnosis(address, env, job_id, temp_dir))
    assert "succeeded" in result.stdout.lower()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_last"] < summary["eval_loss_first"]
    assert (out / "model" / "config.json").is_file()
