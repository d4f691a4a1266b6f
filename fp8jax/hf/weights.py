"""Hugging Face tensor names and layouts <-> the fp8jax Transformer's ``params`` tree.

Each HF tensor is described by its name, its shape and the *pieces* it maps to: a piece is a
numpy view of the HF tensor (reshape / transpose / index, never a copy) that equals one slice
of one fp8jax leaf. Import copies each view into preallocated buffers of the final tree;
export writes each fp8jax slice into the view of an empty HF tensor. The same table serves
both directions, so they cannot disagree.

Layouts: torch ``Linear`` weights are ``[out, in]``, GPT-2's ``Conv1D`` kernels ``[in, out]``;
fp8jax's kernels are ``[in..., out...]`` (``q [D, N, H]``, ``kv [D, 2, K, H]``, fused
``qkv [D, K, G+2, H]`` with query head ``kv * G + j``, ``o [N, H, D]``, LLaMA's ``wi [D, 2, F]``
with gate then up). HF's LLaMA q/k weights are already in rotate-half order, as fp8jax's RoPE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import linen as nn
from flax import traverse_util

from fp8jax.models import build_model
from fp8jax.models.config import ModelConfig

ALL = slice(None)
# Buffers HF models register in their state dicts that are not weights (GPT-2's causal mask,
# old LLaMA's RoPE frequencies).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


@dataclasses.dataclass(frozen=True)
class Piece:
    """``view(hf_tensor)`` equals ``leaf[index]`` of one block (or of the top level)."""

    leaf: tuple[str, ...]  # path inside a block's params, or from the top for non-block leaves
    index: tuple  # basic index into the leaf (per layer); () = all of it
    view: Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One tensor of the HF state dict and where its values live in the fp8jax tree."""

    name: str
    shape: tuple[int, ...]
    layer: int | None  # block index, None for embeddings, final norm and head
    pieces: tuple[Piece, ...]


def leaf_key(model_cfg: ModelConfig, piece: Piece, layer: int | None):
    """(flat params path, index into that leaf) of ``piece`` for ``layer``."""
    if layer is None:
        return piece.leaf, piece.index
    if model_cfg.scan_layers:  # nn.scan stacks the blocks on a leading axis
        return ("blocks", *piece.leaf), (layer, *piece.index)
    return (f"block_{layer}", *piece.leaf), piece.index


def one(name: str, shape, layer: int | None, leaf, index=(), view=None) -> HfTensor:
    """A HF tensor that is one slice of one fp8jax leaf (``view`` default: as it is)."""
    return HfTensor(name, tuple(shape), layer, (Piece(tuple(leaf), index, view or _same),))


def _attn_pieces(m: ModelConfig, qkv: str, part: str, views: Callable[[int], Callable]) -> tuple:
    """Pieces of the q, k or v part (``qkv``) of a projection's kernel or bias (``part``).

    ``views(rank)`` gives the HF view whose trailing axes are [K, G, H] (rank 3: queries,
    grouped as the fused kernel holds them) or [N or K, H] (rank 2).
    """
    g = m.num_heads // m.num_kv_heads
    lead = (ALL,) if part == "kernel" else ()  # the kernel's input axis D
    if m.fused_qkv:
        slot = {"q": slice(0, g), "k": g, "v": g + 1}[qkv]
        return (Piece(("attn", "qkv", part), (*lead, ALL, slot), views(3 if qkv == "q" else 2)),)
    if qkv == "q":
        return (Piece(("attn", "q", part), (), views(2)),)
    return (Piece(("attn", "kv", part), (*lead, "kv".index(qkv)), views(2)),)


def llama_tensors(m: ModelConfig) -> list[HfTensor]:
    """LLaMA / Mistral / Qwen2 state dict (torch Linear [out, in])."""
    d, n, kh, h, f, v = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    g = n // kh
    out = [one("model.embed_tokens.weight", (v, d), None, ("embed", "embedding"))]
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        for qkv, heads in (("q", n), ("k", kh), ("v", kh)):

            def kernel_views(rank, heads=heads):  # [heads * H, D] -> [D, heads, H] / [D, K, G, H]
                if rank == 3:
                    return lambda w: w.reshape(kh, g, h, d).transpose(3, 0, 1, 2)
                return lambda w: w.reshape(heads, h, d).transpose(2, 0, 1)

            def bias_views(rank, heads=heads):
                shape = (kh, g, h) if rank == 3 else (heads, h)
                return lambda b: b.reshape(shape)

            name = f"{p}self_attn.{qkv}_proj"
            pieces = _attn_pieces(m, qkv, "kernel", kernel_views)
            out.append(HfTensor(f"{name}.weight", (heads * h, d), i, pieces))
            if m.qkv_bias:
                pieces = _attn_pieces(m, qkv, "bias", bias_views)
                out.append(HfTensor(f"{name}.bias", (heads * h,), i, pieces))
        o_view = lambda w: w.reshape(d, n, h).transpose(1, 2, 0)  # [D, N*H] -> [N, H, D]
        out += [
            one(f"{p}self_attn.o_proj.weight", (d, n * h), i, ("attn", "o", "kernel"), (), o_view),
            one(f"{p}mlp.gate_proj.weight", (f, d), i, ("mlp", "wi", "kernel"), (ALL, 0), _t),
            one(f"{p}mlp.up_proj.weight", (f, d), i, ("mlp", "wi", "kernel"), (ALL, 1), _t),
            one(f"{p}mlp.down_proj.weight", (d, f), i, ("mlp", "wo", "kernel"), (), _t),
            one(f"{p}input_layernorm.weight", (d,), i, ("attn_norm", "scale")),
            one(f"{p}post_attention_layernorm.weight", (d,), i, ("mlp_norm", "scale")),
        ]
    out.append(one("model.norm.weight", (d,), None, ("final_norm", "scale")))
    if not m.tie_embeddings:
        out.append(one("lm_head.weight", (v, d), None, ("head", "kernel"), (), _t))
    return out


