"""Transformer block pieces: attention (MHA/GQA, RoPE), MLP (GELU/SwiGLU), pre-norm block.

Shape suffixes: B batch, L sequence length, D d_model, N query heads, K key/value heads,
H head dim, F MLP hidden width, 2 a fused pair (key/value, or SwiGLU gate/up).

FP8: every block linear is an ``nn.DenseGeneral`` whose ``dot_general_cls`` is the FP8 core
when ``cfg.recipe`` is set (O1-O3): E4M3 x and W forward, E5M2 dy backward, per-tensor scales
in the ``fp8_state`` collection; GPT's MLP (``ops.mlp``) and the fused Q/K/V projection
(``ops.qkv``) run as one custom VJP each on the same params and state. Norms, RoPE, softmax and
residual adds stay in ``cfg.dtype`` (reductions in f32), since FP8-LM converts only the matmul
weights of linear layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax.ad_checkpoint import checkpoint_name

from fp8jax.models import decode
from fp8jax.models.config import ModelConfig
from fp8jax.models.params import (
    INIT_STD,
    FusedLinear,
    NormParams,
    bias_init,
    norm_scale_init,
    normal_init,
)
from fp8jax.models.rope import rope
from fp8jax.nn.linen import fp8_dot_general_cls, keep_kernel_dtype
from fp8jax.nn.state import FP8_STATS
from fp8jax.ops import attention as fp8_attention
from fp8jax.ops import mlp as fp8_mlp
from fp8jax.ops import qkv as fp8_qkv
from fp8jax.ops import remat as fp8_remat
from fp8jax.ops.act_dot import act_dot_general
from fp8jax.parallel.sharding import constrain  # inert unless a step binds a mesh

__all__ = [
    "FLAX_FP8",
    "MLP_MODULES",
    "Attention",
    "Block",
    "Mlp",
    "constrain",
    "dense",
    "folds_norm",
    "fp8_cls",
    "fuses_activation",
    "fuses_mlp",
    "fuses_qkv",
    "norm",
    "promote_for",
    "rebuilds_operands",
    "recomputes_elementwise",
    "segment_mask",
]

# The collection of flax's own FP8 ops (fp8_impl='flax'): the gradient of its variables is their
# new value.
FLAX_FP8 = OVERWRITE_WITH_GRADIENT


def fp8_cls(cfg: ModelConfig, prologue: str | None = None):
    """The model's FP8 ``dot_general_cls`` (None at O0): fp8jax's, or flax's for comparison."""
    if not cfg.recipe:
        return None
    if cfg.fp8_impl == "flax":
        return nn.Fp8DirectDotGeneralOp  # flax's op: the comparison benchmark's
    return fp8_dot_general_cls(
        cfg.recipe,
        cast_kernel=cfg.cast_kernel,
        prologue=prologue,
        out_dtype=cfg.dtype,
        rebuild=rebuilds_operands(cfg),
    )


def promote_for(cfg: ModelConfig, fp8_cls_) -> Callable:
    """A linear's ``promote_dtype``: fp8jax's FP8 cast reads the kernel as stored (f32 masters
    straight to E4M3, no bf16 copy first); everything else promotes as flax does."""
    if fp8_cls_ is not None and cfg.fp8_impl == "fp8jax":
        return keep_kernel_dtype
    return nn.dtypes.promote_dtype


def fuses_activation(cfg: ModelConfig) -> bool:
    """Whether the GELU MLP hands its pre-activation to ``wo``'s FP8 cast (fp8jax's op only)."""
    return bool(cfg.recipe) and cfg.fp8_impl == "fp8jax" and cfg.fuse_activation


def fuses_mlp(cfg: ModelConfig) -> bool:
    """Whether GPT's MLP runs as one FP8 custom VJP (``fp8jax.ops.mlp``, ``fp8.fuse_mlp``).

    Only where a VJP applies (delayed scaling or a fine recipe, the fused cast kernels):
    elsewhere, as where ``train.partitionable`` picks XLA's casts for SPMD, the two-matmul path
    keeps its activation sharding constraint.
    """
    recipe_fuses = bool(cfg.recipe) and cfg.recipe.fuses_mlp
    fusable = cfg.cast_kernel != "xla" and recipe_fuses and cfg.family.mlp == "gelu"
    return fuses_activation(cfg) and cfg.fuse_mlp and fusable


