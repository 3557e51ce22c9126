"""Writes deploy/grafana/rlhf_ray.json, the Grafana dashboard of rlhf-ray jobs, with the Grafana Foundation SDK
(grafana-foundation-sdk, the `test` extra): one page of what a person watching RLHF looks at, every panel a query of
the `ray_rlhf_ray_*` gauges a job exports through Ray (jobs/metrics.py), a `run` variable to pick runs.

    .venv/bin/python deploy/grafana/build_dashboard.py          # rewrite the JSON after changing PANELS
    .venv/bin/python deploy/grafana/build_dashboard.py --check  # exit 1 when the JSON is not what PANELS give

tests/test_metrics_endpoint.py runs every panel's query against a real Prometheus scraping a real PPO job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rlhf_ray.jobs.metrics import gauge_name  # noqa: E402

OUT = Path(__file__).resolve().parent / "rlhf_ray.json"
UID = "rlhf-ray-runs"


class Panel(NamedTuple):
    title: str
    unit: str
    series: tuple[tuple[str, str], ...]  # (metric key as in metrics.jsonl, legend after the run's name)
    description: str


PANELS = (
    Panel("Reward of the rollouts", "none", (("reward/mean", "mean"), ("reward/std", "std")),
          "The training reward of each iteration's samples. It should rise; on its own it proves little."),
    Panel("Held-out reward and check", "none",
          (("eval/reward", "reward, greedy"), ("eval/sampled_reward", "reward, sampled"),
           ("eval/task_accuracy", "check, greedy"), ("eval/sampled_task_accuracy", "check, sampled")),
          "At every evaluation (ppo.eval_every): the reward and the held-out check (ppo.accuracy_function) of "
          "answers to held-out prompts. A reward that rises while the check falls is reward hacking."),
    Panel("KL to the reference", "none", (("kl/mean", "token mean"),),
          "How far the policy has moved from its start. A jump: kl_coef too small or the learning rate too high."),
    Panel("Policy entropy", "none", (("policy/entropy", "entropy"),),
          "Token entropy of the policy on its own samples; a collapse to ~0 means it stopped exploring."),
    Panel("Clip fraction and update size", "none",
          (("policy/clip_fraction", "clip fraction"), ("policy/approx_kl", "KL old -> new")),
          "Share of tokens whose ratio was clipped (healthy below ~0.2) and the KL of one update."),
    Panel("Losses", "none", (("policy/loss", "policy"), ("critic/loss", "critic")),
          "The policy's PPO loss and, with a critic (advantage_estimator gae), the value loss."),
    Panel("Generation throughput", "none", (("generate/tokens_per_s", "tokens/s"),),
          "Tokens the engine pool generated per second of generation."),
    Panel("Engine utilisation", "percentunit", (("generate/engine_utilisation", "busy"),),
          "Share of the iteration the engines were generating; low in sync mode, near 1 in async mode."),
    Panel("Time per iteration", "s",
          (("time/engine_generate", "generate"), ("time/generate_wait", "waited for rollouts"),
           ("time/experience", "experience"), ("time/train", "train"), ("time/sync", "weight sync"),
           ("time/iteration", "whole iteration")),
          "Where each iteration's wall time went."),
    Panel("Replay buffer", "none",
          (("buffer/samples", "samples held"), ("buffer/staleness", "staleness (versions)"),
           ("buffer/refused_stale", "refused as stale")),
          "Fill and staleness of the rollouts waiting for the learners (async mode keeps some)."),
    Panel("Weight sync size", "bytes", (("sync/bytes", "bytes"),),
          "Bytes of policy weights sent to the engines per sync."),
    Panel("Weight sync time", "s",
          (("time/sync", "whole sync"), ("sync/gather_seconds", "gather"), ("sync/load_seconds", "engine load")),
          "Seconds per weight sync: gathering the weights on the learner and loading them into the engines."),
    Panel("Policy version", "none", (("policy_version", "version"),),
          "Optimizer steps applied to the policy; flat while the job is alive means it is stuck."),
    Panel("Restarts and warnings", "none",
          (("actors/restarts", "actors replaced"), ("actors/learner_restarts", "learner restarts"),
           ("eval/reward_hacking_signs", "reward-hacking signs")),
          "Replaced actors, automatic restarts after a learner rank died, and the held-out check's warning (1 or "
          "2: the reward rose while the check fell over ppo.hacking_warning_evaluations evaluations)."),
)


def query(key: str) -> str:
    """The panel query of one metric for the runs picked in the `run` variable."""
    return f'ray_{gauge_name(key)}{{run=~"$run"}}'


def build() -> dict:
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (dashboard.Dashboard("rlhf-ray runs").uid(UID).tags(["rlhf-ray", "ray"]).refresh("10s")
             .time("now-1h", "now").description("rlhf-ray jobs: learning, speed, buffer, weight sync, restarts "
                                                "(deploy/grafana/build_dashboard.py)")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(dashboard.QueryVariable("run").label("run").datasource(source)
                            .query(f"label_values({query('policy_version').split('{')[0]}, run)")
                            .multi(True).include_all(True).all_value(".*")
                            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)))
    for i, panel in enumerate(PANELS):
        built = (timeseries.Panel().title(panel.title).description(panel.description).unit(panel.unit)
                 .datasource(source).height(8).span(8))
        for j, (key, legend) in enumerate(panel.series):
            built = built.with_target(prometheus.Dataquery().expr(query(key)).legend_format(f"{{{{run}}}} {legend}")
                                      .ref_id(chr(ord("A") + j)).datasource(source))
        board = board.with_panel(built)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing")
    args = parser.parse_args()
    text = json.dumps(build(), indent=2, sort_keys=True) + "\n"
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is not what build_dashboard.py writes now: run it", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
