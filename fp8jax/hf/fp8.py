"""FP8 serving export of Hugging Face checkpoints (E4M3 weights + f32 scales), and back to BF16.

Two layouts, both with ``quant_method: 'fp8'`` and dynamic activation scaling (the server
quantizes activations itself, so no activation scale is stored):

- ``'tensor'``: one f32 scale per weight, ``X.weight_scale`` of shape ``[]``: the layout vLLM's
  ``fp8`` method reads.
- ``'block'``: DeepSeek-V3's fine-grained layout, ``X.weight_scale_inv`` of shape
  ``[ceil(rows / b), ceil(cols / b)]``, one scale per ``b x b`` block of the stored weight
  (edge blocks are partial): what transformers' ``FineGrainedFP8Config`` and vLLM read.

In both, the stored scale is the DEQUANT multiplier, ``w ~= q * s`` (the HF convention; the
training side of fp8jax stores the inverse, ``q = w * scale``). Each scale comes from its own
tensor's or block's amax, ``s = amax / 448``, so the largest value lands on E4M3's max.

Weights are E4M3, not E5M2: a trained weight's values span a few binades around its amax, so
they need precision (3 mantissa bits) far more than E5M2's range.

The command line converts a whole HF dir one safetensors file at a time (docs/hf.md):
``python -m fp8jax.hf.fp8 SRC_DIR OUT_DIR [--to bf16|fp8-tensor|fp8-block] [--block 128]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np
import safetensors.numpy

from fp8jax import errors, provenance
from fp8jax.hf import architectures

__all__ = [
    "BF16",
    "E4M3",
    "E4M3_MAX",
    "INDEX",
    "SCHEMES",
    "SUFFIXES",
    "TARGETS",
    "check_block",
    "convert",
    "dequantize",
    "dequantize_weight",
    "is_decoder_linear",
    "is_fp8",
    "load_tensors",
    "main",
    "quantization_config",
    "quantize",
    "quantize_weight",
    "read_header",
    "save_tensors",
    "weight_of_scale",
]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
BF16 = np.dtype(ml_dtypes.bfloat16)
SCHEMES = ("tensor", "block")
SUFFIXES = {"block": "_scale_inv", "tensor": "_scale"}  # X.weight -> X.weight<suffix>
TARGETS = {"bf16": None, "fp8-tensor": "tensor", "fp8-block": "block"}
INDEX = "model.safetensors.index.json"
# Activation scales of statically quantized checkpoints: meaningless once weights are BF16.
_ACTIVATION_SCALES = (".input_scale", ".activation_scale")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".index.json")
# The decoder linears FP8 loaders swap for their FP8 layer: transformers' swaps ``nn.Linear``
# only, so GPT-2's c_attn/c_proj/c_fc (``Conv1D``, weights stored ``[in, out]``) stay BF16. An
# MoE block's experts (``experts.{j}.gate_proj``, Mixtral's ``experts.{j}.w1``/``w3``/``w2``)
# are stored one tensor per expert, each with its scales; transformers stacks them into its
# FP8 experts module on load. Routers (``gate``: transformers' router modules, no
# ``nn.Linear``) and Qwen2-MoE's ``shared_expert_gate`` stay BF16, as fp8jax's router is f32.
_LINEAR = re.compile(
    r"(^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|experts\.\d+\.w[123])"
    r"\.weight$"
)
# The output head: left in BF16 and listed even when it is tied (no tensor of its own), since a
# loader given a skip list swaps every ``nn.Linear`` not on it, the head included.
_HEAD = "lm_head"


def is_decoder_linear(name: str) -> bool:
    """Whether ``name`` is the weight of a decoder block's ``nn.Linear`` or of one routed expert
    (LLaMA-style names)."""
    return _LINEAR.search(name) is not None


def check_block(block) -> None:
    """Raise a one-line ConfigError unless ``block`` is a power of two."""
    if not (isinstance(block, int) and not isinstance(block, bool) and block > 0):
        raise errors.ConfigError(f"block size {block!r}: use a power of two such as 128")
    if block & (block - 1):
        raise errors.ConfigError(f"block size {block} is not a power of two: use e.g. 128")


def quantization_config(scheme: str, block: int = 128, skipped=()) -> dict:
    """The config.json ``quantization_config`` of ``scheme``; ``skipped``: unquantized linears."""
    errors.check_choice(scheme, SCHEMES, "FP8 scheme")
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        check_block(block)
        qconfig.update(fmt="e4m3", weight_block_size=[block, block])
        if skipped:  # transformers' FineGrainedFP8Config key
            qconfig["modules_to_not_convert"] = sorted(set(skipped))
    elif skipped:  # vLLM's Fp8Config key
        qconfig["ignored_layers"] = sorted(set(skipped))
    return qconfig


def _scale_of(amax: np.ndarray) -> np.ndarray:
    """Dequant scales ``amax / 448``; 1 for an all-zero tensor/block (its q is 0 anyway)."""
    tiny = np.finfo(np.float32).smallest_subnormal  # amax / 448 may underflow for subnormal w
    scale = np.maximum(amax.astype(np.float32) / np.float32(E4M3_MAX), tiny)
    return np.where(amax > 0, scale, np.float32(1.0)).astype(np.float32)


def _to_e4m3(x: np.ndarray) -> np.ndarray:
    # Clip first: ml_dtypes' cast turns values past 448 into NaN (E4M3 has no Inf).
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def _expand(s_GrxGc: np.ndarray, shape, block_r: int, block_c: int) -> np.ndarray:
    """Block scales (last two axes) repeated to every element of a ``shape`` weight."""
    s = np.repeat(np.repeat(s_GrxGc, block_r, axis=-2), block_c, axis=-1)
    return s[..., : shape[-2], : shape[-1]]


def quantize_weight(name: str, w_RxC, scheme: str, block: int = 128):
    """One weight as ``(q_RxC E4M3, scale f32)``: scale ``[]`` ('tensor') or ``[Rb, Cb]``."""
    w = np.asarray(w_RxC, np.float32)
    if not np.isfinite(w).all():  # never laundered into finite FP8 values
        bad = int(w.size - np.isfinite(w).sum())
        raise errors.CheckpointMismatchError(
            f"tensor {name!r} has {bad} non-finite values: fix or re-export the checkpoint"
        )
    if w.ndim != 2:
        raise errors.CheckpointMismatchError(
            f"tensor {name!r} has shape {list(w.shape)}: FP8 export quantizes 2-D weights only"
        )
    if scheme == "tensor":
        scale = _scale_of(np.asarray(np.abs(w).max(initial=0.0)))
        return _to_e4m3(w / scale), scale.reshape(())
    rows, cols = w.shape
    grid_r, grid_c = math.ceil(rows / block), math.ceil(cols / block)
    padded = np.zeros((grid_r * block, grid_c * block), np.float32)  # zeros leave amaxes alone
    padded[:rows, :cols] = np.abs(w)
    amax_RbxCb = padded.reshape(grid_r, block, grid_c, block).max(axis=(1, 3))
    del padded
    s_RbxCb = _scale_of(amax_RbxCb)
    return _to_e4m3(w / _expand(s_RbxCb, w.shape, block, block)), s_RbxCb


def quantize(
    tensors: Mapping[str, np.ndarray],
    scheme: str,
    block: int = 128,
    predicate: Callable[[str], bool] = is_decoder_linear,
) -> tuple[dict[str, np.ndarray], dict]:
    """E4M3 copies (+ scales) of the weights ``predicate`` picks; the rest as they are.

    Returns the new state dict and its ``quantization_config``. Embeddings, norms, biases,
    GPT-2's ``Conv1D`` linears and ``lm_head`` are not picked by the default predicate and keep
    their dtype; every 2-D weight not picked, and ``lm_head`` (tied or not), is listed in the
    config as not converted.
    """
    errors.check_choice(scheme, SCHEMES, "FP8 scheme")
    check_block(block)
    out, skipped = {}, ([] if predicate(f"{_HEAD}.weight") else [_HEAD])
    for name, w in tensors.items():
        if not predicate(name):
            out[name] = w
            if name.endswith(".weight") and np.ndim(w) == 2:
                skipped.append(name.removesuffix(".weight"))
            continue
        q, scale = quantize_weight(name, w, scheme, block)
        out[name], out[name + SUFFIXES[scheme]] = q, scale
    return out, quantization_config(scheme, block, skipped)


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is an FP8 value format (E4M3/E5M2 variants; E8M0 scales are not)."""
    return np.dtype(dtype).name.startswith(("float8_e4m3", "float8_e5m2"))


