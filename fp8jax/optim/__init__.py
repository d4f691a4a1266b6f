"""Optimizer: FP8/FP16 Adam moments and FP16 master weights, per FP8-LM level."""
