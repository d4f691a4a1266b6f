"""Expert parallelism: MoE token dispatch and combine by all-to-all over the ``expert`` mesh axis.

The routed experts of an MoE layer are split over ``expert`` (E / ep consecutive experts per
shard), and so are the tokens (the axis carries batch rows, as in GShard and DeepSeek-V3). Per
shard, with its T tokens ``x_TxD``, their experts ``idx_Txk`` and router weights ``p_Txk``:

1. The T*k (token, expert) pairs are sorted by expert (stable, so token order within each) and
   written into one fixed-size buffer per destination shard, the shard holding the pair's
   expert: T*k rows each in dropless mode (room for every pair; XLA:CPU has no
   ``ragged_all_to_all``, so the buffers are padded), ``min(T*k, E/ep * C)`` with a capacity C.
2. One ``all_to_all`` delivers every shard the rows for its experts; it sorts them by expert
   and runs its experts' grouped GEMMs (``experts_fn(x_MxD, group_sizes_G)``, G = E/ep: the
   FP8 ``GroupedLinear`` or any ``ragged_dot``); padding rows sort last and count in no group.
3. The reverse ``all_to_all`` (the same permutation: block j of shard i goes to block i of
   shard j) brings each pair's result back to its token's shard (in the experts' output
   dtype), where the pairs are summed with their router weights in f32.

Capacity mode keeps, per expert, the first C = ceil(capacity_factor * T_all * k / E) pairs in
token order over all ``token_axes`` shards (T_all their tokens): each shard learns from an
``all_gather`` of per-expert counts how many pairs the shards before it sent, so the sharded
layer drops exactly the pairs the one-device layer drops. ``fp8_dispatch`` sends the tokens as
E4M3 with one f32 scale per row (DeepSeek-V3's dispatch); their gradients return in the compute
dtype, and the combine never leaves it. Everything is differentiable: the backward of an
``all_to_all`` is the reverse one. FP8 amaxes the experts record inside a shard are that
shard's: the train step merges the replicas' FP8 states by max over every data-parallel axis,
``expert`` included (``nn.state.max_over_replicas``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from fp8jax.ops import formats
from fp8jax.ops import rows as rows_lib
from fp8jax.parallel import comm
from fp8jax.parallel import sharding as sharding_lib

__all__ = [
    "EXPERT_AXIS",
    "ExpertsFn",
    "capacity",
    "dispatch_combine",
    "expert_parallel",
    "routed",
    "split_axis",
]

EXPERT_AXIS = "expert"
# (x_MxD rows sorted by local expert, group_sizes_G) -> y_MxD; rows past sum(sizes) give 0.
ExpertsFn = Callable[[jax.Array, jax.Array], jax.Array]


def capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Pairs each expert keeps in capacity mode: ``ceil(capacity_factor * T * k / E)``."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def _linear_index(axes: tuple[str, ...]) -> tuple[jax.Array, int]:
    """(this shard's index over ``axes``, major to minor as listed; their total size)."""
    index, size = jnp.int32(0), 1
    for a in axes:
        n = lax.axis_size(a)
        index, size = index * n + lax.axis_index(a), size * n
    return index, size


def _row_scale_e4m3(x_RxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(E4M3 rows, f32 inverse scale per row): each row's amax lands on E4M3's max (448)."""
    x = x_RxD.astype(jnp.float32)
    amax_R = jnp.max(jnp.abs(x), axis=-1)
    fmax = formats.fmax(formats.E4M3)
    scale_R = jnp.where(amax_R > 0, fmax / amax_R, 1.0)
    # E4M3: the dispatched tokens are forward activations (precision over range); the per-row
    # scale keeps one outlier token from flushing the others.
    q = jnp.clip(x * scale_R[:, None], -fmax, fmax).astype(formats.E4M3)
    return q, 1.0 / scale_R


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fp8_all_to_all(x_NxD: jax.Array, axis_name: str, wire: str) -> jax.Array:
    """``all_to_all`` of rows sent as E4M3 with per-row scales, dequantized on arrival."""
    q, inv_N = _row_scale_e4m3(x_NxD)
    got = lax.all_to_all(comm.to_wire(q, wire), axis_name, 0, 0, tiled=True)
    inv_N = lax.all_to_all(inv_N, axis_name, 0, 0, tiled=True)
    x = comm.from_wire(got, formats.E4M3, wire).astype(jnp.float32) * inv_N[:, None]
    return x.astype(x_NxD.dtype)


def _fp8_all_to_all_fwd(x_NxD, axis_name, wire):
    return _fp8_all_to_all(x_NxD, axis_name, wire), None


def _fp8_all_to_all_bwd(axis_name, wire, _, g_NxD):
    # Straight through the quantization: the gradients travel back in the compute dtype.
    return (lax.all_to_all(g_NxD, axis_name, 0, 0, tiled=True),)


_fp8_all_to_all.defvjp(_fp8_all_to_all_fwd, _fp8_all_to_all_bwd)


def dispatch_combine(
    x_TxD: jax.Array,
    idx_Txk: jax.Array,
    p_Txk: jax.Array,
    experts_fn: ExpertsFn,
    *,
    num_experts: int,
    capacity_factor: float | None = None,
    fp8_dispatch: bool = False,
    axis_name: str = EXPERT_AXIS,
    token_axes: tuple[str, ...] | None = None,
    wire: str = "uint8",
) -> jax.Array:
    """``y_TxD = sum_j p_Txk[:, j] * expert_{idx_Txk[:, j]}(x_TxD)`` (f32) for this shard's tokens.

    Runs per shard inside a manual region (shard_map, or the train step's per-device replicas)
    where ``axis_name`` is bound: this shard holds experts ``[i * G, (i + 1) * G)`` (G =
    num_experts / shards, i its index), which ``experts_fn`` computes. ``capacity_factor``: None
    for dropless dispatch, else the capacity mode's factor, counted over the tokens of all
    ``token_axes`` shards (default: ``axis_name``). ``wire``: how E4M3 rows travel with
    ``fp8_dispatch`` (``comm.wire_format``: 'uint8' on CPU).
    """
    t, d = x_TxD.shape
    k = idx_Txk.shape[1]
    ep = lax.axis_size(axis_name)
    g = num_experts // ep
    tk = t * k
    e_P = idx_Txk.reshape(tk).astype(jnp.int32)  # pair p = token p // k, its (p % k)-th expert
    order_P = jnp.argsort(e_P, stable=True)  # by expert, token order within each
    e_S = e_P[order_P]
    counts_E = jnp.zeros((num_experts,), jnp.int32).at[e_P].add(1)
    start_E = jnp.cumsum(counts_E) - counts_E
    rank_S = jnp.arange(tk, dtype=jnp.int32) - start_E[e_S]  # place among its expert's pairs
    if capacity_factor is None:
        keep_S = jnp.ones((tk,), bool)
        rows = tk  # per destination: every pair may go to one shard
    else:
        axes = tuple(token_axes) if token_axes is not None else (axis_name,)
        shard, shards = _linear_index(axes)
        c = capacity(capacity_factor, t * shards, k, num_experts)
        # Pairs the shards before this one (in token order) sent to each expert.
        all_SxE = lax.all_gather(counts_E, axes, axis=0, tiled=False).reshape(shards, -1)
        before_E = jnp.sum(jnp.where(jnp.arange(shards)[:, None] < shard, all_SxE, 0), axis=0)
        keep_S = before_E[e_S] + rank_S < c
        rows = min(tk, g * c)
    dest_S = e_S // g
    keep_i_S = keep_S.astype(jnp.int32)
    kept_D = jnp.zeros((ep,), jnp.int32).at[dest_S].add(keep_i_S)
    kept_before_S = jnp.cumsum(keep_i_S) - keep_i_S
    slot_S = dest_S * rows + kept_before_S - (jnp.cumsum(kept_D) - kept_D)[dest_S]
    n = ep * rows
    slot_S = jnp.where(keep_S, slot_S, n)  # dropped pairs: out of range, not written
    # Both directions of each row move as gathers (ops.rows): the pair in each buffer slot (tk:
    # an empty slot) and each pair's slot (n: dropped), pair p = token p // k's (p % k)-th.
    src_N = (
        jnp.full((n,), tk, jnp.int32).at[slot_S].set(jnp.arange(tk, dtype=jnp.int32), mode="drop")
    )
    pair_N = jnp.where(src_N < tk, order_P[jnp.minimum(src_N, tk - 1)], tk)
    slot_P = slot_S[jnp.argsort(order_P)]
    send_NxD = rows_lib.repeat_rows(
        x_TxD, jnp.where(pair_N < tk, pair_N // k, t), slot_P.reshape(t, k)
    )
    send_e_N = jnp.full((n,), g, jnp.int32).at[slot_S].set(e_S % g, mode="drop")

    if fp8_dispatch:
        recv_NxD = _fp8_all_to_all(send_NxD, axis_name, wire)
    else:
        recv_NxD = lax.all_to_all(send_NxD, axis_name, 0, 0, tiled=True)
    recv_e_N = lax.all_to_all(send_e_N, axis_name, 0, 0, tiled=True)  # g: an empty slot

    order_N = jnp.argsort(recv_e_N, stable=True)  # by local expert; empty slots last
    inv_N = jnp.argsort(order_N)
    sizes_G = jnp.zeros((g + 1,), jnp.int32).at[recv_e_N].add(1)[:g]
    y_MxD = experts_fn(rows_lib.take_rows(recv_NxD, order_N, inv_N), sizes_G)
    y_NxD = rows_lib.take_rows(y_MxD, inv_N, order_N)
    y_NxD = jnp.where((recv_e_N < g)[:, None], y_NxD, 0)
    back_NxD = lax.all_to_all(y_NxD, axis_name, 0, 0, tiled=True)

    y_PxD = rows_lib.take_rows(back_NxD, slot_P, pair_N)  # each pair's result (dropped: 0)
    y_TxkxD = y_PxD.reshape(t, k, -1)
    return rows_lib.combine(y_TxkxD, p_Txk)


def split_axis() -> str | None:
    """The mesh axis an MoE layer's routed experts are split over where it runs (each device
    holds its own: ``routed`` dispatches to them), or None where the layer holds them all."""
    return EXPERT_AXIS if sharding_lib.expert_axis_size() > 1 else None


def routed(
    x_TxD: jax.Array,
    idx_Txk: jax.Array,
    p_Txk: jax.Array,
    experts_fn: ExpertsFn,
    *,
    num_experts: int,
    capacity_factor: float | None,
    fp8_dispatch: bool,
) -> jax.Array | None:
    """An MoE layer's expert outputs by ``dispatch_combine`` where the model runs per device
    with an 'expert' axis over 1 (``sharding.expert_shards``); None elsewhere (one device, or
    XLA's partitioner, which splits the one-device computation itself).

    There the layer's expert weights are this device's own G = ``num_experts`` / shards
    experts (the train step keeps them split over 'expert'), and ``experts_fn(x_MxD,
    sizes_G)`` computes them.
    """
    if sharding_lib.expert_axis_size() == 1:
        return None
    on_cpu = jax.default_backend() == "cpu"
    return dispatch_combine(
        x_TxD,
        idx_Txk,
        p_Txk,
        experts_fn,
        num_experts=num_experts,
        capacity_factor=capacity_factor,
        fp8_dispatch=fp8_dispatch,
        token_axes=sharding_lib.DP_AXES,
        wire="uint8" if on_cpu else "fp8",
    )


def expert_parallel(
    mesh: Mesh,
    x_TxD: jax.Array,
    idx_Txk: jax.Array,
    p_Txk: jax.Array,
    expert_params,
    experts_fn: Callable,
    *,
    num_experts: int,
    capacity_factor: float | None = None,
    fp8_dispatch: bool = False,
    token_axes: tuple[str, ...] = (EXPERT_AXIS,),
) -> jax.Array:
    """``dispatch_combine`` over ``mesh``: tokens split over ``token_axes``, the leading (expert)
    axis of every ``expert_params`` leaf over 'expert'; ``experts_fn(params_G, x_MxD,
    group_sizes_G)`` computes one shard's experts."""
    rows = PartitionSpec(tuple(token_axes))
    wire = comm.wire_format(mesh, comm.CommConfig())

    def body(x, idx, p, params):
        return dispatch_combine(
            x,
            idx,
            p,
            partial(experts_fn, params),
            num_experts=num_experts,
            capacity_factor=capacity_factor,
            fp8_dispatch=fp8_dispatch,
            token_axes=tuple(token_axes),
            wire=wire,
        )

    experts = jax.tree.map(lambda _: PartitionSpec(EXPERT_AXIS), expert_params)
    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(rows, rows, rows, experts), out_specs=rows, check_vma=False
    )
    return fn(x_TxD, idx_Txk, p_Txk, expert_params)