def gpt2_tensors(m: ModelConfig) -> list[HfTensor]:
    """GPT-2 state dict (Conv1D kernels [in, out]; c_attn's output is q | k | v)."""
    d, n, h, f, v = m.d_model, m.num_heads, m.head_dim, m.d_ff, m.vocab_size
    k, g = m.num_kv_heads, m.num_heads // m.num_kv_heads

    def c_attn(qkv, part):
        j = "qkv".index(qkv)
        lead = (d,) if part == "kernel" else ()  # [D, 3D] or [3D]

        def views(rank):
            shape = (*lead, 3, k, g, h) if rank == 3 else (*lead, 3, n, h)
            return lambda w: w.reshape(shape)[(ALL,) * len(lead) + (j,)]

        return _attn_pieces(m, qkv, part, views)

    def norm(name, leaf, i):
        return [one(f"{name}.weight", (d,), i, (leaf, "scale")),
                one(f"{name}.bias", (d,), i, (leaf, "bias"))]  # fmt: skip

    out = [
        one("transformer.wte.weight", (v, d), None, ("embed", "embedding")),
        one("transformer.wpe.weight", (m.max_len, d), None, ("pos_embed",)),
    ]
    o_view = lambda w: w.reshape(n, h, d)  # [N*H, D] -> [N, H, D]
    for i in range(m.num_layers):
        p = f"transformer.h.{i}."
        w_pieces = sum((c_attn(qkv, "kernel") for qkv in "qkv"), ())
        b_pieces = sum((c_attn(qkv, "bias") for qkv in "qkv"), ())
        out += norm(f"{p}ln_1", "attn_norm", i)
        out += [
            HfTensor(f"{p}attn.c_attn.weight", (d, 3 * d), i, w_pieces),
            HfTensor(f"{p}attn.c_attn.bias", (3 * d,), i, b_pieces),
            one(f"{p}attn.c_proj.weight", (d, d), i, ("attn", "o", "kernel"), (), o_view),
            one(f"{p}attn.c_proj.bias", (d,), i, ("attn", "o", "bias")),
        ]
        out += norm(f"{p}ln_2", "mlp_norm", i)
        out += [
            one(f"{p}mlp.c_fc.weight", (d, f), i, ("mlp", "wi", "kernel")),
            one(f"{p}mlp.c_fc.bias", (f,), i, ("mlp", "wi", "bias")),
            one(f"{p}mlp.c_proj.weight", (f, d), i, ("mlp", "wo", "kernel")),
            one(f"{p}mlp.c_proj.bias", (d,), i, ("mlp", "wo", "bias")),
        ]
    out += norm("transformer.ln_f", "final_norm", None)
    if not m.tie_embeddings:
        out.append(one("lm_head.weight", (v, d), None, ("head", "kernel"), (), _t))
    return out


def _same(x):
    return x


def _t(x):
    return x.T


def hf_tensors(model_cfg: ModelConfig) -> list[HfTensor]:
    """Every tensor of the HF state dict of ``model_cfg``'s family, in HF's order."""
    if model_cfg.num_heads % model_cfg.num_kv_heads:
        raise ValueError(f"num_heads {model_cfg.num_heads} is not a multiple of num_kv_heads")
    return gpt2_tensors(model_cfg) if model_cfg.style == "gpt" else llama_tensors(model_cfg)


def is_ignored(name: str, model_cfg: ModelConfig) -> bool:
    """Whether a HF tensor that the table does not list may be skipped (non-weight buffers;
    a tied model's duplicate ``lm_head.weight``)."""
    return name.endswith(IGNORED_SUFFIXES) or (
        model_cfg.tie_embeddings and name == "lm_head.weight"
    )


def param_shapes(model_cfg: ModelConfig) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """The Transformer's params as a flat dict of path -> ShapeDtypeStruct (nothing allocated)."""
    model = build_model(model_cfg)
    tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
    shapes = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), tokens)
    return traverse_util.flatten_dict(nn.unbox(shapes)["params"])


def empty_params(model_cfg: ModelConfig) -> dict[tuple[str, ...], np.ndarray]:
    """Uninitialised host buffers of every params leaf, in ``param_dtype``."""
    dtype = np.dtype(model_cfg.param_dtype)
    return {k: np.empty(s.shape, dtype) for k, s in param_shapes(model_cfg).items()}


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


def unflatten(flat: dict) -> dict:
    """A nested params dict from a flat one."""
    return traverse_util.unflatten_dict(flat)


def flatten(params) -> dict:
    """A flat path -> array dict of a nested params tree."""
    return traverse_util.flatten_dict(nn.unbox(params))
