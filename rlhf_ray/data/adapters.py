"""One adapter per dataset schema: a raw row (a dict) -> RawSample in DeepSpeed-Chat's exact strings.

The strings follow DeepSpeed-Chat's `raw_datasets.py` (spec §2.4): prompts " Human: ... Assistant:" with no
trailing space, answers with a leading space; Dahoas/rm-static-style datasets keep their own prompt text. An
adapter reads fields through `field()`, which raises FieldError for a missing or mistyped field (the loader turns
it into a DataError naming file, line and field), and returns Skip(reason) for a row that must be left out.
"""

from __future__ import annotations

import re
from dataclasses import replace
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, Protocol

from rlhf_ray.config.data import DatasetFormatSpec
from rlhf_ray.data.raw import RawSample


class Skip(NamedTuple):
    """A row left out on purpose; `reason` keys RawDataset.dropped."""

    reason: str


class FieldError(Exception):
    """A row lacks a field or holds the wrong type there. Internal: the loader adds file and line."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r} {problem}")
        self.field = field
        self.problem = problem


def field(row: Mapping[str, Any], path: str, *, nullable: bool = False, kind: type | tuple[type, ...] = str) -> Any:
    """The value at a dotted path (`question.full_text`, `human_answers.0`). A missing key is always an error;
    null is an error unless `nullable` (then None comes back). An empty list at an index reads as null."""
    value: Any = row
    walked: list[str] = []
    for part in path.split("."):
        walked.append(part)
        where = ".".join(walked)
        if isinstance(value, Mapping):
            if part not in value:
                raise FieldError(where, "is missing")
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit():
            value = value[int(part)] if int(part) < len(value) else None
        else:
            raise FieldError(where, f"is missing (its parent is {type(value).__name__}, not a record)")
        if value is None:
            if nullable:
                return None
            raise FieldError(where, "is null")
    if not isinstance(value, kind):
        wanted = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise FieldError(path, f"is {type(value).__name__}, expected {wanted}")
    return value


def human(prompt: str) -> str:
    """DeepSpeed-Chat's prompt wrapping: leading space, no space after the final colon."""
    return " Human: " + prompt + " Assistant:"


def answer(text: str | None) -> str | None:
    """DeepSpeed-Chat's answer wrapping: one leading space."""
    return None if text is None else " " + text


class Adapter:
    """Maps one dataset's rows. `train_split` / `eval_split` are the source's split names; `eval_split` None
    means the source has no held-out split and the split step carves one from train."""

    name: ClassVar[str]
    hub_name: ClassVar[str | None] = None
    """What `load_dataset` is given, when it differs from `name` (mkqa-Chinese reads `mkqa`)."""
    local_only: ClassVar[bool] = False
    """True when there is no hub dataset of that name: `path` is required."""
    train_split: ClassVar[str] = "train"
    eval_split: ClassVar[str | None] = "test"
    fields: ClassVar[tuple[str, ...]]
    """The fields a row needs, for error messages."""

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        raise NotImplementedError


class DahoasRmStatic(Adapter):
    """Prompts already read "\\n\\nHuman: ... Assistant:" and answers start with a space: used as they are."""

    name = "Dahoas/rm-static"
    fields = ("prompt", "chosen", "rejected")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        return RawSample(field(row, "prompt"), field(row, "chosen"), field(row, "rejected"))


class DahoasFullHhRlhf(DahoasRmStatic):
    name = "Dahoas/full-hh-rlhf"


class DahoasSyntheticInstructGptjPairwise(Adapter):
    """Bare prompt and answers (also DeepSpeed-Chat's documented schema for your own data); train split only."""

    name = "Dahoas/synthetic-instruct-gptj-pairwise"
    eval_split = None
    fields = ("prompt", "chosen", "rejected")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        return RawSample(human(field(row, "prompt")), answer(field(row, "chosen")), answer(field(row, "rejected")))


class YitingxieRlhfRewardDatasets(Adapter):
    """The prompt ends before "Assistant:"; answers carry the whole dialogue, so keep what follows the last
    "Assistant:" (the answer with its leading space)."""

    name = "yitingxie/rlhf-reward-datasets"
    fields = ("prompt", "chosen", "rejected")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        return RawSample(field(row, "prompt") + "Assistant:", field(row, "chosen").split("Assistant:")[-1],
                         field(row, "rejected").split("Assistant:")[-1])


