"""Flax NNX integration: ``nnx.Linear(..., dot_general=Fp8DotGeneral())``, FP8 ``nnx.Einsum`` and
FP8 ``ragged_dot`` (``Fp8RaggedDot``) for expert layers.

Each FP8 matmul keeps its ``Fp8Meta`` in an ``Fp8State`` variable and writes the updated meta
back on every call, so repeated uses of one module chain and the amax merges by max. The
backward pass returns the dy amax as the "gradient" of that variable. Train step::

    def loss_fn(model):
        return loss(model(x), y)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=fp8jax.nn.nnx.diff_state())(model)
    param_grads, fp8_grads = fp8jax.nn.nnx.split_grads(grads)
    optimizer.update(model, param_grads)          # the optimizer never sees fp8_grads
    fp8jax.nn.nnx.update_fp8_state(model, fp8_grads)  # merge dy amax, roll history, rescale

With gradient accumulation call ``merge_fp8_grads`` per micro-batch and ``commit_fp8_state``
once per step. ``model.eval()`` stops amax recording (like BatchNorm's running statistics).
"""

from __future__ import annotations

from flax import nnx

from fp8jax.nn import state
from fp8jax.ops import activations, dot, grouped, kernels, scaling
from fp8jax.recipes import DelayedScaling

__all__ = [
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Fp8RaggedDot",
    "Fp8State",
    "commit_fp8_state",
    "diff_state",
    "merge_fp8_grads",
    "split_grads",
    "update_fp8_state",
]

_DEFAULT_RECIPE = DelayedScaling()


class Fp8State(nnx.Variable):
    """Scale state (an ``Fp8Meta``) of one FP8 matmul; updated by ``update_fp8_state``, not SGD."""


class _Fp8Op(nnx.Module):
    """Shared state handling of the NNX FP8 callables."""

    def __init__(
        self,
        recipe: scaling.Recipe = _DEFAULT_RECIPE,
        w_recipe: scaling.Recipe | None = None,
        *,
        use_running_average: bool = False,
        cast_kernel: str = kernels.AUTO,
        prologue: str | None = None,
    ):
        self.meta = Fp8State(scaling.init_meta(recipe, w_recipe))
        # How operands are quantized: 'auto' (the fused cast+transpose kernel on GPUs, XLA ops
        # elsewhere, resolved when traced), 'xla', 'pallas' or 'interpret' (fp8jax.ops.kernels).
        self.cast_kernel = kernels.check_impl(cast_kernel)
        # An activation applied to lhs inside its quantization ('gelu_tanh'; None: plain lhs).
        activations.activation(prologue)
        self.prologue = prologue
        # True (set by model.eval()): use the stored scales and record no amax, so evaluation
        # batches never leak into the next training step's scales.
        self.use_running_average = use_running_average

    def _write(self, new_meta: scaling.Fp8Meta) -> None:
        if not self.use_running_average:
            self.meta.set_value(new_meta)


class Fp8DotGeneral(_Fp8Op):
    """FP8 ``dot_general`` for ``nnx.Linear``/``nnx.LinearGeneral`` (pass as ``dot_general=``)."""

    def __call__(self, lhs, rhs, dimension_numbers, preferred_element_type=None, **kwargs):
        # nnx passes precision (FP8 GEMMs have one) and out_sharding (it follows the inputs).
        del kwargs
        out, new_meta = dot.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            self.meta.get_value(),
            preferred_element_type,
            self.cast_kernel,
            self.prologue,
        )
        self._write(new_meta)
        return out


class Fp8Einsum(_Fp8Op):
    """FP8 two-operand einsum for ``nnx.Einsum`` (pass as ``einsum_op=``)."""

    def __call__(self, eq: str, lhs, rhs, precision=None, preferred_element_type=None, **kwargs):
        del precision, kwargs
        meta = self.meta.get_value()
        out, new_meta = dot.fp8_einsum(
            eq, lhs, rhs, meta, preferred_element_type, self.cast_kernel, self.prologue
        )
        self._write(new_meta)
        return out


class Fp8RaggedDot(_Fp8Op):
    """FP8 ``jax.lax.ragged_dot`` for expert layers: call it where the model would call
    ``ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])``, rows sorted by group."""

    def __call__(
        self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None
    ):
        del precision  # FP8 GEMMs have one precision
        grouped.check_ragged_call(lhs, rhs, group_sizes, group_offset, "fp8jax.nnx.Fp8RaggedDot")
        out, new_meta = grouped.ragged_dot(
            lhs, rhs, group_sizes, self.meta.get_value(), preferred_element_type
        )
        self._write(new_meta)
        return out


def diff_state(argnum: int = 0) -> nnx.DiffState:
    """``argnums`` for ``nnx.grad``: differentiate the params and the FP8 state of one argument."""
    return nnx.DiffState(argnum, (nnx.Param, Fp8State))


def split_grads(grads: nnx.State) -> tuple[nnx.State, nnx.State]:
    """Split ``diff_state`` grads into (param grads for the optimizer, FP8 amax 'grads')."""
    fp8_grads, param_grads = nnx.split_state(grads, Fp8State, ...)
    return param_grads, fp8_grads


def merge_fp8_grads(model: nnx.Module, fp8_grads: nnx.State) -> None:
    """Fold one micro-batch's dy amax into the pending slots by max (gradient accumulation)."""
    nnx.update(model, state.merge_grads(nnx.state(model, Fp8State), fp8_grads))


def commit_fp8_state(model: nnx.Module) -> None:
    """End a step: roll every amax history and recompute every scale."""
    nnx.update(model, state.commit(nnx.state(model, Fp8State)))


def update_fp8_state(model: nnx.Module, fp8_grads: nnx.State) -> None:
    """``merge_fp8_grads`` then ``commit_fp8_state``: the one call a single-batch step needs."""
    nnx.update(model, state.update_state(nnx.state(model, Fp8State), fp8_grads))
