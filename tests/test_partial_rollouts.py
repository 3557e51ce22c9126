"""Partial rollouts (generation.partial_rollouts): a weight update that reaches an engine mid-rollout pauses the
answers, loads, and the answers go on from where they stopped with the new weights. The gate alone with threads;
then a real engine actor (hf) whose update arrives in a thread of its own while the rollout is held at a known
token (the test hook), for each engine."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlhf_ray.actors.update_gate import HOLD_ENV, UpdateGate


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
                                                                             engine):
    """Each engine: rollout held after 2 tokens, the update (other weights: the tiny base model's) loads in the
    engine's weights thread, the answers go on: their first 2 tokens are those of the same rollout without an
    update (same seed) and carry version 0, the rest version 1; every token's sampling log-prob is the one of the
    weights that drew it, the new weights' computed over prompt and answer so far (their KV recomputed, not the
    old). (No min_new_tokens: vLLM reports log-probs after its min-tokens mask, the learner before it.)"""
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ray.actors.engine import engine_env
    from rlhf_ray.actors.generator import GenerationWorker
    from rlhf_ray.actors.group import ActorGroup
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
        return ActorGroup(GenerationWorker, name, 1, num_cpus=0.5,
                          kwargs=dict(model=ModelSpec(path=str(sft_model), dtype="fp32").model_dump(),
                                      generation=spec.model_dump(), engine=engine,
                                      tokens=TokenConventions.from_tokenizer(tokenizer, sft_model)),
                          env_vars={**engine_env(engine, spec, 1), **env}, call_timeout_s=300,
                          threads={"weights": list(WEIGHT_CALLS)})

    plain, held = start("plain", {}), start("held", {HOLD_ENV: str(HOLD)})
    try:
        for group in (plain, held):
            group.wait_ready(300)
        (straight,) = plain.call("generate", prompts, 3)
        new = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
        buckets = [ray.put(b) for b in pack(list(new.state_dict().items()))]
        rollout = held.submit("generate", prompts, 3)
        time.sleep(5)  # the rollout starts and holds at token HOLD (for 120 s at most) ...
        loaded = held.submit("load_weights", buckets, 1)  # ... until this update asks, from the weights thread
        (result,) = held.gather(loaded, "load_weights")
        (samples,) = held.gather(rollout, "generate")
    finally:
        plain.kill()
        held.kill()
    assert result["version"] == 1
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
