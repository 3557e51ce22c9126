"""rlhf_ray.jobs"""
