"""The PPO job (and GRPO, RLOO, REINFORCE++): job.py checks and places it, trainer.py is the loop

    for step in range(start, iterations):
        for rollout in rollouts.generated():            # sync: one; async: as far ahead as the mode allows
            scores = scorer.score(rollout)               # reward, reference and old log-probs, values
            experience = scorer.advantages(scores)       # advantages and returns (algorithms/advantages.py)
            rollouts.put(experience)                     # into the replay buffer
        taken = rollouts.take(version)                   # the oldest fresh experience
        trained = workers.train(taken)                   # PPO epochs on policy and critic
        weights.sync()                                   # the engines get the new policy: version + 1
        log, evaluate, checkpoint

and each part it calls owns its state: workers.py (the actor groups), scoring.py, rollouts.py (the rollouts in
flight and the replay buffer), weight_sync.py, evaluation.py; iteration_metrics.py builds each metrics line."""

from rlhf_ray.jobs.ppo.job import run_ppo

__all__ = ["run_ppo"]
