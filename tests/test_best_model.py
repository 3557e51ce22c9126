"""ppo.keep_best's tracker (rlhf_ray/jobs/ppo/best_model.py) with a stand-in export that writes the policy's
current "weights" as a file: which evaluation wins, what a stopped and resumed run keeps. The whole path, a real
PPO job exporting a real policy, is in tests/test_ppo_job.py (test_ppo_raises_held_out_reward_and_accuracy)."""

from __future__ import annotations

import json
import math

from rlhf_ray.jobs.ppo.best_model import BestModel


class Policy:
    """The policy as the tracker sees it: something that exports its current weights to a folder."""

    def __init__(self):
        self.weights = "start"
        self.exports = 0

    def export(self, folder: str) -> None:
        from pathlib import Path

        Path(folder).mkdir(parents=True)
        (Path(folder) / "weights").write_text(self.weights)
        self.exports += 1


def kept(tmp_path) -> tuple[str, dict]:
    return (tmp_path / "best_model" / "weights").read_text(), json.loads((tmp_path / "best.json").read_text())


def test_the_best_evaluation_is_exported_a_tie_keeps_the_earlier_and_nan_never_wins(tmp_path):
    policy = Policy()
    best = BestModel(tmp_path, "task_accuracy", policy.export)
    best.start_fresh()
    curve = [(0, 0.10, "start"), (5, 0.18, "it5"), (10, 0.18, "it10"), (15, math.nan, "it15"), (20, 0.12, "it20")]
    won = []
    for iteration, accuracy, weights in curve:
        policy.weights = weights
        won.append(best.consider(iteration, {"reward": 1.0, "task_accuracy": accuracy}))
    assert won == [True, True, False, False, False]
    assert kept(tmp_path) == ("it5", {"iteration": 5, "metric": "task_accuracy", "value": 0.18})
    assert policy.exports == 2 and not list(tmp_path.glob(".tmp-*"))


def test_off_it_exports_nothing(tmp_path):
    policy = Policy()
    best = BestModel(tmp_path, None, policy.export)
    best.start_fresh()
    assert not best.consider(0, {"task_accuracy": 1.0}) and best.state() is None
    assert policy.exports == 0 and not (tmp_path / "best.json").exists()


def test_a_fresh_start_clears_an_earlier_runs_best(tmp_path):
    first = Policy()
    BestModel(tmp_path, "reward", first.export).consider(3, {"reward": 9.0})  # an earlier run's, scoring 9
    again = Policy()
    best = BestModel(tmp_path, "reward", again.export)
    best.start_fresh()
    assert not (tmp_path / "best_model").exists() and not (tmp_path / "best.json").exists()
    assert best.consider(0, {"reward": 1.0})  # this run's own start wins, though 9 > 1


def test_a_resume_keeps_the_checkpoints_best_where_the_folder_still_holds_it(tmp_path):
    policy = Policy()
    best = BestModel(tmp_path, "reward", policy.export)
    best.start_fresh()
    policy.weights = "it5"
    best.consider(5, {"reward": 2.0})
    saved = best.state()  # the checkpoint at iteration 10 keeps the best of iteration 5
    again = BestModel(tmp_path, "reward", Policy().export)
    again.resume(saved)
    assert again.state() == saved and kept(tmp_path)[0] == "it5"
    assert not again.consider(15, {"reward": 1.5})  # the resumed run must beat 2.0


def test_a_resume_tracks_afresh_where_a_later_iteration_replaced_the_checkpoints_best(tmp_path):
    """Stopped after iteration 12 exported a new best, resumed from the checkpoint of iteration 10 (whose best was
    iteration 5): the folder holds iteration 12's model, which the resumed run redoes; iteration 5's is gone. The
    best then starts again from the resumed run's next evaluation, and nothing claims iteration 5."""
    policy = Policy()
    best = BestModel(tmp_path, "reward", policy.export)
    best.start_fresh()
    policy.weights = "it5"
    best.consider(5, {"reward": 2.0})
    saved = best.state()
    policy.weights = "it12 of the stopped run"
    best.consider(12, {"reward": 3.0})
    resumed = Policy()
    again = BestModel(tmp_path, "reward", resumed.export)
    again.resume(saved)
    assert again.state() is None and not (tmp_path / "best_model").exists() and not (tmp_path / "best.json").exists()
    resumed.weights = "it12 redone"
    assert again.consider(12, {"reward": 1.0})
    assert kept(tmp_path) == ("it12 redone", {"iteration": 12, "metric": "reward", "value": 1.0})


def test_a_stop_while_the_folder_changes_resumes_afresh(tmp_path):
    """A stop between removing the old best and writing the new record leaves no record: the resume does not take
    the folder for the checkpoint's best."""
    policy = Policy()
    best = BestModel(tmp_path, "reward", policy.export)
    best.start_fresh()
    best.consider(5, {"reward": 2.0})
    saved = best.state()
    (tmp_path / "best.json").unlink()  # as `consider` does first when a later evaluation wins
    again = BestModel(tmp_path, "reward", Policy().export)
    again.resume(saved)
    assert again.state() is None and not (tmp_path / "best_model").exists()
