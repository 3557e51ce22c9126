"""rlhf_ray.learners"""
