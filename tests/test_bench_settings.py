"""Which kept benchmark results count for a recipe: the settings they ran (recipe + overrides), not the file bytes."""

import importlib.util
import sys
from pathlib import Path


def _bench_module(name: str):
    """A benchmark script loaded by its path; the benchmarks/ folder it puts on sys.path (for its `common`) is taken
    off again so its modules do not shadow others in the session."""
    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(folder) / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        while folder in sys.path:
            sys.path.remove(folder)
        sys.modules.pop("common", None)
    return module


settings_hash = _bench_module("common").settings_hash  # by its path, as the scripts are loaded below

EARLIER = """# one optimizer step per rollout
ppo:
  policy: {micro_batch_size: 16}
  ppo: {rollout_batch_size: 32}
"""
NOW = """ppo:
  policy: {micro_batch_size: 8}
  ppo:
    rollout_batch_size: 32
    train_batch_size: 8     # four steps per rollout
"""


def test_a_run_whose_overrides_made_it_todays_recipe_counts_for_it():
    ran = settings_hash(EARLIER, ["ppo.policy.micro_batch_size=8", "ppo.ppo.train_batch_size=8"])
    assert ran == settings_hash(NOW, [])


def test_comments_and_layout_do_not_change_the_settings():
    assert settings_hash("# a note\nppo: {ppo: {rollout_batch_size: 32}}\n", []) == \
        settings_hash("ppo:\n  ppo:\n    rollout_batch_size: 32   # moved\n", [])


def test_a_changed_value_does():
    assert settings_hash(EARLIER, []) != settings_hash(NOW, [])
    assert settings_hash(NOW, ["ppo.ppo.train_batch_size=16"]) != settings_hash(NOW, [])


def test_distillation_goal_is_met_only_when_on_policy_needs_fewer_teacher_tokens():
    verdict = _bench_module("bench_distill_baseline").goal_verdict
    assert verdict(None, None, 17_000) == "missed"             # on-policy never reached 90% of the teacher
    assert verdict(20_000, 15_000, 17_000) == "missed"         # off-policy got there first
    assert verdict(14_000, 15_000, 17_000) == "met"
    assert verdict(14_000, None, 17_000) == "met"              # off-policy spent more and did not get there
    # on-policy reached it after more teacher tokens than the whole off-policy run had: no comparison yet
    assert verdict(30_000, None, 17_000).startswith("not decided")


def test_a_number_spelled_as_yaml_reads_it_or_as_an_override_is_one_setting():
    """`--set ppo.policy.optim.lr=1e-5` (YAML: the string '1e-5') ran what a recipe's `lr: 1.0e-5` holds."""
    assert settings_hash(NOW, ["ppo.policy.optim.lr=1e-5"]) == \
        settings_hash(NOW.replace("policy: {micro_batch_size: 8}", "policy: {micro_batch_size: 8, optim: {lr: 1.0e-5}}"), [])
    assert settings_hash(NOW, ["ppo.policy.optim.lr=1e-5"]) != settings_hash(NOW, ["ppo.policy.optim.lr=2e-5"])
    assert settings_hash(NOW, ["data.split='3,3,4'"]) != settings_hash(NOW, ["data.split='3,3,5'"])
