"""rlhf_ray: RLHF (SFT -> reward model -> PPO) as a Ray actor/learner service."""

__version__ = "0.1.0"
