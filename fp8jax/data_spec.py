"""The run spec's data sections: ``config.data`` (corpus or fine-tuning examples) and
``config.dpo`` (preference tuning), as frozen dataclasses validated by ``spec.parse``.
"""

from __future__ import annotations

import dataclasses

from fp8jax.errors import ConfigError, check_bool, check_choice, check_int, check_number

__all__ = [
    "DATA_FIX",
    "DATA_FORMATS",
    "OVERLONG",
    "DataSpec",
    "DpoSpec",
    "parse_data",
    "parse_dpo",
]

# The registered data formats (fp8jax.trainer.formats; tests/test_objectives checks they agree):
# corpus, prompt/completion examples, preference pairs.
DATA_FORMATS = ("text", "sft", "dpo")
OVERLONG = ("drop", "truncate")  # what happens to a fine-tuning example longer than a row
DATA_FIX = "set config.data.path to a text file, a folder of .txt files or a .jsonl file"


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """``config.data``: the corpus and its split."""

    format: str  # 'text' (corpus), 'sft' (.jsonl examples) or 'dpo' (.jsonl preference pairs)
    path: str  # text: file, folder of .txt, or .jsonl; sft/dpo: .jsonl file(s); '' = shipped
    val_fraction: float  # share held out for validation: of tokens (text), examples or pairs
    packing: bool  # sft: several examples per row (False: one per row, padded; dpo: False)
    overlong: str  # sft/dpo: 'drop' or 'truncate' an example longer than seq_len + 1 tokens
    tokenizer_min_frequency: int  # BPE merges need at least this many occurrences
    allow_corpus_change: bool  # resume a checkpointed run on changed data


@dataclasses.dataclass(frozen=True)
class DpoSpec:
    """``config.dpo``: the preference loss (used when data.format is 'dpo')."""

    beta: float  # scale of the implicit reward beta * (log pi - log pi_ref)
    label_smoothing: float  # share of pairs assumed mislabelled (0: standard DPO)


def parse_data(d) -> DataSpec:
    """``config.data`` checked field by field."""
    if not isinstance(d.path, str):
        raise ConfigError(f"config.data.path={d.path!r}: {DATA_FIX} ('' = the shipped corpus)")
    check_number(d.val_fraction, "data.val_fraction", "(0, 1)")  # held-out and training data
    check_choice(d.format, DATA_FORMATS, "data.format")
    check_bool(d.packing, "data.packing")
    check_choice(d.overlong, OVERLONG, "data.overlong")
    check_int(d.tokenizer_min_frequency, "data.tokenizer_min_frequency", 0)
    check_bool(d.allow_corpus_change, "data.allow_corpus_change")
    if d.format == "dpo" and d.packing:
        raise ConfigError(
            "config.data.packing=True with data.format='dpo': preference pairs are one "
            "(chosen, rejected) row pair each; set data.packing=False"
        )
    return DataSpec(**{f.name: d[f.name] for f in dataclasses.fields(DataSpec)})


def parse_dpo(c, data: DataSpec, batch_size: int, grad_accum_steps: int) -> DpoSpec:
    """``config.dpo`` checked, and a DPO run's batch against its pairs."""
    check_number(c.beta, "dpo.beta", "(0, inf)")
    check_number(c.label_smoothing, "dpo.label_smoothing", "[0, 0.5)")
    if data.format == "dpo" and batch_size % (2 * grad_accum_steps):
        raise ConfigError(
            f"batch_size={batch_size} with data.format='dpo': each micro-batch holds whole "
            f"(chosen, rejected) pairs, so use a multiple of 2 x grad_accum_steps "
            f"({2 * grad_accum_steps})"
        )
    return DpoSpec(beta=float(c.beta), label_smoothing=float(c.label_smoothing))
