"""Load a Hugging Face dir or an fp8jax work dir; export either as a HF dir (BF16 safetensors).

Import reads ``model.safetensors`` (or the shards ``model.safetensors.index.json`` lists) one
file and one tensor at a time straight into preallocated buffers of the final params tree, so
the model is never twice in host memory; every name and shape is checked against the
architecture before any data is read. Export writes into a temporary sibling folder and renames
it into place, so the output dir is either complete or absent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from fp8jax import _timing, errors, provenance, spec
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import CheckpointError
from fp8jax.hf import architectures, weights, workdir
from fp8jax.models.config import ModelConfig
from fp8jax.tokenizer import Tokenizer

__all__ = [
    "EXPORT_DTYPES",
    "MAX_SHARD_BYTES",
    "MOE_RUN_FIELDS",
    "SAFETENSORS",
    "SAFETENSORS_INDEX",
    "TOKENIZER_FILES",
    "Loaded",
    "architecture",
    "default_model_cfg",
    "export",
    "load",
    "load_hf_params",
    "load_params",
    "model_config",
    "safetensors_files",
    "save_hf",
    "tokenizer",
]

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size (5 GB)
# Tokenizer files a HF dir carries over to its export unchanged.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
EXPORT_DTYPES = ("bfloat16", "float16", "float32")
# The MoeSpec fields that say how the experts are trained and run, not what they are: a base
# config that declares experts keeps its own (a checkpoint's are its run's, or for a HF dir the
# router loss coefficients of its config.json and fp8jax's defaults).
MOE_RUN_FIELDS = (
    "dispatch",
    "capacity_factor",
    "aux_loss_coef",
    "z_loss_coef",
    "bias_update_rate",
    "fp8_dispatch",
)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A checkpoint in fp8jax terms: model config, the Transformer's ``params`` tree (host
    numpy arrays in ``model_cfg.param_dtype``; ``jax.device_put`` places them) and tokenizer."""

    model_cfg: ModelConfig
    params: dict[str, Any]
    tokenizer: Tokenizer


def default_model_cfg() -> ModelConfig:
    """The base config's model at level O0 (f32, no FP8): the training fields of an import."""
    from fp8jax.configs import base

    config = base.get_config()
    config.fp8.level = "O0"
    return spec.parse(config).model


def _kind(path: Path) -> str:
    if (path / architectures.CONFIG).is_file():
        return "hf"
    if workdir.is_workdir(path):
        return "workdir"
    raise CheckpointError(
        f"{path} is neither a Hugging Face model dir (no {architectures.CONFIG}) nor an fp8jax "
        "work dir (no checkpoints/); pass one of those"
    )


def architecture(path: str | os.PathLike) -> dict[str, Any]:
    """ModelConfig architecture fields -> values of a HF dir (config.json) or a work dir."""
    path = Path(path)
    if _kind(path) == "hf":
        config_path = path / architectures.CONFIG
        config = architectures.read_json(config_path)
        _check_unquantized(config, path)
        return architectures.from_hf_config(config, str(config_path))
    return workdir.architecture(path)


