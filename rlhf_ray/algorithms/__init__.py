"""rlhf_ray.algorithms"""
