"""The shipped Grafana dashboard (deploy/grafana/rlhf_ray.json) is what its builder writes, and every panel queries
the runs picked in its `run` variable from the Prometheus picked in its `datasource` variable. That each query
returns the run's series from a real Prometheus is tests/test_metrics_endpoint.py's."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOARD = json.loads((ROOT / "deploy/grafana/rlhf_ray.json").read_text())


def builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", ROOT / "deploy/grafana/build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_dashboard_is_what_the_builder_writes():
    assert builder().build() == BOARD, "run .venv/bin/python deploy/grafana/build_dashboard.py"


def test_every_panel_queries_the_chosen_runs_of_the_chosen_prometheus():
    variables = {v["name"]: v for v in BOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["query"] == "label_values(ray_rlhf_ray_policy_version, run)"
    assert variables["run"]["multi"] and variables["run"]["includeAll"]
    for panel in BOARD["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert re.fullmatch(r'ray_rlhf_ray_[a-z0-9_]+\{run=~"\$run"\}', target["expr"]), target["expr"]
    titles = [p["title"] for p in BOARD["panels"]]
    assert len(titles) == len(set(titles)) >= 12
    positions = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in BOARD["panels"]}
    assert len(positions) == len(titles)  # none drawn over another

