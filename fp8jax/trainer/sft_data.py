"""Supervised fine-tuning data: .jsonl examples -> token ids with loss weights -> row batches.

``build(run, workdir, tokenizer)`` (the ``sft`` format over ``data_format.build``) reads
``run.data.path`` (a .jsonl file or a folder of them; '' = :func:`novel_task` built from the
shipped corpus), encodes every example in memory (the Rust tokenizer does ~1M tokens/s, so a
restart re-encodes rather than keeping a second cache), holds out ``data.val_fraction`` of the
examples and returns an :class:`SftDataset`. Its batches
are ``{'inputs', 'targets', 'weights', 'positions', 'segment_ids'}`` [rows, seq_len]: weights
1.0 on the targets that are completion (assistant) tokens, 0.0 on prompt and padding;
``segment_ids`` 1..n per row for its examples, 0 on padding; positions restart at 0 with
each example. The order is fixed by the seed and the stream resumes from a step count
(``stream.TrainIterator``).
"""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import DataError
from fp8jax.trainer import chat, data_format, tasks
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer.data_format import split
from fp8jax.trainer.stream import Batch, TrainIterator, process_rows, seed32

if TYPE_CHECKING:
    from fp8jax.spec import RunSpec

__all__ = [
    "DTYPES",
    "FIX",
    "KEYS",
    "Example",
    "Sft",
    "SftDataset",
    "build",
    "check_fits",
    "data_key",
    "fit",
    "fit_examples",
    "make_row",
    "novel_task",
    "plan_rows",
    "record_texts",
    "stack",
]

_VERSION = 1  # how examples are encoded and split; part of the data key
KEYS = ("inputs", "targets", "weights", "positions", "segment_ids")
DTYPES = {k: np.float32 if k == "weights" else np.int32 for k in KEYS}  # a batch's arrays
FIX = "set config.data.path to a .jsonl file or a folder of them ('' = the shipped novel task)"
Example = tuple[np.ndarray, np.ndarray]  # ids int32 [n], trained bool [n]


def novel_task(num_examples: int = 512, passage_words: int = 40, seed: int = 0) -> list[dict]:
    """Prompt/completion examples from the shipped novels: a passage -> its novel's title.

    Passages start at random word offsets (``seed``), the same number from each novel.
    """
    files = sorted(corpus_lib.SHIPPED_DIR.glob("*.txt.gz"))
    rng = np.random.default_rng(seed)
    out = []
    for k, f in enumerate(files):
        words = gzip.open(f, "rt", encoding="utf-8").read().split()
        title = tasks.title_of(f)
        share = num_examples // len(files) + (k < num_examples % len(files))
        for start in rng.integers(0, len(words) - passage_words, share):
            passage = " ".join(words[start : start + passage_words])
            out.append(tasks.example(passage, title))
    return [out[i] for i in rng.permutation(len(out))]


def record_texts(records: list[tuple[dict, str]]):
    """Every string of the examples (what a learned BPE is trained on)."""
    for record, _ in records:
        if "messages" in record:
            yield from (m["content"] for m in record["messages"])
        else:
            yield record["prompt"] + record["completion"]


def fit(examples: list[Example], seq_len: int, overlong: str) -> tuple[list[Example], dict]:
    """The examples that fit a row of ``seq_len`` targets (``overlong``: 'drop' or 'truncate'
    the others) and have a loss token; and the counts of those left out."""
    kept, counts = [], dict(overlong=0, no_loss_tokens=0)
    for ids, trained in examples:
        if len(ids) > seq_len + 1:
            if overlong == "drop":
                counts["overlong"] += 1
                continue
            ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
        if not trained[1:].any():  # no target is a completion token (or it was cut off)
            counts["no_loss_tokens"] += 1
            continue
        kept.append((ids, trained))
    return kept, counts


def plan_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, packing: bool) -> list:
    """Example indices of each row: one per row, or packed greedily in ``order``."""
    if not packing:
        return [[int(i)] for i in order]
    rows, row, used = [], [], 0
    for i in order:
        n = int(lengths[i])
        if row and used + n > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(int(i))
        used += n
    return rows + [row] if row else rows


