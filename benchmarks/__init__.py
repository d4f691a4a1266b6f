"""fp8jax's benchmarks, each run from the repository root as ``python -m benchmarks.<name>``.

``benchmarks.runner`` holds what they share: run specs and config overrides, child processes,
JSON output and the printed table; ``benchmarks.common`` the measurement helpers (HLO text,
traces, power samples). Importing this package imports neither jax nor fp8jax, so the PyTorch
reference runs without them.
"""
