"""Hugging Face ``config.json`` <-> the architecture fields of a ``ModelConfig``.

Only the architecture (``models.config.Architecture``) lives in a checkpoint: the execution
fields of a ``ModelConfig`` (dtypes, layer scan, fused QKV, remat, the FP8 recipe ...) come
from a base config, as ``dataclasses.replace(base, **architecture_fields)``. Each model family
(``fp8jax.models.families``) maps its own config.json keys.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from fp8jax.configs import base, fields
from fp8jax.errors import CheckpointError, ConfigError
from fp8jax.models.config import Architecture, ModelConfig, MoeSpec, RopeScaling
from fp8jax.models.families import FAMILIES, Family

__all__ = [
    "ARCHITECTURE_FIELDS",
    "CONFIG",
    "GENERATION_CONFIG",
    "MODEL_TYPES",
    "SUPPORTED",
    "architecture_name",
    "export_name",
    "family_of",
    "fields_of",
    "from_hf_config",
    "from_json",
    "hf_config",
    "read_json",
    "to_json",
]

# The HF architectures the registered families import, and config.json model_type -> one.
SUPPORTED = tuple(a for family in FAMILIES.values() for a in family.hf_architectures)
MODEL_TYPES = {k: a for family in FAMILIES.values() for k, a in family.hf_model_types.items()}
# The ModelConfig fields a checkpoint determines.
ARCHITECTURE_FIELDS = tuple(f.name for f in dataclasses.fields(Architecture))
# What the architecture fields added after the first work-dir records mean where a record
# lacks them: the architecture those records could only describe.
_DEFAULTS = {"qk_norm": "", "sliding_window": 0, "moe": None, "head_width": 0}
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; CheckpointError (one line) if it is missing or malformed."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore the file") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def architecture_name(hfc: dict[str, Any], where: str = CONFIG) -> str:
    """The supported architecture a config.json describes; CheckpointError naming the others."""
    names = hfc.get("architectures") or [MODEL_TYPES.get(hfc.get("model_type"), "")]
    name = names[0] if isinstance(names, list) and names else str(names)
    if name not in SUPPORTED:
        found = name or f"model_type {hfc.get('model_type')!r}"
        raise CheckpointError(
            f"{where} describes {found}, which fp8jax cannot import: supported architectures "
            f"are {', '.join(SUPPORTED)}"
        )
    return name


def family_of(architecture: str) -> Family:
    """The registered family that imports the HF ``architecture`` (one of SUPPORTED)."""
    return next(f for f in FAMILIES.values() if architecture in f.hf_architectures)


def from_hf_config(hfc: dict[str, Any], where: str = CONFIG) -> dict[str, Any]:
    """The ModelConfig architecture fields (ARCHITECTURE_FIELDS) of a HF config.json dict."""
    name = architecture_name(hfc, where)
    try:
        out = family_of(name).from_hf_config(hfc, name, where)
    except CheckpointError:
        raise
    except (ArithmeticError, TypeError, ValueError) as e:  # a zero head count, a str size
        raise CheckpointError(
            f"{where} is malformed ({type(e).__name__}: {e}); restore it"
        ) from None
    return _checked(out, where)


def export_name(model_cfg: ModelConfig) -> str:
    """The HF architecture an fp8jax model exports as (its family's choice, e.g. Qwen2 or
    LLaMA)."""
    return model_cfg.family.hf_export_name(model_cfg)


def hf_config(model_cfg: ModelConfig, eos_id: int | None = None, bos_id: int | None = None):
    """config.json of ``model_cfg`` for export (BF16 weights, transformers' key names)."""
    m = model_cfg
    common = dict(
        architectures=[export_name(m)],
        torch_dtype="bfloat16",
        vocab_size=m.vocab_size,
        tie_word_embeddings=m.tie_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    return dict(common, **m.family.to_hf_config(m))


def to_json(fields: dict[str, Any]) -> dict[str, Any]:
    """Architecture fields as JSON values (RopeScaling as a dict)."""
    out = dict(fields)
    for key in ("rope_scaling", "moe"):
        if out.get(key) is not None:
            out[key] = dataclasses.asdict(out[key])
    return out


def from_json(value: dict[str, Any], where: str) -> dict[str, Any]:
    """Architecture fields from :func:`to_json`'s form; CheckpointError if any is missing."""
    missing = [k for k in ARCHITECTURE_FIELDS if k not in value and k not in _DEFAULTS]
    if missing:
        raise CheckpointError(f"{where} lacks the model fields {missing}; it is incomplete")
    out = {k: value.get(k, _DEFAULTS.get(k)) for k in ARCHITECTURE_FIELDS}
    _checked(out, where)
    try:
        if out["rope_scaling"] is not None:
            out["rope_scaling"] = RopeScaling(**out["rope_scaling"])
        if out["moe"] is not None:
            out["moe"] = MoeSpec(**out["moe"])
    except (TypeError, ValueError) as e:  # a malformed section
        raise CheckpointError(f"{where} records an invalid model ({e}); restore the file") from None
    if not all(isinstance(out[k], int) for k in ("vocab_size", "d_model", "max_len")):
        raise CheckpointError(f"{where} holds non-integer model sizes")
    if not math.isfinite(float(out["norm_eps"])):
        raise CheckpointError(f"{where} holds a non-finite norm_eps")
    return out


def _checked(out: dict[str, Any], where: str) -> dict[str, Any]:
    """``out``, each field checked as its config declares it (a one-line CheckpointError naming
    ``where`` otherwise): an edited or malformed record is refused, not run."""
    declared = fields.declared(base.declarations())
    for k, v in out.items():
        if f"model.{k}" in declared:
            try:
                declared[f"model.{k}"].check(v, f"model.{k}")
            except ConfigError as e:
                problem = str(e).removeprefix("config.")
                raise CheckpointError(
                    f"{where} records an invalid model ({problem}); restore the file"
                ) from None
    return out


def fields_of(model_cfg: ModelConfig) -> dict[str, Any]:
    """The architecture fields of ``model_cfg``."""
    return {k: getattr(model_cfg, k) for k in ARCHITECTURE_FIELDS}
