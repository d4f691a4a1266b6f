"""A checkpoint ready to run without training: model, params, FP8 scales, tokenizer; its loss.

``load`` reads a Hugging Face dir or an fp8jax work dir (through ``fp8jax.hf.load``) and, for
a work dir trained at O1+, the FP8 state of its latest checkpoint: decoding at O1 then runs the
model's FP8 matmuls with the delayed scales training left there. An MoE model with a sigmoid
router's balancing bias gets the bias of that checkpoint (zeros from a Hugging Face dir, which
has no such bias). Nothing is written anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fp8jax import _timing, errors, models, provenance
from fp8jax.diagnostics import memory
from fp8jax.models import moe
from fp8jax.nn.state import FP8
from fp8jax.ops import scaling
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer import data as data_lib
from fp8jax.trainer import step as step_lib

__all__ = [
    "DEFAULT_SEQ_LEN",
    "LAYOUT_FIELDS",
    "LEVELS",
    "Inference",
    "Plan",
    "default_dtype",
    "default_seq_len",
    "evaluate",
    "fine_recipe",
    "fresh_fp8_state",
    "fresh_moe_state",
    "load",
    "plan",
    "restore_fp8_state",
    "restore_moe_state",
    "saved_history_len",
    "saved_moe_state",
    "text_tokens",
]

LEVELS = ("O0", "O1")  # O2/O3 differ from O1 only in what training stores
# Training fields the params and FP8 state layout depend on, taken from a work dir's record.
LAYOUT_FIELDS = ("scan_layers", "fused_qkv", "fp8_lm_head")
# Evaluation's sequence length where the checkpoint records none it trained with.
DEFAULT_SEQ_LEN = 1024
_DATA_FIX = (
    "pass --data a text file, a folder of .txt files, a .jsonl file with a 'text' field, or a glob "
    "pattern of them"
)


@dataclasses.dataclass(frozen=True)
class Inference:
    """What generation and evaluation need: the model, its params and FP8 state (empty at
    O0), the tokenizer, the level the model runs at, and an MoE model's router biases
    (``TrainState.moe_state``; empty unless its sigmoid router keeps a balancing bias)."""

    model: models.Transformer
    params: Any
    fp8_state: Any
    tokenizer: Any
    level: str
    moe_state: Any = dataclasses.field(default_factory=dict)


def default_dtype() -> str:
    """The compute dtype inference runs in unless told: bfloat16 on an accelerator (its matmul
    units' type; half the activation traffic), float32 on a CPU (bfloat16 is emulated there)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checkpoint's model as it will run, its level and tokenizer, read from its records
    before any weight: ``shapes`` lets a caller compile the model's programs while ``load``
    reads the arrays."""

    path: Path
    params_cfg: models.ModelConfig  # the checkpoint's model as its params are read (no recipe)
    model_cfg: models.ModelConfig  # as the model runs: the recipe at O1
    level: str
    tokenizer: Any
    stored_fp8: bool  # the latest checkpoint holds trained FP8 scales (read at O1)
    has_ckpt: bool  # a work dir with checkpoints (not a Hugging Face dir)

    def shapes(self) -> tuple[Any, Any, Any]:
        """``(params, fp8_state, moe_state)`` as ``load`` gives them, ``jax.ShapeDtypeStruct``
        leaves (host params in ``param_dtype``; no FP8 state at O0)."""
        variables = models.abstract_variables(self.model_cfg)
        fp8 = variables.get(FP8, {}) if self.level == "O1" else {}
        return variables["params"], fp8, variables.get(moe.MOE_STATE, {})

    def load(self) -> Inference:
        """The arrays: params (on the default device, committed to none), FP8 state, router
        biases."""
        from fp8jax import hf  # the Hugging Face readers, only when a checkpoint is read

        params = hf.load_params(self.path, self.params_cfg)
        cfg, fp8 = self.model_cfg, {}
        if self.level == "O1":
            stored = self.stored_fp8 and restore_fp8_state(self.path, cfg, cfg.recipe)
            fp8 = stored[1] if stored else fresh_fp8_state(cfg)
        with _timing.stage("to device"):  # one batched transfer, committed to no device
            params = jax.block_until_ready(jax.device_put(params))
        moe_state = restore_moe_state(self.path, cfg) if self.has_ckpt else fresh_moe_state(cfg)
        model = models.build_model(cfg)
        return Inference(model, params, fp8, self.tokenizer, self.level, moe_state)


def plan(path: str, level: str | None = None, dtype: str = "float32") -> Plan:
    """What ``load(path, level, dtype)`` will load, from the checkpoint's records alone."""
    from fp8jax import hf  # the Hugging Face readers, only when a checkpoint is read

    if level is not None:
        errors.check_choice(level, LEVELS, "--level")
    errors.check_choice(dtype, ("float32", "bfloat16", "float16"), "--dtype")
    path = Path(path).expanduser().absolute()  # orbax takes absolute paths only
    if not path.is_dir():
        raise errors.CheckpointError(
            f"--ckpt {str(path)!r} is not a directory: pass a work dir or a Hugging Face model dir"
        )
    record = provenance.read_json(path / provenance.MODEL_RECORD) or {}
    layout = {k: record[k] for k in LAYOUT_FIELDS if k in record}
    base = dataclasses.replace(hf.default_model_cfg(), dtype=jnp.dtype(dtype), **layout)
    params_cfg = hf.model_config(path, base)
    tokenizer = hf.tokenizer(path)
    # A rowwise or block run's state holds amaxes only: its recipe comes from model.json.
    trained = fine_recipe(record) or scaling.DelayedScaling()
    has_ckpt = (path / "checkpoints").is_dir()
    # The checkpoint's tree metadata is read here at every level, before a caller starts
    # compiling beside the load: the params' read needs it too (cached per state), and a
    # compile thread holding the GIL would slow its parse several times over.
    history_len = saved_history_len(path) if has_ckpt else None
    level = level or ("O1" if history_len is not None else "O0")
    cfg = params_cfg
    if level == "O1":
        if history_len is None:
            logging.warning(
                "%s holds no trained FP8 scales: O1 scales every operand by its "
                "own amax (current scaling)",
                path,
            )
            recipe = scaling.CurrentScaling()
        else:
            recipe = dataclasses.replace(trained, history_len=history_len)
        cfg = dataclasses.replace(cfg, recipe=recipe)
    return Plan(path, params_cfg, cfg, level, tokenizer, history_len is not None, has_ckpt)


def load(path: str, level: str | None = None, dtype: str = "float32") -> Inference:
    """The checkpoint at ``path`` (HF dir or work dir) at ``level`` ('O0', 'O1'; None: O1 if
    the checkpoint holds trained FP8 scales, else O0), computing in ``dtype``.

    O1 on a checkpoint without scales (O0 work dir, HF dir) scales each FP8 operand by its own
    amax at every call (current scaling), since there are no trained ones to use.
    """
    return plan(path, level, dtype).load()


def fine_recipe(record: dict) -> scaling.Recipe | None:
    """The rowwise or block recipe a work dir's ``model.json`` says it trained with, else None."""
    recipe = record.get("recipe") or {}
    name = recipe.get("name")
    if name not in scaling.RECIPES or scaling.RECIPES[name]().per_tensor:
        return None
    return scaling.make_recipe(name, **{k: v for k, v in recipe.items() if k != "name"})


def _abstract_variables(model_cfg: models.ModelConfig, collection: str):
    return models.abstract_variables(model_cfg).get(collection, {})


def _abstract_fp8(model_cfg: models.ModelConfig):
    return _abstract_variables(model_cfg, FP8)


def fresh_fp8_state(model_cfg: models.ModelConfig):
    """The FP8 state a fresh model starts with (scale 1, empty histories)."""
    return jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), _abstract_fp8(model_cfg))