def _check_unquantized(hf_config: dict, path: Path) -> None:
    """Refuse a quantized HF dir (an FP8 serving export among them) in one line."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        raise CheckpointError(
            f"{path} is an FP8 serving export (quantization_config 'fp8'), which fp8jax does not "
            f"load; convert it back first: python -m fp8jax.hf.fp8 {shlex.quote(str(path))} "
            f"{shlex.quote(f'{path}-bf16')} --to bf16"
        )
    raise CheckpointError(
        f"{path} is quantized with {method!r}; fp8jax loads unquantized checkpoints only"
    )


def load(path: str | os.PathLike, model_cfg_base: ModelConfig | None = None) -> Loaded:
    """Model config, params and tokenizer of a HF dir or an fp8jax work dir.

    The architecture comes from the checkpoint, the training fields (dtypes, scan, fused QKV,
    remat, FP8 recipe) from ``model_cfg_base`` (default :func:`default_model_cfg`); where both
    have experts, ``model_cfg_base``'s MOE_RUN_FIELDS too. A work dir without ``model.json``
    takes its architecture from ``model_cfg_base``.
    """
    path = Path(path).expanduser().absolute()  # orbax restores work dirs from absolute paths
    model_cfg = model_config(path, model_cfg_base)
    tok = tokenizer(path)  # a bad tokenizer is refused before the weights are read
    return Loaded(model_cfg, load_params(path, model_cfg), tok)


def load_params(path: str | os.PathLike, model_cfg: ModelConfig) -> dict[str, Any]:
    """The params tree ``load`` gives (host numpy arrays in ``param_dtype``), read for
    ``model_cfg`` (``model_config``'s, whose layout it takes): the weights alone."""
    path = Path(path).expanduser().absolute()  # orbax restores work dirs from absolute paths
    if _kind(path) == "workdir":
        saved_cfg = dataclasses.replace(model_cfg, **workdir.layout(path))
        flat = workdir.restore_params(path, saved_cfg)
        flat = weights.relayout(saved_cfg, flat, model_cfg)  # to the caller's scan / fused QKV
    else:
        with _timing.stage("read"):
            flat = load_hf_params(path, model_cfg)
    return weights.unflatten(flat)


def model_config(path: str | os.PathLike, model_cfg_base: ModelConfig | None = None) -> ModelConfig:
    """The ``model_cfg`` that ``load(path, model_cfg_base)`` gives, from the checkpoint's records
    alone (no weight read): a caller can trace and compile the model while ``load`` reads them."""
    path = Path(path).expanduser().absolute()
    kind = _kind(path)
    base = model_cfg_base or default_model_cfg()
    recorded = kind == "hf" or (path / provenance.MODEL_RECORD).is_file()
    # A work dir without a model record: the caller's base config is its architecture.
    fields = architecture(path) if recorded or model_cfg_base is None else {}
    if base.moe is not None and fields.get("moe") is not None:
        kept = {k: getattr(base.moe, k) for k in MOE_RUN_FIELDS}
        fields = dict(fields, moe=dataclasses.replace(fields["moe"], **kept))
    return dataclasses.replace(base, **fields)


def tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a HF dir or an fp8jax work dir (the one ``load`` gives); one whose
    tokenizer.json does not parse is a one-line CheckpointError naming it."""
    path = Path(path).expanduser().absolute()
    if _kind(path) == "workdir":
        read, restore = workdir.tokenizer, "the tokenizer the checkpoint was trained with"
    else:
        read, restore = tokenizer_lib.load_hf, "it (re-download or re-export the model)"
    try:
        return read(path)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    except Exception as e:  # tokenizers raises its own exception types for bad JSON
        raise CheckpointError(
            f"{path / tokenizer_lib.HF_TOKENIZER} is not a readable tokenizer.json ({e}); "
            f"restore {restore}"
        ) from None


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF dir, in the index's order (one file if unsharded)."""
    index_path = directory / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = architectures.read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map; it is not a shard index")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
    elif (directory / SAFETENSORS).is_file():
        files = [directory / SAFETENSORS]
    else:
        raise CheckpointError(
            f"{directory} has no {SAFETENSORS} nor {SAFETENSORS_INDEX}; save the model with "
            "transformers' save_pretrained (safetensors is its default format)"
        )
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f} is missing ({index_path.name} lists it); restore it")
    return files


