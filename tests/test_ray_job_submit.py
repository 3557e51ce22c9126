"""The SFT quickstart submitted with `ray job submit` to a head started by `ray start --head` on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.system
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    dashboard = _free_port()
    temp_dir = tmp_path_factory.mktemp("ray")
    start = [RAY, "start", "--head", f"--port={_free_port()}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard}", "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    subprocess.run(start, env=env, check=True, timeout=180, capture_output=True)
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, timeout=120, capture_output=True)


def test_sft_quickstart_through_ray_job_submit(ray_head, tmp_path, tiny_model):
    address, env = ray_head
    out = tmp_path / "sft"
    entrypoint = [sys.executable, "-m", "rlhf_ray.cli", "sft", "--config", "configs/quickstart/sft.yaml",
                  "--set", f"model.path={tiny_model}", "--set", f"output_dir={out}", "--set", "train.max_steps=10",
                  "--set", "logging.progress=false"]
    submit = [RAY, "job", "submit", "--address", address, "--working-dir", ".",
              "--runtime-env", "deploy/runtime_env.yaml", "--"]
    # the token that `ray start --head` wrote is read by the client only in token mode
    result = subprocess.run(submit + entrypoint, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout.lower()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_last"] < summary["eval_loss_first"]
    assert (out / "model" / "config.json").is_file()