_CITATION_WITH_SPACE = re.compile(r" [\(\[].*?[\)\]]")
_CITATION = re.compile(r"[\(\[].*?[\)\]]")


def remove_citations(text: str) -> str:
    """WebGPT answers cite their browsing results ("[1]", "(2)"). Nothing here browses, so the citations would
    only confuse the model; DeepSpeed-Chat drops them, together with the space before them."""
    return _CITATION.sub("", _CITATION_WITH_SPACE.sub("", text))


class OpenaiWebgptComparisons(Adapter):
    """Chosen is the higher-scored answer; a tie keeps answer_0 as chosen (DeepSpeed-Chat's rule). Train only."""

    name = "openai/webgpt_comparisons"
    eval_split = None
    fields = ("question.full_text", "answer_0", "answer_1", "score_0", "score_1")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        prompt = human(field(row, "question.full_text"))
        first, second = field(row, "answer_0"), field(row, "answer_1")
        score_0, score_1 = (float(field(row, f"score_{i}", kind=(int, float))) for i in (0, 1))
        chosen, rejected = (first, second) if score_0 >= score_1 else (second, first)
        return RawSample(prompt, answer(remove_citations(chosen)), answer(remove_citations(rejected)))


class StanfordnlpSHP(Adapter):
    """`labels` is 1 when human_ref_A is preferred, 0 when human_ref_B is."""

    name = "stanfordnlp/SHP"
    eval_split = "validation"
    fields = ("history", "human_ref_A", "human_ref_B", "labels")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        a, b = field(row, "human_ref_A"), field(row, "human_ref_B")
        chosen, rejected = (a, b) if int(field(row, "labels", kind=(int, float, bool))) == 1 else (b, a)
        return RawSample(human(field(row, "history")), answer(chosen), answer(rejected))


class PvduySharegptAlpacaOaVicuna(Adapter):
    """Vicuna-style "USER: ... ASSISTANT:" prompts renamed to DeepSpeed-Chat's markers; SFT data, no rejected."""

    name = "pvduy/sharegpt_alpaca_oa_vicuna_format"
    fields = ("prompt", "label")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        prompt = field(row, "prompt", nullable=True)
        if not prompt:
            return Skip("empty prompt")
        label = field(row, "label", nullable=True)
        return RawSample(prompt.replace("USER", "Human").replace("ASSISTANT", "Assistant"),
                         answer(label) if label else None)


class LocalJsonFile(Adapter):
    """DeepSpeed-Chat's `local/jsonfile`: prompt / chosen / rejected records whose prompt already carries its
    markers ("Human: ... Assistant:"); every field just gets a leading space. Needs `path`."""

    name = "local/jsonfile"
    local_only = True
    eval_split = "eval"
    fields = ("prompt", "chosen", "rejected (optional)")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        prompt = field(row, "prompt", nullable=True)
        if prompt is None:
            return Skip("null prompt")
        rejected = field(row, "rejected", nullable=True) if "rejected" in row else None
        return RawSample(" " + prompt, answer(field(row, "chosen", nullable=True)), answer(rejected))


class _SFTOnly(Adapter):
    """Single-answer datasets: a null prompt skips the row, a null answer keeps it as a prompt (PPO) only."""

    prompt_path: ClassVar[str]
    answer_path: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.fields = (cls.prompt_path, cls.answer_path)

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        prompt = field(row, self.prompt_path, nullable=True)
        if prompt is None:
            return Skip("null prompt")
        return RawSample(human(prompt), answer(field(row, self.answer_path, nullable=True)))


class Wangrui6ZhihuKOL(_SFTOnly):
    name = "wangrui6/Zhihu-KOL"
    eval_split = None
    prompt_path, answer_path = "INSTRUCTION", "RESPONSE"


class HelloSimpleAIHC3Chinese(_SFTOnly):
    name = "Hello-SimpleAI/HC3-Chinese"
    eval_split = None
    prompt_path, answer_path = "question", "human_answers.0"


class MkqaChinese(_SFTOnly):
    name = "mkqa-Chinese"
    hub_name = "mkqa"
    eval_split = None
    prompt_path, answer_path = "queries.zh_cn", "answers.zh_cn.0.text"