def make_row(examples: list[Example], idxs: list[int], seq_len: int) -> Batch:
    """One row [seq_len] of the batch keys; example k of the row has segment id k + 1."""
    row = {k: np.zeros(seq_len, DTYPES[k]) for k in KEYS}
    at = 0
    for k, i in enumerate(idxs):
        ids, trained = examples[i]
        n = len(ids) - 1  # targets of the example
        span = slice(at, at + n)
        row["inputs"][span], row["targets"][span] = ids[:-1], ids[1:]
        row["weights"][span] = trained[1:]
        row["positions"][span] = np.arange(n)
        row["segment_ids"][span] = k + 1
        at += n
    return row


def stack(rows: list[Batch]) -> Batch:
    """Rows -> one batch [len(rows), seq_len] per key."""
    return {k: np.stack([r[k] for r in rows]) for k in KEYS}


class _Stream:
    """Training batches by global step: each epoch packs the examples in a new seeded order."""

    def __init__(self, examples, seq_len, packing, seed, batch_size, p, rows):
        self.examples, self.seq_len, self.packing = examples, seq_len, packing
        self.seed, self.batch_size, self.p, self.rows = seed, batch_size, p, rows
        self.lengths = np.asarray([len(ids) - 1 for ids, _ in examples])
        self.ends = [0]  # ends[e]: rows in epochs before e (grown as epochs are reached)
        self.plan = functools.lru_cache(maxsize=4)(self._plan)

    def _plan(self, epoch: int) -> list:
        order = np.random.default_rng([seed32("sft-train", self.seed), epoch])
        order = order.permutation(len(self.examples))
        return plan_rows(self.lengths, order, self.seq_len, self.packing)

    def row(self, r: int) -> Batch:
        while self.ends[-1] <= r:
            self.ends.append(self.ends[-1] + len(self.plan(len(self.ends) - 1)))
        epoch = int(np.searchsorted(self.ends, r, side="right")) - 1
        return make_row(self.examples, self.plan(epoch)[r - self.ends[epoch]], self.seq_len)

    def __getitem__(self, step: int) -> Batch:
        first = step * self.batch_size + self.p * self.rows  # this process's rows
        return stack([self.row(first + j) for j in range(self.rows)])


