"""What a failed job prints (jobs/failure.py): the actor and call, the last message, the root cause's traceback
without Ray's wrapping, and every traceback in <output_dir>/logs/error.log. The errors here are Ray's own
exception types built the way Ray builds them from a remote exception; the real run is in test_fault_tolerance."""

from __future__ import annotations

import traceback

import pytest
import ray

from rlhf_ray.actors.group import ActorDiedError, RemoteCallError, _raise_for
from rlhf_ray.functions import RewardFunctionError
from rlhf_ray.jobs.failure import JobFailed, explain, failures_reported, report_failure
from rlhf_ray.jobs.restarts import LearnerRankDied


def users_helper(answer: str) -> float:
    raise ValueError(f"cannot score {answer!r}")


def remote_error() -> RemoteCallError:
    """What gather raises for a reward function that raised inside actor reward-0 (the actor wraps the user's
    error with the sample; Ray carries both across as text and the wrapper's type)."""
    try:
        try:
            users_helper("3 7")
        except ValueError as exc:
            raise RewardFunctionError(f"reward function mod:fn failed on prompt 'Sort 7 3': {exc!r}") from exc
    except RewardFunctionError as exc:
        text = "ray::RewardFunctionWorker.score() (pid=1, ip=127.0.0.1)\n" + "".join(traceback.format_exception(exc))
        ray_error = ray.exceptions.RayTaskError("RewardFunctionWorker.score", text, exc).as_instanceof_cause()
    try:
        _raise_for("reward-0", "score", ray_error)
    except RemoteCallError as err:
        return err
    raise AssertionError("_raise_for did not raise")


def driver_stack(err: BaseException):
    """`err` raised again from a few frames of driver code, as a trainer would."""
    def evaluate():
        raise err

    def fit():
        evaluate()

    fit()


def test_an_actors_error_names_the_actor_and_shows_the_root_cause_first():
    with pytest.raises(RemoteCallError) as info:
        driver_stack(remote_error())
    failure = explain(info.value)
    assert (failure.actor, failure.call) == ("reward-0", "score")
    assert failure.message.startswith("RewardFunctionError: reward function mod:fn failed on prompt 'Sort 7 3'")
    text = "\n".join(failure.cause)
    assert "in users_helper" in text and text.endswith("ValueError: cannot score '3 7'")
    assert "During handling" not in text and "direct cause" not in text and "^^^" not in text
    assert "in evaluate" not in text and "ray::" not in text  # the driver's frames and Ray's header: in the file
    lines = failure.lines(None)
    assert lines[0] == "the job failed: reward-0 failed in `score`"
    assert sum("Traceback" in line for line in lines) == 1


def test_the_whole_chain_goes_to_error_log_and_the_terminal_gets_the_short_one(tmp_path):
    with pytest.raises(JobFailed) as info:
        with failures_reported(tmp_path):
            driver_stack(remote_error())
    logged = (tmp_path / "logs" / "error.log").read_text()
    assert "in evaluate" in logged and "in users_helper" in logged and "RemoteCallError" in logged
    printed = "\n".join(info.value.lines)
    assert f"every traceback: {tmp_path / 'logs' / 'error.log'}" in printed
    assert "in evaluate" not in printed and len(info.value.lines) < 15


def test_a_driver_error_shows_the_driver_frames_where_it_was_raised():
    def plan_rows(rows: dict):
        return rows["missing"]

    with pytest.raises(KeyError) as info:
        plan_rows({})
    failure = explain(info.value)
    assert failure.actor is None and failure.message == "KeyError: 'missing'"
    assert any("in plan_rows" in line for line in failure.cause) and failure.cause[-1] == "KeyError: 'missing'"
    assert failure.lines(None)[0] == "the job failed: the driver failed"


def died_in_init() -> ActorDiedError:
    """An actor whose __init__ raised, as Ray reports it (the creation task's traceback inside the message)."""
    try:
        users_helper("init")
    except ValueError as exc:
        text = ("ray::policy-0:PolicyLearner.__init__() (pid=1, ip=127.0.0.1)\n" +
                "".join(traceback.format_exception(exc)))
    message = ("The actor died because of an error raised in its creation task, " + text)
    return ActorDiedError(f"policy-0 died during `PolicyLearner.__init__`: {message}", "policy-0",
                          "PolicyLearner.__init__")


def test_an_actor_that_failed_to_start_shows_its_init_error_once():
    failure = explain(died_in_init())
    assert (failure.actor, failure.call) == ("policy-0", "PolicyLearner.__init__")
    assert failure.message.splitlines() == [
        "policy-0 died during `PolicyLearner.__init__`: The actor died because of an error raised in its creation "
        "task", "ValueError: cannot score 'init'"]
    assert any("in users_helper" in line for line in failure.cause)


def test_a_killed_learner_rank_keeps_the_restart_advice_and_shows_the_end_of_its_log(tmp_path):
    died = ActorDiedError("policy-1 died during `train`: The actor died unexpectedly before finishing this task.",
                          "policy-1", "train")
    log = tmp_path / "logs" / "policy-1.log"
    log.parent.mkdir()
    log.write_text("".join(f"step {i}\n" for i in range(30)) + "Killed\n")
    try:
        raise LearnerRankDied("policy-1", "died", "run the job again with the same output_dir to resume from step-3",
                              died) from died
    except LearnerRankDied as exc:
        lines = report_failure(exc, tmp_path)
    text = "\n".join(lines)
    assert lines[0] == "the job failed: policy-1 failed in `train`"
    assert "to resume from step-3" in text and "died unexpectedly" in text
    assert f"the last lines of {log}" in text and text.count("step ") == 12 - 1 and "Killed" in text
    assert "Traceback" not in text
