"""pbsd_jax: multi-turn search agents trained with RL and PBSD (Privileged Bayesian
Self-Distillation), in JAX/Flax."""

__version__ = "0.1.0"
