"""Every shipped config loads, and the SmolLM2 recipes fit where their headers say they run: 2 CPU cores as
written, one GPU with the num_gpus their headers list."""

import pytest

from rlhf_ray.config import load_job
from rlhf_ray.plan import ResourcePlan
from tests.conftest import ROOT

CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
ONE_GPU = {  # the headers' placements for one GPU
    "smollm2-grpo.yaml": ["policy.placement.num_gpus=0.5", "generation.placement.num_gpus=0.4",
                          "reference.placement.num_gpus=0.1", "generation.vllm.gpu_memory_utilization=0.3"],
    "smollm2-calculator.yaml": ["sft.placement.num_gpus=1", "ppo.policy.placement.num_gpus=0.5",
                                "ppo.generation.placement.num_gpus=0.4", "ppo.reference.placement.num_gpus=0.1",
                                "ppo.generation.vllm.gpu_memory_utilization=0.3"],
    "smollm2-ppo.yaml": ["policy.placement.num_gpus=0.35", "critic.placement.num_gpus=0.2",
                         "generation.placement.num_gpus=0.35", "reference.placement.num_gpus=0.1",
                         "generation.vllm.gpu_memory_utilization=0.3"],
    "smollm2-sft-ppo.yaml": ["sft.placement.num_gpus=1", "ppo.policy.placement.num_gpus=0.35",
                             "ppo.critic.placement.num_gpus=0.2", "ppo.generation.placement.num_gpus=0.35",
                             "ppo.reference.placement.num_gpus=0.1", "ppo.generation.vllm.gpu_memory_utilization=0.3"],
    "smollm2-descriptions.yaml": ["sft.placement.num_gpus=1", "rm.placement.num_gpus=1",
                                  "ppo.policy.placement.num_gpus=0.35", "ppo.critic.placement.num_gpus=0.2",
                                  "ppo.generation.placement.num_gpus=0.35", "ppo.reference.placement.num_gpus=0.05",
                                  "ppo.reward.placement.num_gpus=0.05",
                                  "ppo.generation.vllm.gpu_memory_utilization=0.3"],
    "smollm2-pipeline.yaml": ["sft.placement.num_gpus=1", "rm.placement.num_gpus=1",
                              "ppo.policy.placement.num_gpus=0.35", "ppo.critic.placement.num_gpus=0.2",
                              "ppo.generation.placement.num_gpus=0.35", "ppo.reference.placement.num_gpus=0.05",
                              "ppo.reward.placement.num_gpus=0.05", "ppo.generation.vllm.gpu_memory_utilization=0.3"],
}


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_every_shipped_config_loads(path):
    load_job(path)


@pytest.mark.parametrize("name", sorted(ONE_GPU))
def test_smollm2_recipes_fit_two_cores_and_one_gpu_unchanged_but_for_placement(name):
    path = ROOT / "configs/recipes" / name
    cpu = ResourcePlan.from_roles(load_job(path).placement_roles())
    assert cpu.check_fits([{"CPU": 2.0}]) == []
    gpu = ResourcePlan.from_roles(load_job(path, ONE_GPU[name]).placement_roles())
    assert gpu.check_fits([{"CPU": 16.0, "GPU": 1.0}]) == []
    assert gpu.check_fits([{"CPU": 16.0}]) != []  # the GPU placements do ask for the GPU
