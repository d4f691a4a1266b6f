"""Preference data for DPO: .jsonl pairs -> token ids with response weights -> row-pair batches.

Each line is ``{"prompt", "chosen", "rejected"}``: three strings (the prompt encoded with the
tokenizer's BOS, each response followed by EOS), or three lists of ``{"role", "content"}``
messages (the prompt's conversation, then each response's turns, rendered with the tokenizer's
chat template). A pair becomes two rows, chosen then rejected, each the prompt followed by
its response, weights 1.0 on the response's targets only (its EOS or end-of-turn included)
and 0.0 on the prompt and padding; one pair per two rows, padded to seq_len (no packing), so
any split of a batch into an even number of rows keeps pairs whole. Batches carry the keys
of fine-tuning (``sft_data.KEYS``), data only: the DPO objective (``objectives.dpo``) holds
beta, label smoothing and the reference. ``data.val_fraction`` of the pairs are held out; the
training order is fixed by the seed and resumes from a step count (``stream.TrainIterator``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from fp8jax.errors import DataError
from fp8jax.trainer import chat, data_format, sft_data
from fp8jax.trainer.sft_data import Example, make_row, stack
from fp8jax.trainer.stream import Batch, TrainIterator, process_rows, seed32

if TYPE_CHECKING:
    from fp8jax.spec import RunSpec

__all__ = [
    "FIELDS",
    "DpoDataset",
    "Preferences",
    "build",
    "check_distinct",
    "check_pair",
    "encode_response",
    "fit_pairs",
    "make_row",
    "novel_pairs",
    "record_texts",
    "stack",
]

_VERSION = 1  # how pairs are encoded and split; part of the data key
FIELDS = ("prompt", "chosen", "rejected")


def novel_pairs(num_pairs: int = 512, passage_words: int = 40, seed: int = 0) -> list[dict]:
    """Preference pairs from the shipped novels: a passage -> its novel's title (chosen) or
    another novel's title (rejected, drawn with ``seed``)."""
    tasks = sft_data.novel_task(num_pairs, passage_words, seed)
    titles = sorted({t["completion"] for t in tasks})
    rng = np.random.default_rng([seed32("dpo-novel"), seed])
    out = []
    for t in tasks:
        others = [x for x in titles if x != t["completion"]]
        rejected = others[int(rng.integers(len(others)))]
        out.append(dict(prompt=t["prompt"], chosen=t["completion"], rejected=rejected))
    return out


def _is_messages(value) -> bool:
    def ok(message) -> bool:
        strings = lambda: all(isinstance(message.get(k), str) for k in ("role", "content"))
        return isinstance(message, dict) and strings()

    return isinstance(value, list) and all(ok(message) for message in value)


def check_pair(record, where: str) -> str:
    """Which kind of pair a parsed .jsonl line is ('text' or 'messages'); DataError if none."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'prompt', 'chosen', 'rejected'")
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise DataError(
            f"{where}: missing {', '.join(map(repr, missing))}: each line needs "
            f"'prompt', 'chosen' and 'rejected'"
        )
    if all(isinstance(record[k], str) for k in FIELDS):
        return "text"
    if all(_is_messages(record[k]) for k in FIELDS):
        return "messages"
    raise DataError(
        f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings, or all "
        f"lists of {{'role', 'content'}} messages"
    )


def encode_response(tokenizer, record: dict, response: str, where: str) -> Example:
    """``(ids int32 [n], trained bool [n])``: the prompt then ``record[response]``, trained on
    the response's tokens only."""
    if check_pair(record, where) == "text":
        return chat.encode(
            tokenizer, dict(prompt=record["prompt"], completion=record[response]), where
        )
    prompt, turns = record["prompt"], record[response]
    try:
        parts = chat.chat_parts(tokenizer, prompt + turns)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from e
    # The prompt's own assistant turns (earlier in the conversation) are context, not trained.
    context = sum(m["role"] == "assistant" for m in prompt)
    ids, trained, seen = [], [], 0
    for part_ids, (_, is_turn) in zip(
        chat.plain_ids(tokenizer, [t for t, _ in parts]), parts, strict=True
    ):
        seen += is_turn
        ids += part_ids
        trained += [is_turn and seen > context] * len(part_ids)
    return np.asarray(ids, np.int32), np.asarray(trained, bool)


