"""Rotary position embedding (RoPE) in the rotate-half layout, with Llama 3's frequency scaling.

Shape suffixes: B batch, L sequence length, N heads, H head dim (H2 its half).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8jax.models.config import RopeScaling

__all__ = [
    "rope",
    "rope_frequencies",
]


def rope_frequencies(half: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """RoPE's ``half`` inverse frequencies ``theta**(-i/half)``, Llama 3-scaled if ``scaling``."""
    inv_freq_H2 = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return inv_freq_H2
    s = scaling
    wavelen_H2 = 2 * math.pi / inv_freq_H2
    # 0 where the wavelength is long (fully slowed), 1 where short (kept), linear in between.
    smooth_H2 = (s.original_max_len / wavelen_H2 - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smooth_H2 = jnp.clip(smooth_H2, 0.0, 1.0)
    return (1 - smooth_H2) * inv_freq_H2 / s.factor + smooth_H2 * inv_freq_H2


def rope(
    x_BxLxNxH: jax.Array,
    positions_BxL: jax.Array,
    theta: float,
    scaling: RopeScaling | None = None,
) -> jax.Array:
    """Rotary position embedding, rotate-half layout (pairs dimension i with i + H/2)."""
    half = x_BxLxNxH.shape[-1] // 2
    inv_freq_H2 = rope_frequencies(half, theta, scaling)
    angle_BxLxH2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_H2
    sin = jnp.sin(angle_BxLxH2)[:, :, None, :]  # [B, L, 1, H/2]
    cos = jnp.cos(angle_BxLxH2)[:, :, None, :]
    # Rotate in f32: bf16 angles lose the position for long sequences.
    x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxH.dtype)