class MkqaJapanese(MkqaChinese):
    name = "mkqa-Japanese"
    prompt_path, answer_path = "queries.ja", "answers.ja.0.text"


class LmqgQgJaquad(_SFTOnly):
    name = "lmqg/qg_jaquad"
    eval_split = "validation"
    prompt_path, answer_path = "question", "sentence"


class LmqgQagJaquad(_SFTOnly):
    name = "lmqg/qag_jaquad"
    eval_split = "validation"
    prompt_path, answer_path = "questions.0", "paragraph"


class CohereMiraclZh(Adapter):
    """Query, first positive passage as chosen, first negative passage as rejected (None when there is none)."""

    name = "Cohere/miracl-zh-queries-22-12"
    eval_split = "dev"
    fields = ("query", "positive_passages.0.text", "negative_passages.0.text")

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        return RawSample(human(field(row, "query")),
                         answer(field(row, "positive_passages.0.text", nullable=True)),
                         answer(field(row, "negative_passages.0.text", nullable=True)))


class CohereMiraclJa(CohereMiraclZh):
    name = "Cohere/miracl-ja-queries-22-12"


class FormatAdapter(Adapter):
    """A dataset described in YAML (`format:`), so users add data without code. With `template: chat_template`
    prompt and answers stay as they are here, and `apply_chat_template` renders them once a tokenizer exists."""

    name = "custom"
    fields = ()

    def __init__(self, name: str, spec: DatasetFormatSpec):
        self.name = name  # type: ignore[misc]  # one instance per configured dataset
        self.spec = spec
        named = (spec.messages_field,) if spec.messages_field else (spec.prompt_field, spec.chosen_field,
                                                                       spec.rejected_field)
        self.fields = tuple(f for f in named if f) + tuple(spec.columns.values())
        if spec.template == "dschat":
            self._prompt, self._answer = " Human: {prompt} Assistant:", spec.answer_template or " {answer}"
        elif spec.template in ("raw", "chat_template"):
            self._prompt, self._answer = "{prompt}", "{answer}"
        else:
            self._prompt, self._answer = spec.template, spec.answer_template or " {answer}"

    def _wrap_answer(self, row: Mapping[str, Any], path: str | None) -> str | None:
        text = None if path is None else field(row, path, nullable=True)
        return None if text is None else self._answer.format(answer=text)

    def convert(self, row: Mapping[str, Any]) -> RawSample | Skip:
        columns = {name: field(row, path, kind=(str, int, float, bool)) for name, path in self.spec.columns.items()}
        if self.spec.messages_field:
            return RawSample("", columns=columns, messages=read_messages(row, self.spec.messages_field))
        prompt = field(row, self.spec.prompt_field, nullable=True)
        if prompt is None:
            return Skip("null prompt")
        return RawSample(self._prompt.format(prompt=prompt), self._wrap_answer(row, self.spec.chosen_field),
                         self._wrap_answer(row, self.spec.rejected_field), columns)


def read_messages(row: Mapping[str, Any], path: str) -> tuple[dict[str, str], ...]:
    """A conversation field: a non-empty list of {role, content} records with string values (FieldError naming the
    first bad item, e.g. `messages.2.content`)."""
    items = field(row, path, kind=list)
    if not items:
        raise FieldError(path, "is an empty conversation")
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise FieldError(f"{path}.{i}", f"is {type(item).__name__}, expected a {{role, content}} record")
        try:
            messages.append({key: field(item, key) for key in ("role", "content")})
        except FieldError as exc:
            raise FieldError(f"{path}.{i}.{exc.field}", exc.problem) from None
    return tuple(messages)


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


_DSCHAT_TURN = re.compile(r"\s*(Human|Assistant):\s?")


def dschat_messages(prompt: str) -> list[dict[str, str]]:
    """DeepSpeed-Chat's " Human: a Assistant: b Human: c Assistant:" as chat messages (the final empty assistant
    turn is what the model answers); any other text is one user message."""
    parts = _DSCHAT_TURN.split(prompt)
    if len(parts) < 3 or parts[0].strip() or parts[-2] != "Assistant" or parts[-1].strip():
        return [{"role": "user", "content": prompt.strip()}]
    roles = {"Human": "user", "Assistant": "assistant"}
    turns = [(roles[parts[i]], parts[i + 1].strip()) for i in range(1, len(parts) - 2, 2)]
    return [{"role": role, "content": text} for role, text in turns]


