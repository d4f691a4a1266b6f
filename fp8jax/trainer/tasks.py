"""The novel task as a measurable result: held-out passages, preference pairs, exact match.

A passage of one of the six shipped novels is the prompt (``"<passage>\\nNovel:"``), its
novel's title the completion (``" <Title>"``), as in ``sft_data.novel_task``. Here the
training and test passages come from disjoint parts of each novel (the test passages from its
last ``test_share`` of words), so no test passage shares a word window with a training one.
A model's answer counts when its decoded completion, stripped, is the title exactly; picking
one of the titles at random scores ``1 / len(novel_titles())``.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fp8jax.errors import DataError
from fp8jax.trainer import corpus as corpus_lib

__all__ = [
    "PROMPT_SUFFIX",
    "chance",
    "exact_match",
    "example",
    "novel_files",
    "novel_split",
    "novel_titles",
    "preference_pairs",
    "title_in",
    "title_of",
    "write_jsonl",
]

PROMPT_SUFFIX = "\nNovel:"  # what ends every prompt, before the title


def title_of(path: str | os.PathLike) -> str:
    """A shipped novel's title: ``pride-and-prejudice.txt.gz`` -> 'Pride And Prejudice'."""
    return Path(path).name.removesuffix(".txt.gz").replace("-", " ").title()


def novel_files() -> list[Path]:
    """The shipped novels, sorted by file name."""
    files = sorted(corpus_lib.SHIPPED_DIR.glob("*.txt.gz"))
    if not files:
        raise DataError(f"no novels in {corpus_lib.SHIPPED_DIR}: reinstall fp8jax")
    return files


def novel_titles() -> list[str]:
    """The six titles a completion can be, in file order."""
    return [title_of(f) for f in novel_files()]


def example(passage: str, title: str) -> dict:
    """One prompt/completion record of the task."""
    return {"prompt": f"{passage}{PROMPT_SUFFIX}", "completion": f" {title}"}


def novel_split(
    num_train: int, num_test: int, passage_words: int, test_share: float = 0.1, seed: int = 0
) -> tuple[list[dict], list[dict]]:
    """(train, test) examples: the same number from each novel, at random word offsets (``seed``),
    the test passages from the last ``test_share`` of each novel's words, the training ones from
    the rest; each list shuffled."""
    if not 0 < test_share < 1:
        raise DataError(f"test_share={test_share}: use a share in (0, 1)")
    rng = np.random.default_rng(seed)
    files = novel_files()
    train, test = [], []
    for k, f in enumerate(files):
        words = gzip.open(f, "rt", encoding="utf-8").read().split()
        cut = int(len(words) * (1 - test_share))
        title = title_of(f)
        for out, total, lo, hi in ((train, num_train, 0, cut), (test, num_test, cut, len(words))):
            share = total // len(files) + (k < total % len(files))
            if hi - lo <= passage_words:
                raise DataError(
                    f"{f.name}: its part of {hi - lo} words is shorter than "
                    f"passage_words={passage_words}; use shorter passages"
                )
            for start in rng.integers(lo, hi - passage_words, share):
                out.append(example(" ".join(words[start : start + passage_words]), title))
    return (
        [train[i] for i in rng.permutation(len(train))],
        [test[i] for i in rng.permutation(len(test))],
    )


def title_in(record: dict) -> str:
    """The title a record's completion names (its text, stripped)."""
    return record["completion"].strip()


def preference_pairs(examples: Sequence[dict], seed: int = 0) -> list[dict]:
    """``{'prompt', 'chosen', 'rejected'}`` per example: chosen its right title, rejected one of
    the other titles drawn uniformly (``seed``)."""
    titles = novel_titles()
    rng = np.random.default_rng(seed)
    out = []
    for r in examples:
        right = title_in(r)
        wrong = [t for t in titles if t != right]
        rejected = wrong[int(rng.integers(len(wrong)))]
        out.append({"prompt": r["prompt"], "chosen": f" {right}", "rejected": f" {rejected}"})
    return out


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The share of predictions that equal their reference once both are stripped."""
    if len(predictions) != len(references) or not references:
        raise ValueError(
            f"{len(predictions)} predictions for {len(references)} references: "
            "give one prediction per reference (at least one)"
        )
    hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True))
    return hits / len(references)


def chance() -> float:
    """Exact match of a uniform guess among the titles."""
    return 1.0 / len(novel_titles())


def write_jsonl(path: str | os.PathLike, records: Sequence[dict]) -> Path:
    """Write ``records`` one JSON object a line, atomically (a temporary file renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    return path
