"""Evaluation: accuracy, pass@k, tiers, metric log, report and results."""