def fuses_qkv(cfg: ModelConfig) -> bool:
    """Whether the fused Q/K/V projection runs as one FP8 custom VJP (``fp8jax.ops.qkv``,
    ``fp8.fuse_qkv``): delayed scaling and the fused cast kernels only, as ``fuses_mlp``."""
    fusable = cfg.cast_kernel != "xla" and bool(cfg.recipe) and cfg.recipe.scales_known_ahead
    return cfg.fused_qkv and cfg.fuse_qkv and cfg.fp8_impl == "fp8jax" and fusable


def folds_norm(cfg: ModelConfig, fused: Callable[[ModelConfig], bool]) -> bool:
    """Whether GPT's LayerNorm before the op that ``fused`` (``fuses_qkv``, ``fuses_mlp``)
    tells about is folded into that op's E4M3 cast (``fp8.fuse_norm``, ``ops.norm``).

    Only where the backward casts x again (``rebuilds_operands``: a remat policy that keeps
    no E4M3 copy of it), where the fold spares a norm pass per rebuild. Without remat the
    step measured the same speed folded and 0.69 GiB more peak (gpt_1b3 O1, docs/kernels.md).
    """
    layer_norm = cfg.family.norm == "layernorm"
    return cfg.fuse_norm and layer_norm and fused(cfg) and "x" in rebuilds_operands(cfg)


def recomputes_elementwise(cfg: ModelConfig) -> bool:
    """Whether the MLP's activation is recomputed in the backward pass.

    Only without block remat (``remat_policy='none'``), where autodiff would keep the
    activation's intermediates (GELU's tanh terms, SwiGLU's product) for every layer. The MLP
    then keeps what its matmuls need (the fused FP8 MLP not even wo's FP8 input, rebuilt by its
    cast: ``ops.mlp``; GPT's O0 MLP not GELU's output: ``ops.act_dot``); the backward pass
    redoes a few elementwise passes per layer. The norms are not recomputed: XLA:GPU fuses
    their f32 intermediates into their backward, and under ``nn.remat`` they saved under 0.03
    GiB of gpt_1b3's and llama_1b's peak on an H200 for 0.6-1.7% of the step
    (docs/performance.md).
    """
    return cfg.recompute_elementwise and cfg.remat_policy == "none"


def rebuilds_operands(cfg: ModelConfig) -> str:
    """The operands ('x', 'w', 'xw' or '') the FP8 matmuls cast again in the backward pass
    rather than keep as FP8 copies (``ops.gemm.GemmConfig.rebuild``): those the block remat
    policy does not keep (``ops.remat.KEPT_OPERANDS``; without remat, all are kept). The
    backward would otherwise redo each forward cast (both layouts and the amax) for the one
    layout it reads; the forward then writes only the layout its GEMM reads."""
    if cfg.remat_policy == "none":
        return ""
    kept = fp8_remat.KEPT_OPERANDS.get(cfg.remat_policy, "")
    return "".join(op for op in "xw" if op not in kept)


def dense(
    cfg: ModelConfig,
    features,
    names,
    *,
    axis=-1,
    std=INIT_STD,
    name=None,
    prologue=None,
    use_bias: bool | None = None,
    dot_general: Callable | None = None,
):
    """A linear layer; FP8 when ``cfg.recipe`` is set, else a plain matmul in ``cfg.dtype``.

    ``names`` label the kernel's axes (input axes then ``features``); the bias takes the
    trailing ``len(features)`` names. ``prologue`` (FP8 only) is an activation the layer applies
    to its input inside the FP8 cast. ``use_bias`` defaults to the family's (``cfg.use_bias``).
    ``dot_general`` (O0 only) replaces ``lax.dot_general``.
    """
    features = tuple(features)
    fp8 = fp8_cls(cfg, prologue)
    return nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=cfg.use_bias if use_bias is None else use_bias,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=normal_init(names, std),
        bias_init=bias_init(names[-len(features) :]),
        promote_dtype=promote_for(cfg, fp8),
        dot_general_cls=fp8,
        dot_general=dot_general,
        name=name,
    )


def norm(cfg: ModelConfig, name: str) -> nn.Module:
    """The family's norm: LayerNorm (GPT) or RMSNorm (LLaMA); statistics in f32 whatever
    ``cfg.dtype``."""
    common = dict(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)
    scale_init = norm_scale_init()
    if cfg.family.norm == "layernorm":
        return nn.LayerNorm(scale_init=scale_init, bias_init=bias_init(("norm",)), **common)
    return nn.RMSNorm(scale_init=scale_init, **common)