def load_hf_params(directory: str | os.PathLike, model_cfg: ModelConfig) -> dict:
    """The flat params of a HF dir's safetensors, checked tensor by tensor against the table."""
    directory = Path(directory)
    table = {t.name: t for t in weights.hf_tensors(model_cfg)}
    files = safetensors_files(directory)
    found: dict[str, Path] = {}
    for f in files:  # names and shapes first: refuse a bad checkpoint before reading data
        with _safe_open(f) as st:
            for name in st.keys():
                shape = tuple(st.get_slice(name).get_shape())
                if name not in table:
                    if weights.is_ignored(name, model_cfg):
                        continue
                    raise CheckpointError(
                        f"{f.name} holds tensor {name} {list(shape)}, which the "
                        f"{architectures.export_name(model_cfg)} architecture of "
                        f"{architectures.CONFIG} does not have"
                    )
                if shape != table[name].shape:
                    raise CheckpointError(
                        f"tensor {name} in {f.name} has shape {list(shape)}, but "
                        f"{architectures.CONFIG} implies {list(table[name].shape)}"
                    )
                found[name] = f
    missing = [name for name in table if name not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{directory} lacks tensor {missing[0]}{more}; it is incomplete")
    buffers = weights.empty_params(model_cfg)
    for f in files:
        with _safe_open(f) as st:
            for name in st.keys():
                if name in table and found[name] == f:
                    tensor = st.get_tensor(name)
                    _check_finite(tensor, f"tensor {name} in {f}", _NON_FINITE_FIX)
                    weights.fill(model_cfg, buffers, table[name], tensor)
    return buffers


@contextlib.contextmanager
def _safe_open(f: Path):
    """``safetensors.safe_open(f)``; a truncated or malformed file is a one-line CheckpointError."""
    try:
        with safetensors.safe_open(str(f), framework="numpy") as st:
            yield st
    except safetensors.SafetensorError as e:
        raise CheckpointError(
            f"{f} is not a readable safetensors file ({e}); it may be truncated: re-download "
            f"or re-export it"
        ) from None


_NON_FINITE_FIX = (
    "non-finite weights cannot train or serve: re-download or re-export the checkpoint"
)


def _export_fix(dtype: np.dtype) -> str:
    if dtype == np.float16:
        return "a value past float16's range: export with --dtype bfloat16 or float32"
    return "non-finite weights cannot serve: export an earlier checkpoint of the run"


def _check_finite(array: np.ndarray, what: str, fix: str) -> None:
    """Raise a one-line CheckpointError naming ``what`` and ``fix`` if ``array`` holds NaN/Inf."""
    if array.dtype.kind not in "fcV" and "float" not in array.dtype.name:
        return
    finite = np.isfinite(array)
    if not finite.all():
        count = int(finite.size - np.count_nonzero(finite))
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise CheckpointError(
            f"{what} holds {count} NaN/Inf values (the first at index {list(first)}: "
            f"{array[first]}); {fix}"
        )


def save_hf(
    out_dir: str | os.PathLike,
    model_cfg: ModelConfig,
    params,
    tokenizer: Tokenizer,
    dtype: str = "bfloat16",
    max_shard_bytes: int = MAX_SHARD_BYTES,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a HF model dir (safetensors in ``dtype``, config, tokenizer) atomically.

    ``tokenizer_dir``: a HF dir whose tokenizer and generation config files are copied as they
    are (else they are written from ``tokenizer``). Refuses a non-empty ``out_dir``.
    """
    out_dir = Path(out_dir).absolute()
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}: use one of {list(EXPORT_DTYPES)}")
    provenance.check_new_output(out_dir, "output", CheckpointError)
    model_cfg.family.check_hf_export(model_cfg)  # e.g. GPT-2 has no grouped-query attention
    window = model_cfg.sliding_window
    if window and "sliding_window" not in model_cfg.family.to_hf_config(model_cfg):
        raise CheckpointError(
            f"{architectures.export_name(model_cfg)} has no sliding-window attention: a model "
            f"with model.sliding_window={window} has no Hugging Face form to export as"
        )
    flat = weights.flatten(params)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:  # a read-only mount, another user's folder
        raise CheckpointError(errors.output_beside(out_dir, e)) from None
    try:
        _write_tensors(tmp, model_cfg, flat, np.dtype(dtype), max_shard_bytes)
        config = architectures.hf_config(model_cfg, tokenizer.eos_id, tokenizer.bos_id)
        _write_json(tmp / architectures.CONFIG, config)
        _write_tokenizer(tmp, tokenizer, model_cfg, tokenizer_dir)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tensors(out: Path, model_cfg: ModelConfig, flat, dtype, max_shard_bytes: int) -> None:
    """The safetensors shards (each under ``max_shard_bytes`` unless one tensor is larger)."""
    tensors = weights.hf_tensors(model_cfg)
    shards: list[list[weights.HfTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = int(np.prod(t.shape)) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    names = [SAFETENSORS]
    if len(shards) > 1:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards, strict=True):
        arrays = {t.name: weights.gather(model_cfg, flat, t, dtype) for t in shard}
        for tensor_name, array in arrays.items():  # NaN/Inf, or a value past dtype's range
            _check_finite(array, f"tensor {tensor_name} (in {dtype.name})", _export_fix(dtype))
        safetensors.numpy.save_file(arrays, str(out / name), metadata={"format": "pt"})
        total += sum(a.nbytes for a in arrays.values())
        weight_map.update(dict.fromkeys(arrays, name))
        del arrays  # one shard in memory at a time
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out / SAFETENSORS_INDEX, index)


def _write_tokenizer(out: Path, tok: Tokenizer, model_cfg: ModelConfig, source) -> None:
    if source is not None:
        source = Path(source)
        for name in (*TOKENIZER_FILES, architectures.GENERATION_CONFIG):
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
        return
    tok.save(out / "tokenizer.json")
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        eos_token=tok.eos_token,
        bos_token=tok.bos_token,
        model_max_length=model_cfg.max_len,
        clean_up_tokenization_spaces=False,
    )
    if tok.pad_id is not None:
        config["pad_token"] = tok.id_to_token(tok.pad_id)
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    _write_json(out / "tokenizer_config.json", config)
    generation = dict(eos_token_id=list(tok.eos_ids) if len(tok.eos_ids) > 1 else tok.eos_id)
    if tok.bos_id is not None:
        generation["bos_token_id"] = tok.bos_id
    _write_json(out / architectures.GENERATION_CONFIG, generation)


def export(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Export a work dir (or re-export a HF dir) to the HF dir ``out_dir`` in ``dtype``."""
    src = Path(src)
    provenance.check_new_output(Path(out_dir).absolute(), "output", CheckpointError)
    loaded = load(src)
    tokenizer_dir = src if _kind(src) == "hf" else None
    return save_hf(
        out_dir,
        loaded.model_cfg,
        loaded.params,
        loaded.tokenizer,
        dtype,
        max_shard_bytes,
        tokenizer_dir,
    )
