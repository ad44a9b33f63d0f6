"""Running: the run configuration, the loop, the task, checkpoints, the CLI."""
