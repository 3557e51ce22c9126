"""Multi-turn episodes (rlhf_ray/envs): the calculator task, observations rendered in the chat template's markup,
and token-in token-out turns: the ids an episode trains on are exactly the ids the engine sampled, with the
observation ids between them masked out."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
from transformers import AutoTokenizer

from rlhf_ray.envs.environment import Environment, Step
from rlhf_ray.data.calculator_tool import calculate
from rlhf_ray.envs.calculator import CalculatorEnv
from rlhf_ray.envs.episode import run_episodes
from rlhf_ray.envs.render import ObservationRenderer


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculate("3 x 4 + (10 - 4) / 4") == Fraction(27, 2)
    assert calculate("-2*3") == -6
    for bad, why in [("2**10", "only numbers"), ("__import__('os')", "only numbers"), ("1/0", "division by zero"),
                     ("1+", "cannot read"), ("9" * 80, "1 to 64 characters")]:
        with pytest.raises(ValueError, match=why):
            calculate(bad)


def test_the_calculator_env_answers_calls_and_scores_the_final_answer():
    env = CalculatorEnv(max_calls=2)
    first = env.reset({"prompt": " Human: Ava has 5 apples. Then she finds 7 more. How many? Assistant:", "answer": "12"})
    assert first[0]["role"] == "user" and first[0]["content"].startswith("Ava has 5 apples.")
    assert "Human:" not in first[0]["content"] and "<calc>" in first[0]["content"]
    call = env.step("I will add. <calc>5 + 7</calc>")
    assert (call.observation, call.tool_call, call.valid_call, call.done) == ("12", True, True, False)
    broken = env.step("<calc>5 plus 7</calc>")
    assert broken.observation.startswith("error:") and broken.tool_call and not broken.valid_call
    assert env.step("<calc>1+1</calc>").done  # a third call is over the limit
    env.reset({"prompt": "q", "answer": "12"})
    assert (env.step("The answer is 12.").reward, env.step("The answer is 13.").reward) == (1.0, 0.0)


def test_observations_render_in_the_chat_template_markup(smollm2, tiny_model):
    chatml = ObservationRenderer(AutoTokenizer.from_pretrained(smollm2), role="tool")
    tokenizer = chatml.tokenizer
    # after the policy's <|im_end|>: the newline the template writes, the tool message, the next assistant header
    assert tokenizer.decode(chatml.ids("42")) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    tiny = AutoTokenizer.from_pretrained(tiny_model)  # its template renders user and assistant turns only
    with pytest.raises(ValueError, match="does not render a 'tool' message .* choose another observation role"):
        ObservationRenderer(tiny, role="tool").ids("42")
    assert tiny.decode(ObservationRenderer(tiny, role="user").ids("42")) == " Human: 42 Assistant:"


class Scripted(Environment):
    """Replies 'ok' twice, then ends with reward 1."""

    def __init__(self, slow_s: float = 0.0):
        self.turns, self.slow_s = 0, slow_s

    def reset(self, sample):
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, answer):
        time.sleep(self.slow_s)
        self.turns += 1
        return Step(observation="ok", tool_call=True, valid_call=True) if self.turns < 3 else Step(reward=1.0, done=True)


def test_trained_tokens_are_the_sampled_tokens_across_turns(smollm2):
    """The engine samples a non-canonical split of ' The result <calc>40+2</calc>' (' Th' + 'e', ' res' + 'ult':
    pieces the tokenizer would merge): the episode keeps those ids verbatim, then the observation's own ids, then
    the next turn's ids. Decoding the episode and encoding it again gives other ids, so a loop that re-tokenised
    text would fail here."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    end = tokenizer.eos_token_id
    piece = [i for text in (" Th", "e", " res", "ult", " <", "calc", ">40+2</", "calc", ">") for i in
             tokenizer(text, add_special_tokens=False)["input_ids"]] + [end]
    turns = [piece, tokenizer(" Fine", add_special_tokens=False)["input_ids"] + [end],
             tokenizer(" The answer is 42.", add_special_tokens=False)["input_ids"] + [end]]
    seen_prompts = []

    def generate(prompts):
        seen_prompts.append([list(p) for p in prompts])
        ids = turns[len(seen_prompts) - 1]
        return [{"answer_ids": ids, "logprobs": [-0.5] * len(ids), "finished": True} for _ in prompts]

    renderer = ObservationRenderer(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 40+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    (episode,) = run_episodes(generate, [Scripted()], [prompt], tokenizer, renderer, max_turns=4,
                              max_answer_tokens=256)
    obs = list(renderer.ids("ok"))
    assert episode["answer_ids"] == turns[0] + obs + turns[1] + obs + turns[2]
    assert episode["answer_mask"] == [1] * len(turns[0]) + [0] * len(obs) + [1] * len(turns[1]) + [0] * len(obs) + \
        [1] * len(turns[2])
    assert len(episode["logprobs"]) == len(episode["answer_ids"])
    assert (episode["turns"], episode["reward"], episode["tool_calls"], episode["valid_calls"]) == (3, 1.0, 2, 2)
    # every turn continued from the exact ids so far
    assert seen_prompts[1] == [prompt + turns[0] + obs] and seen_prompts[2] == [prompt + turns[0] + obs + turns[1] + obs]
    assert episode["versions"] == [0] * len(episode["answer_ids"])  # turns that carry no versions: 0
    text = tokenizer.decode(prompt + episode["answer_ids"])
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != prompt + episode["answer_ids"]


def test_an_episode_keeps_the_policy_version_of_each_turn(smollm2):
    """Partial rollouts reach multi-turn episodes between turns: each turn's tokens keep the version that sampled
    them, an observation the version of the turn before it."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    end = tokenizer.eos_token_id
    said = tokenizer(" <calc>1+1</calc>", add_special_tokens=False)["input_ids"] + [end]
    calls = []

    def generate(prompts):
        calls.append(len(calls))
        return [{"answer_ids": said, "logprobs": [-0.5] * len(said), "finished": True, "versions": [len(calls)] *
                 len(said)} for _ in prompts]

    renderer = ObservationRenderer(tokenizer)
    prompt = tokenizer(" Add", add_special_tokens=False)["input_ids"]
    (episode,) = run_episodes(generate, [Scripted()], [prompt], tokenizer, renderer, max_turns=2, max_answer_tokens=256)
    obs = list(renderer.ids("ok"))
    assert episode["versions"] == [1] * len(said) + [1] * len(obs) + [2] * len(said)


def test_episodes_end_on_limits_and_slow_or_broken_steps(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    end = tokenizer.eos_token_id
    answer = tokenizer(" hm", add_special_tokens=False)["input_ids"]

    def generate(prompts):
        return [{"answer_ids": answer + [end], "logprobs": [0.0] * (len(answer) + 1), "finished": True}
                for _ in prompts]

    class Broken(Scripted):
        def step(self, answer):
            raise RuntimeError("bug in the task")

    renderer, prompt = ObservationRenderer(tokenizer), [1, 2, 3]
    capped, slow, broken = run_episodes(generate, [Scripted(), Scripted(slow_s=2.0), Broken()], [prompt] * 3,
                                        tokenizer, renderer, max_turns=2, max_answer_tokens=256, step_timeout_s=0.5)
    assert capped["turns"] == 2 and capped["answer_mask"][-1] == 1  # the turn limit: no observation after the last
    assert (slow["turns"], slow["reward"]) == (1, 0.0) and (broken["turns"], broken["reward"]) == (1, 0.0)
    (cut,) = run_episodes(lambda prompts: [{"answer_ids": answer, "logprobs": [0.0] * len(answer), "finished": False}],
                          [Scripted()], [prompt], tokenizer, renderer, max_turns=4, max_answer_tokens=256)
    assert cut["turns"] == 1 and not cut["finished"]  # cut off mid-turn: nothing to answer


def test_real_engine_episodes_continue_from_their_own_ids(sft_model):
    """The hf engine on the SFT'd tiny model (it ends its answers) plays 3-turn episodes: each turn's prompt is the
    episode's prompt plus exactly what was sampled and observed so far, and the engine's log-probs sit on the sampled
    ids only."""
    from rlhf_ray.actors.hf_engine import HFEngine
    from rlhf_ray.config import GenerationSpec, ModelSpec
    from rlhf_ray.config.generation import SamplingSpec
    from rlhf_ray.data.tokens import TokenConventions

    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    engine = HFEngine(ModelSpec(path=str(sft_model), dtype="fp32"), GenerationSpec(),
                      TokenConventions.from_tokenizer(tokenizer, sft_model))
    sampling = SamplingSpec(max_new_tokens=24, n_samples_per_prompt=1)
    calls = []

    def generate(prompts):
        calls.append(prompts)
        return [dict(s) for s in engine.generate(prompts, sampling, seed=len(calls))]

    class Always(Scripted):
        def step(self, answer):
            return Step(observation="Sort 2 0 1")

    prompts = [tokenizer(f" Human: Sort {q} Assistant:", add_special_tokens=False)["input_ids"]
               for q in ("3 1 2 0", "1 0 2", "2 1 0 3")]
    episodes = run_episodes(generate, [Always() for _ in prompts], prompts, tokenizer,
                            ObservationRenderer(tokenizer, "user"), max_turns=3, max_answer_tokens=400)
    assert [e["turns"] for e in episodes] == [3, 3, 3] and len(calls) == 3
    for p, e in zip(prompts, episodes):
        assert len(e["answer_ids"]) == len(e["answer_mask"]) == len(e["logprobs"])
        assert all(lp == 0.0 for lp, m in zip(e["logprobs"], e["answer_mask"]) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(e["logprobs"], e["answer_mask"]) if m == 1)
        assert e["answer_mask"].count(0) == 2 * len(ObservationRenderer(tokenizer, "user").ids("Sort 2 0 1"))
    for turn, sent in enumerate(calls):
        for p, e, prompt in zip(prompts, episodes, sent):
            assert prompt == p + e["answer_ids"][: len(prompt) - len(p)]


def test_sft_conversations_are_laid_out_token_for_token_as_rollouts(smollm2):
    """A worked conversation of demo/word-problems-calculator, tokenised for SFT, is the very sequence a calculator
    episode plays when the policy samples those replies: same prompt ids, the replies ending on their stop id and
    trained, the calculator's message (rendered by the observation renderer) masked; and its first message is the
    one CalculatorEnv renders for the PPO prompt of the same problem. A layout that tokenised the whole rendered
    conversation at once, or kept ChatML's newline after <|im_end|> in the trained reply, fails here."""
    from rlhf_ray.data import word_problems
    from rlhf_ray.data.tokenized import IGNORE_INDEX, conversation_ids
    from rlhf_ray.data.tokens import TokenConventions

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokens = TokenConventions.from_tokenizer(tokenizer, smollm2)
    train, _ = word_problems.problems()
    problem = next(p for p in train if p.expression.count(" ") >= 4)  # a two-step problem
    row = conversation_ids(word_problems.calculator_conversation(problem), tokenizer, tokens)

    replies = [tokens.encode_answer(tokenizer, f"<calc>{problem.expression}</calc>"),
               tokens.encode_answer(tokenizer, f"The answer is {problem.value}.")]
    calls = []

    def generate(prompts):
        calls.append(prompts)
        return [{"answer_ids": replies[len(calls) - 1], "logprobs": [0.0] * len(replies[len(calls) - 1]),
                 "finished": True}]

    env = CalculatorEnv(max_calls=2)
    ppo_prompt = tokenizer.decode(tokens.encode_prompt(tokenizer, problem.prompt), skip_special_tokens=True)
    first = env.reset({"prompt": ppo_prompt, "answer": problem.value})  # what the episode runner does
    prompt = tokens.encode_prompt(tokenizer, tokenizer.apply_chat_template(first, tokenize=False,
                                                                             add_generation_prompt=True))
    (episode,) = run_episodes(generate, [env], [prompt], tokenizer, ObservationRenderer(tokenizer, "tool"),
                              max_turns=3, max_answer_tokens=256)
    assert episode["reward"] == 1.0 and episode["valid_calls"] == 1
    assert row["input_ids"] == prompt + episode["answer_ids"]
    trained = [label != IGNORE_INDEX for label in row["labels"]]
    assert trained == [False] * len(prompt) + [bool(m) for m in episode["answer_mask"]]
    assert [t for t, keep in zip(row["labels"], trained) if keep] == replies[0] + replies[1]
