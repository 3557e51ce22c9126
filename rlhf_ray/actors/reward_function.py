"""The reward role as a Python function (`reward.function: package.module:function`), run in its own actor like a
reward model: the function gets decoded prompts and answers, and the samples' dataset columns as keyword
arguments (one list per column, as TRL does: `answer=[...]`), and returns one score per answer."""

from __future__ import annotations

import math

import torch

from rlhf_ray.actors.http_reward import RemoteRewardError
from rlhf_ray.actors.payload import by_reference
from rlhf_ray.algorithms.batch import RolloutBatch
from rlhf_ray.algorithms.experience import unpack_rollouts
from rlhf_ray.data.decoding import TextDecoder
from rlhf_ray.functions import RewardFunctionError, column_arguments, load_function


class RewardFunctionWorker:
    def __init__(self, *, rank: int, world_size: int, function: str | None, tokenizer: str, http: dict | None = None,
                 http_credentials: dict | None = None):
        """`function`: an import path; or `http`: a HttpRewardSpec as a dict (a reward server, called alike), with
        the token and CA the driver read for it (http_reward.credentials).
        `tokenizer`: the policy's tokenizer folder, used only to decode (without importing transformers where
        its tokenizer.json suffices: rlhf_ray/data/decoding.py)."""
        if http is not None:
            from rlhf_ray.actors.http_reward import HttpReward
            from rlhf_ray.config.ppo_job import HttpRewardSpec

            self.name, self.function = http["url"], HttpReward(HttpRewardSpec.model_validate(http),
                                                               **(http_credentials or {}))
        else:
            self.name, self.function = function, load_function(function)
        self.tokenizer = TextDecoder(tokenizer)

    def texts(self, batch: RolloutBatch, lo: int, hi: int) -> tuple[list[str], list[str]]:
        rows = unpack_rollouts(batch, lo, hi)
        prompts = [self.tokenizer.decode(prompt) for prompt, _ in rows]
        answers = [self.tokenizer.decode(answer, skip_special_tokens=True) for _, answer in rows]
        return prompts, answers

    @by_reference
    def score(self, batch: RolloutBatch, lo: int, hi: int) -> torch.Tensor:
        prompts, answers = self.texts(batch, lo, hi)
        return self.score_texts(prompts, answers, (batch.columns or [{}] * len(batch))[lo:hi])

    def score_texts(self, prompts: list[str], answers: list[str], columns: list[dict] | None = None) -> torch.Tensor:
        """Scores one by one on failure, so the error names the sample that broke the function."""
        columns = columns if columns is not None else [{} for _ in answers]
        kwargs = column_arguments(self.function, columns)
        try:
            scores = [float(v) for v in self.function(prompts, answers, **kwargs)]
            if len(scores) != len(answers):
                raise ValueError(f"returned {len(scores)} scores for {len(answers)} answers")
            if not all(math.isfinite(v) for v in scores):
                raise ValueError("returned a non-finite score")
            return torch.tensor(scores)
        except RemoteRewardError:  # a server that failed after its retries: asking it row by row would not help
            raise
        except Exception as batch_error:  # noqa: BLE001 - find and report the offending sample
            for i, (prompt, answer) in enumerate(zip(prompts, answers)):
                try:
                    value = float(self.function([prompt], [answer], **{k: v[i:i + 1] for k, v in kwargs.items()})[0])
                    if not math.isfinite(value):
                        raise ValueError(f"returned {value}")
                except Exception as exc:  # noqa: BLE001
                    raise RewardFunctionError(f"reward function {self.name} failed on prompt {prompt!r} with answer "
                                              f"{answer!r} (columns {columns[i]}): {type(exc).__name__}: {exc}"
                                              ) from exc
            raise RewardFunctionError(f"reward function {self.name} failed on a batch of {len(answers)} answers "
                                      f"(each alone works): {type(batch_error).__name__}: {batch_error}") from batch_error

    def ping(self) -> int:
        return 0
