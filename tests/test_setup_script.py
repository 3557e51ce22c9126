"""scripts/setup.sh, the first thing a new user runs (README: the quickstart and the tests both start with it): a
few lines of its own, pip's output in a log it names, a failed install shows that log's last lines and its path
and leaves the environment marked unfinished, and a run on a finished environment prints nothing.

The quiet success path is the first part of every CI run's output (.ci/run on a fresh clone: the set-up's lines
before pytest's); installing the whole stack again in a test would take minutes and the network."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def setup(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def test_a_failed_install_names_the_step_and_shows_the_log_tail(tmp_path):
    venv, wheels = tmp_path / "venv", tmp_path / "wheels"
    wheels.mkdir()  # an empty wheel folder and no index: pip finds nothing to install
    result = setup({"RLHF_RAY_VENV": str(venv), "RLHF_RAY_EXTRAS": "cpu,test", "PIP_NO_INDEX": "1",
                    "PIP_FIND_LINKS": str(wheels), "PYTHON": getattr(sys, "_base_executable", sys.executable)})
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"[setup] installing rlhf-ray[cpu,test] into {venv} in 2 steps (the first run takes several minutes); "
        f"pip's output: {venv}/setup.log",
        "[setup] 1/2 torch 2.13.0 (CPU build) ... failed"]
    err = result.stderr.splitlines()
    assert err[0] == f"[setup] torch 2.13.0 (CPU build) failed; the last lines of {venv}/setup.log:"
    assert any(line.strip().startswith("ERROR:") and "torch" in line for line in err)  # pip's own words
    assert err[-1] == f"[setup] the whole output: {venv}/setup.log" and len(err) <= 28
    assert "### torch 2.13.0 (CPU build)" in (venv / "setup.log").read_text()
    assert not (venv / ".rlhf-ray-setup").exists()  # the next run tries again


def test_a_finished_environment_is_reused_silently():
    stamp = ROOT / ".venv" / ".rlhf-ray-setup"
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "scripts/setup.sh").read_bytes())
    if not stamp.is_file() or not stamp.read_text().startswith(key.hexdigest()[:16]):
        pytest.skip("the environment in .venv was set up from other files: run scripts/setup.sh first")
    result = setup({"RLHF_RAY_EXTRAS": stamp.read_text().split(" ", 1)[1].strip()})
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
