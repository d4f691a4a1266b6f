"""Memory account: bytes per parameter of params, gradients and optimizer state, and XLA's view.

``bytes_per_param`` reads the actual trees (arrays or ``jax.eval_shape`` abstractions, such as
``loop.setup(run).abstract``), so it reports whatever level they represent.
``state_bytes`` estimates the same bytes from the f32 params' shapes and a level's
``optim.levels.Storage``, which the trainer builds its state from: O0 and O1 store f32 params
and f32 Adam moments (12 B/param; O1 adds only the FP8 GEMMs' scale state, outside params and
optimizer state); O2 and O3 store FP16 masters, E4M3 m and FP16 v for the matmul weights
(5 B/param plus three f32 scales per tensor). Gradients are not stored in these trees, so their
width is a parameter: FP8-LM counts the matmul weights' gradients in FP8 from O1 on
(``level=Level.O1`` or later implies ``matmul_grads_dtype='e5m2'``, 1 byte); fp8jax computes
them in the compute dtype and sends them over the wire in FP8 (fp8jax.parallel.comm).

Optimizer-state leaves are attributed to a parameter when the end of their tree path is that
parameter's path (optax states mirror the params tree); leaves that match nothing (step counts,
schedule state) count towards the overall figures only.

``compiled_memory`` reads XLA's account of a compiled program; ``check_fits`` refuses one whose
peak exceeds the device's memory (``device_memory_limit``), before it runs.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import errors
from fp8jax._tree import path_key
from fp8jax.optim.levels import Level, Storage
from fp8jax.optim.master import ScaledTensor, is_scaled, resolve_mask, storage_dtype

__all__ = [
    "account",
    "bytes_per_param",
    "check_fits",
    "compiled_memory",
    "device_memory_limit",
    "format_compiled_memory",
    "memory_table",
    "state_bytes",
]

_MIB = 2.0**20


def _nbytes(leaf) -> int:
    """Bytes of one stored leaf (array, ShapeDtypeStruct or ScaledTensor of either)."""
    if isinstance(leaf, ScaledTensor):
        return _nbytes(leaf.data) + _nbytes(leaf.scale)
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        return 0  # python scalars, None, MaskedNode-free placeholders: nothing on the device
    return math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize


def _count(leaf) -> int:
    return math.prod(leaf.shape) if hasattr(leaf, "shape") else 0


def _width(dtype, default_leaf) -> float:
    """Bytes per element for a gradient: a dtype / format name / number, or the leaf's own."""
    if dtype is None:
        # Gradients are taken wrt the materialised tree: f32 for ScaledTensor masters.
        if isinstance(default_leaf, ScaledTensor):
            return 4.0
        return float(jnp.dtype(default_leaf.dtype).itemsize)
    if isinstance(dtype, int | float):
        return float(dtype)
    try:
        return float(storage_dtype(dtype).itemsize)
    except ValueError:
        return float(jnp.dtype(dtype).itemsize)


def account(params, opt_state, grads_dtype=None, matmul_grads_dtype=None, mask=None) -> dict:
    """Raw counts: elements and bytes of params, grads and opt state, overall and matmul-only.

    ``grads_dtype``: width of every gradient (dtype, 'e5m2'/'float16'/..., or bytes; None: the
    dtype of the materialised param). ``matmul_grads_dtype``: override for the matmul weights.
    ``mask``: which params count as matmul weights (default: 'kernel' leaves of rank >= 2).
    """
    selected = jax.tree.leaves(resolve_mask(params, mask), is_leaf=is_scaled)
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_scaled)[0]
    if len(selected) != len(flat):
        raise ValueError("mask does not match the params tree")
    mm_grads = grads_dtype if matmul_grads_dtype is None else matmul_grads_dtype
    totals = {k: 0.0 for k in ("n", "params", "grads", "opt_state")}
    matmul = dict(totals)
    by_path = {}
    for (path, leaf), is_mm in zip(flat, selected, strict=True):
        n = _count(leaf)
        row = {
            "n": n,
            "params": _nbytes(leaf),
            "grads": n * _width(mm_grads if is_mm else grads_dtype, leaf),
        }
        by_path[path_key(path)] = (bool(is_mm), n)
        for k, v in row.items():
            totals[k] += v
            if is_mm:
                matmul[k] += v
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_scaled)[0]:
        nbytes = _nbytes(leaf)
        totals["opt_state"] += nbytes
        key = path_key(path)
        for start in range(len(key)):  # longest suffix first
            hit = by_path.get(key[start:])
            if hit is not None and hit[1] == _count(leaf):
                if hit[0]:
                    matmul["opt_state"] += nbytes
                break
    return {"all": totals, "matmul": matmul}


def state_bytes(params, storage: Storage, mask=None) -> dict[str, int]:
    """Bytes of params and optimizer state the trainer stores for f32 ``params``.

    From the shapes of ``params`` and a level's ``storage`` (``Level.O2.storage()``, or
    ``run.fp8.storage``); ``mask`` selects the matmul weights (default: 'kernel' leaves of
    rank >= 2). Keys: ``params``, ``opt_state`` and the same with a ``matmul_`` prefix.
    """
    s = storage
    width = lambda fmt: storage_dtype(fmt).itemsize  # noqa: E731
    scale = jnp.dtype(jnp.float32).itemsize  # one f32 scale per ScaledTensor
    narrow_master = storage_dtype(s.master_format) != jnp.dtype(jnp.float32)
    out = dict.fromkeys(("params", "opt_state", "matmul_params", "matmul_opt_state"), 0)
    flat = jax.tree.leaves(params, is_leaf=is_scaled)
    selected = jax.tree.leaves(resolve_mask(params, mask), is_leaf=is_scaled)
    for leaf, is_mm in zip(flat, selected, strict=True):
        n = _count(leaf)
        p, o = 4 * n, 8 * n  # f32 param, f32 m and v
        if is_mm and narrow_master:
            p = n * width(s.master_format) + scale
        if is_mm and s.fp8_adam:
            o = n * (width(s.m_format) + width(s.v_format)) + 2 * scale
        out["params"] += p
        out["opt_state"] += o
        if is_mm:
            out["matmul_params"] += p
            out["matmul_opt_state"] += o
    out["opt_state"] += 2 * 4  # int32 step counts: Adam's and the learning-rate schedule's
    return out


