"""Supervised fine-tuning data: .jsonl examples -> token ids with loss weights -> row batches.

``build(run, workdir, tokenizer)`` reads ``run.data.path`` (a .jsonl file or a folder of them;
'' = :func:`novel_task` built from the shipped corpus), encodes every example in memory (the
Rust tokenizer does ~1M tokens/s, so a restart re-encodes rather than keeping a second cache),
holds out ``data.val_fraction`` of the examples and returns an :class:`SftDataset`. Its batches
are ``{'inputs', 'targets', 'weights', 'positions', 'segment_ids'}`` [rows, seq_len]: weights
1.0 on the targets that are completion (assistant) tokens, 0.0 on prompt and padding;
``segment_ids`` 1..n per row for its examples, 0 on padding; positions restart at 0 with
each example. The order is fixed by the seed and the stream resumes from a step count
(``stream.TrainIterator``).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from fp8jax import provenance
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import DataError
from fp8jax.trainer import chat, tasks
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer.stream import Batch, TrainIterator, process_rows, seed32

if TYPE_CHECKING:
    from fp8jax.spec import RunSpec

_VERSION = 1  # how examples are encoded and split; part of the data key
KEYS = ("inputs", "targets", "weights", "positions", "segment_ids")
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


def source_files(path: str) -> tuple[list[Path], str]:
    """The .jsonl files ``data.path`` names (a file or a folder) and a description."""
    p = Path(path).expanduser().resolve()
    if p.is_file():
        return [p], f"file {p}"
    files = sorted(f for f in p.rglob("*") if f.name.endswith((".jsonl", ".jsonl.gz")))
    if not p.is_dir() or not files:
        raise DataError(f"{p} is not a .jsonl file or a folder of them: set config.data.path "
                        f"to fine-tuning examples ('' = the shipped novel task)")  # fmt: skip
    return files, f"folder {p} ({len(files)} files)"


def read_records(files: list[Path], check=chat.check_record) -> list[tuple[dict, str]]:
    """``(example, 'file:line')`` of every non-blank line; a malformed line is a DataError
    (``check(record, where)`` raises it for a well-formed JSON line of the wrong shape)."""
    out = []
    for f in files:
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{f}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e.msg})") from e
                check(record, where)
                out.append((record, where))
    return out


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


def split(n: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) example indices: a fixed share, spread over the file by a fixed shuffle."""
    num_val = min(int(round(n * val_fraction)), n - 1) if val_fraction > 0 else 0
    if val_fraction > 0 and n > 1:
        num_val = max(num_val, 1)
    order = np.random.default_rng(seed32("sft-split")).permutation(n)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


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
    row = {k: np.zeros(seq_len, np.float32 if k == "weights" else np.int32) for k in KEYS}
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
        stream = _Stream(self.train, self.seq_len, self.packing, self.seed, self.batch_size, p,
                         rows)  # fmt: skip
        identity = dict(batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed,
                        data=self.key[:16])  # fmt: skip
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
            out.append(stack([make_row(self.val, idxs, self.seq_len)
                              for idxs in plan[first : first + rows]]))  # fmt: skip
        return out


def build(run: RunSpec, workdir: str | os.PathLike, tokenizer=None) -> SftDataset:
    """The fine-tuning data of ``run`` (``tokenizer``: an init_from checkpoint's; None: learn a
    BPE on the examples into ``<workdir>/tokenizer.json``). DataError on bad data, before
    anything in ``workdir`` changes."""
    workdir, data, optim = Path(workdir), run.data, run.optim
    if data.path:
        files, desc = source_files(data.path)
        records, corpus = read_records(files), corpus_lib.fingerprint(files)
    else:
        tasks = novel_task(passage_words=max(8, optim.seq_len // 4), seed=run.seed)
        records = [(r, f"novel task example {i}") for i, r in enumerate(tasks, 1)]
        corpus = tokenizer_lib.sha256(json.dumps(tasks, sort_keys=True))
        desc = f"novel task ({len(records)} passages of the shipped corpus)"
    if not records:
        raise DataError(f"no examples in {desc}: add .jsonl lines or fix config.data.path")
    identity = dict(corpus=corpus, source=desc, val_fraction=float(data.val_fraction))
    resumed = provenance.has_checkpoint(workdir)
    record_data = provenance.check_resume(workdir, identity, resumed, data.allow_corpus_change)
    new_tok = False
    if tokenizer is None:
        built_from = dict(sft=_VERSION, corpus=corpus, vocab_size=int(run.model.vocab_size),
                          min_frequency=int(data.tokenizer_min_frequency))  # fmt: skip
        tokenizer, new_tok = provenance.tokenizer_for(
            workdir / "tokenizer.json", built_from, lambda: record_texts(records), resumed
        )
    examples = [chat.encode(tokenizer, r, where) for r, where in records]
    train_idx, val_idx = split(len(examples), data.val_fraction)
    train, dropped = fit([examples[i] for i in train_idx], optim.seq_len, data.overlong)
    val, val_dropped = fit([examples[i] for i in val_idx], optim.seq_len, data.overlong)
    if dropped["overlong"] + val_dropped["overlong"]:
        logging.warning(
            "data.overlong='%s': %d of %d examples are longer than seq_len+1=%d tokens and "
            "were %s", data.overlong, dropped["overlong"] + val_dropped["overlong"],
            len(examples), optim.seq_len + 1,
            "dropped" if data.overlong == "drop" else "truncated",
        )  # fmt: skip
    if dropped["no_loss_tokens"] + val_dropped["no_loss_tokens"]:
        logging.warning("%d examples have no completion token within seq_len and were dropped",
                        dropped["no_loss_tokens"] + val_dropped["no_loss_tokens"])  # fmt: skip
    if not train or (data.val_fraction > 0 and not val):
        raise DataError(
            f"{desc}: {len(train)} training and {len(val)} validation examples fit "
            f"seq_len={optim.seq_len}: use more examples, a larger seq_len, a larger "
            f"data.val_fraction or data.overlong='truncate'"
        )
    key_src = dict(v=_VERSION, corpus=corpus, tokenizer=tokenizer_lib.sha256(
        tokenizer.to_str()), seq_len=optim.seq_len, overlong=data.overlong)  # fmt: skip
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()
    workdir.mkdir(parents=True, exist_ok=True)  # every check passed: now the work dir changes
    if new_tok:
        tokenizer_lib.save_cached(tokenizer, workdir / "tokenizer.json", built_from)
    if record_data:
        provenance.write_json(workdir / provenance.MANIFEST, identity)
    logging.info("%s: %d training, %d validation examples", desc, len(train), len(val))
    sizes = dict(seed=run.seed, batch_size=optim.batch_size, seq_len=optim.seq_len)
    return SftDataset(tokenizer, train, val, packing=data.packing, key=key, **sizes)
