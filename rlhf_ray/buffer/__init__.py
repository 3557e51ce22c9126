"""rlhf_ray.buffer"""