def weight_of_scale(name: str) -> str | None:
    """The weight a scale name belongs to ('X.weight_scale_inv' -> 'X.weight'), else None."""
    for suffix in SUFFIXES.values():
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def _block_size(qconfig: Mapping) -> tuple[int, int] | None:
    size = qconfig.get("weight_block_size")
    if size is None:
        return None
    pair = isinstance(size, (list, tuple)) and len(size) == 2
    if not (pair and all(isinstance(b, int) and b > 0 for b in size)):
        raise errors.CheckpointMismatchError(
            f"quantization_config.weight_block_size={size!r}: expected two positive integers"
        )
    return int(size[0]), int(size[1])


def _scales_f32(s, qconfig: Mapping) -> np.ndarray:
    s = np.asarray(s)
    if s.dtype == np.uint8 and qconfig.get("scale_fmt") == "ue8m0":  # E8M0 stored as bytes
        return np.exp2(s.astype(np.float32) - 127.0)
    return s.astype(np.float32)


def dequantize_weight(name: str, q, s, qconfig: Mapping, dtype=BF16) -> np.ndarray:
    """``q * s`` in ``dtype``: ``s`` one scale, broadcastable, or its block grid."""
    q_f32, s_f32 = np.asarray(q).astype(np.float32), _scales_f32(s, qconfig)
    if s_f32.size == 1:
        return (q_f32 * s_f32.reshape(())).astype(dtype)
    block = _block_size(qconfig)
    if block and q_f32.ndim >= 2 and s_f32.ndim == q_f32.ndim:
        *lead, rows, cols = q_f32.shape
        grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if tuple(s_f32.shape) == (*lead, *grid):  # leading axes: stacked experts
            return (q_f32 * _expand(s_f32, q_f32.shape, *block)).astype(dtype)
    try:
        return (q_f32 * s_f32).astype(dtype)  # per-channel scales such as [rows, 1]
    except ValueError:
        raise errors.CheckpointMismatchError(
            f"scale of {name!r} has shape {list(s_f32.shape)}, which fits neither its weight "
            f"{list(q_f32.shape)} nor weight_block_size {list(block or [])}"
        ) from None


