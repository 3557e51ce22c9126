"""Pure torch math of RLHF (losses, log-probs, advantages). No Ray, no DeepSpeed: golden-tested in isolation."""
