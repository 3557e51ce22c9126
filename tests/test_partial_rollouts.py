"""Partial rollouts (generation.partial_rollouts): a weight update that reaches an engine mid-rollout pauses the
answers, loads, and the answers go on from where they stopped with the new weights. The gate alone with threads;
then a real engine actor (hf) whose update arrives in a thread of its own while the rollout is held at a known
token (the test hook), for each engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf_ray.actors.update_gate import HOLD_ENV, HOLDING, UpdateGate


def test_an_update_in_two_parts_holds_the_generation_until_its_last_part():
    gate, events = UpdateGate(), []

    def generation():
        with gate.generation():
            for token in range(200):
                if gate.requested:
                    events.append(f"paused at {token}")
                    gate.pause()
                    events.append("resumed")
                    return
                time.sleep(0.005)
            events.append("ran to the end")

    thread = threading.Thread(target=generation)
    thread.start()
    time.sleep(0.05)
    with gate.update(last=False):
        events.append("part 1")
    time.sleep(0.1)  # between the parts the engine stays with the update
    with gate.update(last=True):
        events.append("part 2")
    thread.join(10)
    assert events[0].startswith("paused at") and events[1:] == ["part 1", "part 2", "resumed"], events
    with gate.generation():  # nothing left held
        assert not gate.requested


def test_a_failing_update_gives_the_engine_back():
    gate = UpdateGate()
    with pytest.raises(RuntimeError), gate.update(last=False):
        raise RuntimeError("load failed")
    done = threading.Event()
    threading.Thread(target=lambda: (gate.generation().__enter__(), done.set())).start()
    assert done.wait(5), "a generation waited for an update that had failed"


MAX_NEW, HOLD = 16, 2


@pytest.mark.system
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_an_update_mid_generation_continues_the_answers_with_the_new_weights(shared_ray, sft_model, tiny_model,
                                                                             engine, tmp_path):
    """Each engine: rollout held after 2 tokens, the update (other weights: the tiny base model's) loads in the
    engine's weights thread, the answers go on: their first 2 tokens are those of the same rollout without an
    update (same seed) and carry version 0, the rest version 1; every token's sampling log-prob is the one of the
    weights that drew it, the new weights' computed over prompt and answer so far (their KV recomputed, not the
    old). (No min_new_tokens: vLLM reports log-probs after its min-tokens mask, the learner before it.)"""
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray.actors.actor_logs import actor_logs
    from rlhf_ray.actors.engine import engine_env
    from rlhf_ray.actors.generator import GenerationWorker
    from rlhf_ray.actors.group import ActorGroup, Slots, Thread, Timeouts
    from rlhf_ray.actors.pool import WEIGHT_CALLS
    from rlhf_ray.algorithms.logprobs import answer_logprobs
    from rlhf_ray.config.generation import GenerationSpec
    from rlhf_ray.config.model import ModelSpec
    from rlhf_ray.data.tokens import TokenConventions
    from rlhf_ray.models.weight_buckets import pack

    spec = GenerationSpec.model_validate({"engine": engine, "partial_rollouts": True,
                                          "vllm": {"dtype": "fp32", "max_model_len": 256}, "sampling": {
        "max_new_tokens": MAX_NEW, "n_samples_per_prompt": 2, "temperature": 1.0}})
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    prompts = [tokenizer(t)["input_ids"] for t in (" Human: Sort 3 1 2 Assistant:", " Human: Sort 9 4 Assistant:")]

    def start(name: str, env: dict) -> ActorGroup:
        return ActorGroup(GenerationWorker, name, 1, Slots(0.5, env_vars={**engine_env(engine, spec, 1), **env}),
                          kwargs=dict(model=ModelSpec(path=str(sft_model), dtype="fp32").model_dump(),
                                      generation=spec.model_dump(), engine=engine,
                                      tokens=TokenConventions.from_tokenizer(tokenizer, sft_model)),
                          timeouts=Timeouts(call_s=300), threads={"weights": Thread(WEIGHT_CALLS)})

    with actor_logs(tmp_path):  # the held engine says in its log when it holds
        plain, held = start("plain", {}), start("held", {HOLD_ENV: str(HOLD)})
    try:
        for group in (plain, held):
            group.wait_ready(300)
        (straight,) = plain.call("generate", prompts, 3)
        new = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
        buckets = [ray.put(b) for b in pack(list(new.state_dict().items()))]
        rollout = held.submit("generate", prompts, 3)
        deadline = time.monotonic() + 120  # the rollout starts and holds at token HOLD (for 120 s at most) ...
        while HOLDING not in Path(held.log_files[0]).read_text():
            assert time.monotonic() < deadline, "the held engine's rollout did not reach its hold within 120 s"
            time.sleep(0.1)
        loaded = held.submit("load_weights", buckets, 1)  # ... until this update asks, from the weights thread
        (result,) = held.gather(loaded, "load_weights")
        (samples,) = held.gather(rollout, "generate")
    finally:
        plain.kill()
        held.kill()
    assert result.version == 1
    old = AutoModelForCausalLM.from_pretrained(sft_model).eval()
    assert any(len(s["answer_ids"]) > HOLD for s in samples), "no answer went on past the hold"
    for before, after in zip(straight, samples):
        assert before["versions"] == [0] * len(before["answer_ids"])
        held_for = min(HOLD, len(after["answer_ids"]))  # an answer that ended before the hold: all version 0
        length = len(after["answer_ids"])
        assert after["versions"] == [0] * held_for + [1] * (length - held_for) and after["version"] == 0
        assert after["answer_ids"][:held_for] == before["answer_ids"][:held_for]
        torch.testing.assert_close(after["logprobs"][:held_for], before["logprobs"][:held_for], rtol=0, atol=1e-5)
        ids = torch.tensor([after["prompt_ids"] + after["answer_ids"]])
        with torch.no_grad():
            by_old, by_new = (answer_logprobs(m(ids).logits, ids, length)[0] for m in (old, new))
        torch.testing.assert_close(torch.tensor(after["logprobs"][:held_for]), by_old[:held_for], rtol=0, atol=1e-3)
        torch.testing.assert_close(torch.tensor(after["logprobs"][held_for:]), by_new[held_for:], rtol=0, atol=1e-3)


class Scripted:
    """An engine whose answer to a prompt whose last id is k is `k` tokens long (ids 1..k, id 0 ends it), one token
    per step; it keeps the engine contract: budgets, stop asked after each token with the answers that ended."""

    name = "scripted"

    def __init__(self, step_s: float = 0.002):
        self.step_s, self.calls = step_s, []

    def generate(self, prompts, sampling, seed, greedy=False, stop=None, budgets=None):
        n = 1 if greedy else sampling.n_samples_per_prompt
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        self.calls.append(len(rows))
        drawn = [[] for _ in rows]
        limit = [budgets[i][0] if budgets else sampling.max_new_tokens for i, _ in rows]

        def target(p):  # the length the full answer has, whatever part of it the prompt already holds
            return p[[j for j, t in enumerate(p) if t >= 100][-1]] - 100

        def ended(r):
            return bool(drawn[r]) and drawn[r][-1] == 0 or len(drawn[r]) >= limit[r]

        for step in range(1, max(limit) + 1):
            for r, (_, p) in enumerate(rows):
                if not ended(r):
                    so_far = len(p) - 1 - [j for j, t in enumerate(p) if t >= 100][-1] + len(drawn[r])
                    drawn[r].append(0 if so_far + 1 >= target(p) else so_far + 1)
            time.sleep(self.step_s)
            if all(ended(r) for r in range(len(rows))) or (stop and stop(step, [ended(r) for r in range(len(rows))])):
                break
        return [{"prompt_index": i, "prompt_ids": p, "answer_ids": d, "logprobs": [-1.0] * len(d),
                 "finished": bool(d) and d[-1] == 0} for (i, p), d in zip(rows, drawn)]


def test_rollouts_stream_the_first_whole_groups_and_the_long_answer_goes_on_into_a_later_rollout():
    """Two rollouts started together (the second joins while the first drives the engine): the first returns the
    first two groups to finish, one of them the second rollout's; the long answer goes on, its tokens carried, into
    the second rollout; every group comes back exactly once, whole."""
    from rlhf_ray.actors.partial_rollout import PartialRollouts
    from rlhf_ray.config.generation import SamplingSpec

    engine, gate = Scripted(step_s=0.01), UpdateGate()
    stream = PartialRollouts(engine, SamplingSpec(max_new_tokens=64, n_samples_per_prompt=2), gate, lambda: 0)
    results = {}

    def rollout(name, lengths, keys):
        results[name] = stream.rollout([[100 + k] for k in lengths], seed=1, keys=keys)

    first = threading.Thread(target=rollout, args=("first", [3, 40], [10, 11]))
    first.start()
    time.sleep(0.05)  # the first drives the engine ...
    second = threading.Thread(target=rollout, args=("second", [5, 6], [20, 21]))
    second.start()  # ... and the second's prompts join it at its next token
    first.join(10)
    second.join(10)
    (groups1, counts1, _), (groups2, counts2, _) = results["first"], results["second"]
    assert [g.key for g in groups1] == [10, 20] and counts1 == {"streamed": 1, "restarted": 0}
    assert sorted(g.key for g in groups2) == [11, 21] and counts2 == {"streamed": 1, "restarted": 0}
    long = next(g for g in groups2 if g.key == 11)
    for answer in long.answers:  # drawn in both calls, continued where it stopped
        assert answer.answer_ids == list(range(1, 40)) + [0] and answer.finished
    assert stream.in_flight == []
    assert len(engine.calls) >= 3  # the first call's round, the round after the second joined, the second call's


def test_the_hold_hook_leaves_an_engines_first_rollout_alone_and_holds_the_next_until_an_update():
    """The test hook (update_gate.HOLD_ENV) holds a rollout at its token until an update asks for the engine. The
    engine's first rollout call is not held: a job's first update trains on it, so no update can come before it
    ends (held, every partial-rollout job idled the hook's seconds at its start). Its second call holds, and an
    update releases it: its answers carry both versions."""
    from rlhf_ray.actors.partial_rollout import PartialRollouts
    from rlhf_ray.config.generation import SamplingSpec

    gate, version = UpdateGate(), {"now": 0}
    stream = PartialRollouts(Scripted(step_s=0.01), SamplingSpec(max_new_tokens=64, n_samples_per_prompt=1), gate,
                             lambda: version["now"], hold=(2, 120.0))
    results = {}

    def rollout(name):
        results[name] = stream.rollout([[106]], seed=1, keys=[name])

    first = threading.Thread(target=rollout, args=("first",), daemon=True)
    first.start()
    first.join(20)
    assert not first.is_alive(), "the engine's first rollout call was held with no update to come"
    second = threading.Thread(target=rollout, args=("second",), daemon=True)
    second.start()
    time.sleep(0.5)
    assert second.is_alive() and not gate.requested  # held at token 2, no update asked yet
    with gate.update():
        version["now"] = 1
    second.join(20)
    assert not second.is_alive()
    (group,), _, _ = results["second"]
    assert group.answers[0].versions == [0, 0, 1, 1, 1, 1]


def test_a_rollout_restarts_answers_older_than_max_staleness():
    """An answer in flight whose first token is over max_staleness versions older than the engine's weights is
    started again (the buffer would refuse the rollout holding it): its tokens all carry the new version."""
    from rlhf_ray.actors.partial_rollout import Answer, Group, PartialRollouts
    from rlhf_ray.config.generation import SamplingSpec

    version = {"now": 3}
    stream = PartialRollouts(Scripted(), SamplingSpec(max_new_tokens=64, n_samples_per_prompt=1), UpdateGate(),
                             lambda: version["now"], max_staleness=1)
    stale = Group(0, [Answer([104], answer_ids=[1, 2], logprobs=[-1.0, -1.0], versions=[1, 2])], key=7)
    fresh = Group(1, [Answer([105], answer_ids=[1, 2], logprobs=[-1.0, -1.0], versions=[2, 2])], key=8)
    stream.in_flight = [stale, fresh]
    groups, counts, _ = stream.rollout([[103]], seed=0, keys=[9])
    returned = {g.key: g for g in stream.in_flight + groups}
    assert counts["restarted"] == 1
    assert returned[7].answers[0].versions[0] == 3, "the stale answer kept its old tokens"
    assert returned[8].answers[0].versions[:2] == [2, 2], "a fresh answer was started again"


def test_hf_engine_keeps_each_prompts_budget_and_reports_ended_answers(sft_model):
    """The hf engine ends each prompt's answers at its own budget and tells `stop` which answers have ended."""
    from transformers import AutoTokenizer

    from rlhf_ray.actors.hf_engine import HFEngine
    from rlhf_ray.config import GenerationSpec, ModelSpec
    from rlhf_ray.config.generation import SamplingSpec
    from rlhf_ray.data.tokens import TokenConventions

    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    engine = HFEngine(ModelSpec(path=str(sft_model), dtype="fp32"), GenerationSpec(),
                      TokenConventions.from_tokenizer(tokenizer, sft_model))
    prompts = [tokenizer(" Human: Sort 3 1 2 Assistant:")["input_ids"], tokenizer(" Human: Sort 9 Assistant:")["input_ids"]]
    seen = []
    rows = engine.generate(prompts, SamplingSpec(max_new_tokens=32, n_samples_per_prompt=2, temperature=1.0), 0,
                           stop=lambda tokens, ended: seen.append((tokens, list(ended))) or False, budgets=[(2, 0), (5, 5)])
    assert [len(r["answer_ids"]) <= b for r, b in zip(rows, [2, 2, 5, 5])] == [True] * 4
    assert [len(r["answer_ids"]) for r in rows[2:]] == [5, 5]  # its own minimum and maximum
    tokens, ended = seen[-1]
    assert ended[:2] == [True, True] and tokens <= 5
    assert all(e or not r["finished"] and len(r["answer_ids"]) < b for e, r, b in zip(ended, rows, [2, 2, 5, 5]))


def test_answers_left_in_flight_go_on_between_rollout_calls():
    """A rollout returns before an older, longer answer ends; with no call waiting, that answer goes on in the
    background (the engine does not idle) and the next call finds it whole."""
    from rlhf_ray.actors.partial_rollout import Answer, Group, PartialRollouts
    from rlhf_ray.config.generation import SamplingSpec

    engine = Scripted(step_s=0.005)
    stream = PartialRollouts(engine, SamplingSpec(max_new_tokens=64, n_samples_per_prompt=1), UpdateGate(), lambda: 0)
    stream.in_flight = [Group(0, [Answer([130], answer_ids=[1], logprobs=[-1.0], versions=[0])], key=7)]
    groups, _, _ = stream.rollout([[102]], seed=0, keys=[9])
    assert [g.key for g in groups] == [9]
    (left,) = stream.in_flight
    deadline = time.time() + 10
    while not left.answers[0].finished and time.time() < deadline:
        time.sleep(0.02)
    assert left.answers[0].answer_ids == list(range(1, 30)) + [0], "the answer left in flight did not go on"
    began = time.perf_counter()
    groups, _, seconds = stream.rollout([[140]], seed=1, keys=[10])
    assert [g.key for g in groups] == [7] and time.perf_counter() - began < 0.1  # already whole: at once
    assert seconds >= 20 * engine.step_s  # the engine's seconds between the calls count with this one
    assert [g.key for g in stream.in_flight] == [10]


def test_closing_stops_the_answers_going_on_between_calls_before_the_engine_shuts_down():
    """The job's end (GenerationWorker.close): an answer left in flight is being continued in the background;
    closing stops it at its next token and returns with the engine free, and nothing generates afterwards."""
    from rlhf_ray.actors.partial_rollout import Answer, Group, PartialRollouts
    from rlhf_ray.config.generation import SamplingSpec

    engine = Scripted(step_s=0.01)
    stream = PartialRollouts(engine, SamplingSpec(max_new_tokens=64, n_samples_per_prompt=1), UpdateGate(), lambda: 0)
    long = Group(0, [Answer([160], answer_ids=[1], logprobs=[-1.0], versions=[0])], key=7)  # 60 tokens to go
    stream.in_flight = [long]
    stream.rollout([[102]], seed=0, keys=[9])  # returns; the long answer goes on between calls
    time.sleep(0.1)
    assert len(engine.calls) == 2 and not long.answers[0].finished  # the rollout's round, then one between calls
    began = time.perf_counter()
    stream.close()
    assert time.perf_counter() - began < 1 and stream.in_flight == []
    drawn, calls = len(long.answers[0].answer_ids), len(engine.calls)
    time.sleep(0.1)
    assert len(long.answers[0].answer_ids) == drawn < 60 and len(engine.calls) == calls


def test_the_engine_learner_mismatch_is_reported_by_the_age_of_each_tokens_sampler():
    """Answer tokens sampled 0, 1 and 2 versions before the learner that scored them: each age's mismatch is the
    KL over its own tokens only (the old weights' drift adds to the numeric gap), and an age without tokens is
    not reported."""
    from rlhf_ray.actors.experience_worker import mismatch_by_age as by_age
    from rlhf_ray.algorithms.batch import RolloutBatch
    from rlhf_ray.algorithms.experience import mismatch_kl

    action = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    versions = torch.tensor([[5, 5, 6, 0], [4, 6, 0, 0]])  # scored at 6: ages 1 1 0 / 2 0
    engine = -torch.rand(2, 4)
    learner = engine + torch.tensor([[0.3, 0.3, 0.01, 0.0], [0.9, 0.01, 0.0, 0.0]])
    batch = RolloutBatch(sequences=torch.zeros(2, 6, dtype=torch.long), attention_mask=torch.ones(2, 6),
                         action_mask=action, prompt_width=2, engine_logp=engine, token_version=versions)
    def mismatch_by_age(batch, learner, scored_at):  # the metrics' names of what is measured
        return {f"generate/mismatch_kl_age_{age}": value for age, value
                in zip(("0", "1", "2plus"), by_age(batch, learner, scored_at)) if value is not None}

    out = mismatch_by_age(batch, learner, scored_at=6)
    assert set(out) == {"generate/mismatch_kl_age_0", "generate/mismatch_kl_age_1", "generate/mismatch_kl_age_2plus"}
    only = lambda cells: mismatch_kl(engine, learner, torch.tensor(cells).float())  # noqa: E731
    assert out["generate/mismatch_kl_age_0"] == pytest.approx(only([[0, 0, 1, 0], [0, 1, 0, 0]]))
    assert out["generate/mismatch_kl_age_1"] == pytest.approx(only([[1, 1, 0, 0], [0, 0, 0, 0]]))
    assert out["generate/mismatch_kl_age_2plus"] > out["generate/mismatch_kl_age_1"] > out["generate/mismatch_kl_age_0"]
    assert set(mismatch_by_age(batch, learner, scored_at=5)) == {"generate/mismatch_kl_age_0",
                                                                 "generate/mismatch_kl_age_1"}
