"""Multi-turn rollouts: environments a policy talks to over several turns (tools, games, checkers)."""
