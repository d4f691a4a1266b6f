"""Decoder-only transformer: GPT-2 style or LLaMA style, FP8 block linears at O1-O3.

Shape suffixes: B batch, L sequence length, D d_model, V vocabulary.

The embedding and the LM head stay in ``cfg.dtype`` unless ``fp8_lm_head``: the head's output
feeds the softmax directly (DeepSeek-V3 keeps it in high precision, and so does the torchao
float8 reference of benchmarks/torch_reference.py).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp8jax import _timing
from fp8jax.models import head_loss
from fp8jax.models.config import REMAT_POLICIES, ModelConfig
from fp8jax.models.decode import CACHE
from fp8jax.models.layers import (
    FLAX_FP8,
    Block,
    constrain,
    fp8_cls,
    norm,
    promote_for,
    segment_mask,
)
from fp8jax.models.moe import MOE_LOSSES, MOE_METRICS, MOE_STATE
from fp8jax.models.params import normal_init
from fp8jax.nn.state import FP8, FP8_STATS, FP8_WEIGHTS
from fp8jax.parallel import layerwise

__all__ = [
    "HeadKernel",
    "Transformer",
    "abstract_variables",
    "build_model",
    "tie_grads",
]


@jax.custom_vjp
def tie_grads(x, params):
    """Identity on ``(x, params)``; its backward releases both cotangents together."""
    return x, params


def _tie_fwd(x, params):
    return (x, params), None


def _tie_bwd(_, cts):
    # A block's input gradient (what the block below needs) leaves only together with the
    # block's weight gradients. Beside collectives, XLA:GPU's latency-hiding scheduler moved
    # every weight-gradient GEMM to the end of the backward pass (gpt_1b3's HLO: 120 of 120),
    # which under remat keeps each block's recomputed activations and output gradient alive
    # (the temp memory it saves: docs/performance.md).
    return jax.lax.optimization_barrier(cts)


tie_grads.defvjp(_tie_fwd, _tie_bwd)


class Transformer(nn.Module):
    """``tokens [B, L] int32 -> logits [B, L, V] float32``, or with ``targets_BxL`` each
    target's cross entropy float32 [B, L] (the head's logits never leave the model), or with
    ``loss_weights_BxL`` too ``(cross entropy [B, L], sum(weights * cross entropy))``: a loss to
    differentiate (the cross entropy comes back without a gradient).

    ``positions_BxL`` (default ``0..L-1`` in every row) place each token for RoPE or the learned
    position table; ``segment_ids_BxL`` (packed examples, one id per example) keep attention
    within an example. With ``cfg.loss_chunk`` > 0 the cross entropy runs the head over that
    many tokens at a time (``head_loss.chunked_cross_entropy``): no [B, L, V] logits in the
    forward or backward pass; with the weights, each chunk's gradient is formed where its
    logits are (``head_loss.weighted_cross_entropy``), so the head's GEMM runs once.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens_BxL: jax.Array,
        positions_BxL: jax.Array | None = None,
        segment_ids_BxL: jax.Array | None = None,
        targets_BxL: jax.Array | None = None,
        loss_weights_BxL: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        c = self.cfg
        if loss_weights_BxL is not None and targets_BxL is None:
            raise ValueError("loss_weights_BxL weighs targets: pass targets_BxL with them")
        default_positions = positions_BxL is None
        if default_positions:
            positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
        embed = nn.Embed(
            c.vocab_size,
            c.d_model,
            embedding_init=normal_init(("vocab", "embed")),
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            name="embed",
        )
        x_BxLxD = embed(tokens_BxL)
        if c.family.positions == "learned":
            pos_table = self.param(
                "pos_embed", normal_init((None, "embed")), (c.max_len, c.d_model), c.param_dtype
            )
            if default_positions:  # a slice, not a gather (and a scatter in the backward)
                pos_LxD = pos_table[: tokens_BxL.shape[1]]
            else:
                pos_LxD = jnp.take(pos_table, positions_BxL, axis=0)
            x_BxLxD = x_BxLxD + pos_LxD.astype(c.dtype)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "embed"))
        x_BxLxD = self._blocks(x_BxLxD, positions_BxL, segment_mask(segment_ids_BxL))
        x_BxLxD = norm(c, "final_norm")(x_BxLxD)
        if targets_BxL is not None and c.loss_chunk > 0:
            return self._chunked_loss(x_BxLxD, embed, targets_BxL, loss_weights_BxL)
        logits_BxLxV = self._head(x_BxLxD, embed)
        # Logits come out of the GEMM in cfg.dtype (bf16 backward GEMMs, half the memory of an
        # f32 product) and are upcast here, so the loss and its softmax run in f32.
        logits_BxLxV = constrain(logits_BxLxV.astype(jnp.float32), ("batch", "length", "vocab"))
        if targets_BxL is None:
            return logits_BxLxV
        ce_BxL = head_loss.token_cross_entropy(logits_BxLxV, targets_BxL)
        if loss_weights_BxL is None:
            return ce_BxL
        total = jnp.sum(ce_BxL * loss_weights_BxL.astype(jnp.float32))
        return jax.lax.stop_gradient(ce_BxL), total

    def _block_cls(self, name: str):
        """The block class for scope ``name``: remat'd as configured, its params gathered inside
        the remat region when the step gathers per layer (``parallel.layerwise``)."""
        c = self.cfg
        block = Block
        view = None if self.is_initializing() else layerwise.block_view(name)
        if view is not None:
            block = nn.map_variables(Block, "params", view)
        if c.remat_policy != "none":
            # prevent_cse stops XLA from merging the recomputation back into the forward pass;
            # scan already prevents that, and the guard would only cost speed there.
            block = nn.remat(
                block, policy=REMAT_POLICIES[c.remat_policy], prevent_cse=not c.scan_layers
            )
        return block

    def _blocks(self, x_BxLxD: jax.Array, positions_BxL, mask_Bx1xLxL) -> jax.Array:
        c = self.cfg
        if c.scan_layers:
            # One compiled block; params, FP8 scale state, the FP8 health stats and the MoE
            # losses, metrics and balancing bias of each layer get a leading layer axis.
            stack = nn.scan(
                self._block_cls("blocks"),
                variable_axes={
                    **dict.fromkeys(("params", FP8, FP8_STATS, FLAX_FP8, CACHE, FP8_WEIGHTS), 0),
                    **dict.fromkeys((MOE_LOSSES, MOE_METRICS, MOE_STATE), 0),
                },
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=c.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x_BxLxD, _ = stack(c, name="blocks")(x_BxLxD, positions_BxL, mask_Bx1xLxL)
            return x_BxLxD
        tie = c.tie_block_grads and c.remat_policy != "none" and not self.is_initializing()
        for i in range(c.num_layers):
            block = self._block_cls(f"block_{i}")
            if not tie:
                x_BxLxD, _ = block(c, name=f"block_{i}")(x_BxLxD, positions_BxL, mask_Bx1xLxL)
                continue
            # map_variables hands the block's params to tie_in before the block runs; tie_in
            # ties them to the block's input, which the block then reads from the box (a
            # one-element list, a pytree the lifted call passes through).
            box = [x_BxLxD]

            def tie_in(params, box=box):
                box[0], params = tie_grads(box[0], params)
                return params

            tied = nn.map_variables(block, "params", tie_in)(c, name=f"block_{i}")
            x_BxLxD, _ = tied(box, positions_BxL, mask_Bx1xLxL)
        return x_BxLxD

    def _head(self, x_BxLxD: jax.Array, embed: nn.Embed) -> jax.Array:
        c = self.cfg
        # The head's FP8 state must live where the blocks' does (flax's op: its own collection).
        head_cls = fp8_cls(c) if c.fp8_lm_head else None
        if not c.tie_embeddings:
            head = nn.Dense(
                c.vocab_size,
                use_bias=False,
                dtype=c.dtype,
                param_dtype=c.param_dtype,
                kernel_init=normal_init(("embed", "vocab")),
                promote_dtype=promote_for(c, head_cls),
                dot_general_cls=head_cls,
                name="head",
            )
            return head(x_BxLxD)
        # Tied: contract D with the embedding table [V, D] in place (no transposed copy).
        table_VxD = embed.embedding.astype(c.dtype)
        dims = (((x_BxLxD.ndim - 1,), (1,)), ((), ()))
        if head_cls:
            return head_cls(name="head")(x_BxLxD.astype(c.dtype), table_VxD, dims)
        return jax.lax.dot_general(x_BxLxD.astype(c.dtype), table_VxD, dims)

    def _chunked_loss(self, x_BxLxD, embed: nn.Embed, targets_BxL, weights_BxL):
        c = self.cfg
        if c.fp8_lm_head:  # spec.parse refuses this pairing; library users get the same line
            raise ValueError(
                "model.loss_chunk > 0 needs model.fp8_lm_head=False: the chunked loss runs the "
                "LM head in the compute dtype"
            )
        if c.tie_embeddings:
            w, w_d = embed.embedding, 1  # [V, D]
        else:
            w, w_d = HeadKernel(c, name="head")(), 0  # [D, V], nn.Dense's 'head' kernel
        b, length, d = x_BxLxD.shape
        x_NxD, t_N = x_BxLxD.reshape(b * length, d), targets_BxL.reshape(-1)
        if weights_BxL is None:
            ce_N = head_loss.chunked_cross_entropy(x_NxD, w, t_N, c.loss_chunk, c.dtype, w_d)
            return ce_N.reshape(b, length)
        ce_N, total = head_loss.weighted_cross_entropy(
            x_NxD, w, t_N, weights_BxL.reshape(-1), c.loss_chunk, c.dtype, w_d
        )
        return ce_N.reshape(b, length), total


class HeadKernel(nn.Module):
    """The untied LM head's kernel [D, V]: the parameter that ``nn.Dense`` 'head' creates (same
    path, shape, initializer), for the chunked loss, which reads it without the Dense."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self) -> jax.Array:
        c = self.cfg
        shape = (c.d_model, c.vocab_size)
        return self.param("kernel", normal_init(("embed", "vocab")), shape, c.param_dtype)


def build_model(model_cfg: ModelConfig) -> Transformer:
    """The transformer ``model_cfg`` describes (``spec.parse(config).model`` for a config)."""
    return Transformer(model_cfg)


def abstract_variables(model_cfg: ModelConfig) -> dict:
    """Every variable collection of the model ``model_cfg`` describes (params, FP8 state, router
    biases...) as unboxed ``jax.ShapeDtypeStruct``s: nothing allocated, traced once per config."""
    return jax.tree.map(lambda s: s, _traced_variables(model_cfg))  # a copy the caller may edit


# One trace per config, also when two threads ask for it at once; two configs trace side by
# side (a checkpoint's load traces its params while a compile thread traces the FP8 model).
_TRACING: dict[ModelConfig, threading.Lock] = {}
_TRACING_LOCK = threading.Lock()


def _traced_variables(model_cfg: ModelConfig) -> dict:
    with _TRACING_LOCK:
        lock = _TRACING.setdefault(model_cfg, threading.Lock())
    with lock:
        return _trace_variables(model_cfg)


@functools.lru_cache(maxsize=16)
def _trace_variables(model_cfg: ModelConfig) -> dict:
    # Tracing an unrolled deep model's init takes seconds (each FP8 matmul's custom VJP): a
    # checkpoint's load asks for its params, FP8 state and router biases, each from this trace.
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    model = build_model(model_cfg)
    with _timing.stage("trace"):
        return nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens))