def apply_prompt_template(sample: RawSample, template: str) -> RawSample:
    """The sample with its prompt re-wrapped by `template` (a format string using {prompt}, `prompt_template`):
    {prompt} is the user's text of a one-turn DeepSpeed-Chat prompt, else the prompt as it is."""
    messages = dschat_messages(sample.prompt)
    question = messages[0]["content"] if len(messages) == 1 else sample.prompt.strip()
    return replace(sample, prompt=template.format(prompt=question))


def apply_chat_template(sample: RawSample, tokenizer: ChatTokenizer) -> RawSample:
    """Render a sample with the tokenizer's chat template, for the tokenising step (`chat_template: true`).

    The prompt becomes the rendered conversation (DeepSpeed-Chat turns split into messages) plus the generation
    prompt; each answer becomes what the template puts after that (the reply and the template's own end-of-turn
    marker), so prompt + answer is exactly the rendered conversation. The tokenising step places the tokenizer's
    BOS only where the template did not already write it, and appends no second end-of-turn. A `messages` sample
    keeps its conversation (SFT renders it turn by turn, `conversation_pieces`); its prompt becomes the
    conversation before the first assistant message."""
    _need_template(tokenizer, conversation=sample.messages is not None)
    if sample.messages is not None:
        first = next((i for i, m in enumerate(sample.messages) if m["role"] == "assistant"), len(sample.messages))
        prompt = tokenizer.apply_chat_template(list(sample.messages[:first]), tokenize=False,
                                               add_generation_prompt=True)
        return RawSample(prompt, columns=sample.columns, messages=sample.messages)
    user = dschat_messages(sample.prompt)
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)

    def reply(text: str | None) -> str | None:
        if text is None:
            return None
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": text.strip()}],
                                             tokenize=False)
        return full[len(prompt):] if full.startswith(prompt) else text

    return RawSample(prompt, reply(sample.chosen), reply(sample.rejected), sample.columns)


def conversation_pieces(messages: tuple[dict[str, str], ...], tokenizer: ChatTokenizer) -> list[tuple[str, bool]]:
    """A conversation as the chat template renders it, cut into (text, trained) pieces: each assistant message's
    reply (what the template writes for it, its end-of-turn included) is trained; everything between (system,
    user and tool messages, the assistant headers) is context. This is the layout of a multi-turn rollout: the
    policy's turns, then each observation rendered after them. ValueError when the conversation has no assistant
    message or the template does not render each turn as a continuation of the text before it."""
    _need_template(tokenizer, conversation=True)
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("the conversation starts with an assistant message; give the messages it answers first")
        head = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False)
        if not head.startswith(done) or not full.startswith(head):
            raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', 'the tokenizer')} rewrites "
                             f"earlier turns when message {i} is added, so the conversation cannot be trained turn "
                             "by turn")
        pieces += [(head[len(done):], False), (full[len(head):], True)]
        done = full
    if not pieces:
        raise ValueError("the conversation has no assistant message to train on")
    return pieces


def _need_template(tokenizer: ChatTokenizer, conversation: bool = False) -> None:
    if getattr(tokenizer, "chat_template", None) is not None:
        return
    name = getattr(tokenizer, "name_or_path", "the tokenizer")
    if conversation:
        raise ValueError(f"{name} has no chat template, and conversation rows (messages) are rendered with one: give "
                         "the tokenizer a template (tokenizer_config.json's chat_template) or train another model")
    raise ValueError(f"{name} has no chat template; set chat_template: false for this dataset (or give the tokenizer "
                     "a template)")


ADAPTERS: tuple[type[Adapter], ...] = (
    DahoasRmStatic, DahoasFullHhRlhf, DahoasSyntheticInstructGptjPairwise, YitingxieRlhfRewardDatasets,
    OpenaiWebgptComparisons, StanfordnlpSHP, PvduySharegptAlpacaOaVicuna, Wangrui6ZhihuKOL, CohereMiraclZh,
    HelloSimpleAIHC3Chinese, MkqaChinese, MkqaJapanese, CohereMiraclJa, LmqgQgJaquad, LmqgQagJaquad, LocalJsonFile,
)
"""Every built-in schema, in DeepSpeed-Chat's registry order."""
