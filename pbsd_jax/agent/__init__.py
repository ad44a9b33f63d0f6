"""The search agent: the environment's rules, retrievers, prompts and the rollout."""