def fresh_moe_state(model_cfg: models.ModelConfig):
    """The router biases a fresh MoE model starts with (zeros; {} where it keeps none)."""
    target = _abstract_variables(model_cfg, moe.MOE_STATE)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), target)


def restore_moe_state(workdir: Path, model_cfg: models.ModelConfig):
    """The router biases (``TrainState.moe_state``) of the work dir's latest checkpoint, {} for
    a model that keeps none; zeros (warned) where the checkpoint saved none."""
    fresh = fresh_moe_state(model_cfg)
    if not fresh:
        return fresh
    restored = saved_moe_state(workdir)
    if not restored:
        logging.warning("%s holds no MoE router biases: the router selects without them", workdir)
        return fresh
    layout = lambda tree: (jax.tree.structure(tree), [x.shape for x in jax.tree.leaves(tree)])
    if layout(restored) != layout(fresh):
        raise errors.CheckpointMismatchError(
            f"{workdir} holds MoE router biases of another layout than the recorded model's: "
            "its scan_layers or expert count differs from model.json"
        )
    return jax.tree.map(lambda r, f: jnp.asarray(r, f.dtype), restored, fresh)


def saved_moe_state(workdir: Path) -> dict:
    """The router biases (``TrainState.moe_state``) the work dir's latest checkpoint saved, as
    host arrays in the layout it trained with; {} where it saved none."""
    from fp8jax.hf import workdir as workdir_lib

    state_dir = workdir_lib.latest_step_dir(workdir) / "state"
    saved = workdir_lib.state_metadata(state_dir).get(moe.MOE_STATE)
    if not saved:
        return {}
    return workdir_lib.restore_host(state_dir, moe.MOE_STATE, saved)


