"""rlhf_ray.actors"""
