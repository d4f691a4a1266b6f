"""FP8 ops: formats, scaling recipes, fused cast kernels, the FP8 ``dot_general`` and fused MLP."""