def _saved_fp8(workdir: Path) -> tuple[Path, Any, int | None]:
    """``(state dir, FP8 state metadata, amax history length)`` of the work dir's latest
    checkpoint; the metadata and length None where it saved no FP8 state (an O0 run)."""
    from fp8jax.hf import workdir as workdir_lib

    state_dir = workdir_lib.latest_step_dir(workdir) / "state"
    saved = workdir_lib.state_metadata(state_dir).get("fp8")
    if not saved:
        return state_dir, None, None
    histories = [m.shape[-1] for m in jax.tree.leaves(saved) if len(m.shape) >= 1]
    return state_dir, saved, max(histories) - 1  # amax_history holds history_len + 1 slots


def saved_history_len(workdir: Path) -> int | None:
    """The amax history length of the FP8 state the work dir's latest checkpoint saved (from
    its metadata), None where it saved none (an O0 run)."""
    return _saved_fp8(workdir)[2]


def restore_fp8_state(workdir: Path, model_cfg: models.ModelConfig, recipe: scaling.Recipe):
    """``(history_len, fp8_state)`` of the work dir's latest checkpoint under the ``recipe`` it
    trained with (its history length read from the checkpoint), or None at O0."""
    from fp8jax.hf import workdir as workdir_lib

    state_dir, saved, history_len = _saved_fp8(workdir)
    if saved is None:
        return None
    cfg = dataclasses.replace(
        model_cfg, recipe=dataclasses.replace(recipe, history_len=history_len)
    )
    target = _abstract_fp8(cfg)
    restored = workdir_lib.restore_host(state_dir, "fp8", saved)

    def take(key_path, like):
        node = restored
        for k in key_path:
            name = getattr(k, "key", getattr(k, "name", None))
            if not isinstance(node, dict) or name not in node:
                raise errors.CheckpointMismatchError(
                    f"{state_dir} holds no FP8 state {jax.tree_util.keystr(key_path)} the "
                    "model needs: its fp8_lm_head or layout differs from the recorded model"
                )
            node = node[name]
        return jnp.asarray(node, like.dtype).reshape(like.shape)

    return history_len, jax.tree_util.tree_map_with_path(take, target)