def record_texts(records):
    """Every string of the pairs (what a learned BPE is trained on)."""
    for record, _ in records:
        for k in FIELDS:
            value = record[k]
            yield from ([value] if isinstance(value, str) else (m["content"] for m in value))


def fit_pairs(pairs: list[tuple[Example, Example]], seq_len: int, overlong: str):
    """The pairs whose two rows both fit (``sft_data.fit``), flattened chosen, rejected, ...;
    and the number of pairs left out."""
    kept = []
    for chosen, rejected in pairs:
        rows, _ = sft_data.fit([chosen, rejected], seq_len, overlong)
        if len(rows) == 2:
            kept += rows
    return kept, len(pairs) - len(kept) // 2


def _same(chosen: Example, rejected: Example) -> bool:
    """Whether a pair's two rows are one: its DPO loss is log(2) whatever the policy."""
    return all(np.array_equal(a, b) for a, b in zip(chosen, rejected, strict=True))


def check_distinct(
    desc: str, train: list[Example], val: list[Example], records: list, seq_len: int
) -> None:
    """A DataError naming the data and its first such line when every training pair (rows
    ``2k``, ``2k + 1``) has its chosen response equal to its rejected one (the loss stays
    log(2): nothing is learned); a warning with the count when some pairs do. ``records``:
    the ``(record, where)`` pairs, to name the first one."""
    same = [_same(*train[k : k + 2]) for k in range(0, len(train), 2)]
    same_val = sum(_same(*val[k : k + 2]) for k in range(0, len(val), 2))
    if not any(same) and not same_val:
        return
    first = next((w for r, w in records if r["chosen"] == r["rejected"]), None)
    where = f" (the first at {first})" if first else f" once cut to seq_len={seq_len}"
    if all(same):
        raise DataError(
            f"{desc}: every one of its {len(same)} training pairs has the same chosen and "
            f"rejected response{where}, so the DPO loss stays log(2) and nothing is learned; "
            "give each pair a rejected response that differs from its chosen one"
        )
    logging.warning(
        "%s: %d of %d training and %d of %d validation pairs have the same chosen and "
        "rejected response%s; they add log(2) to the loss and teach nothing",
        desc,
        sum(same),
        len(same),
        same_val,
        len(val) // 2,
        where,
    )


