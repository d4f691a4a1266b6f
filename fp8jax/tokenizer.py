"""Tokenizers: the byte-level BPE trained locally with ``tokenizers`` (no hub access), and
Hugging Face ``tokenizer.json`` directories with their special tokens and chat template."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from absl import logging
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = [
    "EOS",
    "HF_SPECIAL_FILES",
    "HF_TOKENIZER",
    "MIN_VOCAB_SIZE",
    "Tokenizer",
    "from_str",
    "load",
    "load_cached",
    "load_hf",
    "record_path",
    "save_cached",
    "sha256",
    "train",
]

EOS = "<|endoftext|>"
# 256 byte symbols plus EOS: the smallest vocabulary that can still encode any text.
MIN_VOCAB_SIZE = 257
# A Hugging Face tokenizer directory: the tokenizer itself and the files naming its special tokens.
HF_TOKENIZER = "tokenizer.json"
HF_SPECIAL_FILES = ("tokenizer_config.json", "generation_config.json", "config.json")


class Tokenizer:
    """A ``tokenizers`` tokenizer with its special ids: fp8jax's byte-level BPE or a HF one.

    ``eos_id`` ends a document (fp8jax's BPE: ``<|endoftext|>``); ``eos_ids`` are every id that
    ends a generation; ``bos_id``/``pad_id`` are None when the tokenizer has none.
    ``chat_template`` is the Jinja chat template of a HF tokenizer, or None.
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        eos_id: int | None = None,
        bos_id: int | None = None,
        pad_id: int | None = None,
        chat_template: str | None = None,
        eos_ids: Sequence[int] = (),
    ):
        self._tok = tok
        if eos_id is None:
            eos_id = tok.token_to_id(EOS)
        if eos_id is None:
            raise ValueError(f"tokenizer has no {EOS} token; it was not made by fp8jax")
        self.eos_id: int = int(eos_id)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *map(int, eos_ids)]))
        self.bos_id: int | None = bos_id
        self.pad_id: int | None = pad_id
        self.chat_template: str | None = chat_template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` tokenizer itself (its pre-tokenizer, model and added tokens)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids (ids are in ``[0, vocab_size)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str:
        """The text of the EOS token."""
        return self._tok.id_to_token(self.eos_id)

    @property
    def bos_token(self) -> str | None:
        """The text of the BOS token, or None."""
        return None if self.bos_id is None else self._tok.id_to_token(self.bos_id)

    def id_to_token(self, token_id: int) -> str | None:
        """The text of token ``token_id``, or None outside the vocabulary."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary or added token), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (no EOS appended).

        With ``add_special_tokens`` the tokenizer's post-processor runs (a HF tokenizer may add
        a BOS), as in transformers' ``tokenizer(text)['input_ids']``; fp8jax's BPE has none.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust backend."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text without the special tokens a tokenizer adds around any text,
        encoded in parallel and without offsets (the corpus encoder's fast path)."""
        encoded = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encoded]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; EOS shows as its token text unless ``skip_special_tokens``."""
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


def load_hf(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (``tokenizer.json``).

    EOS, BOS and PAD come from ``tokenizer_config.json``, then ``generation_config.json``, then
    ``config.json`` (the first that names each); a directory whose ``tokenizer.json`` holds
    fp8jax's ``<|endoftext|>`` and names no EOS gets that one. Raises ``ValueError`` (one line)
    when ``tokenizer.json`` is missing or names no EOS at all.
    """
    directory = Path(directory)
    path = directory / HF_TOKENIZER
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: the tokenizer must be a fast (tokenizers) one; save it with "
            f"transformers' tokenizer.save_pretrained({str(directory)!r})"
        )
    return _with_specials(tokenizers.Tokenizer.from_file(str(path)), directory)


def load(path: str | os.PathLike) -> Tokenizer:
    """An existing tokenizer: a ``tokenizer.json`` file or a Hugging Face model directory.

    Special tokens come from the directory (of the file) as in :func:`load_hf`. Raises a
    one-line ``ValueError`` naming ``path`` when it is missing, does not load or names no EOS.
    """
    path = Path(path).expanduser()
    file = path / HF_TOKENIZER if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"{file} does not exist: name a tokenizer.json file or a Hugging Face model dir "
            "holding one (transformers' tokenizer.save_pretrained writes it)"
        )
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception types for bad JSON
        raise ValueError(f"{file} is not a tokenizers tokenizer.json ({e})") from None
    return _with_specials(tok, file.parent)


def _with_specials(tok: tokenizers.Tokenizer, directory: Path) -> Tokenizer:
    """``tok`` with the EOS, BOS, PAD and chat template that ``directory``'s files name."""
    files = [_read_json(directory / name) for name in HF_SPECIAL_FILES]
    ids = {}
    for kind in ("eos", "bos", "pad"):
        ids[kind] = _special_ids(tok, files, kind)
    eos_ids = ids["eos"] or ([tok.token_to_id(EOS)] if tok.token_to_id(EOS) is not None else [])
    if not eos_ids:
        raise ValueError(
            f"{directory} names no EOS token: set eos_token in tokenizer_config.json or "
            "eos_token_id in generation_config.json"
        )
    template = files[0].get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    if not isinstance(template, str):  # a list of named templates: the default one
        named = {t.get("name"): t.get("template") for t in template or []}
        template = named.get("default")
    first = lambda xs: xs[0] if xs else None  # noqa: E731
    return Tokenizer(tok, eos_ids[0], first(ids["bos"]), first(ids["pad"]), template, eos_ids)


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``; {} where there is no such file. A file that is not one is a
    one-line ValueError: its EOS, BOS or chat template must not vanish unseen."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else "not JSON text"
        raise ValueError(f"{path} is unreadable ({why}); restore it or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a JSON object; restore it")
    return value


def _special_ids(tok: tokenizers.Tokenizer, files: list[dict], kind: str) -> list[int]:
    """Ids of the ``kind`` ('eos', 'bos', 'pad') token: the first of ``files`` naming it.

    tokenizer_config.json names the token by text (a string, or a dict with 'content');
    generation_config.json and config.json by id (an int or a list of ints).
    """
    token = files[0].get(f"{kind}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tok.token_to_id(token) is not None:
        found = [tok.token_to_id(token)]
        if kind == "eos":  # generation may stop at more ids than the tokenizer's own EOS
            found += _ids_of(files[1].get("eos_token_id"))
        return found
    for values in files[1:]:
        found = _ids_of(values.get(f"{kind}_token_id"))
        if found:
            return found
    return []


def _ids_of(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


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
