"""Data: the synthetic knowledge graph, its corpus and questions, oracle trajectories, seqio
tasks. This is the only package that may import TensorFlow (through seqio)."""
