"""rlhf_ray.data"""
