"""Byte-level BPE tokenizer trained locally with the ``tokenizers`` package (no hub access)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from absl import logging
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
# 256 byte symbols plus EOS: the smallest vocabulary that can still encode any text.
MIN_VOCAB_SIZE = 257


class Tokenizer:
    """Lossless byte-level BPE tokenizer with an EOS / document-separator token."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self._tok = tok
        eos_id = tok.token_to_id(EOS)
        if eos_id is None:
            raise ValueError(f"tokenizer has no {EOS} token; it was not made by fp8jax")
        self.eos_id: int = eos_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids (ids are in ``[0, vocab_size)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS appended)."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust backend."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; EOS shows as ``<|endoftext|>`` unless ``skip_special_tokens``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        """The tokenizer as the ``tokenizers`` JSON string."""
        return self._tok.to_str()

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON to ``path`` atomically (other processes may read it concurrently)."""
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(self.to_str(), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Read a tokenizer saved by :meth:`save`."""
        return cls(tokenizers.Tokenizer.from_file(str(path)))


def train(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with exactly ``vocab_size`` ids on ``texts``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + EOS), got {vocab_size}"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    # No normalizer and no prefix space: encode/decode must round-trip any text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    learned = tok.get_vocab_size(with_added_tokens=True)
    if learned < vocab_size:
        # A small corpus runs out of frequent pairs; pad with never-produced tokens so the id
        # range always equals the model's embedding size and the cache check stays exact.
        logging.warning(
            "BPE learned only %d of %d tokens (corpus too small or min_frequency too high); "
            "padding with reserved tokens",
            learned,
            vocab_size,
        )
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - learned)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"BPE training produced {tok.get_vocab_size()} ids, not {vocab_size}")
    return Tokenizer(tok)


def record_path(path: str | os.PathLike) -> Path:
    """Where the record of what built the tokenizer at ``path`` lives (``tokenizer.meta.json``)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.meta.json")


def load_cached(path: str | os.PathLike) -> tuple[str | None, dict | None]:
    """The JSON of the tokenizer saved at ``path`` (None if absent) and what built it.

    What built it is the ``built_from`` dict given to :func:`save_cached`; None when there is no
    record, or the record belongs to other bytes (the file was replaced, or a save was killed
    between the two files).
    """
    path = Path(path)
    if not path.exists():
        return None, None
    text = path.read_text(encoding="utf-8")
    try:
        record = json.loads(record_path(path).read_text())
    except (OSError, ValueError):
        return text, None
    if not isinstance(record, dict) or record.get("sha256") != sha256(text):
        return text, None
    return text, record.get("built_from")


def save_cached(tok: Tokenizer, path: str | os.PathLike, built_from: dict) -> None:
    """Save ``tok`` to ``path`` and, after it, the record of what built it (both atomically)."""
    path = Path(path)
    tok.save(path)
    record = record_path(path)
    tmp = record.with_name(f"{record.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(sha256=sha256(tok.to_str()), built_from=built_from), indent=1))
    os.replace(tmp, record)


def from_str(text: str) -> Tokenizer:
    """A :class:`Tokenizer` from its ``tokenizers`` JSON string."""
    return Tokenizer(tokenizers.Tokenizer.from_str(text))


def sha256(text: str) -> str:
    """Hex SHA-256 of ``text`` in UTF-8 (identifies a tokenizer by its JSON)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
