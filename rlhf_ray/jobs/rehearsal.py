"""`rlhf-ray rehearse`: a PPO job run for a few iterations with random weights in its models' shapes, on the
cluster it would run on, to see before a long run what each role really holds against the plan's prediction, where
an iteration's time goes and how fast the weights reach the engines.

Each model of the job is replaced by a folder of random weights in its shape: its own config.json and tokenizer
when the folder is here, else (a hub id that is not) the known-shapes table's numbers (memory/shapes.py) as a
Llama-style or OPT-style config with a stand-in tokenizer. The rehearsal then runs the job itself (run_ppo) with
no evaluation and no checkpoints, in a folder of its own, and reads back its metrics and summary.json.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_ray.config.ppo_job import PPOJob
from rlhf_ray.jobs.metrics import METRICS_FILE
from rlhf_ray.jobs.ppo.job import run_ppo
from rlhf_ray.jobs.preflight import model_specs
from rlhf_ray.memory.budget import role_memory
from rlhf_ray.memory.shapes import ModelShape, known_shape
from rlhf_ray.models.sources import resolve_model_sources
from rlhf_ray.models.tiny import default_corpus, train_tokenizer, write_model_folder

log = logging.getLogger(__name__)

GOAL = 0.10
"""Issue 38's bound on |plan - measured| / measured for every role."""


def config_for_shape(shape: ModelShape, tokenizer):
    """An HF config of `shape` (a table entry: no config.json here): OPT's layout for a two-matrix MLP, Llama's
    otherwise."""
    from transformers import LlamaConfig, OPTConfig

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if not shape.gated_mlp:
        return OPTConfig(hidden_size=shape.hidden, ffn_dim=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, vocab_size=shape.vocab, word_embed_proj_dim=shape.hidden,
                         tie_word_embeddings=shape.tied_embeddings, max_position_embeddings=2048, **ids)
    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                       head_dim=shape.dim_per_head, tie_word_embeddings=shape.tied_embeddings,
                       max_position_embeddings=8192, **ids)


