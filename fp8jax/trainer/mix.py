"""Weighted mixtures of corpora (``data.format='mix'``): several sources, one training stream.

``config.data.sources`` names the sources, each a text corpus or a folder of token shards read
by its own registered format (``text``, ``tokens``), and ``config.data.weights`` their shares.
Every source is encoded and split as it would be alone (a text source's token cache lives in
``<workdir>/sources/<k>/tokens``, or in the shared ``config.data.cache_dir``); all of them
share one tokenizer (``config.data.tokenizer``, an ``init_from`` checkpoint's, or a BPE learned
on a sample of every text source). The training stream interleaves the sources' windows with
``grain.MapDataset.mix``: global window ``i`` comes from a fixed source at a fixed position in
its own shuffled stream, so the realized shares follow the weights at every prefix and a run
resumes exactly from its step. Validation windows spread over every source's held-out split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from fp8jax import tokenizer as tokenizer_lib
from fp8jax.data_spec import SourceSpec
from fp8jax.errors import DataError
from fp8jax.trainer import data, data_format
from fp8jax.trainer.stream import TrainIterator, process_rows
from fp8jax.trainer.token_shards import Concat

if TYPE_CHECKING:
    from fp8jax.spec import RunSpec

__all__ = ["Mix", "MixedDataset", "Part"]

_SOURCES_DIR = "sources"  # <workdir>/sources/<k>: source k's own caches


@dataclasses.dataclass(frozen=True)
class Part:
    """One source of a mixture: its spec, the run its format reads it with, its source."""

    spec: SourceSpec
    run: RunSpec  # the mixture's run with data.format and data.path of this source
    source: data_format.Source


@contextlib.contextmanager
def _naming_source(k: int, spec: SourceSpec):
    """A source's DataError names its ``config.data.sources`` entry, which the user sets,
    where its format's message names ``config.data.path`` (unused by a mixture)."""
    try:
        yield
    except DataError as e:
        entry = f"config.data.sources entry {k}"
        msg = str(e)
        if "config.data.path" in msg:
            msg = msg.replace("config.data.path", f"{entry} ({spec.path!r})")
            msg = msg.replace(" ('' = the shipped corpus)", "")  # an entry is never empty
        else:
            msg = f"{entry} ({spec.path!r}): {msg}"
        raise type(e)(msg) from e


def _source_run(run: RunSpec, spec: SourceSpec) -> RunSpec:
    sub = dataclasses.replace(run.data, format=spec.format, path=spec.path, sources=())
    return dataclasses.replace(run, data=sub)


class MixedDataset(data.Dataset):
    """Several datasets' training windows interleaved by weight; their validation splits
    read as one."""

    def __init__(self, parts: list[data.Dataset], weights: list[float], **kwargs):
        train = Concat([p.train_tokens for p in parts])
        val = Concat([p.val_tokens for p in parts])
        super().__init__(parts[0].tokenizer, train, val, **kwargs)
        self.parts, self.weights = parts, weights

    def windows(self, seq_len: int, salt: tuple = ()):
        """Every source's windows (each shuffled by its own seed) interleaved by weight."""
        import grain  # only here, as in data.Dataset.windows

        streams = [p.windows(seq_len, (*salt, "mix", k)) for k, p in enumerate(self.parts)]
        return grain.MapDataset.mix(streams, self.weights)

    def train_iter(
        self,
        batch_size: int | None = None,
        seq_len: int | None = None,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> TrainIterator:
        """Batches ``{'inputs', 'targets'}`` int32 [batch_size / processes, seq_len], each row
        a window of one source, the sources in proportion to their weights."""
        batch_size = batch_size or self.batch_size
        seq_len = seq_len or self.seq_len
        p, num_p, rows = process_rows(batch_size, process_index, process_count)
        ds = self.windows(seq_len).batch(rows, drop_remainder=True)[p::num_p]
        identity = dict(batch_size=batch_size, seq_len=seq_len, seed=self.seed, data=self.key[:16])
        return TrainIterator(ds, identity)


class _Encoded(data_format.Encoded):
    """Each source's encoded data; committed and discarded together."""

    def __init__(self, make, parts: list[data_format.Encoded], workdirs: list[Path]):
        self.make, self.parts, self.workdirs = make, parts, workdirs

    @property
    def dataset(self) -> MixedDataset:
        """The :class:`MixedDataset` over every source's committed data."""
        return self.make([p.dataset for p in self.parts])

    def commit(self, workdir: Path) -> None:
        del workdir  # each source commits into its own folder
        for part, sub in zip(self.parts, self.workdirs, strict=True):
            part.commit(sub)

    def discard(self) -> None:
        for part in self.parts:
            part.discard()


@data_format.register
class Mix(data_format.DataFormat):
    """``data.format='mix'``: the weighted mixture of ``config.data.sources``."""

    name = "mix"
    dtypes = {"inputs": np.int32, "targets": np.int32}
    tokenizer_fields = dict(data.Text.tokenizer_fields, mix=1)

    def source(self, run: RunSpec) -> data_format.Source:
        """Every source as its own format reads it (the first bad one raises); the mixture's
        fingerprint covers each one's fingerprint, format and weight."""
        specs = run.data.sources
        if not specs:
            raise DataError("config.data.format='mix' needs config.data.sources: name them")
        parts = []
        for k, spec in enumerate(specs):
            sub = _source_run(run, spec)
            with _naming_source(k, spec):
                parts.append(Part(spec, sub, data_format.get(spec.format).source(sub)))
        identity = [(p.spec.format, p.source.corpus, p.spec.weight) for p in parts]
        corpus = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
        desc = "mix of " + ", ".join(f"{p.source.desc} (weight {p.spec.weight:g})" for p in parts)
        logging.info("data source: %s", desc)
        return data_format.Source(desc, corpus, parts)

    def texts(self, source: data_format.Source) -> Iterator[str]:
        """Each source's texts in turn (a token-shard source has none: a DataError)."""
        for k, p in enumerate(source.content):
            with _naming_source(k, p.spec):
                yield from data_format.get(p.spec.format).texts(p.source)

    def encode(self, run: RunSpec, source, tokenizer, workdir: Path) -> _Encoded:
        """Each source encoded and split by its format into ``<workdir>/sources/<k>``."""
        parts, workdirs = [], []
        try:
            for k, part in enumerate(source.content):
                sub = workdir / _SOURCES_DIR / str(k)
                fmt = data_format.get(part.spec.format)
                with _naming_source(k, part.spec):
                    parts.append(fmt.encode(part.run, part.source, tokenizer, sub))
                workdirs.append(sub)
        except BaseException:
            for p in parts:
                p.discard()
            raise
        optim = run.optim
        sizes = dict(seed=run.seed, batch_size=optim.batch_size, seq_len=optim.seq_len)
        key = data_format.cache_key(
            mix=1,
            corpus=source.corpus,
            tokenizer=tokenizer_lib.sha256(tokenizer.to_str()),
            val_fraction=float(run.data.val_fraction),
        )
        weights = [p.spec.weight for p in source.content]
        make = functools.partial(MixedDataset, weights=weights, key=key, **sizes)
        return _Encoded(make, parts, workdirs)
