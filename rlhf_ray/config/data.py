"""Which datasets feed a job, how they split across the SFT / RM / PPO phases, and how long sequences get."""

from __future__ import annotations

from pydantic import Field, field_validator

from rlhf_ray.config.base import StrictModel


class DatasetSpec(StrictModel):
    """One raw dataset: a registered name (e.g. `Dahoas/rm-static`, `demo/arithmetic`) or a local file."""

    name: str
    """Registry name. Local files use a registry name that describes their schema (see docs/configuration.md)."""
    path: str | None = None
    """Local file or folder to read instead of the hub (json, jsonl, parquet, or a saved dataset)."""
    weight: float = Field(1.0, gt=0)
    """Relative share of this dataset when several are blended."""


class DataSpec(StrictModel):
    """The data of a job. The data layer (rlhf_ray/data/) turns it into tokenised datasets."""

    datasets: list[DatasetSpec] = Field(default_factory=lambda: [DatasetSpec(name="demo/arithmetic")])
    """Raw datasets, blended by weight; each is split across the three phases."""
    split: str = "2,4,4"
    """Shares of every dataset given to SFT, RM and PPO (DeepSpeed-Chat's `--data_split`): disjoint phases."""
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    """Held-out share carved from a dataset that has no eval split of its own."""
    max_seq_len: int = Field(512, ge=8)
    """SFT / RM: prompt + answer tokens per sample."""
    max_prompt_len: int = Field(256, ge=1)
    """PPO: prompt tokens (over-long prompts are cut from the left, keeping the question's end)."""
    cache_dir: str | None = None
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
