"""The PPO job's live progress line (jobs/progress.py): one line per iteration wherever output is not a terminal
(`ray job logs`, pipes, CI), rewritten in place on a terminal."""

from __future__ import annotations

import io

from rlhf_ray.jobs.held_out import Answered, Evaluation
from rlhf_ray.jobs.progress import Progress, duration

METRICS = {"reward/mean": 0.4123, "kl/mean": 0.0123, "policy/entropy": 1.234, "time/iteration": 8.0,
           "time/generate_wait": 4.2, "time/experience": 0.3, "time/train": 3.1, "time/sync": 0.4}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_plain_line_per_iteration_with_the_runs_numbers():
    out = io.StringIO()
    progress = Progress(total=10, start=2, samples_per_iteration=32, stream=out)
    progress.update(3, METRICS)
    progress.update(4, {**METRICS, "reward/mean": 0.5})
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    first = lines[0]
    for part in ("iter 3/10", "reward 0.412", "kl 0.0123", "entropy 1.23", "4.0 samples/s", "gen 4.2s", "exp 0.3s",
                 "train 3.1s", "sync 0.4s", "eta "):
        assert part in first, (part, first)
    assert "reward 0.500" in lines[1] and len(first) <= 120


def test_a_terminal_gets_the_line_rewritten_in_place_and_a_newline_at_the_end():
    out = Terminal()
    progress = Progress(total=2, start=0, samples_per_iteration=8, stream=out)
    progress.update(1, METRICS)
    progress.update(2, {"reward/mean": 1.0})
    progress.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "eta" not in text.split("\r")[-1]  # the last iteration: nothing left


def test_disabled_progress_writes_nothing_and_durations_read_well():
    out = io.StringIO()
    progress = Progress(total=5, start=0, samples_per_iteration=8, enabled=False, stream=out)
    progress.update(1, METRICS)
    progress.close()
    assert out.getvalue() == ""
    assert [duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_the_latest_held_out_reward_and_check_show_with_the_iteration_they_were_measured_at():
    out = io.StringIO()
    progress = Progress(total=10, start=0, samples_per_iteration=32, stream=out)
    progress.evaluated(0, Evaluation(Answered(0.1, 0.0)))  # no rule: nothing to show
    progress.update(1, METRICS)
    progress.evaluated(0, Evaluation(Answered(0.1, 0.0, 0.17, 0.0)))
    progress.update(2, METRICS)
    progress.evaluated(2, Evaluation(Answered(0.2, 0.0, 0.25, 0.0)))
    progress.update(3, METRICS)
    lines = out.getvalue().splitlines()
    assert "held-out" not in lines[0]
    assert "reward 0.412  held-out reward 0.100 check 0.170 (iter 0)  kl" in lines[1]
    assert "held-out reward 0.200 check 0.250 (iter 2)" in lines[2]


def test_an_evaluation_kept_in_a_checkpoint_reads_back_as_it_was():
    """A resumed job's starting evaluation comes from the checkpoint's eval_before: the flat names summary.json and
    metrics.jsonl use, read back into the record."""
    evaluation = Evaluation(Answered(0.5, 0.01, 0.25, 0.02), Answered(0.4, 0.03, 0.2, 0.04, 2.0, 1.0, 1.0))
    flat = evaluation.metrics()
    assert flat["task_accuracy"] == 0.25 and flat["sampled_reward"] == 0.4 and flat["sampled_turns_per_episode"] == 2.0
    assert "turns_per_episode" not in flat
    assert Evaluation.of(flat) == evaluation
    assert Evaluation.of(Evaluation(Answered(0.5, 0.01)).metrics()) == Evaluation(Answered(0.5, 0.01))
    assert not Evaluation.of({}) and Evaluation().metrics() == {}


def test_a_change_in_the_engines_serving_shows_on_the_line_it_happened():
    """An elastic generation pool: the line says when engines joined or left, not every iteration."""
    out = io.StringIO()
    progress = Progress(total=10, start=0, samples_per_iteration=32, stream=out)
    for step, engines in enumerate([2, 2, 3, 3, 2], start=1):
        progress.update(step, METRICS | {"generate/engines": float(engines)})
    lines = out.getvalue().splitlines()
    assert ["engines" in line for line in lines] == [False, False, True, False, True]
    assert "engines 2 -> 3" in lines[2] and "engines 3 -> 2" in lines[4]