def random_model(source: str, out: Path, seed: int = 0) -> Path:
    """A folder with random weights in the shape of `source` (a model folder, or a hub id of the known-shapes
    table) and a tokenizer (the folder's own; for a hub id a stand-in BPE tokenizer, since the hub's is not here),
    written in bf16 (each role loads it in its own dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(source)
    if (folder / "config.json").is_file():
        config, tokenizer = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    elif (shape := known_shape(source)) is not None:
        tokenizer = train_tokenizer(default_corpus(), min(shape.vocab, 1024))
        config = config_for_shape(shape, tokenizer)
    else:
        raise ValueError(f"{source}: no config.json there and not a model of the known-shapes table "
                         "(rlhf_ray/memory/shapes.py): rehearse needs the model's shape")
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return write_model_folder(model, tokenizer, out)


def with_random_models(job: PPOJob, folder: Path) -> PPOJob:
    """The job with every model replaced by random weights of its shape (one folder per distinct model)."""
    job = resolve_model_sources(job).model_copy(deep=True)
    made: dict[str, Path] = {}
    for loc, spec in model_specs(job):
        if spec.path is None:
            continue
        if spec.path not in made:
            made[spec.path] = random_model(spec.path, folder / f"model-{len(made)}")
            log.info("rehearsal: %s -> random weights in %s", spec.path, made[spec.path])
        owner = job
        for name in loc[:-1]:
            owner = getattr(owner, name)
        setattr(owner, loc[-1], spec.model_copy(update={"path": str(made[spec.path]), "tokenizer": None,
                                                        "size_like": None}))
    return job


def rehearsal_job(job: PPOJob, folder: Path, iterations: int) -> PPOJob:
    """`job` with random models, `iterations` iterations, no evaluation, no checkpoints, writing under `folder`."""
    job = job.model_copy(update={"output_dir": str(folder / "run")})  # a GGUF model is imported under it too
    job = with_random_models(job, folder / "models")
    ppo = job.ppo.model_copy(update={"iterations": iterations, "eval_prompts": 0, "eval_every": 0})
    checkpoint = job.checkpoint.model_copy(update={"every_steps": 0, "resume": False})
    return job.model_copy(update={"ppo": ppo, "checkpoint": checkpoint})


@dataclass
class Rehearsal:
    device: str
    """Where the roles ran: "cuda" or "cpu"."""
    memory: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    """Role -> (the plan's GiB per replica, or None where the plan cannot size it; the measured peak GiB)."""
    times: dict[str, float] = field(default_factory=dict)
    """Median seconds per iteration after the first: iteration, generation, experience, training, sync."""
    orchestration: float = 0.0
    sync_bytes: float = 0.0
    transport: str = ""

    @property
    def worst_error(self) -> float:
        errors = [abs(plan - got) / got for plan, got in self.memory.values() if plan is not None and got > 0]
        return max(errors, default=float("nan"))

    def lines(self, config: str, iterations: int) -> list[str]:
        """The report, at most 80 columns wide (but for the config's path)."""
        out = [f"rehearsal: {iterations} iterations with random weights ({self.device})", f"config: {config}", "",
               f"{'role':<12}{'plan GiB':>10}{'measured GiB':>14}{'error':>8}"]
        for role, (plan, got) in self.memory.items():
            error = f"{(plan - got) / got:+.0%}" if plan is not None and got > 0 else "-"
            out.append(f"{role:<12}{'-' if plan is None else f'{plan:.2f}':>10}{got:>14.2f}{error:>8}")
        t = self.times
        out += ["", "measured: each role's largest replica, above its process before the model",
                f"within {GOAL:.0%} of the plan: {'yes' if self.worst_error <= GOAL else 'no'} (worst "
                f"{self.worst_error:.0%})", "",
                f"iteration {t['iteration']:.2f} s: generation {t['generation']:.2f} s, experience "
                f"{t['experience']:.2f} s,", f"  training {t['training']:.2f} s, weight sync {t['sync']:.2f} s, "
                f"orchestration {self.orchestration:.0%}"]
        if self.sync_bytes and t["sync"] > 0:
            out.append(f"weight sync: {self.sync_bytes / 1e6:.0f} MB in {t['sync']:.3f} s "
                       f"({self.sync_bytes / t['sync'] / 1e9:.2f} GB/s, {self.transport})")
        return out


def rehearse(job: PPOJob, folder: Path, iterations: int = 3) -> Rehearsal:
    """Run `job` with random weights for `iterations` iterations under `folder`; the plan beside what it measured."""
    rehearsed = rehearsal_job(job, Path(folder), iterations)
    summary = run_ppo(rehearsed)
    lines = [json.loads(line) for line in (Path(rehearsed.output_dir) / METRICS_FILE).read_text().splitlines()]
    steps = [m for m in lines if "time/iteration" in m]
    later = steps[1:] or steps

    def median(key: str) -> float:
        return statistics.median(m[key] for m in later)

    planned = role_memory(rehearsed)
    on_gpu = any(placement.num_gpus > 0 for placement in rehearsed.placement_roles().values())
    result = Rehearsal(device="cuda" if on_gpu else "cpu", transport=summary["weight_sync"])
    for role, got in summary["peak_memory_gib"].items():
        bytes_ = planned[role].bytes if role in planned else None
        plan = None if bytes_ is None else (bytes_.device if on_gpu else bytes_.device + bytes_.host) / 2**30
        result.memory[role] = (plan, got)
    result.times = {"iteration": median("time/iteration"), "generation": median("time/engine_generate"),
                    "experience": median("compute/experience_seconds"), "training": median("compute/train_seconds"),
                    "sync": median("time/sync")}
    result.orchestration, result.sync_bytes = median("time/orchestration_fraction"), median("sync/bytes")
    (Path(folder) / "rehearsal.json").write_text(json.dumps({
        "device": result.device, "memory_gib": {r: {"plan": p, "measured": m} for r, (p, m) in result.memory.items()},
        "seconds": result.times, "orchestration_fraction": result.orchestration, "sync_bytes": result.sync_bytes,
        "transport": result.transport}, indent=2))
    return result

