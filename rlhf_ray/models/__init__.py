"""rlhf_ray.models"""
