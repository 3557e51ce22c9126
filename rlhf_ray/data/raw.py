"""The one shape every raw dataset is turned into, in DeepSpeed-Chat's exact strings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RawSample:
    """One example. `prompt` is " Human: ... Assistant:" (no trailing space); `chosen` / `rejected` are answers
    with a leading space, or None when the dataset has none (such samples serve SFT only, or PPO prompts)."""

    prompt: str
    chosen: str | None = None
    rejected: str | None = None
    columns: dict = field(default_factory=dict, hash=False)
    """Further dataset columns (e.g. {"answer": "71"}: a verifiable task's ground truth). They travel with the
    prompt through the generation pool and the replay buffer to reward functions, as keyword arguments."""
    messages: tuple[dict, ...] | None = field(default=None, hash=False)
    """A whole conversation ({role, content} messages) instead of prompt + answers: SFT trains on every assistant
    message of it, the rest is context; as a PPO prompt it is the conversation before its first assistant message.
    Rendered with the tokenizer's chat template (`adapters.apply_chat_template` fills `prompt`)."""

    @property
    def prompt_and_chosen(self) -> str | None:
        return None if self.chosen is None else self.prompt + self.chosen

    @property
    def prompt_and_rejected(self) -> str | None:
        return None if self.rejected is None else self.prompt + self.rejected


@dataclass
class RawDataset:
    """A dataset's train and eval samples. `eval` is None when the source has no eval split of its own (one is
    then carved from train by the split step). `fingerprint` changes whenever the content may have changed
    (hub revision, local file size and mtime), and keys the tokenised cache."""

    name: str
    train: list[RawSample]
    eval: list[RawSample] | None = None
    fingerprint: str = ""
    dropped: dict[str, int] = field(default_factory=dict)
    """Rows skipped while reading, by reason (e.g. {"empty prompt": 3}), for the data report."""
