"""The trainer: loop, train step, checkpoints, data and metrics."""
