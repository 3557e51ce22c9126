"""DeepSpeed ZeRO learner groups: one Ray actor per data-parallel rank, all called together."""
