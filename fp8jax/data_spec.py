"""The run spec's data sections: ``config.data`` (corpus or fine-tuning examples) and
``config.dpo`` (preference tuning), as frozen dataclasses validated by ``spec.parse``.
"""

from __future__ import annotations

import dataclasses

from fp8jax.errors import ConfigError

__all__ = [
    "DATA_FIX",
    "DATA_FORMATS",
    "FORMATS",
    "MIX_FORMATS",
    "OVERLONG",
    "DataSpec",
    "DpoSpec",
    "FormatFacts",
    "SourceSpec",
    "parse_data",
    "parse_dpo",
    "parse_sources",
]


@dataclasses.dataclass(frozen=True)
class FormatFacts:
    """What the run spec's checks need to know of a data format (the format itself:
    ``fp8jax.trainer.formats``; tests/test_objectives checks that they agree)."""

    # Examples are (chosen, rejected) row pairs, trained whole: no packing, and each
    # micro-batch and data-parallel replica holds an even number of rows.
    pairs: bool = False
    # Its data is the mixture of config.data.sources (each read by its own format).
    mixes: bool = False


# The registered data formats (fp8jax.trainer.formats; tests/test_objectives checks they agree):
# corpus, pre-tokenized corpus, a weighted mixture of those, prompt/completion examples,
# preference pairs.
FORMATS = {
    "text": FormatFacts(),
    "tokens": FormatFacts(),
    "mix": FormatFacts(mixes=True),
    "sft": FormatFacts(),
    "dpo": FormatFacts(pairs=True),
}
DATA_FORMATS = tuple(FORMATS)
MIX_FORMATS = ("text", "tokens")  # the formats a mixture's sources may have
OVERLONG = ("drop", "truncate")  # what happens to a fine-tuning example longer than a row
DATA_FIX = (
    "set config.data.path to a text file, a folder of .txt files, a .jsonl file or a glob "
    "pattern of them ('' = the shipped corpus)"
)


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture (``config.data.sources``): how it is read, where, how often."""

    format: str  # 'text' or 'tokens': the format that reads it
    path: str  # its file or folder (as config.data.path of that format)
    weight: float  # its share of the training windows, relative to the others' (> 0)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """``config.data``: the corpus and its split."""

    format: str  # 'text' (corpus), 'tokens' (token shards), 'mix', 'sft' or 'dpo' (.jsonl)
    path: str  # text: file, folder of .txt, or .jsonl; sft/dpo: .jsonl file(s); '' = shipped
    val_fraction: float  # share held out for validation: of tokens (text), examples or pairs
    packing: bool  # sft: several examples per row (False: one per row, padded; dpo: False)
    overlong: str  # sft/dpo: 'drop' or 'truncate' an example longer than seq_len + 1 tokens
    tokenizer: str  # tokenizer.json or HF model dir to encode with; '' = learn a BPE
    tokenizer_min_frequency: int  # BPE merges need at least this many occurrences
    encode_workers: int  # text: processes encoding the corpus (0 = one per CPU core)
    cache_dir: str  # text: folder of token caches shared by runs; '' = the work dir's tokens/
    sources: tuple[SourceSpec, ...]  # mix: the mixed sources and their weights; () otherwise
    allow_corpus_change: bool  # resume a checkpointed run on changed data
    verify_corpus: bool  # text: every corpus byte checked before a token cache's reuse

    @property
    def pairs(self) -> bool:
        """Whether the format's examples are (chosen, rejected) row pairs, trained whole."""
        return FORMATS[self.format].pairs


@dataclasses.dataclass(frozen=True)
class DpoSpec:
    """``config.dpo``: the preference loss (used when data.format is 'dpo')."""

    beta: float  # scale of the implicit reward beta * (log pi - log pi_ref)
    label_smoothing: float  # share of pairs assumed mislabelled (0: standard DPO)


def parse_data(d) -> DataSpec:
    """``config.data`` (its fields checked by ``spec.parse``) checked against its format."""
    if FORMATS[d.format].pairs and d.packing:
        raise ConfigError(
            f"config.data.packing=True with data.format={d.format!r}: preference pairs are one "
            "(chosen, rejected) row pair each; set data.packing=False"
        )
    sources = parse_sources(d.sources, d.weights)
    if FORMATS[d.format].mixes != bool(sources):
        raise ConfigError(
            f"config.data.sources={d.sources!r} with data.format={d.format!r}: a mixture names "
            "its sources in data.sources and sets data.format='mix'; other formats leave "
            "data.sources ''"
        )
    fields = {f.name: d[f.name] for f in dataclasses.fields(DataSpec) if f.name != "sources"}
    return DataSpec(sources=sources, **fields)


def parse_sources(sources: str, weights: str) -> tuple[SourceSpec, ...]:
    """``config.data.sources`` ('[format:]path,...') and ``config.data.weights`` ('w,...',
    '' = equal) as typed sources; a one-line ConfigError naming the fix otherwise."""
    entries = [e.strip() for e in sources.split(",")] if sources.strip() else []
    given = [w.strip() for w in weights.split(",")] if weights.strip() else []
    if given and len(given) != len(entries):
        raise ConfigError(
            f"config.data.weights={weights!r} has {len(given)} weights for {len(entries)} "
            "data.sources: give one weight per source, or '' for equal weights"
        )
    out = []
    for k, entry in enumerate(entries):
        kind, sep, path = entry.partition(":")
        if not sep or kind not in MIX_FORMATS:
            kind, path = "text", entry  # no 'format:' prefix: a text corpus
        try:
            weight = float(given[k]) if given else 1.0
        except ValueError:
            weight = float("nan")
        if not path or not weight > 0 or weight == float("inf"):
            raise ConfigError(
                f"config.data.sources entry {k} ({entry!r}, weight {given[k] if given else 1}): "
                "each source is '[text:|tokens:]path' with a finite weight > 0 in data.weights"
            )
        same = [j for j, o in enumerate(out) if (o.format, o.path) == (kind, path)]
        if same:  # its windows twice over: a typo, or a weight given the long way
            raise ConfigError(
                f"config.data.sources entry {k} ({entry!r}) repeats entry {same[0]}: name each "
                f"source once and give it a larger weight in data.weights"
            )
        out.append(SourceSpec(kind, path, weight))
    return tuple(out)


def parse_dpo(c, data: DataSpec, batch_size: int, grad_accum_steps: int) -> DpoSpec:
    """``config.dpo`` (its fields checked by ``spec.parse``), and a run's batch against its
    format's pairs."""
    if data.pairs and batch_size % (2 * grad_accum_steps):
        raise ConfigError(
            f"batch_size={batch_size} with data.format={data.format!r}: each micro-batch holds "
            f"whole (chosen, rejected) pairs, so use a multiple of 2 x grad_accum_steps "
            f"({2 * grad_accum_steps})"
        )
    return DpoSpec(beta=float(c.beta), label_smoothing=float(c.label_smoothing))