def bytes_per_param(
    params,
    opt_state,
    grads_dtype=None,
    matmul_grads_dtype=None,
    mask=None,
    level: Level | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """One ``memory_table`` row: counts, bytes/param overall and for matmul weights, total MiB.

    Keys: ``params``, ``grads``, ``opt_state``, ``total`` (bytes/param over all params), the same
    with a ``matmul_`` prefix (matmul weights only), ``n_params``, ``n_matmul``, ``total_mib``.
    ``level`` labels the row and, from O1 on, counts the matmul weights' gradients as FP8
    (1 byte) unless ``matmul_grads_dtype`` says otherwise.
    """
    if matmul_grads_dtype is None and level is not None and level.fp8_grad_comm:
        matmul_grads_dtype = "e5m2"  # FP8-LM: weight gradients in FP8 from O1 on
    raw = account(params, opt_state, grads_dtype, matmul_grads_dtype, mask)
    row: dict[str, Any] = {
        "label": label if label is not None else ("" if level is None else str(level)),
        "n_params": int(raw["all"]["n"]),
        "n_matmul": int(raw["matmul"]["n"]),
    }
    for group, prefix in (("all", ""), ("matmul", "matmul_")):
        r, n = raw[group], max(raw[group]["n"], 1)
        for k in ("params", "grads", "opt_state"):
            row[prefix + k] = r[k] / n
        row[prefix + "total"] = (r["params"] + r["grads"] + r["opt_state"]) / n
    a = raw["all"]
    row["total_mib"] = (a["params"] + a["grads"] + a["opt_state"]) / _MIB
    return row


# (row key, column title, format): bytes/param of params, grads, optimizer state and their sum,
# over all params and over the matmul weights alone.
_PARTS = (("params", "params"), ("grads", "grads"), ("opt_state", "opt"), ("total", "total"))
_COLUMNS = (
    ("label", "level", "{}"),
    ("n_params", "#params", "{:,}"),
    ("n_matmul", "#matmul", "{:,}"),
    *(
        (prefix + key, (group + title) if i == 0 else title, "{:.2f}")
        for prefix, group in (("", "all: "), ("matmul_", "matmul: "))
        for i, (key, title) in enumerate(_PARTS)
    ),
    ("total_mib", "MiB", "{:,.1f}"),
)


def memory_table(rows) -> str:
    """A plain-text table of ``bytes_per_param`` rows."""
    cells = [[title for _, title, _ in _COLUMNS]]
    cells += [[fmt.format(row[key]) for key, _, fmt in _COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    caption = "bytes per parameter (all params, then matmul weights only); MiB: params+grads+opt"
    return "\n".join([caption, *lines])


_COMPILED_FIELDS = {
    "argument": "argument_size_in_bytes",
    "output": "output_size_in_bytes",
    "alias": "alias_size_in_bytes",
    "temp": "temp_size_in_bytes",
    "generated_code": "generated_code_size_in_bytes",
}


def compiled_memory(compiled) -> dict[str, int] | None:
    """Bytes from ``compiled.memory_analysis()`` plus ``peak`` (argument + output - alias + temp).

    None when the backend reports nothing (some return None or raise).
    """
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError, TypeError):
        return None
    if isinstance(stats, list | tuple):  # older jax: one entry per device
        stats = stats[0] if stats else None
    if stats is None:
        return None
    out = {k: int(getattr(stats, attr, 0) or 0) for k, attr in _COMPILED_FIELDS.items()}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def format_compiled_memory(stats: dict[str, int] | None) -> str:
    """One line in MiB, or a note that the backend did not report."""
    if stats is None:
        return "compiled memory: not reported by this backend"
    return "compiled memory (MiB): " + ", ".join(f"{k} {v / _MIB:,.1f}" for k, v in stats.items())


_GIB = 2.0**30


def device_memory_limit() -> int | None:
    """Bytes a program may use on the first local device (``memory_stats()['bytes_limit']``);
    None where the backend does not report it (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def check_fits(stats: dict[str, int] | None, what: str, fixes: str) -> None:
    """Raise a one-line ConfigError when the compiled peak in ``stats`` (``compiled_memory``,
    per device) exceeds ``device_memory_limit``; ``fixes`` says what lowers it. Nothing to
    check where either figure is unknown."""
    limit = device_memory_limit()
    if stats is None or limit is None or stats["peak"] <= limit:
        return
    gib = lambda key: f"{stats[key] / _GIB:,.2f}"  # noqa: E731
    raise errors.ConfigError(
        f"{what} needs {stats['peak'] / _GIB:,.2f} GiB per device (arguments {gib('argument')} "
        f"+ outputs {gib('output')} - aliased {gib('alias')} + temporaries {gib('temp')} GiB), "
        f"more than the {limit / _GIB:,.2f} GiB of {jax.local_devices()[0].device_kind}; {fixes}"
    )
