"""The device mesh and the one table from logical axes to mesh axes."""