def segment_mask(segment_ids_BxL: jax.Array | None) -> jax.Array | None:
    """``[B, 1, L, L]`` True where query and key lie in the same packed example, or None."""
    if segment_ids_BxL is None:
        return None
    return (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]


class Attention(nn.Module):
    """Causal self-attention; grouped-query when ``num_kv_heads < num_heads``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        x_BxLxD: jax.Array,
        positions_BxL: jax.Array,
        mask_Bx1xLxL: jax.Array | None = None,
        ln=None,
    ) -> jax.Array:
        """Attention over ``x``; ``mask`` (True = may attend) narrows the causal mask. ``ln``
        (``NormParams``' output): x is the LayerNorm's input, folded into the fused Q/K/V."""
        c = self.cfg
        n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
        bias = c.use_bias or c.qkv_bias
        if c.fused_qkv:
            q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self._qkv(x_BxLxD, ln)
        else:
            q_names = ("embed", "heads", "head_dim")
            q_BxLxNxH = dense(c, (n, h), q_names, name="q", use_bias=bias)(x_BxLxD)
            # K and V share one GEMM: one quantization of x and a wider (faster) FP8 matmul.
            kv_names = ("embed", None, "kv_heads", "head_dim")
            kv_BxLx2xKxH = dense(c, (2, k, h), kv_names, name="kv", use_bias=bias)(x_BxLxD)
            k_BxLxKxH, v_BxLxKxH = kv_BxLx2xKxH[:, :, 0], kv_BxLx2xKxH[:, :, 1]
        if c.qk_norm:  # before RoPE, so the KV cache holds normed keys as attention reads them
            q_BxLxNxH = _qk_norm(c, q_BxLxNxH, "q_norm")
            k_BxLxKxH = _qk_norm(c, k_BxLxKxH, "k_norm")
        if c.family.positions == "rope":
            q_BxLxNxH = rope(q_BxLxNxH, positions_BxL, c.rope_theta, c.rope_scaling)
            k_BxLxKxH = rope(k_BxLxKxH, positions_BxL, c.rope_theta, c.rope_scaling)
        q_BxLxNxH = constrain(q_BxLxNxH, ("batch", "length", "heads", None))
        k_BxLxKxH = constrain(k_BxLxKxH, ("batch", "length", "kv_heads", None))
        v_BxLxKxH = constrain(v_BxLxKxH, ("batch", "length", "kv_heads", None))
        # Attention itself stays in cfg.dtype: cuDNN's FP8 attention is slower fwd+bwd on Hopper.
        if decode.decoding(self):  # generation: this call's keys/values join the cache
            cache = decode.KVCache(c.sliding_window, c.decode_attention, name="cache")
            o_BxLxNxH = cache(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, positions_BxL)
        else:  # over the last c.sliding_window positions where that is set (Mistral)
            o_BxLxNxH = fp8_attention.causal_attention(
                q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask_Bx1xLxL, c.attention_impl, c.sliding_window
            )
        o_BxLxNxH = constrain(o_BxLxNxH, ("batch", "length", "heads", None))
        out = dense(
            c,
            (c.d_model,),
            ("heads", "head_dim", "embed"),
            axis=(-2, -1),
            std=_residual_std(c),
            name="o",
        )
        return out(o_BxLxNxH)

    def _qkv(self, x_BxLxD, ln=None):
        """Q, K and V from one GEMM: one quantization of x, one dgrad, no dx sum."""
        c = self.cfg
        k, g, h = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        # Per key/value head: its g query heads, then K, then V. Query head i = kv * g + j is
        # the grouping dot_product_attention expects, and a 'tensor' split of the kv axis keeps
        # each shard's queries with their keys (the flattened GEMM axis stays contiguous).
        names = ("embed", "kv_heads", None, "head_dim")
        bias = c.use_bias or c.qkv_bias
        # The FP8 health step (FP8_STATS) takes the DenseGeneral path: same forward, same paths.
        if fuses_qkv(c) and not self.is_mutable_collection(FP8_STATS):
            shape = (c.d_model, k, g + 2, h)
            qkv = FusedLinear(c, shape, names, INIT_STD, use_bias=bias, name="qkv")
            w_DxKxG2xH, meta = qkv.Fp8DotGeneral_0(x_BxLxD, qkv.kernel)
            q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, meta = fp8_qkv.qkv_projection(
                x_BxLxD.astype(c.dtype),
                w_DxKxG2xH,  # as stored: the cast reads f32 masters directly
                qkv.bias,
                meta,
                c.cast_kernel,
                rebuilds_operands(c),
                ln,
            )
            qkv.Fp8DotGeneral_0.write(meta)
            return q_BxLxNxH, k_BxLxKxH, v_BxLxKxH
        qkv_BxLxKxG2xH = dense(c, (k, g + 2, h), names, name="qkv", use_bias=bias)(x_BxLxD)
        batch, length = x_BxLxD.shape[:2]
        q_BxLxNxH = qkv_BxLxKxG2xH[:, :, :, :g].reshape(batch, length, k * g, h)
        return q_BxLxNxH, qkv_BxLxKxG2xH[:, :, :, g], qkv_BxLxKxG2xH[:, :, :, g + 1]


class Mlp(nn.Module):
    """The family's MLP: GELU (GPT) or SwiGLU (LLaMA)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, ln=None) -> jax.Array:
        """The MLP of ``x``; ``ln`` (``NormParams``' output): x is the LayerNorm's input, folded
        into the fused MLP."""
        c = self.cfg
        # The FP8 health step (FP8_STATS) takes the two-matmul path: same forward, same paths.
        if fuses_mlp(c) and not self.is_mutable_collection(FP8_STATS):
            return self._fused(x_BxLxD, ln)
        prologue = act = None
        if c.family.mlp == "gelu":
            h_BxLxF = dense(c, (c.d_ff,), ("embed", "mlp"), name="wi")(x_BxLxD)
            h_BxLxF = checkpoint_name(h_BxLxF, fp8_remat.HIDDEN)
            if fuses_activation(c):
                # wo's E4M3 cast applies the GELU itself: act(h) is never written to memory,
                # and the backward pass keeps only h (the pre-activation) for GELU's derivative.
                prologue = "gelu_tanh"
            elif _act_dot_mlp(c):
                act = "gelu_tanh"  # wo applies GELU itself and keeps only h (ops.act_dot)
            else:
                h_BxLxF = nn.gelu(h_BxLxF, approximate=True)  # GPT-2's tanh approximation
            h_BxLxF = constrain(h_BxLxF, ("batch", "length", "mlp"))
        else:
            # Gate and up projections fused: one FP8 quantization of x, one GEMM.
            gu_BxLx2xF = dense(c, (2, c.d_ff), ("embed", None, "mlp"), name="wi")(x_BxLxD)
            gu_BxLx2xF = checkpoint_name(gu_BxLx2xF, fp8_remat.HIDDEN)
            h_BxLxF = nn.silu(gu_BxLx2xF[:, :, 0]) * gu_BxLx2xF[:, :, 1]
            h_BxLxF = constrain(h_BxLxF, ("batch", "length", "mlp"))
        out = dense(
            c,
            (c.d_model,),
            ("mlp", "embed"),
            std=_residual_std(c),
            name="wo",
            prologue=prologue,
            dot_general=None if act is None else act_dot_general(act),
        )
        return out(h_BxLxF)

    def _fused(self, x_BxLxD, ln=None):
        """``fp8jax.ops.mlp.gelu_mlp`` on wi's and wo's params and FP8 state."""
        c = self.cfg
        wi = FusedLinear(c, (c.d_model, c.d_ff), ("embed", "mlp"), INIT_STD, name="wi")
        wo = FusedLinear(c, (c.d_ff, c.d_model), ("mlp", "embed"), _residual_std(c), name="wo")
        x_BxLxD = x_BxLxD.astype(c.dtype)
        # Kernels and bias as stored: the casts read f32 masters directly (no bf16 copy).
        w1_DxF, meta1 = wi.Fp8DotGeneral_0(x_BxLxD, wi.kernel)
        w2_FxD, meta2 = wo.Fp8DotGeneral_0(None, wo.kernel)
        b1_F = wi.bias
        y_BxLxD, meta1, meta2 = fp8_mlp.gelu_mlp(
            x_BxLxD,
            w1_DxF,
            b1_F,
            w2_FxD,
            meta1,
            meta2,
            c.cast_kernel,
            recompute_cast=recomputes_elementwise(c),  # rebuild implies it too (ops.mlp)
            rebuild=rebuilds_operands(c),
            ln=ln,
        )
        wi.Fp8DotGeneral_0.write(meta1)
        wo.Fp8DotGeneral_0.write(meta2)
        return y_BxLxD + jnp.asarray(wo.bias, c.dtype)


class Block(nn.Module):
    """Pre-norm block; returns ``(x, None)`` so ``nn.scan`` can stack it."""

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self, x_BxLxD: jax.Array, positions_BxL: jax.Array, mask_Bx1xLxL: jax.Array | None
    ) -> tuple[jax.Array, None]:
        c = self.cfg
        if isinstance(x_BxLxD, list):  # Transformer._blocks' tied input
            (x_BxLxD,) = x_BxLxD
        attn = Attention(c, name="attn")
        h_BxLxD, ln = self._norm(x_BxLxD, "attn_norm", fuses_qkv)
        x_BxLxD = x_BxLxD + attn(h_BxLxD, positions_BxL, mask_Bx1xLxL, ln=ln)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "embed"))
        # Named for remat policies (ops.remat): the MLP norm's input, which its backward reads.
        x_BxLxD = checkpoint_name(x_BxLxD, fp8_remat.RESIDUAL)
        mlp = _mlp_cls(c)(c, name="mlp")
        h_BxLxD, ln = self._norm(x_BxLxD, "mlp_norm", fuses_mlp)
        x_BxLxD = x_BxLxD + mlp(h_BxLxD, ln=ln)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "embed"))
        return x_BxLxD, None

    def _norm(self, x_BxLxD, name: str, fused: Callable[[ModelConfig], bool]):
        """``(the norm's output, None)``, or ``(x, NormParams' output)`` where the op that
        ``fused`` tells about folds the norm into its E4M3 cast (``folds_norm``). The FP8
        health step (FP8_STATS) runs the unfused ops: the norms as modules."""
        c = self.cfg
        if folds_norm(c, fused) and not self.is_mutable_collection(FP8_STATS):
            return x_BxLxD, NormParams(c, name=name)()
        return norm(c, name)(x_BxLxD), None


