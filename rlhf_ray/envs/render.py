"""Token ids of an environment's observation, in the chat template's markup, appended after the ids the policy
sampled. The ids are computed from the observation alone against a fixed context, so the policy's ids are never
decoded and encoded again (re-tokenising `answer + observation` as text can merge or split tokens at the seam,
and then the trained tokens are not the sampled ones)."""

from __future__ import annotations

from functools import lru_cache


class ObservationRenderer:
    """`ids(text)`: what follows a finished policy turn: the rest of the turn's closing markup (e.g. ChatML's newline
    after `<|im_end|>`), the observation as a `role` message, and the header of the next assistant turn."""

    MARK = "rlhf-ray-probe"
    PROBE = ({"role": "user", "content": "q"}, {"role": "assistant", "content": MARK})

    def __init__(self, tokenizer, role: str = "tool"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} has no chat template: multi-turn "
                             "rollouts render observations with it")
        self.tokenizer, self.role = tokenizer, role
        before = tokenizer.apply_chat_template(list(self.PROBE), tokenize=False)
        closing = before[before.rindex(self.MARK) + len(self.MARK):]  # what the template writes after an answer
        eos = tokenizer.eos_token or ""
        # a finished turn ends on its stop token (the eos); what the template writes after it belongs to what follows
        self._gap = closing[closing.index(eos) + len(eos):] if eos and eos in closing else ""
        self._before = before
        self.ids = lru_cache(maxsize=4096)(self._ids)

    def _ids(self, text: str) -> tuple[int, ...]:
        after = self.tokenizer.apply_chat_template([*self.PROBE, {"role": self.role, "content": text}],
                                                   tokenize=False, add_generation_prompt=True)
        if not after.startswith(self._before) or text not in after[len(self._before):]:
            raise ValueError(f"the chat template of {self.tokenizer.name_or_path} does not render a {self.role!r} "
                             f"message after an assistant turn; choose another observation role (e.g. 'user')")
        return tuple(self.tokenizer(self._gap + after[len(self._before):], add_special_tokens=False)["input_ids"])
