"""A bundled environment for any task with a checking rule: a wrong answer is told so and may try again, up to the
episode's turn limit. The rule is any reward function (`prompts, answers, **columns -> scores`, e.g.
rlhf_ray.data.demo_sort:score or rlhf_ray.data.answers:last_number_reward); a score of 1 is right."""

from __future__ import annotations

from rlhf_ray.envs.environment import Environment, Step


class RetryEnv(Environment):
    def __init__(self, rule: str = "rlhf_ray.data.answers:last_number_reward",
                 reply: str = "That is not right. Try again."):
        from rlhf_ray.functions import load_function

        self.rule, self.reply = load_function(rule), reply
        self.prompt, self.columns = "", {}

    def reset(self, sample: dict) -> list[dict[str, str]]:
        """The dataset's prompt as the first user message (its ' Human: ... Assistant:' wrapper removed)."""
        from rlhf_ray.functions import column_arguments

        self.prompt = sample["prompt"]
        self.columns = column_arguments(self.rule, [{k: v for k, v in sample.items() if k != "prompt"}])
        question = self.prompt.strip().removeprefix("Human:").removesuffix("Assistant:").strip()
        return [{"role": "user", "content": question}]

    def step(self, answer: str) -> Step:
        if self.rule([self.prompt], [answer], **self.columns)[0] >= 1.0:
            return Step(reward=1.0, done=True)
        return Step(observation=self.reply)
