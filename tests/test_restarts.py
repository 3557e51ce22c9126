"""Automatic restarts after a learner rank dies (rlhf_ray/jobs/restarts.py), without Ray: which errors end an
attempt, how many attempts run, what the final error says."""

from __future__ import annotations

import pytest

from rlhf_ray.actors.group import ActorCallTimeout, ActorDiedError
from rlhf_ray.jobs.checkpoints import Checkpoints
from rlhf_ray.jobs.restarts import LearnerRankDied, learner_deaths_explained, with_learner_restarts


def test_a_dead_or_hung_rank_of_a_learner_group_is_named_with_the_checkpoint_to_resume_from(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    (tmp_path / "checkpoints" / "step-00000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000003" / "trainer_state.json").write_text('{"step": 3}')
    with pytest.raises(LearnerRankDied, match=r"sft-learner-1 died.*resume from .*step-00000003"):
        with learner_deaths_explained(checkpoints, ("sft-learner",)):
            raise ActorDiedError("gone", "sft-learner-1")
    with pytest.raises(LearnerRankDied, match="critic-0 hangs"):
        with learner_deaths_explained(checkpoints, ("policy", "critic")):
            raise ActorCallTimeout("slow", [("critic-0", None)])
    with pytest.raises(ActorDiedError):  # a stateless role's death is the caller's to handle (it is replaced)
        with learner_deaths_explained(checkpoints, ("policy", "critic")):
            raise ActorDiedError("gone", "generation-0")


def test_restarts_are_bounded_and_counted(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    seen = []

    def dies_twice(restarts: int) -> str:
        seen.append(restarts)
        if restarts < 2:
            raise LearnerRankDied(f"learner rank policy-0 died (attempt {restarts})")
        return "done"

    assert with_learner_restarts(2, checkpoints, dies_twice) == "done" and seen == [0, 1, 2]
    seen.clear()
    with pytest.raises(LearnerRankDied, match="attempt 1"):
        with_learner_restarts(1, checkpoints, dies_twice)
    assert seen == [0, 1]
    seen.clear()
    with pytest.raises(ValueError):  # any other error ends the job at once
        with_learner_restarts(2, checkpoints, lambda restarts: seen.append(restarts) or int("x"))
    assert seen == [0]