def _act_dot_mlp(cfg: ModelConfig) -> bool:
    """Whether GPT's O0 MLP recomputes GELU through ``ops.act_dot`` (wo keeps h, not GELU(h)).

    LLaMA's SwiGLU takes ``_mlp_cls``' remat instead: through the same op it measured more
    peak memory at no more speed (docs/performance.md).
    """
    return recomputes_elementwise(cfg) and cfg.recipe is None and cfg.family.mlp == "gelu"


# Block kind (MLPS) -> the module at the block's ``mlp`` scope, called ``(x_BxLxD, ln=None)``;
# a kind's own module registers itself here (``models.moe``: 'moe').
MLP_MODULES: dict[str, type[nn.Module]] = {"gelu": Mlp, "swiglu": Mlp}


def _mlp_cls(cfg: ModelConfig) -> type[nn.Module]:
    """The family's MLP module (``MLP_MODULES``); ``Mlp`` recomputing its activation in the
    backward pass under ``nn.remat`` where ``recomputes_elementwise``.

    GPT's fused FP8 MLP and GPT's O0 MLP (``ops.act_dot``) keep only the pre-activation
    themselves. Otherwise the policy keeps the matmuls' outputs (and, at O1+, their E4M3
    operands: ``ops.remat``) and drops the activation's intermediates, which the backward
    pass recomputes from the first output.
    """
    module = MLP_MODULES[cfg.family.mlp]
    if module is not Mlp or not recomputes_elementwise(cfg) or fuses_mlp(cfg) or _act_dot_mlp(cfg):
        return module
    if cfg.recipe is None:
        return nn.remat(Mlp, policy=jax.checkpoint_policies.dots_saveable)
    return nn.remat(Mlp, policy=fp8_remat.fp8_dots_and_inputs_saveable)


def _qk_norm(cfg: ModelConfig, x_BxLxHeadsxH: jax.Array, name: str) -> jax.Array:
    """RMSNorm of queries or keys (``cfg.qk_norm``): over each head's H values with a scale
    [H] shared by the heads ('head', Qwen3), or over all heads' values with a scale [heads * H]
    ('full', OLMoE). Statistics in f32, as the block's norms."""
    rms = nn.RMSNorm(
        epsilon=cfg.norm_eps,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        scale_init=norm_scale_init(),
        name=name,
    )
    if cfg.qk_norm == "head":
        return rms(x_BxLxHeadsxH)
    batch, length, heads, h = x_BxLxHeadsxH.shape
    return rms(x_BxLxHeadsxH.reshape(batch, length, heads * h)).reshape(x_BxLxHeadsxH.shape)


def _residual_std(cfg: ModelConfig) -> float:
    # GPT-2: projections into the residual stream are scaled by 1/sqrt(2 * layers) so the
    # stream's variance does not grow with depth.
    return INIT_STD / math.sqrt(2 * cfg.num_layers)