class _PairStream:
    """Training batches by global step: each epoch visits the pairs in a new seeded order."""

    def __init__(self, examples, seq_len, seed, batch_size, p, rows):
        self.examples, self.seq_len, self.seed = examples, seq_len, seed
        self.batch_size, self.p, self.rows = batch_size, p, rows
        self.num_pairs = len(examples) // 2
        self.order = functools.lru_cache(maxsize=4)(self._order)

    def _order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([seed32("dpo-train", self.seed), epoch])
        return rng.permutation(self.num_pairs)

    def __getitem__(self, step: int) -> Batch:
        first = (step * self.batch_size + self.p * self.rows) // 2  # this process's first pair
        rows = []
        for g in range(first, first + self.rows // 2):
            epoch, k = divmod(g, self.num_pairs)
            i = int(self.order(epoch)[k])
            rows += [make_row(self.examples, [2 * i + j], self.seq_len) for j in (0, 1)]
        return stack(rows)


def _pair_rows(batch_size: int, process_index, process_count) -> tuple[int, int]:
    p, _, rows = process_rows(batch_size, process_index, process_count)
    if rows % 2:
        raise ValueError(
            f"batch_size={batch_size} gives each process {rows} rows: DPO needs "
            f"an even number (whole chosen/rejected pairs)"
        )
    return p, rows


class DpoDataset:
    """Encoded preference pairs: a checkpointable training stream and fixed eval batches."""

    def __init__(self, tokenizer, train, val, *, seed, batch_size, seq_len, key=""):
        self.tokenizer, self.train, self.val = tokenizer, train, val  # chosen, rejected, ...
        self.seed, self.batch_size, self.seq_len, self.key = seed, batch_size, seq_len, key

    def train_iter(self, *, process_index=None, process_count=None) -> TrainIterator:
        """Batches of ``sft_data.KEYS`` [batch_size / processes, seq_len], resumable by step;
        rows 2k and 2k + 1 are one pair's chosen and rejected response."""
        p, rows = _pair_rows(self.batch_size, process_index, process_count)
        stream = _PairStream(self.train, self.seq_len, self.seed, self.batch_size, p, rows)
        identity = dict(
            batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed, data=self.key[:16]
        )
        return TrainIterator(stream, identity)

    def eval_batches(self, num_batches: int, *, process_index=None, process_count=None):
        """The first ``num_batches`` batches of held-out pairs in file order (the last one
        filled up with empty pairs, whose weights are 0)."""
        p, rows = _pair_rows(self.batch_size, process_index, process_count)
        idxs = [[i] for i in range(len(self.val))][: num_batches * self.batch_size]
        idxs += [[]] * (-len(idxs) % self.batch_size)
        out = []
        for b in range(len(idxs) // self.batch_size):
            first = b * self.batch_size + p * rows
            out.append(
                stack([make_row(self.val, r, self.seq_len) for r in idxs[first : first + rows]])
            )
        return out


def _shipped_pairs(run: RunSpec):
    pairs = novel_pairs(passage_words=max(8, run.optim.seq_len // 4), seed=run.seed)
    return pairs, "novel pair", "novel preference pairs"


@data_format.register
class Preferences(data_format.DataFormat):
    """``data.format='dpo'``: .jsonl (prompt, chosen, rejected) pairs, trained by DPO."""

    name = "dpo"
    objective = "dpo"
    dtypes = sft_data.DTYPES
    path_fix = sft_data.FIX
    tokenizer_fields = dict(dpo=_VERSION)

    def source(self, run: RunSpec) -> data_format.Source:
        """The pairs of ``data.path`` (each line checked), or the shipped novel pairs."""
        shipped = functools.partial(_shipped_pairs, run)
        return data_format.jsonl_source(run.data.path, check_pair, shipped, "pairs", sft_data.FIX)

    def texts(self, source: data_format.Source):
        """Every string of the pairs."""
        return record_texts(source.content)

    def encode(self, run: RunSpec, source, tokenizer, workdir: Path) -> data_format.Encoded:
        """Every pair encoded as two rows, split and fitted to rows; nothing written."""
        del workdir
        data, optim = run.data, run.optim
        pairs = [
            tuple(encode_response(tokenizer, r, k, where) for k in ("chosen", "rejected"))
            for r, where in source.content
        ]
        train_idx, val_idx = data_format.split(len(pairs), data.val_fraction)
        train, dropped = fit_pairs([pairs[i] for i in train_idx], optim.seq_len, data.overlong)
        val, val_dropped = fit_pairs([pairs[i] for i in val_idx], optim.seq_len, data.overlong)
        if dropped + val_dropped:
            logging.warning(
                "%d of %d pairs have a row over seq_len+1=%d tokens (data.overlong='%s') or a "
                "response without a token in it, and were dropped",
                dropped + val_dropped,
                len(pairs),
                optim.seq_len + 1,
                data.overlong,
            )
        sft_data.check_fits(source.desc, train, val, run, "pairs", per=2)
        check_distinct(source.desc, train, val, source.content, optim.seq_len)
        logging.info(
            "%s: %d training, %d validation pairs", source.desc, len(train) // 2, len(val) // 2
        )
        key = sft_data.data_key(source, tokenizer, run, _VERSION)
        dataset = DpoDataset(
            tokenizer,
            train,
            val,
            seed=run.seed,
            batch_size=optim.batch_size,
            seq_len=optim.seq_len,
            key=key,
        )
        return data_format.Encoded(dataset)


def build(run: RunSpec, workdir: str | os.PathLike, tokenizer=None) -> DpoDataset:
    """The preference data of ``run`` (``tokenizer``: an init_from checkpoint's; None: learn a
    BPE on the pairs into ``<workdir>/tokenizer.json``). DataError on bad data, before
    anything in ``workdir`` changes."""
    return data_format.build(data_format.get(Preferences.name), run, workdir, tokenizer)
