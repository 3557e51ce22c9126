"""The environment interface. A task writes one class; YAML names it by import path (`package.module:Class`).

    env = Class(**options)            # one instance per episode
    messages = env.reset(sample)      # the conversation's first messages, from a dataset sample (its prompt, columns)
    loop: the policy answers; env.step(answer text) -> Step(observation, reward, done)

The policy's answer reaches `step` as text (decoded from the ids it sampled); the observation goes back as text and
is rendered in the chat template's markup once, on its own (envs/render.py): the ids the policy sampled are never
decoded and encoded again, so the trained tokens are the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    """What the environment answers to one policy turn."""

    observation: str | None = None
    """The environment's reply (a tool result), shown to the policy as the next message; None ends the episode."""
    reward: float = 0.0
    """Added to the episode's reward."""
    done: bool = False
    """The episode is over (the policy gave its final answer, or failed)."""
    tool_call: bool = False
    """This turn asked for a tool (counted for metrics)."""
    valid_call: bool = False
    """...and the call was well formed (counted for the tool-call validity metric)."""
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """One episode of a multi-turn task. Subclasses implement `reset` and `step`; both must be quick (each call
    runs under the episode's step timeout)."""

    def reset(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        """The conversation's first messages (`[{"role": "user", "content": ...}]`) for a dataset sample: a dict
        with its `prompt` text and its dataset columns."""
        raise NotImplementedError

    def step(self, answer: str) -> Step:
        """React to the policy's latest turn (its text, special tokens removed)."""
        raise NotImplementedError
