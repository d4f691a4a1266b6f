"""An fp8jax trainer work dir as a checkpoint: its model record, latest params and tokenizer.

The params come from the newest finished step under ``<workdir>/checkpoints`` at any level:
only the ``params`` subtree is read (orbax partial restore: no optimizer state, no train
config), and O2/O3's FP16 masters (``ScaledTensor`` data + scale) are dequantized with
``optim.master.materialize``. The step's array files are first checked against the CRC-32s
saved with it (``fp8jax.checksums``): a changed file is refused, never read as weights.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fp8jax import _timing, checksums, errors, provenance
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import CheckpointError, CheckpointMismatchError
from fp8jax.hf import architectures, weights
from fp8jax.models.config import ModelConfig
from fp8jax.optim import master
from fp8jax.tokenizer import Tokenizer

__all__ = [
    "LAYOUT_FIELDS",
    "TOKENIZER",
    "architecture",
    "is_workdir",
    "latest_step_dir",
    "layout",
    "restore_host",
    "restore_params",
    "state_metadata",
    "storage_error",
    "tokenizer",
    "verify_step",
]

TOKENIZER = "tokenizer.json"


def is_workdir(path: str | Path) -> bool:
    """Whether ``path`` is an fp8jax work dir (it has a ``checkpoints`` folder)."""
    return (Path(path) / "checkpoints").is_dir()


def latest_step_dir(workdir: Path) -> Path:
    """``checkpoints/<step>`` of the newest finished step; CheckpointError if there is none."""
    folder = workdir / "checkpoints"
    steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir()]
    if not steps:
        raise CheckpointError(
            f"{folder} holds no finished checkpoint; train longer (config.checkpoint_every_steps) "
            "or point at a work dir that has one"
        )
    return folder / str(max(steps))


def verify_step(step_dir: Path) -> None:
    """Refuse (one-line CheckpointError naming the file) a checkpoint step whose array files
    differ from the checksums saved with it; a step saved without checksums passes, warned."""
    changed = checksums.verify(str(step_dir))
    if changed:
        raise CheckpointError(
            f"checkpoint {step_dir} changed on disk since it was saved ({changed}); move that "
            "step aside to use the one before it"
        )


def architecture(workdir: Path) -> dict[str, Any]:
    """The architecture fields the work dir's ``model.json`` records."""
    path = workdir / provenance.MODEL_RECORD
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the work dir does not record its model; restore it, or rerun "
            "train.py on this work dir with the config it was trained with (which writes it)"
        )
    return architectures.from_json(architectures.read_json(path), str(path))


LAYOUT_FIELDS = ("scan_layers", "fused_qkv")  # what the params tree's structure depends on


def layout(workdir: Path) -> dict[str, Any]:
    """The params layout fields ``model.json`` records (empty without a record)."""
    path = workdir / provenance.MODEL_RECORD
    record = architectures.read_json(path) if path.is_file() else {}
    return {k: record[k] for k in LAYOUT_FIELDS if isinstance(record.get(k), bool)}


def _is_scaled_dict(x) -> bool:
    return isinstance(x, dict) and set(x) == {"data", "scale"}


def storage_error(e: Exception) -> str:
    """An orbax/tensorstore error in brief: its first line, without the TensorStore spec."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    for tail in (" See full TensorStore", " [tensorstore_spec="):
        first = first.split(tail)[0]
    return first[:300]


def state_metadata(state_dir: Path) -> dict:
    """The tree metadata of a checkpoint step's train state (``<step>/state``); unreadable: a
    one-line CheckpointError. Read once per state of the file (its path, size and mtime): the
    params, the FP8 state and the router biases of one load each ask for it."""
    try:
        stat = (Path(state_dir) / "_METADATA").stat()
    except OSError:
        stat = None
    key = (str(state_dir), None if stat is None else (stat.st_size, stat.st_mtime_ns))
    return _state_metadata(*key)


@functools.lru_cache(maxsize=4)
def _state_metadata(state_dir: str, _stat: tuple[int, int] | None) -> dict:
    import orbax.checkpoint as ocp  # heavy: only when a work dir is read
    from etils import epath

    try:
        with _timing.stage("metadata"):
            return ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir)).tree
    except Exception as e:  # orbax raises many types for unreadable metadata
        raise CheckpointError(
            f"cannot read the checkpoint metadata in {state_dir} ({storage_error(e)}); move that "
            "step aside to use the one before it"
        ) from e


def restore_host(state_dir: Path, key: str, saved) -> Any:
    """Entry ``key`` of a step's train state as host (numpy) arrays, laid out as its metadata
    ``saved``; unreadable: a one-line CheckpointError.

    Orbax reads the files straight into numpy arrays, committed to no device (a jax array
    committed to the CPU would pull every program it enters onto the CPU, whatever device the
    params are on), without a jax array in between to copy from.
    """
    import orbax.checkpoint as ocp  # heavy: only when a work dir is read
    from etils import epath

    item = {key: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    try:
        with _timing.stage("read"), ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(epath.Path(state_dir), args=args)[key]
    except Exception as e:  # orbax/tensorstore raise many types for unreadable files
        raise CheckpointError(
            f"checkpoint {state_dir} is unreadable ({storage_error(e)}); move that step "
            "aside to use the one before it"
        ) from e
    return jax.tree.map(np.asarray, restored)


def restore_params(workdir: Path, model_cfg: ModelConfig) -> dict:
    """The latest checkpoint's params as a flat dict of host arrays in ``param_dtype``."""
    step_dir = latest_step_dir(workdir)
    with _timing.stage("checksums"):
        verify_step(step_dir)  # before orbax reads a changed file as weights
    state_dir = step_dir / "state"
    saved = state_metadata(state_dir)
    if "params" not in saved:
        raise CheckpointError(
            f"cannot read the checkpoint metadata in {state_dir} ('params'); move that step "
            "aside to use the one before it"
        )
    restored = restore_host(state_dir, "params", saved["params"])
    # O2/O3 masters: FP16 data with one f32 scale, dequantized as the train step does.
    restored = jax.tree.map(
        lambda x: master.ScaledTensor(**x) if _is_scaled_dict(x) else x,
        restored,
        is_leaf=_is_scaled_dict,
    )
    flat = weights.flatten(master.materialize(restored, np.float32))
    expected = weights.param_shapes(model_cfg)
    for path, shape in expected.items():
        have = flat.get(path)
        if have is None or tuple(have.shape) != tuple(shape.shape):
            name = ".".join(path)
            got = "absent" if have is None else list(have.shape)
            raise CheckpointMismatchError(
                f"{state_dir} does not hold the model {workdir / provenance.MODEL_RECORD} "
                f"describes: params {name} is {got} there, {list(shape.shape)} expected"
            )
    extra = sorted(".".join(p) for p in flat if p not in expected)
    if extra:
        raise CheckpointMismatchError(
            f"{state_dir} holds params {extra[0]} that the recorded model has no use for"
        )
    dtype = np.dtype(model_cfg.param_dtype)
    return {path: np.asarray(flat[path]).astype(dtype, copy=False) for path in expected}


def tokenizer(workdir: Path) -> Tokenizer:
    """The work dir's own tokenizer: its learned BPE, or the one a fine-tuning run imported."""
    path = workdir / TOKENIZER
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: restore the tokenizer the checkpoint was trained with"
        )
    if not (workdir / "tokenizer_config.json").is_file():
        return Tokenizer.load(path)
    # A fine-tuning run keeps its checkpoint's EOS, BOS and chat template beside tokenizer.json.
    with errors.reraise_as(CheckpointError, ValueError):
        return tokenizer_lib.load_hf(workdir)
