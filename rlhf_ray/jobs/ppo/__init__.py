"""The PPO job (and GRPO, RLOO, REINFORCE++): job.py checks and places it, trainer.py is the loop

    for step in range(start, iterations):
        experience = rollouts.take(version)     # rollouts generated, scored and buffered ahead as the mode allows
        trained    = workers.train(experience)  # PPO epochs on policy and critic
        weights.sync()                          # the engines get the new policy: version + 1
        log, evaluate, checkpoint

and each part it calls owns its state: workers.py (the actor groups), rollouts.py (the feed into the replay
buffer), weight_sync.py, evaluation.py; iteration_metrics.py builds each metrics line."""

from rlhf_ray.jobs.ppo.job import run_ppo

__all__ = ["run_ppo"]
