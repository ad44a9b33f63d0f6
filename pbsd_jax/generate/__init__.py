"""Sampling from the model: prefill, append, decode loop, stop strings on device."""