def dequantize(
    tensors: Mapping[str, np.ndarray], quantization_config: Mapping, dtype=BF16
) -> dict[str, np.ndarray]:
    """Every FP8 weight of ``tensors`` times its scale, in ``dtype``; scales dropped.

    Reads both layouts above and DeepSeek-style checkpoints (block scales, stacked or not,
    f32 or E8M0). Tensors that are not FP8 pass through as they are.
    """
    out = {}
    for name, w in tensors.items():
        if name.endswith(_ACTIVATION_SCALES):
            continue
        weight = weight_of_scale(name)
        if weight in tensors and is_fp8(tensors[weight].dtype):
            continue  # a scale: applied to its weight
        if not is_fp8(np.asarray(w).dtype):
            out[name] = w
            continue
        names = [name + suffix for suffix in SUFFIXES.values()]
        found = [n for n in names if n in tensors]
        if not found:
            raise errors.CheckpointMismatchError(
                f"FP8 tensor {name!r} has no scale ({' or '.join(names)}): incomplete checkpoint"
            )
        out[name] = dequantize_weight(name, w, tensors[found[0]], quantization_config, dtype)
    return out


# safetensors' numpy loader cannot build BF16/FP8 arrays (numpy has no such dtypes), so files
# are read here by their documented layout: an 8-byte little-endian header length, the JSON
# header {name: {dtype, shape, data_offsets}}, then the raw bytes; ml_dtypes gives the dtypes.
_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": BF16,
    "F8_E4M3": E4M3,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_header(path: os.PathLike) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header (``__metadata__`` left out)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise errors.CheckpointMismatchError(f"{path} is not a safetensors file: {e}") from e
    header.pop("__metadata__", None)
    try:
        for entry in header.values():
            entry["offset"] = 8 + size
        end = 8 + size + max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise errors.CheckpointMismatchError(f"{path} has a malformed safetensors header") from e
    if os.path.getsize(path) < end:
        raise errors.CheckpointMismatchError(
            f"{path} is truncated: {os.path.getsize(path)} bytes where its header needs {end}; "
            f"re-download or re-export it"
        )
    return header