def default_seq_len(path: str, max_len: int) -> int:
    """The sequence length evaluation defaults to: the training ``seq_len`` a work dir's latest
    checkpoint records (its data position), else ``DEFAULT_SEQ_LEN``; at most ``max_len``."""
    from fp8jax.hf import workdir as workdir_lib

    path = Path(path).expanduser()
    trained = None
    if (path / "checkpoints").is_dir():
        try:
            data = workdir_lib.latest_step_dir(path) / "data" / "metadata"
        except errors.CheckpointError:
            data = None
        trained = (provenance.read_json(data) or {}).get("seq_len") if data else None
    if not isinstance(trained, int) or isinstance(trained, bool) or trained < 1:
        trained = DEFAULT_SEQ_LEN
    return min(max_len, trained)


def text_tokens(tokenizer, path: str, limit: int) -> np.ndarray:
    """The first ``limit`` token ids of the text at ``path`` (a file, a folder of .txt, a
    .jsonl with 'text'), encoded as the trainer encodes its corpus: EOS after each document."""
    with errors.reraise_as(errors.DataError, ValueError, OSError):
        files, desc = corpus_lib.source_files(path, fix=_DATA_FIX)
        ids: list[int] = []
        doc_tokens = 0
        for text, ends_doc in corpus_lib.pieces(files, "--data"):
            (piece,) = tokenizer.encode_batch([text])  # as the trainer's encoder calls it
            ids.extend(piece)
            doc_tokens += len(piece)
            if ends_doc and doc_tokens:  # empty documents get no separator either
                ids.append(tokenizer.eos_id)
                doc_tokens = 0
            if len(ids) >= limit:
                break
    if not ids:
        raise errors.DataError(f"no text found in {desc}: pass a file or folder holding text")
    return np.asarray(ids[:limit], np.int32)


def evaluate(
    inf: Inference, tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int
) -> dict:
    """Mean loss and perplexity over consecutive windows of ``tokens`` (the trainer's
    validation batches: ``data.Dataset.eval_batches``), with the model at ``inf.level``."""
    errors.check_int(batch_size, "--batch_size", 1)
    errors.check_int(seq_len, "--seq_len", 1, inf.model.cfg.max_len)
    errors.check_int(num_batches, "--num_batches", 1)
    if len(tokens) // (seq_len + 1) // batch_size == 0:
        raise errors.DataError(
            f"the text holds {len(tokens)} tokens, less than one batch of --batch_size "
            f"{batch_size} x (--seq_len {seq_len} + 1); pass a smaller --batch_size or --seq_len, "
            f"or more text"
        )
    dataset = data_lib.Dataset(
        inf.tokenizer, tokens[:0], tokens, batch_size=batch_size, seq_len=seq_len
    )
    with errors.reraise_as(errors.DataError, ValueError):
        batches = dataset.eval_batches(num_batches)
    zero = jnp.zeros((), jnp.int32)
    state = step_lib.TrainState(
        zero, inf.params, None, inf.fp8_state, zero, zero, moe_state=inf.moe_state
    )
    batches = [jax.tree.map(jnp.asarray, b) for b in batches]
    eval_step = jax.jit(step_lib.make_eval_step(inf.model)).lower(state, batches[0]).compile()
    memory.check_fits(
        memory.compiled_memory(eval_step),
        f"evaluating --batch_size {batch_size} x --seq_len {seq_len}",
        "pass a smaller --batch_size or --seq_len",
    )
    losses = [float(eval_step(state, b)) for b in batches]
    loss = float(np.mean(losses))
    if not math.isfinite(loss):
        bad = next(i for i, x in enumerate(losses) if not math.isfinite(x))
        raise errors.NonFiniteOutputError(
            f"the loss is {loss} (first at batch {bad}): the checkpoint's weights or FP8 scales "
            f"are not finite (or overflow --dtype); use an earlier checkpoint or --dtype float32"
        )
    return {
        "loss": loss,
        "perplexity": float(math.exp(min(loss, 50.0))),
        "batches": len(losses),
        "tokens": len(losses) * batch_size * seq_len,
    }
