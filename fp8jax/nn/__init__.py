"""Flax integration: linen and NNX FP8 layers and the ``fp8_state`` collection helpers."""
