"""`rlhf-ray quickstart`, the README's main command, as a user runs it, shortened: every quickstart config is
validated, then GRPO on SmolLM2 runs and ends with held-out before -> after accuracy by the last-number rule."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from rlhf_ray.cli import main
from tests.conftest import ROOT



@pytest.mark.system
@pytest.mark.usefixtures("shared_ray")  # its jobs run on the session's embedded Ray
def test_the_quickstart_validates_every_config_and_reports_grpo_accuracy(tmp_path, capsys):
    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs/quickstart", configs)
    grpo = yaml.safe_load((configs / "grpo.yaml").read_text())
    grpo["output_dir"] = str(tmp_path / "grpo")
    grpo["ppo"] |= {"iterations": 1, "rollout_batch_size": 4, "eval_prompts": 16, "eval_samples": 0}
    grpo["logging"] = {"progress": False}
    grpo["cluster"] |= {"dashboard": False}
    (configs / "grpo.yaml").write_text(yaml.safe_dump(grpo))

    assert main(["quickstart", "--configs", str(configs)]) == 0
    printed = capsys.readouterr().out
    checked = printed.splitlines()[0]  # one line for the configs
    assert checked.startswith("[1/2] 10 quickstart configs load and fit this machine: dpo, grpo-http, grpo,")
    assert checked.endswith(f"sft (in {configs})")
    assert "GRPO: held-out task accuracy (rule-checked), greedy" in printed
    summary = json.loads((tmp_path / "grpo" / "summary.json").read_text())
    assert summary["iterations"] == 1
    # the accuracy is ppo.accuracy_function's last-number rule, the same rule as the reward; demo/arithmetic's own
    # exact-answer rule would mark SmolLM2's explained answers ("23 + 48 = 71") wrong
    assert summary["task_accuracy_before"] == pytest.approx(summary["reward_before"])
    assert summary["task_accuracy_after"] == pytest.approx(summary["reward_after"])
    # each accuracy with its standard error over the held-out prompts
    words = " ".join(printed.split())  # the console wraps long lines
    line = f"greedy {summary['task_accuracy_before']:.3f} -> {summary['task_accuracy_after']:.3f} ± " \
           f"{summary['task_accuracy_se_after']:.3f}"
    if "sampled_task_accuracy_after" in summary:
        line += f", sampled {summary['sampled_task_accuracy_before']:.3f} -> " \
                f"{summary['sampled_task_accuracy_after']:.3f} ± {summary['sampled_task_accuracy_se_after']:.3f}"
    assert f"{line} (±: one standard error over the {summary['eval_prompts']} held-out prompts)" in words
    # every job ends with its report (the page itself is checked in a browser in test_report.py)
    page = (tmp_path / "grpo" / "report.html").read_text()
    assert "task_accuracy_after" in page and (tmp_path / "grpo" / "report" / "reward.png").is_file()


def test_a_quickstart_config_that_does_not_load_stops_before_anything_runs(tmp_path, capsys):
    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs/quickstart", configs)
    (configs / "rm.yaml").write_text((configs / "rm.yaml").read_text().replace("epochs: 4", "epochs: four"))
    assert main(["quickstart", "--configs", str(configs)]) == 2
    printed = capsys.readouterr().out
    assert "rm.yaml" in printed and "train.epochs" in printed
    assert "GRPO" not in printed