def load_tensors(path: os.PathLike, names=None) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file (all, or ``names``) as read-only memory-mapped arrays."""
    header = read_header(path)
    out = {}
    for name in header if names is None else names:
        entry = header[name]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise errors.CheckpointMismatchError(f"{path}: {name!r} has dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        if end == begin:  # np.memmap cannot map zero bytes
            out[name] = np.zeros(entry["shape"], dtype)
            continue
        raw = np.memmap(path, np.uint8, "r", offset=entry["offset"] + begin, shape=(end - begin,))
        out[name] = raw.view(dtype).reshape(entry["shape"])
    return out


def save_tensors(tensors: Mapping[str, np.ndarray], path: os.PathLike) -> None:
    """Write ``tensors`` as a safetensors file transformers and vLLM load (format 'pt')."""
    # np.asarray, not np.ascontiguousarray, which turns a [] scale into [1].
    contiguous = {name: np.asarray(t, order="C") for name, t in tensors.items()}
    safetensors.numpy.save_file(contiguous, str(path), metadata={"format": "pt"})


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line (the UserError path), not usage + message
        raise errors.ConfigError(f"{message}; see python -m fp8jax.hf.fp8 --help")


def _shards(src: pathlib.Path) -> dict[str, dict]:
    """{file name: header} of the checkpoint's safetensors files (the index's, if any)."""
    if (src / INDEX).is_file():
        weight_map = architectures.read_json(src / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise errors.CheckpointError(
                f"{src / INDEX} has no weight_map; it is not a shard index"
            )
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise errors.CheckpointMismatchError(
            f"no *.safetensors in {src}: pass a Hugging Face dir saved with safetensors"
        )
    missing = [f for f in files if not (src / f).is_file()]
    if missing:
        raise errors.CheckpointMismatchError(f"{src / INDEX} names missing files {missing}")
    return {f: read_header(src / f) for f in files}


def _convert_file(src, file, headers, src_q, scheme, block):
    """One shard converted: its FP8 weights' scales are fetched from wherever they live."""
    where = {name: f for f, header in headers.items() for name in header}
    tensors = dict(load_tensors(src / file))
    if src_q:
        for name in list(tensors):
            if is_fp8(tensors[name].dtype):
                for scale in (name + suffix for suffix in SUFFIXES.values()):
                    if scale in where and scale not in tensors:
                        tensors[scale] = load_tensors(src / where[scale], [scale])[scale]
            weight = weight_of_scale(name)
            if weight in where and where[weight] != file:
                del tensors[name]  # the scale of a weight in another shard: converted there
        tensors = dequantize(tensors, src_q, BF16 if scheme is None else np.float32)
    if scheme is None:
        return tensors, []
    tensors, qconfig = quantize(tensors, scheme, block)
    return tensors, qconfig.get("modules_to_not_convert", qconfig.get("ignored_layers", []))


def convert(src_dir: os.PathLike, out_dir: os.PathLike, to: str | None = None, block=128) -> str:
    """Convert a HF dir to BF16 or FP8 (``to`` in TARGETS; default: the other way); returns ``to``.

    One safetensors file in memory at a time; written to a temp dir renamed to ``out_dir``.
    """
    src, out = pathlib.Path(src_dir), pathlib.Path(out_dir)
    if not src.is_dir():
        raise errors.ConfigError(f"{src} is not a directory: pass a Hugging Face checkpoint dir")
    if not (src / "config.json").is_file():
        raise errors.CheckpointMismatchError(f"no config.json in {src}: not a Hugging Face dir")
    config = architectures.read_json(src / "config.json")
    src_q = config.pop("quantization_config", None)
    if src_q is not None and (not isinstance(src_q, dict) or src_q.get("quant_method") != "fp8"):
        method = src_q.get("quant_method") if isinstance(src_q, dict) else src_q
        raise errors.CheckpointMismatchError(f"{src} is quantized with {method!r}, not 'fp8'")
    to = to or ("bf16" if src_q else "fp8-block")
    errors.check_choice(to, TARGETS, "--to")
    check_block(block)
    provenance.check_new_output(out, "output")
    headers = _shards(src)
    scheme = TARGETS[to]
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:  # a read-only mount, another user's folder
        raise errors.ConfigError(errors.output_beside(out, e)) from None
    try:
        weight_map, total, skipped = {}, 0, set()
        for file in headers:
            tensors, skip = _convert_file(src, file, headers, src_q, scheme, block)
            save_tensors(tensors, tmp / file)
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.nbytes for t in tensors.values())
            skipped.update(skip)
        if (src / INDEX).is_file():
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if scheme is None:
            config["torch_dtype"] = "bfloat16"
        else:
            config["quantization_config"] = quantization_config(scheme, block, skipped)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for path in src.iterdir():  # tokenizer, generation config...; not other weight files
            if path.name not in {"config.json", INDEX} and not path.name.endswith(_WEIGHTS):
                copy = shutil.copytree if path.is_dir() else shutil.copy2
                copy(path, tmp / path.name)
        os.rename(tmp, out)  # atomic; replaces an empty dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to


def main(argv=None) -> int:
    """The command line; a bad input is one stderr line and exit code 2."""
    parser = _Parser(prog="python -m fp8jax.hf.fp8", description=__doc__.split("\n")[0])
    parser.add_argument("src_dir", help="Hugging Face checkpoint dir (safetensors)")
    parser.add_argument("out_dir", help="new (or empty) dir to write")
    parser.add_argument("--to", help=f"{' | '.join(TARGETS)} (default: bf16 if SRC is FP8)")
    parser.add_argument("--block", type=int, default=128, help="block size of fp8-block")
    try:
        args = parser.parse_args(argv)
        to = convert(args.src_dir, args.out_dir, args.to, args.block)
    except errors.USER_ERRORS as e:
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} ({to})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
