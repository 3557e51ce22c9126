"""Faults injected into real PPO runs on a local Ray (CPU): engines, reward actors and learner ranks killed, the
whole job killed and run again. Stateless actors are replaced and their work re-issued; a dead learner rank stops
the job with its name and the checkpoint to resume from; no checkpoint is ever half-written."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from rlhf_ray.actors.reward_function import RewardFunctionWorker
from rlhf_ray.functions import RewardFunctionError
from rlhf_ray.jobs.checkpoints import STATE_FILE, Checkpoints
from tests.conftest import at_checkpoints, job_actor, one_update
from tests.test_ppo_job import NO_REFERENCE, ppo_job

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("shared_ray")]  # one embedded Ray for the module

SMALL = ["ppo.iterations=4", "ppo.rollout_batch_size=16", "ppo.eval_prompts=8", "policy.micro_batch_size=16",
         "critic.micro_batch_size=16", "checkpoint.every_steps=1", "checkpoint.keep_last=10"]


def complete_checkpoints(out: Path) -> list[Path]:
    return Checkpoints(out, keep_last=1).complete()


def assert_no_half_written_checkpoint(out: Path) -> None:
    for path in (out / "checkpoints").glob("step-*"):
        assert (path / STATE_FILE).is_file(), f"{path} has no {STATE_FILE}"


@contextlib.contextmanager
def two_engine_run(tmp_path, sft_model, rm_model, *overrides):
    """A PPO trainer with two engines on an embedded Ray, one iteration done; yields (trainer, 32 training prompts)."""
    from transformers import AutoTokenizer

    from rlhf_ray.data.build import build_phase_data
    from tests.conftest import placed_trainer

    job = ppo_job(tmp_path, sft_model, rm_model, "generation.placement.replicas=2",
                  "generation.placement.num_cpus=0.25", "critic.placement.num_cpus=0.25", *NO_REFERENCE, *overrides)
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    data = build_phase_data(job.data, tokenizer, "ppo", job.seed, tmp_path / "cache")
    prompts = [r["prompt_ids"] for r in data.train[:32]]
    with placed_trainer(job, tokenizer, data) as trainer:
        pool = trainer.workers.pool
        one_update(trainer, 0, pool.collect(pool.submit(prompts, seed=0)))
        assert pool.versions() == [1, 1]
        yield trainer, prompts


def actor_pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_killed_or_hung_engine_and_reward_actor_are_replaced_and_their_work_reissued(tmp_path, sft_model, rm_model,
                                                                                   transport, caplog):
    """A killed engine (while generating) and a killed reward actor are replaced and their share of the work is
    done again, under both weight transports. Then, in the same run with the object store, the same for processes
    that hang (SIGSTOP: alive but answering nothing): after cluster.call_timeout_s each is killed, named and
    replaced."""
    stopped = []
    with two_engine_run(tmp_path, sft_model, rm_model, f"generation.weight_sync.transport={transport}",
                        "cluster.call_timeout_s=10", "cluster.max_actor_restarts=4") as started:
        trainer, prompts = started
        pool, restarts = trainer.workers.pool, trainer.workers.restarts
        pending = pool.submit(prompts, seed=1)
        ray.kill(pool.group.actors[1], no_restart=True)  # dies while generating its half of the prompts
        rollout = pool.collect(pending)
        assert restarts.replaced == ["generation-1"]
        assert rollout.samples == 32 and rollout.version == 1  # the new engine was brought to version 1
        assert pool.versions() == [1, 1]
        greedy = pool.generate(prompts[:4] * 2, seed=0, greedy=True)  # engine 0 and engine 1, same prompts
        assert [s["answer_ids"] for s in greedy[:4]] == [s["answer_ids"] for s in greedy[4:]]

        ray.kill(trainer.workers.reward.actors[0], no_restart=True)
        result = one_update(trainer, 1, rollout)  # the reward rows are scored again by a new actor
        assert restarts.replaced == ["generation-1", "reward-0"]
        assert result["actors/restarts"] == 2 and result["policy_version"] == 2
        if transport != "object_store":
            return
        try:
            stopped.append(actor_pid(pool.group.actors[1]))
            os.kill(stopped[-1], signal.SIGSTOP)
            start = time.monotonic()
            rollout = pool.collect(pool.submit(prompts, seed=2))
            assert restarts.replaced == ["generation-1", "reward-0", "generation-1"]
            assert 10 <= time.monotonic() - start < 90
            assert rollout.samples == 32 and pool.versions() == [2, 2]
            assert "generation-1 hangs" in caplog.text

            stopped.append(actor_pid(trainer.workers.reward.actors[0]))
            os.kill(stopped[-1], signal.SIGSTOP)
            result = one_update(trainer, 2, rollout)
            assert restarts.replaced == ["generation-1", "reward-0", "generation-1", "reward-0"]
            assert result["policy_version"] == 3 and "reward-0 hangs" in caplog.text
        finally:
            for pid in stopped:  # a stopped process would not even die of SIGTERM
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def kill(name: str, namespace: str, process: bool = False):
    """A kill of actor `name`: through Ray, or (`process`) its process by SIGKILL, as the kernel's OOM killer does
    (Ray then prints its own "(raylet) A worker died ..." to the driver)."""
    def now() -> None:
        actor = job_actor(name, namespace)
        if process:
            os.kill(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60), signal.SIGKILL)
        else:
            ray.kill(actor, no_restart=True)
    return now


def wait_for(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
        time.sleep(0.1)


def first_restarted_step(out: Path) -> int | None:
    """The first step that the automatically restarted run logged (its metrics count one learner restart)."""
    path = out / "metrics.jsonl"
    whole = path.read_text().split("\n")[:-1] if path.is_file() else []  # a line still being written is left out
    restarted = [m["step"] for m in map(json.loads, whole) if m.get("actors/learner_restarts") == 1]
    return restarted[0] if restarted else None


def test_killed_learner_ranks_restart_the_job_by_itself_then_stop_it_naming_the_rank_and_where_to_resume(
        tmp_path, sft_model, rm_model, capfd, caplog, monkeypatch):
    """cluster.learner_restarts=1: the critic's rank killed (its process, by SIGKILL) after the first checkpoint,
    the job restarts every role from its newest checkpoint by itself (no user action), saying so once, with Ray's
    own "(raylet) A worker died" message kept in logs/ray.log, off the terminal; the policy's rank killed after the
    restarted run's own first checkpoint, the budget is spent and the job stops, naming the rank and the checkpoint
    a rerun resumes from (test_killed_job_resubmitted_resumes_from_its_last_checkpoint). No checkpoint is left
    half-written."""
    from rlhf_ray.jobs.ppo import run_ppo
    from rlhf_ray.jobs.restarts import LearnerRankDied

    job = ppo_job(tmp_path, sft_model, rm_model, *SMALL, *NO_REFERENCE, "ppo.iterations=6",
                  "cluster.learner_restarts=1")
    out, namespace = Path(job.output_dir), job.cluster.namespace
    # the critic after the first checkpoint; the policy after the restarted run's own first one
    at_checkpoints(monkeypatch, kill("critic-0", namespace, process=True), kill("policy-0", namespace))
    with pytest.raises(LearnerRankDied) as info:
        run_ppo(job)
    restarted_step = [step] if (step := first_restarted_step(out)) is not None else []
    message = str(info.value)
    assert "policy-0 died" in message and "resume from" in message and "step-" in message
    assert "so the job stops after 1 automatic restart (cluster.learner_restarts)" in message
    restarting = [r.getMessage() for r in caplog.records if "restarts every actor" in r.getMessage()]
    assert len(restarting) == 1 and restarting[0].startswith("learner rank critic-0 died; a ZeRO group cannot "
                                                             "continue without one of its ranks: the job restarts")
    assert not any("job stops" in r.getMessage() for r in caplog.records)
    terminal = capfd.readouterr()
    assert "A worker died" not in terminal.out + terminal.err
    wait_for(lambda: "A worker died" in ((out / "logs" / "ray.log").read_text() if (out / "logs" / "ray.log").is_file()
                                         else ""), "Ray's message about the killed critic in logs/ray.log", 30)
    assert_no_half_written_checkpoint(out)
    done = int(Checkpoints.state(complete_checkpoints(out)[-1])["step"])
    assert restarted_step and 2 <= restarted_step[0] <= done < 6
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "policy_version" in m]
    assert [m["step"] for m in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 2  # redone steps once
    assert steps[0]["actors/learner_restarts"] == 0 and steps[-1]["actors/learner_restarts"] == 1


def test_killed_job_resubmitted_resumes_from_its_last_checkpoint(tmp_path, sft_model, rm_model):
    from tests.conftest import ROOT

    overrides = [f"policy.model.path={sft_model}", f"reward.model.path={rm_model}",
                 f"output_dir={tmp_path / 'ppo'}", "cluster.dashboard=false", "logging.progress=false", *SMALL]
    command = [sys.executable, "-m", "rlhf_ray.cli", "ppo", "--config", str(ROOT / "configs/quickstart/ppo.yaml")]
    for item in overrides:
        command += ["--set", item]
    out = tmp_path / "ppo"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 400
    while not complete_checkpoints(out) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, "the job ended before it could be killed"
    os.killpg(first.pid, signal.SIGKILL)  # the driver, the embedded Ray and every actor, at once
    first.wait()
    assert_no_half_written_checkpoint(out)
    done = int(Checkpoints.state(complete_checkpoints(out)[-1])["step"])

    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed PPO from {out / 'checkpoints' / f'step-{done:08d}'}" in second.stderr
    # quiet by default: the terminal has the job's own lines only, the actors' library logs are in output_dir/logs
    ours = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) rlhf_ray[.\w]*: ")
    others = [line for line in second.stderr.splitlines() if line.strip() and not ours.match(line)]
    assert not others and "Traceback" not in second.stdout + second.stderr, others[:20]
    logs = {f.name: f.read_text() for f in (out / "logs").iterdir()}
    assert {"policy-0.log", "critic-0.log", "generation-0.log", "reference-0.log", "reward-0.log"} <= set(logs)
    assert "Loading weights" in logs["policy-0.log"]  # transformers' progress bar, no longer on the terminal
    assert json.loads((out / "summary.json").read_text())["iterations"] == 4
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "policy_version" in m] == [1, 2, 3, 4]  # redone steps logged once


def failing_reward(prompts: list[str], answers: list[str]) -> list[float]:
    if any("7" in p for p in prompts):
        raise ValueError("cannot score sevens")
    return [1.0] * len(answers)


def raising_reward(prompts: list[str], answers: list[str]) -> list[float]:
    return [_score_one(a) for a in answers]


def _score_one(answer: str) -> float:
    raise ValueError(f"cannot score {answer!r}")


def test_a_failed_job_prints_the_actor_and_its_first_error_and_logs_every_traceback(tmp_path, sft_model, rm_model,
                                                                                    capsys):
    """`rlhf-ray ppo` whose reward function raises in its actor: the terminal names the actor and the call, shows
    the user's frames once (no Ray wrapping, no driver stack), the exit code says the job failed, and
    logs/error.log has the whole chain."""
    from rlhf_ray.cli import main
    from rlhf_ray.exit_codes import EXIT_JOB_FAILED
    from tests.conftest import ROOT

    out = tmp_path / "ppo"
    overrides = [f"policy.model.path={sft_model}", "reward.model.path=null",
                 "reward.function=tests.test_fault_tolerance:raising_reward", f"critic.model.path={rm_model}",
                 f"output_dir={out}", "cluster.dashboard=false", "logging.progress=false", *SMALL, *NO_REFERENCE]
    argv = ["ppo", "--config", str(ROOT / "configs/quickstart/ppo.yaml")] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == EXIT_JOB_FAILED
    err = capsys.readouterr().err
    shown = err[err.index("the job failed"):].splitlines()
    assert shown[0] == "the job failed: reward-0 failed in `score`"
    assert shown[1].startswith("  RewardFunctionError: reward function tests.test_fault_tolerance:raising_reward "
                               "failed on prompt")
    assert err.count("Traceback") == 1 and err.count("in _score_one") == 1 and "ValueError: cannot score" in err
    assert "ray::" not in err and "run_ppo" not in err and len(shown) < 15, shown
    assert shown[-1] == f"every traceback: {out / 'logs' / 'error.log'}; reward-0's output: {out / 'logs' / 'reward-0.log'}"
    logged = (out / "logs" / "error.log").read_text()
    assert "in run_ppo" in logged and "in _score_one" in logged and "RemoteCallError: reward-0 raised" in logged


def test_a_raising_reward_function_is_reported_with_the_sample(tiny_model):
    worker = RewardFunctionWorker(rank=0, world_size=1, function="tests.test_fault_tolerance:failing_reward",
                                  tokenizer=str(tiny_model))
    assert worker.score_texts(["Sort 1 2"], ["1 2"]).tolist() == [1.0]
    with pytest.raises(RewardFunctionError) as info:
        worker.score_texts(["Sort 1 2", "Sort 7 3"], ["1 2", "3 7"])
    assert "'Sort 7 3'" in str(info.value) and "'3 7'" in str(info.value) and "ValueError: cannot score sevens" in str(info.value)


def test_a_crash_while_writing_a_checkpoint_leaves_the_last_complete_one(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=2)
    staged = checkpoints.staging(1)
    torch.save({"w": torch.ones(2)}, staged / "weights.pt")
    first = checkpoints.commit(staged, 1, {"policy_version": 1})
    half = checkpoints.staging(2)
    (half / "weights.pt").write_bytes(b"partial")  # the process dies here, before commit
    assert checkpoints.latest() == first
    for step in (2, 3, 4):
        checkpoints.commit(checkpoints.staging(step), step, {"policy_version": step})
    assert [p.name for p in checkpoints.complete()] == ["step-00000003", "step-00000004"]  # keep_last
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
