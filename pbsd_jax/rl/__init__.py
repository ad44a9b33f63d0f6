"""Reinforcement learning: likelihoods, the PBSD credit, algorithms, the learner."""
