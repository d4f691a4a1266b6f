"""Hugging Face tensor names and layouts <-> the fp8jax Transformer's ``params`` tree.

A model family lists its HF state dict as ``HfTensor`` rows (``Family.hf_tensors``; the rows
and pieces: ``fp8jax.models.hf_table``). Import copies each piece's view into preallocated
buffers of the final tree; export writes each fp8jax slice into the view of an empty HF tensor.
The same table serves both directions, so they cannot disagree.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn
from flax import traverse_util

from fp8jax.models import abstract_variables
from fp8jax.models.config import ModelConfig
from fp8jax.models.hf_table import HfTensor, Piece

__all__ = [
    "IGNORED_SUFFIXES",
    "HfTensor",
    "check_coverage",
    "empty_params",
    "fill",
    "flatten",
    "gather",
    "hf_tensors",
    "is_ignored",
    "leaf_key",
    "param_shapes",
    "relayout",
    "unflatten",
]

# Buffers HF models register in their state dicts that are not weights (GPT-2's causal mask,
# old LLaMA's RoPE frequencies).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def leaf_key(model_cfg: ModelConfig, piece: Piece, layer: int | None):
    """(flat params path, index into that leaf) of ``piece`` for ``layer``."""
    if layer is None:
        return piece.leaf, piece.index
    if model_cfg.scan_layers:  # nn.scan stacks the blocks on a leading axis
        return ("blocks", *piece.leaf), (layer, *piece.index)
    return (f"block_{layer}", *piece.leaf), piece.index


def hf_tensors(model_cfg: ModelConfig) -> list[HfTensor]:
    """Every tensor of the HF state dict of ``model_cfg``'s family, in HF's order."""
    if model_cfg.num_heads % model_cfg.num_kv_heads:
        raise ValueError(f"num_heads {model_cfg.num_heads} is not a multiple of num_kv_heads")
    return model_cfg.family.hf_tensors(model_cfg)


def is_ignored(name: str, model_cfg: ModelConfig) -> bool:
    """Whether a HF tensor that the table does not list may be skipped (non-weight buffers;
    a tied model's duplicate ``lm_head.weight``)."""
    return name.endswith(IGNORED_SUFFIXES) or (
        model_cfg.tie_embeddings and name == "lm_head.weight"
    )


def param_shapes(model_cfg: ModelConfig) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """The Transformer's params as a flat dict of path -> ShapeDtypeStruct (nothing allocated)."""
    return traverse_util.flatten_dict(abstract_variables(model_cfg)["params"])


def empty_params(model_cfg: ModelConfig) -> dict[tuple[str, ...], np.ndarray]:
    """Uninitialised host buffers of every params leaf, each in its own dtype (``param_dtype``;
    an MoE router's kernel f32 whatever it)."""
    return {k: np.empty(s.shape, s.dtype) for k, s in param_shapes(model_cfg).items()}


def check_coverage(model_cfg: ModelConfig, tensors: list[HfTensor]) -> None:
    """Raise if the table leaves an fp8jax leaf unwritten (a mapping bug, not bad input)."""
    shapes = param_shapes(model_cfg)
    written = {k: np.zeros(s.shape, bool) for k, s in shapes.items()}
    for t in tensors:
        for piece in t.pieces:
            path, index = leaf_key(model_cfg, piece, t.layer)
            written[path][index] = True
    missing = [traverse_util.unflatten_dict({k: 0}) for k, w in written.items() if not w.all()]
    if missing:
        raise RuntimeError(f"the HF mapping leaves params unwritten: {missing[:3]}")


def fill(model_cfg: ModelConfig, buffers: dict, tensor: HfTensor, value: np.ndarray) -> None:
    """Copy the HF tensor ``value`` into its slices of the flat ``buffers``."""
    for piece in tensor.pieces:
        path, index = leaf_key(model_cfg, piece, tensor.layer)
        target = buffers[path]
        part = piece.view(value)
        if target[index].shape != part.shape:
            raise RuntimeError(f"{tensor.name}: piece {part.shape} vs {path} {target[index].shape}")
        target[index] = part


def gather(model_cfg: ModelConfig, flat_params: dict, tensor: HfTensor, dtype) -> np.ndarray:
    """The HF tensor ``tensor`` assembled from the flat fp8jax params, in ``dtype``."""
    out = np.empty(tensor.shape, dtype)
    for piece in tensor.pieces:
        path, index = leaf_key(model_cfg, piece, tensor.layer)
        view = piece.view(out)
        assert np.shares_memory(view, out), f"{tensor.name}: the view copies"
        view[...] = np.asarray(flat_params[path][index]).astype(dtype)
    return out


def relayout(src_cfg: ModelConfig, flat: dict, dst_cfg: ModelConfig) -> dict:
    """Flat params of ``src_cfg``'s layout (scan_layers, fused_qkv) in ``dst_cfg``'s."""
    if (src_cfg.scan_layers, src_cfg.fused_qkv) == (dst_cfg.scan_layers, dst_cfg.fused_qkv):
        return flat
    buffers = empty_params(dst_cfg)
    pairs = zip(hf_tensors(src_cfg), hf_tensors(dst_cfg), strict=True)
    for src, dst in pairs:  # the same HF tensors, in the same order
        fill(
            dst_cfg,
            buffers,
            dst,
            gather(src_cfg, flat, src, buffers[_first_leaf(dst_cfg, dst)].dtype),
        )
    return buffers


def _first_leaf(model_cfg: ModelConfig, tensor: HfTensor) -> tuple[str, ...]:
    return leaf_key(model_cfg, tensor.pieces[0], tensor.layer)[0]


def unflatten(flat: dict) -> dict:
    """A nested params dict from a flat one."""
    return traverse_util.unflatten_dict(flat)


def flatten(params) -> dict:
    """A flat path -> array dict of a nested params tree."""
    return traverse_util.flatten_dict(nn.unbox(params))
