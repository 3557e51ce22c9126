"""The pipeline job: (pretrain ->) SFT -> RM -> PPO, or SFT -> DPO, each stage's model feeding the next."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_ray.config.base import FieldProblem, StrictModel
from rlhf_ray.config.placement import PlacementSpec
from rlhf_ray.config.jobs import FINAL_MODEL_DIR, DPOJob, JobBase, PretrainJob, RMJob, SFTJob
from rlhf_ray.config.ppo_job import PPOJob

ANSWERS_FILE = "teacher_answers.jsonl"
"""The teacher's answers a warm-up stage trains on, in its output_dir (`rlhf-ray sample` writes the same rows)."""
ANSWERS_FORMAT = {"prompt_field": "prompt", "chosen_field": "answer", "template": "raw"}
"""How an SFT job reads such a file (`data.datasets: [{name: custom, path: FILE, format: ANSWERS_FORMAT}]`): the
prompt as the PPO job rendered it, the answer as the model wrote it (its stop token included), neither re-rendered,
so SFT trains on the very prompt ids the PPO job samples from."""
PAIRS_DIR = "pairs"
"""The labelled preference pairs a reward-model stage trains on (train.jsonl) and is checked on (eval.jsonl), in its
output_dir, when the pipeline labels them (a `pairs` section)."""
PAIRS_FORMAT = {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected", "template": "raw"}
"""How the reward-model stage reads them: the prompt as the PPO stage renders it, both answers as the SFT model wrote
them (stop token included)."""


class WarmupJob(SFTJob):
    """Before on-policy distillation: the student's SFT on the teacher's own answers to a sample of the PPO stage's
    training prompts (the off-policy start the peers' distillation recipes use; docs/jobs.md). The pipeline samples
    them on the cluster with the PPO stage's generation settings and engine placement, writes them to
    `<output_dir>/teacher_answers.jsonl`, and then runs this SFT job on them. Defaults: the model is the PPO
    stage's policy model (the student), the data that file with `split: "1,0,0"`; the PPO stage's policy then starts
    from this stage's model."""

    prompts: int = Field(240, ge=1)
    """How many of the PPO stage's training prompts the teacher answers (a sample seeded by the PPO stage's seed),
    `generation.sampling.n_samples_per_prompt` answers each."""
    keep_unfinished: bool = False
    """Keep answers cut at `generation.sampling.max_new_tokens` (dropped by default: SFT on them would teach the
    student to stop mid-answer)."""


class PreferencePairs(StrictModel):
    """Between sft and rm: InstructGPT's labelling step with a known truth. The SFT model answers `prompts` +
    `eval_prompts` of the PPO stage's training prompts twice each (the PPO stage's generation settings and engine
    placement), a gold function scores every answer, and a Bradley-Terry draw on the two scores labels which one is
    chosen (annotator noise: `temperature`); pairs with equal scores are ties and left out. The reward-model stage
    then trains on the first `prompts` pairs and reports its accuracy on the others beside the gold function's own
    (the ceiling on noisy labels). The gold function is the truth the reward model never sees: name it as the PPO
    stage's `ppo.accuracy_function` too, to measure the policy by it (docs/jobs.md, "Preference pairs with a
    hidden truth")."""

    gold_function: str = Field(pattern=r"^[\w.]+:\w+$")
    """Import path of the gold score, called like a reward function: `fn(prompts, answers, **columns)` -> a score per
    answer (e.g. `rlhf_ray.data.descriptions:gold` for the `demo/descriptions` task)."""
    prompts: int = Field(600, ge=1)
    """Training prompts answered twice: at most this many training pairs (fewer by the ties)."""
    eval_prompts: int = Field(100, ge=1)
    """Further prompts whose pairs are the reward model's held-out check (never trained on)."""
    temperature: float = Field(0.1, ge=0)
    """The annotator's noise: P(a chosen over b) = sigmoid((gold(a) - gold(b)) / temperature); 0: always the higher
    score."""


def _with_default(section: dict[str, Any], keys: tuple[str, ...], value: str) -> None:
    """Set section[k0][k1]...[kn] = value unless the user gave it (raw YAML dicts, before validation)."""
    for key in keys[:-1]:
        child = section.setdefault(key, {})
        if not isinstance(child, dict):
            return
        section = child
    section.setdefault(keys[-1], value)


def _names_a_model(section: dict[str, Any], role: str) -> bool:
    """The role's model is given in the raw YAML (a path, or a GGUF file)."""
    model = (section.get(role) or {}).get("model") if isinstance(section.get(role), dict) else None
    return isinstance(model, dict) and bool(model.get("path") or model.get("gguf_file"))


def _wire_warmup(warmup: dict[str, Any], ppo: dict[str, Any]) -> None:
    """The warm-up starts from the student (ppo's policy model) and reads the teacher's answers it writes; ppo's
    policy starts from the warm-up's model (raw YAML dicts, before validation)."""
    policy = ppo.get("policy")
    student = policy.get("model") if isinstance(policy, dict) else None
    if not isinstance(student, dict):
        return  # no student named: warmup.model is then required, and validation says so there
    warmup.setdefault("model", dict(student))
    data = warmup.setdefault("data", {})
    if isinstance(data, dict):
        data.setdefault("datasets", [{"name": "custom", "path": f"{warmup['output_dir']}/{ANSWERS_FILE}",
                                      "format": dict(ANSWERS_FORMAT)}])
        data.setdefault("split", "1,0,0")
    ppo["policy"] = {**policy, "model": {**student, "path": f"{warmup['output_dir']}/{FINAL_MODEL_DIR}",
                                         "gguf_file": None}}


class PipelineJob(JobBase):
    """SFT -> RM -> PPO, SFT -> PPO with a reward function or server (no reward model to train), or SFT -> DPO,
    optionally after continued pretraining. Stage outputs default to
    `<output_dir>/{pretrain,sft,rm,ppo,dpo}`; SFT starts from the pretrain stage's model when there is one, the reward
    model from the SFT model (as InstructGPT's does), PPO's policy and reference from the SFT model, and its critic
    and reward model from the RM, unless a path is given (without an RM stage the critic starts from the SFT model,
    its value head new); DPO starts from the SFT model. A PPO stage with a teacher
    (on-policy distillation) distils the SFT model by default: the teacher's path defaults to it, the policy to the
    SFT model only where no model is named; a warm-up stage then trains that student on the teacher's own answers
    first, and PPO's policy starts from the warm-up's model."""

    summary: ClassVar[str] = "(pretrain ->) SFT -> RM -> PPO, or SFT -> DPO"
    runner: ClassVar[str] = "rlhf_ray.jobs.pipeline:run_pipeline"
    kind: Literal["pipeline"] = "pipeline"
    pretrain: PretrainJob | None = None
    """Optional stage 0, as in a pretrain config: continued pretraining on mmap corpora, whose model SFT starts from
    (sft's `model.path` left unset takes it)."""
    sft: SFTJob
    """Stage 1, as in an sft config (`kind` and `output_dir` may be left out)."""
    rm: RMJob | None = None
    """Stage 2, as in an rm config; `model.path` left unset takes the SFT output. Leave it out when PPO's reward is a
    function or a server."""
    ppo: PPOJob | None = None
    """Stage 3, as in a ppo config; model paths left unset take the SFT / RM outputs."""
    dpo: DPOJob | None = None
    """Instead of rm and ppo: DPO after SFT, as in a dpo config; `model.path` left unset takes the SFT output."""
    warmup: WarmupJob | None = None
    """Between sft and ppo, with a ppo stage that has a teacher (on-policy distillation): the teacher answers
    `warmup.prompts` training prompts, and the student (ppo's policy model) is fine-tuned on those answers, as in an
    sft config; the PPO stage's policy starts from its model."""
    pairs: PreferencePairs | None = None
    """Between sft and rm: label pairs of the SFT model's own answers by a gold function (a Bradley-Terry draw) and
    train the reward model on them; rm's data defaults to them (`<rm output_dir>/pairs/`)."""

    @model_validator(mode="after")
    def _one_route(self) -> "PipelineJob":
        if self.dpo is not None and (self.rm is not None or self.ppo is not None):
            raise FieldProblem("dpo", "a pipeline runs either rm and ppo after sft, or dpo: remove one route")
        if self.dpo is None and self.ppo is None:
            raise FieldProblem("ppo", "no stage after sft: give a ppo section (with an rm section when its reward is "
                                      "a reward model), or a dpo one")
        if self.warmup is not None and (self.ppo is None or self.ppo.teacher is None):
            raise FieldProblem("warmup", "a warm-up fine-tunes the student on the teacher's answers before on-policy "
                                         "distillation: it needs a ppo stage with a teacher section; remove warmup")
        if self.pairs is not None and (self.rm is None or self.ppo is None):
            raise FieldProblem("pairs", "preference pairs are labelled from the SFT model's answers to the ppo stage's "
                                        "prompts and train the rm stage: give both an rm and a ppo section, or remove "
                                        "pairs")
        if self.pairs is not None and [d.path for d in self.rm.data.datasets] != [f"{self.rm.output_dir}/{PAIRS_DIR}"]:
            raise FieldProblem("pairs", f"the rm stage trains on the labelled pairs ({self.rm.output_dir}/{PAIRS_DIR}/) "
                                        "the pairs section writes: remove rm.data.datasets, or remove pairs")
        if self.pairs is not None and (self.rm.data.split_shares[0] or self.rm.data.split_shares[2]):
            raise FieldProblem("pairs", f"rm.data.split {self.rm.data.split!r} gives the labelled pairs to other "
                                        "phases too, which never read them: remove rm.data.split (the pairs are the "
                                        "rm stage's alone: '0,1,0')")
        if self.pairs is not None and self.ppo.generation.environment is not None:
            raise FieldProblem("pairs", "pairs are two single answers to one prompt; the ppo stage plays multi-turn "
                                        "episodes (generation.environment): remove pairs")
        if self.warmup is not None and self.ppo.generation.environment is not None:
            raise FieldProblem("warmup", "the warm-up trains on one answer per prompt; the ppo stage plays multi-turn "
                                         "episodes (generation.environment): remove warmup, or give the student an "
                                         "SFT stage of its own on conversations")
        return self

    @model_validator(mode="before")
    @classmethod
    def _wire_stages(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        root = data.get("output_dir", cls.model_fields["output_dir"].default)
        shared = {k: data[k] for k in ("seed", "cluster", "logging") if k in data}
        stages = {}
        for stage in ("pretrain", "sft", "warmup", "rm", "ppo", "dpo"):
            section = data.get(stage)
            if section is None and stage != "sft":
                continue
            if not isinstance(section, dict):
                return data
            section = {**shared, **section}
            section.setdefault("kind", "sft" if stage == "warmup" else stage)
            section.setdefault("output_dir", f"{root}/{stage}")
            stages[stage] = section
        if "pretrain" in stages:
            _with_default(stages["sft"], ("model", "path"), f"{stages['pretrain']['output_dir']}/{FINAL_MODEL_DIR}")
        sft_model = f"{stages['sft']['output_dir']}/{FINAL_MODEL_DIR}"
        for stage in ("rm", "dpo"):
            if stage in stages:
                _with_default(stages[stage], ("model", "path"), sft_model)
        if isinstance(data.get("pairs"), dict) and "rm" in stages:
            rm_data = stages["rm"].setdefault("data", {})
            if isinstance(rm_data, dict):
                rm_data.setdefault("datasets", [{"name": "custom", "path": f"{stages['rm']['output_dir']}/{PAIRS_DIR}",
                                                 "format": dict(PAIRS_FORMAT)}])
                rm_data.setdefault("split", "0,1,0")
        if "warmup" in stages and "ppo" in stages:
            _wire_warmup(stages["warmup"], stages["ppo"])
        if "ppo" in stages:
            if not _names_a_model(stages["ppo"], "policy"):
                _with_default(stages["ppo"], ("policy", "model", "path"), sft_model)
            if isinstance(stages["ppo"].get("teacher"), dict) and not _names_a_model(stages["ppo"], "teacher"):
                _with_default(stages["ppo"], ("teacher", "model", "path"), sft_model)
            if "rm" not in stages and isinstance(stages["ppo"].get("critic"), dict) \
                    and not _names_a_model(stages["ppo"], "critic"):  # no reward model: the SFT backbone, a new head
                _with_default(stages["ppo"], ("critic", "model", "path"), sft_model)
        if "ppo" in stages and "rm" in stages:  # without an rm stage the reward is a function or a server
            rm_model = f"{stages['rm']['output_dir']}/{FINAL_MODEL_DIR}"
            reward = stages["ppo"].get("reward")
            if not (isinstance(reward, dict) and (reward.get("function") or reward.get("http"))):
                _with_default(stages["ppo"], ("reward", "model", "path"), rm_model)
            if isinstance(stages["ppo"].get("critic"), dict):
                _with_default(stages["ppo"], ("critic", "model", "path"), rm_model)
        return {**data, **stages}

    def placement_roles(self) -> dict[str, PlacementSpec]:
        """Stages run one after another, so the plan that must fit is the largest stage's."""
        return (self.dpo or self.ppo or self.sft).placement_roles()  # sft alone: the route check then says why

    def named_stages(self) -> dict[str, JobBase]:
        """The stages in the order they run, by their section's name."""
        order = ("pretrain", "sft", "warmup", "rm", "ppo", "dpo")
        return {name: getattr(self, name) for name in order if getattr(self, name) is not None}
