"""Fused FP8 cast + transpose + amax: one read of a tensor, both GEMM layouts out.

Hopper's FP8 GEMMs take both operands with the contracting axis innermost, so the forward
pass's ``x`` [M, K] is also needed as [K, M] for the weight gradient, and ``dy`` [M, N] as
[N, M]. XLA's fusion that writes both layouts runs well below the GPU's memory bandwidth, and
the amax is a separate reduction pass over the same tensor (measured: docs/performance.md).
Under delayed scaling the scale is known before the pass, so a single kernel can read the
tensor once, write the FP8 tensor and its transpose, and record the amax (into a history's
pending slot, in place: ``pending=``).

``cast_transpose`` runs a Pallas kernel (Triton backend) on GPUs and the same arithmetic as
plain XLA ops elsewhere; ``impl='interpret'`` runs the kernel through Pallas' interpreter on
any backend (tests).

An optional elementwise ``prologue`` (``activations.ACTIVATIONS``) is applied in f32 to each
block before the amax and the cast, so an MLP's activation needs no pass of its own: the pass
that quantizes the second matmul's input reads the pre-activation instead of the activation.
``norm`` does the same for a LayerNorm in front of the matmul: the pass reads the norm's input
and its row statistics, and the normalized tensor is never written in high precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.ops import activations, formats, scaling

__all__ = [
    "ACT_COL_BLOCKS",
    "AUTO",
    "BOTH",
    "IMPLS",
    "WARPS",
    "affine_operands",
    "apply_affine",
    "apply_norm",
    "cast_transpose",
    "check_affine",
    "check_impl",
    "check_norm",
    "dispatch",
    "grid_layout",
    "kernel_tanh",
    "norm_operands",
    "pallas_cast_transpose",
    "record_amax",
    "record_reference",
    "resolve_impl",
    "untarget",
]

IMPLS = ("xla", "pallas", "interpret")
AUTO = "auto"  # the library ops' default cast: ``resolve_impl`` picks one of IMPLS per platform
# Triton blocks are powers of two; fp8jax pads GEMM dims to 16. 64 rows x 128 columns with 4
# warps is the fastest tuning over GPT's operand shapes (measured: docs/performance.md).
_ROW_BLOCKS, _COL_BLOCKS = (64, 32, 16), (128, 64, 32, 16)
# Passes that compute an activation (a prologue, or the backward's act' and act) run fastest on
# 64 x 64 blocks (measured on GPT's MLP tensors: benchmarks.act_kernels, docs/kernels.md).
ACT_COL_BLOCKS = (64, 32, 16)
WARPS = 4
BOTH = "both"  # cast_transpose's default layouts: q [M, K] and q.T [K, M]


def check_impl(impl: str) -> str:
    """Return ``impl`` if it is ``AUTO`` or one of ``IMPLS``; a clear error otherwise."""
    if impl != AUTO and impl not in IMPLS:
        raise ValueError(
            f"unknown FP8 cast kernel {impl!r}: use one of {(AUTO, *IMPLS)} (fp8.cast_kernel)"
        )
    return impl


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """``impl`` checked, with ``AUTO`` resolved for ``platform`` (default: JAX's default backend).

    'pallas' on GPUs, where the fused kernel makes the whole train step faster (measured:
    docs/performance.md), 'xla' elsewhere. 'pallas' itself lowers to the Triton kernel on CUDA
    only and to XLA ops on other GPUs. Called at trace time.
    """
    if check_impl(impl) != AUTO:
        return impl
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("gpu", "cuda") else "xla"


def _block(n: int, blocks) -> int | None:
    return next((b for b in blocks if n % b == 0), None)


def kernel_tanh(interpret: bool):
    """The tanh a kernel's activation uses: the GPU's tanh.approx.f32 (one instruction, relative
    error ~2**-11, far below E4M3's 2**-4 spacing; libdevice's exact tanh makes the GELU kernel
    compute-bound). The interpreter runs jnp.tanh."""
    if interpret:
        return jnp.tanh
    from jax.experimental.pallas import triton as plt

    return plt.approx_tanh


def dispatch(impl: str, shape, reference, pallas, *args, col_blocks=_COL_BLOCKS):
    """``reference(*args)`` or ``pallas(*args, bm, bk, interpret)`` for an [M, K] pass.

    'xla', and sides not in multiples of 16 (or empty), take XLA ops; 'interpret' runs the
    kernel through Pallas' interpreter; 'pallas' picks per platform when lowering: the Triton
    kernel for CUDA, XLA ops anywhere else.
    """
    impl = resolve_impl(impl)
    bm, bk = _block(shape[0], _ROW_BLOCKS), _block(shape[1], col_blocks)
    if impl == "xla" or bm is None or bk is None or 0 in shape:
        return reference(*args)
    if impl == "interpret":
        return pallas(*args, bm, bk, True)
    return jax.lax.platform_dependent(
        *args,
        cuda=lambda *a: pallas(*a, bm, bk, False),
        default=reference,
    )


def apply_affine(x, affine):
    """``x * alpha + bias`` in f32 (``affine = (alpha, bias [K])``), or ``x`` as it is."""
    if affine is None:
        return x
    alpha, bias_K = affine
    return x.astype(jnp.float32) * alpha + bias_K.astype(jnp.float32)[None, :]


def affine_operands(affine, bk: int):
    """A kernel's extra inputs for ``affine``: ``(alpha for its scalars, [bias], [bias's
    BlockSpec: the [bk] slice of block column j])``, all empty without one."""
    if affine is None:
        return [], [], []
    from jax.experimental import pallas as pl

    return [affine[0]], [affine[1]], [pl.BlockSpec((bk,), lambda i, j: (j,))]


def apply_norm(x, norm):
    """LayerNorm from given statistics, in f32: ``(x - mean) * (rstd * gamma) + beta`` (``norm
    = (mean [M], rstd [M], gamma [K], beta [K])``, flax's ``LayerNorm`` order), or ``x``."""
    if norm is None:
        return x
    mean_M, rstd_M, gamma_K, beta_K = (a.astype(jnp.float32) for a in norm)
    mul_MxK = rstd_M[:, None] * gamma_K[None, :]
    return (x.astype(jnp.float32) - mean_M[:, None]) * mul_MxK + beta_K[None, :]


def norm_operands(norm, bm: int, bk: int):
    """A kernel's extra inputs for ``norm`` and their BlockSpecs (this block's rows of the
    statistics, its columns of gamma and beta); both empty without one."""
    if norm is None:
        return [], []
    from jax.experimental import pallas as pl

    rows, cols = pl.BlockSpec((bm,), lambda i, j: (i,)), pl.BlockSpec((bk,), lambda i, j: (j,))
    return list(norm), [rows, rows, cols, cols]


def check_norm(norm, shape) -> None:
    """A clear error unless ``norm`` is None or ``(mean [M], rstd [M], gamma [K], beta [K])``."""
    if norm is None:
        return
    m, k = shape
    want = [(m,), (m,), (k,), (k,)]
    if len(norm) != 4 or [jnp.shape(a) for a in norm] != want:
        raise ValueError(
            f"norm must be (mean, rstd, gamma, beta) of shapes {want}, got "
            f"{[jnp.shape(a) for a in norm]}"
        )


def _reference(x, scale, dtype, prologue=None, affine=None, norm=None):
    """The XLA version: the same saturating quantize as ``formats.quantize``, plus the amax."""
    x = apply_norm(apply_affine(x, affine), norm)
    if prologue is not None:
        x = activations.activation(prologue)(
            x.astype(jnp.float32)
        )  # [M, K] f32: quantized unrounded
    q = formats.quantize(x, scale, dtype)  # [M, K]
    return q, q.T, formats.amax(x)


def record_amax(pending_ref, block_max):
    """Max this block's amax into ``pending_ref[0]`` (a history's pending slot), atomically.

    The kernel then records the whole tensor's amax itself: no per-block partials for XLA to
    reduce and merge afterwards, one small kernel per tensor fewer. A non-finite block records 0,
    as ``scaling.sanitize_amax`` does for a whole tensor (the XLA path sees the whole tensor, so
    there a single Inf records nothing at all).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    # Pallas' interpreter discharges the atomic into a plain max: the same code serves both.
    block_max = jnp.where(jnp.isfinite(block_max), block_max, 0.0)
    plt.atomic_max(pending_ref, (pl.ds(0, 1),), jnp.full((1,), block_max, jnp.float32))


def _kernel(
    *refs,
    limit: float,
    dtype,
    cast_first,
    prologue,
    tanh,
    affine: bool,
    norm: bool,
    layouts,
    record,
):
    # scale_ref: [scale(, alpha)]; bias_ref: this block's [bk] of the bias (with affine); the
    # norm's mean and rstd [bm], gamma and beta [bk] (with norm); the pending input (aliased
    # to pending_ref) only when recording.
    scale_ref, x_ref, *rest = refs
    bias_ref = rest.pop(0) if affine else None
    norm_refs = [rest.pop(0) for _ in range(4)] if norm else None
    rest = rest[1:] if record else rest
    q_ref = rest.pop(0) if layouts != "col" else None
    qt_ref = rest.pop(0) if layouts != "row" else None
    x_bxk = x_ref[...].astype(jnp.float32)  # [bm, bk], read once
    if affine:
        x_bxk = apply_affine(x_bxk, (scale_ref[1], bias_ref[...]))
    if norm:
        x_bxk = apply_norm(x_bxk, [r[...] for r in norm_refs])
    x_bxk = activations.activation(prologue, tanh)(x_bxk)
    if record:
        record_amax(rest[0], jnp.max(jnp.abs(x_bxk)))
    # f32 multiply and clip before the narrow cast, exactly as formats.quantize: out-of-range
    # values would otherwise become NaN (E4M3) or Inf (E5M2); Inf and NaN become NaN.
    y_bxk = formats.saturate(x_bxk * scale_ref[0], jnp.isfinite(x_bxk), limit)
    q_bxk = y_bxk.astype(dtype)
    if q_ref is not None:
        q_ref[...] = q_bxk
    # The transpose goes through shared memory: of the FP8 block (cast_first, a quarter of the
    # bytes) or of the f32 one. The same bits either way; which is faster is the GPU's call.
    if qt_ref is not None:
        qt_ref[...] = q_bxk.T if cast_first else y_bxk.T.astype(dtype)


def pallas_cast_transpose(
    x,
    scale,
    dtype,
    bm: int,
    bk: int,
    interpret: bool,
    num_warps=WARPS,
    num_stages=1,
    cast_first=False,
    prologue=None,
    pending=None,
    affine=None,
    layouts=BOTH,
    record=True,
    norm=None,
):
    """The Pallas kernel on [M, K] with explicit tuning (blocks, warps, stages), for tuning runs.

    ``pending``: the f32[n] whose slot 0 takes the amax (updated in place and returned in the
    amax's place), else a fresh zero and the amax itself. ``layouts`` and ``record``: as
    ``cast_transpose``'s (None in the place of what is not written)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    (m, k), (gm, gk), target, whole, (alpha, bias, bias_spec) = grid_layout(
        x, bm, bk, pending, affine
    )
    stats, stats_specs = norm_operands(norm, bm, bk)
    kernel = functools.partial(
        _kernel,
        limit=formats.fmax(dtype),
        dtype=dtype,
        cast_first=cast_first,
        prologue=prologue,
        tanh=kernel_tanh(interpret),
        affine=affine is not None,
        norm=norm is not None,
        layouts=_check_layouts(layouts),
        record=record,
    )
    scalars = [scale, *alpha]
    specs = {
        "row": (pl.BlockSpec((bm, bk), lambda i, j: (i, j)), jax.ShapeDtypeStruct((m, k), dtype)),
        "col": (pl.BlockSpec((bk, bm), lambda i, j: (j, i)), jax.ShapeDtypeStruct((k, m), dtype)),
        "amax": (whole, jax.ShapeDtypeStruct(target.shape, jnp.float32)),
    }
    names = [n for n in ("row", "col") if layouts in (BOTH, n)] + (["amax"] if record else [])
    outs = pl.pallas_call(
        kernel,
        grid=(gm, gk),
        in_specs=[
            pl.BlockSpec((len(scalars),), lambda i, j: (0,)),
            pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
            *bias_spec,
            *stats_specs,
            *([whole] if record else []),
        ],
        out_specs=[specs[n][0] for n in names],
        out_shape=[specs[n][1] for n in names],
        input_output_aliases={2 + len(bias) + len(stats): len(names) - 1} if record else {},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="fp8_cast_transpose",
    )(jnp.stack(scalars).astype(jnp.float32), x, *bias, *stats, *([target] if record else []))
    got = dict(zip(names, outs, strict=True))
    amax = untarget(got["amax"], pending) if record else None
    return got.get("row"), got.get("col"), amax


def _target(pending):
    """The array the kernel's atomics max into: ``pending`` itself, or a fresh f32 zero."""
    if pending is None:
        return jnp.zeros((1,), jnp.float32)
    if pending.ndim != 1 or pending.dtype != jnp.float32:
        raise ValueError(
            f"pending must be an f32 vector (an amax history), got {pending.shape} {pending.dtype}"
        )
    return pending


def grid_layout(x, bm: int, bk: int, pending, affine):
    """What both kernels' calls share: ``x``'s [M, K], the grid, the amax target, its BlockSpec
    (every block maxes into slot 0) and ``affine_operands``."""
    from jax.experimental import pallas as pl

    target = _target(pending)
    whole = pl.BlockSpec(target.shape, lambda i, j: (0,))
    m, k = x.shape
    return (m, k), (m // bm, k // bk), target, whole, affine_operands(affine, bk)


def untarget(target, pending):
    """A kernel's amax output as callers get it: the history, or (no ``pending``) the amax."""
    return target[0] if pending is None else target


def record_reference(amax, pending):
    """The XLA paths' record (``scaling.record_history``), or the sanitized amax itself."""
    return untarget(scaling.record_history(_target(pending), amax), pending)


def _check_layouts(layouts: str) -> str:
    if layouts not in (BOTH, "row", "col"):
        raise ValueError(f"layouts must be {BOTH!r}, 'row' or 'col', got {layouts!r}")
    return layouts


def cast_transpose(
    x: jax.Array,
    scale: jax.Array,
    fmt,
    impl: str = "pallas",
    prologue: str | None = None,
    pending: jax.Array | None = None,
    affine: tuple[jax.Array, jax.Array] | None = None,
    layouts: str = BOTH,
    record: bool = True,
    norm: tuple[jax.Array, ...] | None = None,
):
    """``(q [M, K], q.T [K, M], amax)``: ``x`` [M, K] scaled, saturated and cast to ``fmt``.

    ``impl``: 'pallas' (the fused kernel on GPUs, XLA ops elsewhere), 'interpret' (the kernel
    through Pallas' interpreter, any backend) or 'xla'. Shapes whose sides are not multiples of
    16 take the XLA path. ``prologue`` (a name in ``activations.ACTIVATIONS``) quantizes
    ``act(x)``. With ``pending`` (an f32 amax history) the third output is that history with the
    amax max-merged into slot 0, as ``scaling.record``; the kernel writes it in place. Inf and NaN
    come out NaN (``formats.saturate``); the amax of a non-finite tensor counts as 0.
    ``affine = (alpha, bias [K])`` quantizes ``act(x * alpha + bias)`` (in f32): a GEMM's raw
    output is unscaled and biased in the same read. ``layouts`` 'row' or 'col' writes only q or
    q.T, and ``record=False`` no amax (None in their places): a backward pass that casts an
    operand again, with the forward's scale, for the one layout its GEMM reads. ``norm = (mean
    [M], rstd [M], gamma [K], beta [K])`` quantizes the LayerNorm of ``x`` from those row
    statistics (``apply_norm``, in f32, after any affine and before any prologue).
    """
    dtype = formats.as_dtype(fmt)
    activations.activation(prologue)  # a clear error for an unknown name
    check_affine(affine, x.shape[-1])
    check_norm(norm, x.shape)
    _check_layouts(layouts)

    def reference(x, s, p, a, n):
        q, q_t, amax = _reference(x, s, dtype, prologue, a, n)
        return (
            q if layouts != "col" else None,
            q_t if layouts != "row" else None,
            record_reference(amax, p) if record else None,
        )

    return dispatch(
        impl,
        x.shape,
        reference,
        lambda x, s, p, a, n, bm, bk, interpret: pallas_cast_transpose(
            x,
            s,
            dtype,
            bm,
            bk,
            interpret,
            prologue=prologue,
            pending=p,
            affine=a,
            layouts=layouts,
            record=record,
            norm=n,
        ),
        x,
        scale,
        pending,
        affine,
        norm,
        col_blocks=_COL_BLOCKS if prologue is None else ACT_COL_BLOCKS,
    )


def check_affine(affine, k: int) -> None:
    """A clear error unless ``affine`` is None or ``(a scalar, a bias of shape (k,))``."""
    if affine is None:
        return
    alpha, bias = affine
    if jnp.ndim(alpha) != 0 or jnp.shape(bias) != (k,):
        raise ValueError(
            f"affine must be (a scalar, a bias of shape ({k},)), got shapes "
            f"{jnp.shape(alpha)} and {jnp.shape(bias)}"
        )
