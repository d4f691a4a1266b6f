"""Parallelism: the device mesh and shardings, FP8 gradient reduction, FP8 weight all-gather."""
