"""Which datasets feed a job, how they split across the SFT / RM / PPO phases, and how long sequences get."""

from __future__ import annotations

from string import Formatter
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.paths import PathField

TEMPLATE_KEYWORDS = ("dschat", "raw", "chat_template")


def _format_fields(template: str) -> set[str]:
    """The `{names}` a str.format template uses; ValueError for a malformed one (e.g. an unmatched brace)."""
    return {name for _, name, _, _ in Formatter().parse(template) if name is not None}


def _check_format(value: str, name: str, alternatives: str) -> None:
    """A format string whose only placeholder is {name}, or a ValueError saying what was expected."""
    try:
        names = _format_fields(value)
    except ValueError as exc:
        raise ValueError(f"not a valid format string ({exc}); use {{{{ }}}} for literal braces") from None
    if names != {name}:
        raise ValueError(f"expected {alternatives}a format string using only {{{name}}}, got {value!r}")


class DatasetFormatSpec(StrictModel):
    """How to read a dataset the registry does not know: which fields hold the prompt and the answers, and how
    to wrap them. A dotted field reaches into nested records and lists (`question.full_text`, `answers.0`)."""

    prompt_field: str = "prompt"
    """Field holding the prompt text."""
    chosen_field: str | None = "chosen"
    """Field holding the preferred answer; null for a prompt-only dataset (PPO prompts)."""
    rejected_field: str | None = None
    """Field holding the rejected answer; null for SFT-only data (no pairs for the reward model)."""
    template: str = "dschat"
    """`dschat`: prompt " Human: {prompt} Assistant:" and answers " {answer}" (DeepSpeed-Chat's strings);
    `raw`: fields used as they are; `chat_template`: the tokenizer's chat template, applied when the data is
    tokenised (the prompt becomes one user message, each answer the assistant's reply); or a Python format
    string using `{prompt}`, e.g. "### Question: {prompt}\\n### Answer:"."""
    answer_template: str | None = None
    """Format string using `{answer}` for dschat and custom templates; default " {answer}" (leading space)."""
    messages_field: str | None = None
    """Field holding a whole conversation, a list of {role, content} messages (the OpenAI / TRL chat format), instead
    of prompt and answer fields: SFT trains on every assistant message, the other messages (system, user, tool) are
    context; PPO takes the conversation before the first assistant message as its prompt. Rendered with the
    tokenizer's chat template, so `template` must be `chat_template` or left out."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Further fields carried with each prompt to reward functions, as keyword arguments: {keyword: field path},
    e.g. `{answer: solution.final}` gives a function `answer=[...]` (one value per answer scored). A missing field
    is an error naming file, line and field."""

    @field_validator("template")
    @classmethod
    def _template_is_known_or_formats_prompt(cls, value: str) -> str:
        if value in TEMPLATE_KEYWORDS:
            return value
        _check_format(value, "prompt", f"one of {', '.join(TEMPLATE_KEYWORDS)} or ")
        return value

    @field_validator("answer_template")
    @classmethod
    def _answer_template_formats_answer(cls, value: str | None) -> str | None:
        if value is None:
            return value
        _check_format(value, "answer", "")
        return value

    @model_validator(mode="after")
    def _answer_template_needs_a_wrapping_template(self) -> "DatasetFormatSpec":
        if self.answer_template is not None and self.template in ("raw", "chat_template"):
            raise FieldProblem("answer_template", f"template {self.template!r} uses the answers as they are; "
                                                  "drop answer_template or use dschat / a format string")
        return self

    @model_validator(mode="before")
    @classmethod
    def _conversations_take_the_chat_template(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("messages_field") is None:
            return data
        if data.get("template", "chat_template") != "chat_template":
            raise FieldProblem("template", "a messages_field conversation is rendered with the chat template: "
                                           "set template: chat_template or leave it out")
        return {**data, "template": "chat_template"}


class DatasetSpec(StrictModel):
    """One raw dataset: a registered name (e.g. `Dahoas/rm-static`, `demo/arithmetic`), read from the hub or from
    a local copy, or any dataset described by a `format` section."""

    name: str
    """Registry name (exact; the error lists the registered ones), `custom`, or, with `format`, a hub id."""
    path: Annotated[str | None, PathField()] = None
    """Local file or folder to read instead of the hub: a json / jsonl / parquet file, a folder of such files
    named by split (train.jsonl, test.jsonl, ...), or a folder written by `save_to_disk`."""
    weight: float = Field(1.0, gt=0)
    """Multiplies this dataset's size in a blend: 1 uses every sample once (DeepSpeed-Chat's concatenation),
    2 repeats it twice, 0.5 keeps a random half."""
    format: DatasetFormatSpec | None = None
    """Field mapping for a dataset the registry does not know (name `custom` or an unregistered hub id)."""
    chat_template: bool = False
    """Render this dataset with the model tokenizer's chat template (for instruct models): the prompt becomes the
    conversation so far (DeepSpeed-Chat's " Human: ... Assistant:" turns become user / assistant messages) plus
    the generation prompt, each answer the assistant's reply with the template's end-of-turn. Works for any
    dataset; for a `format:` dataset it is the same as `template: chat_template`."""
    prompt_template: str | None = None
    """A format string using `{prompt}` that re-wraps each prompt for a base model without a chat template, e.g.
    "Question: {prompt}\\nAnswer:". `{prompt}` is the question (the user's text of a one-turn " Human: ...
    Assistant:" prompt; a longer conversation keeps its turns as they are); answers keep their leading space. Not
    with `chat_template` or a `format:` section (which has its own `template`)."""
    subset: str | None = None
    """Hub configuration name of a dataset that has several (the second argument of `load_dataset`)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit). Pin it: the tokenised cache is keyed on name and revision."""
    train_split: str | None = None
    """Split to train on, instead of the dataset's usual one (e.g. `train_prefs`)."""
    eval_split: str | None = None
    """Held-out split, instead of the dataset's usual one; without one, eval data is carved from train."""

    @field_validator("prompt_template")
    @classmethod
    def _prompt_template_formats_prompt(cls, value: str | None) -> str | None:
        if value is not None:
            _check_format(value, "prompt", "")
        return value

    @model_validator(mode="after")
    def _one_way_to_wrap_prompts(self) -> "DatasetSpec":
        if self.prompt_template is None:
            return self
        if self.chat_template:
            raise FieldProblem("prompt_template", "chat_template: true renders prompts with the model's chat "
                                                  "template; drop one of the two")
        if self.format is not None:
            raise FieldProblem("prompt_template", "a format: dataset wraps its prompts with format.template; set "
                                                  "the template there")
        return self

    @model_validator(mode="after")
    def _custom_needs_format_and_path(self) -> "DatasetSpec":
        if self.name == "custom" and self.format is None:
            raise FieldProblem("format", "name 'custom' needs a format section (prompt_field, chosen_field, ...)")
        if self.name == "custom" and self.path is None:
            raise FieldProblem("path", "name 'custom' reads a local file or folder; set path")
        return self


class DataSpec(StrictModel):
    """The data of a job. The data layer (rlhf_ray/data/) turns it into tokenised datasets."""

    datasets: list[DatasetSpec] = Field(default_factory=lambda: [DatasetSpec(name="demo/sort")])
    """Raw datasets, blended by weight; each is split across the three phases."""
    split: str = "2,4,4"
    """Shares of every dataset given to SFT, RM and PPO (DeepSpeed-Chat's `--data_split`): disjoint phases."""
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    """Held-out share carved from a dataset that has no eval split of its own."""
    max_seq_len: int = Field(512, ge=8)
    """SFT / RM: prompt + answer tokens per sample."""
    max_prompt_len: int = Field(256, ge=1)
    """PPO: prompt tokens (over-long prompts are cut from the left, keeping the question's end)."""
    overlong: Literal["trim_prompt", "drop"] = "trim_prompt"
    """A sample longer than its limit with its end-of-text token: trim its prompt from the left, or drop it.
    The answer and its end-of-text are never cut. Either way it is counted in the data report."""
    cache_dir: Annotated[str | None, PathField()] = None
    """Tokenised cache; default `<output_dir>/data_cache`."""

    @field_validator("split")
    @classmethod
    def _split_is_three_shares(cls, value: str) -> str:
        parts = value.split(",")
        try:
            shares = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"split must be three comma-separated numbers like '2,4,4', got {value!r}") from None
        if len(shares) != 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
            raise ValueError(f"split must be three non-negative shares for SFT,RM,PPO like '2,4,4', got {value!r}")
        return value

    @property
    def split_shares(self) -> tuple[float, float, float]:
        a, b, c = (float(p) for p in self.split.split(","))
        return a, b, c
