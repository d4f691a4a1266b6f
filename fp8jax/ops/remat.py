"""Names of the FP8 matmuls' residuals, and the remat policies that save them by name.

The FP8 matmuls (``dot.dot_general``, ``mlp.gelu_mlp``, ``fine.fine_matmul``) are custom VJPs.
Their forward rules tag what the backward reads with ``jax.ad_checkpoint.checkpoint_name``, so a
``jax.checkpoint`` (``nn.remat``) policy around them can choose to keep it instead of
recomputing it. Names inside a custom VJP's forward rule reach the enclosing policy: JAX inlines
the forward rule when it differentiates under ``jax.checkpoint``, and the policy sees each
``name`` like any other equation. Outside the forward rule only the matmul's output exists;
the FP8 operands never leave the custom VJP, so this is the only place they can be named.

``jax.checkpoint_policies.dots_saveable`` sees the FP8 ``lax.dot_general`` of the per-tensor
and rowwise recipes (it keeps their raw outputs) but never the FP8 operands, so the backward
re-quantizes x and w (and recomputes whatever produced x); it does not see the block recipe's
GEMM on GPUs at all (a Pallas kernel, not a ``dot_general``). The names here do not depend on
how a GEMM is lowered.

Three names come from the model rather than the matmuls: ``ATTENTION`` (attention's residuals,
``ops.attention``), ``HIDDEN`` (the MLP's first GEMM output, at any level) and ``RESIDUAL`` (the
residual stream between a block's attention and its MLP). With ``FP8_OUT`` (the fused MLP's
hidden output) they name every activation a block's backward pass reads, which is what
``activations_saveable`` keeps.

Build your own policy with ``jax.checkpoint_policies.save_only_these_names(FP8_X, ...)``.
"""

from __future__ import annotations

import jax

__all__ = [
    "ACTIVATION_NAMES",
    "ATTENTION",
    "FP8_OUT",
    "GATHERED",
    "HIDDEN",
    "KEPT_OPERANDS",
    "FP8_W",
    "FP8_X",
    "NAMES",
    "NORM_STATS",
    "POLICIES",
    "RESIDUAL",
    "activations_and_weights_saveable",
    "activations_saveable",
    "fp8_dots_and_inputs_saveable",
    "fp8_dots_saveable",
    "fp8_inputs_saveable",
    "full_keep_gathered",
]

# x's E4M3 copy in the layout the weight-gradient GEMM reads (1 byte per element of the
# activation), with its f32 scales: one per tensor, row or tile, by recipe.
FP8_X = "fp8jax_x_e4m3"
# w's E4M3 copy in the layout the input-gradient GEMM reads (1 byte per weight, per use), with
# its f32 scales. Saving it costs a weight-sized buffer per layer; recomputing it is one cast
# pass over the weight.
FP8_W = "fp8jax_w_e4m3"
# The FP8 GEMM's forward output in the matmul's output dtype (the fused MLP: its first GEMM's
# raw output, which the second GEMM's cast and GELU' read): what ``dots_saveable`` keeps of a
# plain matmul.
FP8_OUT = "fp8jax_gemm_out"
NAMES = (FP8_X, FP8_W, FP8_OUT)
# A weight all-gathered over fsdp where its layer runs (``parallel.layerwise``), in the compute
# dtype: saved, the backward pass reads it instead of gathering it again.
GATHERED = "fp8jax_gathered"
# Attention's backward residuals (q, k, v, its output and softmax statistics: ops.attention) and
# its output, the o projection's input.
ATTENTION = "fp8jax_attention"
# The MLP's first GEMM output (its pre-activation, or SwiGLU's gate and up), any level.
HIDDEN = "fp8jax_hidden"
# The residual stream after a block's attention, the input of its MLP's norm.
RESIDUAL = "fp8jax_residual"
# A LayerNorm's f32 row statistics (mean, 1/std) where the norm is folded into the next FP8
# matmul's cast (``ops.norm``): 8 bytes per token and norm.
NORM_STATS = "fp8jax_norm_stats"

_cp = jax.checkpoint_policies

# Plain dots' outputs (O0, attention's einsums) plus the FP8 GEMMs' outputs: dots_saveable at
# every level and for every recipe. The backward re-quantizes x and w from recomputed inputs.
fp8_dots_saveable = _cp.save_from_both_policies(
    _cp.dots_saveable, _cp.save_only_these_names(FP8_OUT)
)
# The FP8 operands only (x and w in E4M3, 1 byte per element): the backward GEMMs read them
# as saved, nothing is re-quantized for them; a forward GEMM whose output the backward needs
# (q, k, v; the MLP's hidden layer) is recomputed. No plain dots saved: at O0 this is 'full'.
fp8_inputs_saveable = _cp.save_only_these_names(FP8_X, FP8_W)
# Both: the FP8 operands and every GEMM output (FP8 and plain). The backward recomputes only
# elementwise work (norms, activations, softmax) and no matmul.
fp8_dots_and_inputs_saveable = _cp.save_from_both_policies(
    fp8_dots_saveable, _cp.save_only_these_names(FP8_X, FP8_W)
)
# Recompute the whole block but keep its gathered weights (per-layer fsdp gathers): one gather
# per layer and step instead of two, for a layer's weights held from its forward to its backward.
full_keep_gathered = _cp.save_only_these_names(GATHERED)
# Every activation the block's backward reads (the MLP's hidden layer, attention's residuals, the
# residual stream and folded norms' statistics; FP8_OUT: the fused MLP's hidden layer) and no
# FP8 operand: the backward pass re-applies the norms (a folded norm inside the cast that
# rebuilds its output) and casts x and w to E4M3 again (the same scales, so the same bits; one
# layout each: the models' matmuls ``rebuild`` under it); no GEMM or attention forward again.
ACTIVATION_NAMES = (FP8_OUT, ATTENTION, HIDDEN, RESIDUAL, NORM_STATS)
activations_saveable = _cp.save_only_these_names(*ACTIVATION_NAMES)
# The same plus the weights' E4M3 copies in the layout dgrad reads (1 byte per weight and
# layer): the backward re-casts x only, not the f32 masters (4 bytes read per weight).
activations_and_weights_saveable = _cp.save_only_these_names(*ACTIVATION_NAMES, FP8_W)
POLICIES = {
    "activations_saveable": activations_saveable,
    "activations_and_weights_saveable": activations_and_weights_saveable,
    "fp8_dots_saveable": fp8_dots_saveable,
    "fp8_inputs_saveable": fp8_inputs_saveable,
    "fp8_dots_and_inputs_saveable": fp8_dots_and_inputs_saveable,
}
# The FP8 operands ('x': FP8_X, 'w': FP8_W) each block policy keeps for the backward; a policy
# not named here keeps none, and the matmuls cast those again (``gemm.GemmConfig.rebuild``).
KEPT_OPERANDS = {
    "fp8_inputs_saveable": "xw",
    "fp8_dots_and_inputs_saveable": "xw",
    "activations_and_weights_saveable": "w",
}