class SftDataset:
    """Encoded fine-tuning examples: a checkpointable training stream and fixed eval batches."""

    def __init__(self, tokenizer, train, val, *, seed, batch_size, seq_len, packing, key=""):
        self.tokenizer, self.train, self.val = tokenizer, train, val
        self.seed, self.batch_size, self.seq_len = seed, batch_size, seq_len
        self.packing, self.key = packing, key

    def train_iter(self, *, process_index=None, process_count=None) -> TrainIterator:
        """Batches of ``KEYS`` [batch_size / processes, seq_len], resumable by step."""
        p, _, rows = process_rows(self.batch_size, process_index, process_count)
        stream = _Stream(
            self.train, self.seq_len, self.packing, self.seed, self.batch_size, p, rows
        )
        identity = dict(
            batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed, data=self.key[:16]
        )
        return TrainIterator(stream, identity)

    def eval_batches(self, num_batches: int, *, process_index=None, process_count=None):
        """The first ``num_batches`` batches of the held-out examples in file order (the last
        one filled up with empty rows, whose weights are 0)."""
        p, _, rows = process_rows(self.batch_size, process_index, process_count)
        lengths = np.asarray([len(ids) - 1 for ids, _ in self.val])
        plan = plan_rows(lengths, np.arange(len(self.val)), self.seq_len, self.packing)
        plan = plan[: num_batches * self.batch_size]
        plan += [[]] * (-len(plan) % self.batch_size)
        out = []
        for b in range(len(plan) // self.batch_size):
            first = b * self.batch_size + p * rows
            out.append(
                stack(
                    [make_row(self.val, idxs, self.seq_len) for idxs in plan[first : first + rows]]
                )
            )
        return out


def fit_examples(examples: list[Example], run: RunSpec) -> tuple[list[Example], list[Example]]:
    """(train, val) of the encoded ``examples`` that fit ``run``'s rows; DataError if either
    split is left without one."""
    data, seq_len = run.data, run.optim.seq_len
    train_idx, val_idx = split(len(examples), data.val_fraction)
    train, dropped = fit([examples[i] for i in train_idx], seq_len, data.overlong)
    val, val_dropped = fit([examples[i] for i in val_idx], seq_len, data.overlong)
    if dropped["overlong"] + val_dropped["overlong"]:
        logging.warning(
            "data.overlong='%s': %d of %d examples are longer than seq_len+1=%d tokens and were %s",
            data.overlong,
            dropped["overlong"] + val_dropped["overlong"],
            len(examples),
            seq_len + 1,
            "dropped" if data.overlong == "drop" else "truncated",
        )
    if dropped["no_loss_tokens"] + val_dropped["no_loss_tokens"]:
        logging.warning(
            "%d examples have no completion token within seq_len and were dropped",
            dropped["no_loss_tokens"] + val_dropped["no_loss_tokens"],
        )
    return train, val


def check_fits(desc: str, train: list, val: list, run: RunSpec, noun: str, per: int = 1) -> None:
    """DataError unless training and (with a validation share) held-out ``noun`` are left; a
    ``noun`` is ``per`` encoded rows."""
    if not train or (run.data.val_fraction > 0 and not val):
        raise DataError(
            f"{desc}: {len(train) // per} training and {len(val) // per} validation {noun} fit "
            f"seq_len={run.optim.seq_len}: use more {noun}, a larger seq_len, a larger "
            f"data.val_fraction or data.overlong='truncate'"
        )


def data_key(source: data_format.Source, tokenizer, run: RunSpec, version: int = _VERSION) -> str:
    """The key of encoded .jsonl data: what shaped its rows (``version``: its format's encoding;
    a resumed stream warns when the key changes)."""
    return data_format.cache_key(
        v=version,
        corpus=source.corpus,
        tokenizer=tokenizer_lib.sha256(tokenizer.to_str()),
        seq_len=run.optim.seq_len,
        overlong=run.data.overlong,
    )


def _shipped_task(run: RunSpec):
    task = novel_task(passage_words=max(8, run.optim.seq_len // 4), seed=run.seed)
    return task, "novel task example", "novel task"


@data_format.register
class Sft(data_format.DataFormat):
    """``data.format='sft'``: .jsonl prompt/completion or chat examples, loss on completions."""

    name = "sft"
    dtypes = DTYPES
    path_fix = FIX
    tokenizer_fields = dict(sft=_VERSION)

    def source(self, run: RunSpec) -> data_format.Source:
        """The examples of ``data.path`` (each line checked), or the shipped novel task."""
        shipped = functools.partial(_shipped_task, run)
        return data_format.jsonl_source(run.data.path, chat.check_record, shipped, "examples", FIX)

    def texts(self, source: data_format.Source):
        """Every string of the examples."""
        return record_texts(source.content)

    def encode(self, run: RunSpec, source, tokenizer, workdir: Path) -> data_format.Encoded:
        """Every example encoded, split and fitted to rows; nothing written."""
        del workdir
        examples = [chat.encode(tokenizer, r, where) for r, where in source.content]
        train, val = fit_examples(examples, run)
        check_fits(source.desc, train, val, run, "examples")
        logging.info("%s: %d training, %d validation examples", source.desc, len(train), len(val))
        optim, key = run.optim, data_key(source, tokenizer, run)
        sizes = dict(seed=run.seed, batch_size=optim.batch_size, seq_len=optim.seq_len)
        dataset = SftDataset(tokenizer, train, val, packing=run.data.packing, key=key, **sizes)
        return data_format.Encoded(dataset)


def build(run: RunSpec, workdir: str | os.PathLike, tokenizer=None) -> SftDataset:
    """The fine-tuning data of ``run`` (``tokenizer``: an init_from checkpoint's; None: learn a
    BPE on the examples into ``<workdir>/tokenizer.json``). DataError on bad data, before
    anything in ``workdir`` changes."""
    return data_format.build(data_format.get(Sft.name), run, workdir, tokenizer)
