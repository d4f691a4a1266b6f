"""A byte-level BPE's corpus ids a word at a time: each distinct word is tokenized once.

A tokenizer whose pipeline is a byte-level BPE's (no normalizer, the ``ByteLevel`` pre-tokenizer
with its regex and no prefix space, a BPE model without dropout, no truncation or padding) cuts
text into words with one regex and tokenizes each word alone: the ids of a text are those of its
words in order. :class:`WordEncoder` cuts with Python's ``re`` and looks each word up in a dict of
the words seen so far (the BPE model tokenizes a new one), several times cheaper than the
tokenizer's own encoder, which builds an ``Encoding`` holding each token's string.

Llama 3's and Qwen2's tokenizers cut words with a regex of their own (a ``Split`` pre-tokenizer,
its pieces isolated, before a ``ByteLevel`` without its regex), Qwen2's after an NFC normalizer:
:class:`SplitWordEncoder` runs that pattern with the ``regex`` module (which knows the Unicode
classes that ``re`` lacks) and normalizes through the tokenizer's own normalizer.

The regex's classes (letters, numbers, blanks, the rest) are the tokenizer's own: each character
is put in the class that the tokenizer's pre-tokenizer shows for it (how it cuts the character
after a letter, a number and a full stop), and kept only where both engines then cut that probe
text the same way. A text holding a character that is not, or an added token
(``<|endoftext|>``), is left to the tokenizer (:meth:`WordEncoder.accepts`). A ``Split``
pattern's characters are each probed in the contexts of ``_SPLIT_CONTEXTS`` (the pattern's
cuts depend on the classes of the characters around one, as each published byte-level BPE's
do) and kept where both engines cut the probes alike; the pattern is kept only where the
encoder gives the tokenizer's ids of ``STRUCTURE_PROBES`` and ``SPLIT_PROBES``.
"""

from __future__ import annotations

import array
import bisect
import itertools
import json
import re
import unicodedata
from collections.abc import Callable, Iterable

import numpy as np
import regex
from tokenizers import models, normalizers, pre_tokenizers, processors

from fp8jax.tokenizer import Tokenizer

__all__ = [
    "MAX_WORDS",
    "SLICE_CHARS",
    "SPLIT_PROBES",
    "STRUCTURE_PROBES",
    "SplitWordEncoder",
    "WordEncoder",
]

SLICE_CHARS = 1 << 16  # text cut into words at a time
MAX_WORDS = 1 << 18  # distinct words remembered (about 40 MB); past it the dict starts over
# A class and a character of it: a character that stays one word after it is of its class (a
# letter, a number, neither and not blank); one that stays after none is blank.
_LEADS = (("L", "a"), ("N", "1"), ("O", "."))
# Texts that exercise each branch of the regex (contractions, digit runs, blank runs before a
# word or a line end): the tokenizer's regex must cut them as this module's does.
STRUCTURE_PROBES = (
    "don't I'll we've she's they're I'm he'd 'S 'LL o'clock ''s",
    "12345 1234567 3.14 x2 2x $9,99 10%",
    "a  b   c\t\td \n e\n\n\nf  \n  g",
    " lead...!!  ?! <tag> end \n ",
)
# ... and the branches of Llama 3's and Qwen2's patterns: case-blind contractions, digits in
# groups, a mark before a word, line breaks after punctuation and within blank runs, CRLF.
SPLIT_PROBES = (
    "DON'T I'M He'S THEY'RE we'Ve 'Ll 'D x's",
    "1 12 123 1234 12345 1234567890 x1234y 3.14159 1,000,000 ½12 ٣٤٥٦",
    '(word) "quoted" -dash ¿qué? .hidden a.b.c 数据abc',
    "end.\n\nnext,\r\n\r\n  indented\n\t\ttab \n\n \n x  \r\n",
)
# The contexts a character of a Split pattern is probed in ("c" stands for it), each ending in a
# line break: after each lead, before each trail and a few more. Each pair of the character
# classes that Llama 3's, Qwen2's and GPT-4o's patterns tell apart (letters of each case, marks,
# numbers, blanks, line breaks, the rest, a contraction's letters) is cut otherwise in one.
_SPLIT_LEADS = ("a", "A", "1", ".", "..", " ", "\n", "'")
_SPLIT_TRAILS = ("a", "A", "1", ".", " ", "\n")
_SPLIT_CONTEXTS = "".join(
    f"{context}\n"
    for context in (
        *(f"{lead}c" for lead in _SPLIT_LEADS),
        *(f"c{trail}" for trail in _SPLIT_TRAILS),
        *(" ca", ".c.", "'ca", "cAc", "cccc", " cc'c"),
    )
)
# The end of a run of ASCII before non-ASCII text, and the run: NFC composes no pair whose second
# character is ASCII and reorders no ASCII character, so text is normalized a run at a time.
_NON_ASCII = re.compile(r"([\x00-\x09\x0b-\x7f]?[^\x00-\x7f]+)")


def _probes(chars: list[str]) -> str:
    """The probe text of ``chars``: each after each lead of ``_LEADS``, the probes apart."""
    return "".join(f"\n\n{lead}{c}" for c in chars for _, lead in _LEADS)


def _split_probes(chars: list[str]) -> tuple[str, list[int]]:
    """The probe text of ``chars`` for a Split pattern (each in ``_SPLIT_CONTEXTS``), and
    where each character's probes start."""
    text = "".join(_SPLIT_CONTEXTS.replace("c", c) for c in chars)
    return text, list(range(0, len(text), len(_SPLIT_CONTEXTS)))


def _probe_lead(k: int) -> int:
    """Where the lead of probe ``k`` is in a probe text (each probe takes four characters)."""
    return 4 * k + 2


def _byte_chars() -> dict[int, str]:
    """The byte-level alphabet: each byte's character (printable bytes keep their own)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + k) for k, b in enumerate(moved)}}


_BYTE_CHARS = str.maketrans({chr(b): c for b, c in _byte_chars().items()})


def _mapped(word: str) -> str:
    """``word`` as the byte-level pre-tokenizer hands it to the model: a character a byte."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_CHARS)


def _char_set(spans: Iterable[tuple[str, str]], negate: bool = False) -> str:
    """A regex character set of the ranges ``spans`` (``negate``: of any other character)."""
    parts = [f"\\U{ord(a):08x}" + (f"-\\U{ord(b):08x}" if b > a else "") for a, b in spans]
    if not parts:
        return "[\\s\\S]" if negate else "[^\\s\\S]"
    return f"[{'^' * negate}{''.join(parts)}]"


class _Words(dict):
    """Word -> its ids' bytes; a word not yet seen is tokenized on lookup."""

    def __init__(self, tokenize: Callable[[str], bytes]):
        super().__init__()
        self.tokenize = tokenize

    def __missing__(self, word: str) -> bytes:
        ids = self[word] = self.tokenize(word)
        return ids


class WordEncoder:
    """The ids of texts for a byte-level BPE, each distinct word tokenized once (bytes of
    ``dtype``)."""

    def __init__(self, tok: Tokenizer, dtype: str):
        backend = tok.backend
        self._pre, self._model = backend.pre_tokenizer, backend.model
        self._code = np.dtype(dtype).char  # the array module's code for the same items
        added = sorted(self._added_texts(tok), key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._lead = re.compile(_char_set((t[0], t[0]) for t in added)) if added else None
        self._kind: dict[str, str] = {}  # a probed character's class: L, N, S (blank) or O
        self._seen: set[str] = set()  # characters probed
        self._rejected: set[str] = set()  # ... that the two regex engines class differently
        self._words = _Words(self._tokenize)
        ascii_chars = {chr(i) for i in range(128)}
        self._learn(ascii_chars)
        self._ascii = self._rejected.isdisjoint(ascii_chars)  # an ASCII text needs no probe

    @classmethod
    def of(cls, tok: Tokenizer, dtype: str) -> WordEncoder | None:
        """A word encoder for ``tok``, or None when its pipeline is not a byte-level BPE's
        (or its regex cuts a structure probe otherwise than this module's); a ``Split``
        pipeline's is :meth:`SplitWordEncoder.of`."""
        b = tok.backend
        pre, post = b.pre_tokenizer, b.post_processor
        if isinstance(pre, pre_tokenizers.Sequence):
            return SplitWordEncoder.of(tok, dtype)
        if b.normalizer is not None or b.truncation is not None or b.padding is not None:
            return None
        if not isinstance(pre, pre_tokenizers.ByteLevel) or pre.add_prefix_space:
            return None
        if not pre.use_regex or not isinstance(b.model, models.BPE) or b.model.dropout:
            return None
        if post is not None and not isinstance(post, processors.ByteLevel):
            return None
        words = cls(tok, dtype)
        if not all(words.accepts(p) and words._agrees(p) for p in STRUCTURE_PROBES):
            return None
        return words

    def accepts(self, text: str) -> bool:
        """Whether :meth:`encode` gives ``text``'s ids: it holds no added token and only
        characters classed alike by both regex engines (new ones are probed now)."""
        if self._holds_added(text):
            return False
        if self._ascii and text.isascii():
            return True
        chars = set(text)
        if not chars <= self._seen:
            self._learn(chars - self._seen)
        return self._rejected.isdisjoint(chars)

    def learn(self, texts: list[str]) -> None:
        """Probe the characters not seen yet of those ``texts`` without an added token, all at
        once (:meth:`accepts` probes one text's)."""
        chars = set().union(*(t for t in texts if not t.isascii() and not self._holds_added(t)))
        if not chars <= self._seen:
            self._learn(chars - self._seen)

    def encode(self, text: str) -> bytes:
        """The ids of ``text`` (one :meth:`accepts`), as the bytes of the dtype's items."""
        # In slices of about SLICE_CHARS cut between two words (a space between two letters):
        # a slice's words are few enough that their memory is reused rather than mapped anew.
        parts, start, get = [], 0, self._words.__getitem__
        while start < len(text):
            cut = self._cut.search(text, start + SLICE_CHARS)
            end = cut.start() if cut else len(text)
            parts.append(b"".join(map(get, self._regex.findall(text, start, end))))
            start = end
        if len(self._words) > MAX_WORDS:
            self._words.clear()
        return b"".join(parts)

    def _added_texts(self, tok: Tokenizer) -> set[str]:
        """The texts of the added tokens (which the tokenizer splits off first)."""
        return {t.content for t in tok.backend.get_added_tokens_decoder().values() if t.content}

    def _holds_added(self, text: str) -> bool:
        """Whether ``text`` holds an added token (which the tokenizer splits off first)."""
        return self._lead is not None and bool(self._lead.search(text) and self._added.search(text))

    def _tokenize(self, word: str) -> bytes:
        tokens = self._model.tokenize(_mapped(word))
        return array.array(self._code, [t.id for t in tokens]).tobytes()

    def _learn(self, chars: set[str]) -> None:
        """Class each of ``chars`` as the tokenizer's pre-tokenizer cuts it after each lead of
        ``_LEADS``, all in one probe text; reject those whose probes the two engines then cut
        differently."""
        new = sorted(chars)
        text = _probes(new)
        theirs = self._pre.pre_tokenize_str(text)
        spans = {span for _, span in theirs}
        for k, c in enumerate(new):
            at = [_probe_lead(len(_LEADS) * k + j) for j in range(len(_LEADS))]
            kinds = [kind for (kind, _), a in zip(_LEADS, at, strict=True) if (a, a + 2) in spans]
            self._kind[c] = kinds[0] if kinds else "S"
        self._compile()
        # All of them when no one character alone is cut otherwise (two characters' probes
        # cut otherwise together).
        bad = set() if self._agrees(text, theirs) else set(self._unlike(new)) or set(new)
        if bad:
            for c in bad:
                del self._kind[c]
            self._rejected |= bad
            self._compile()
        self._seen |= chars

    def _unlike(self, chars: list[str]) -> list[str]:
        """Those of ``chars`` whose probes the two engines cut differently: found by halving
        the characters of a probe text cut otherwise."""
        if self._agrees(_probes(chars)):
            return []
        if len(chars) == 1:
            return chars
        half = len(chars) // 2
        return self._unlike(chars[:half]) + self._unlike(chars[half:])

    def _agrees(self, text: str, theirs: list | None = None) -> bool:
        """Whether this module's regex cuts ``text`` where the tokenizer's pre-tokenizer does
        (``theirs``: its ``pre_tokenize_str`` of ``text``, when already at hand)."""
        if theirs is None:
            theirs = self._pre.pre_tokenize_str(text)
        ours = itertools.accumulate(map(len, self._regex.findall(text)))
        return list(ours) == [end for _, (_, end) in theirs]

    def _compile(self) -> None:
        """The byte-level BPE's regex (its contractions sharing the apostrophe) over the classes
        found so far. A class's ranges also span the characters not probed between two of its
        own (no text it encodes holds them): a few ranges where each script's characters are
        seen one by one."""
        spans: dict[str, list[tuple[str, str]]] = {"L": [], "N": [], "S": [], "O": []}
        for kind, run in itertools.groupby(sorted(self._kind.items()), key=lambda x: x[1]):
            chars = [c for c, _ in run]
            spans[kind].append((chars[0], chars[-1]))
        letter, number, blank = (_char_set(spans[k]) for k in "LNS")
        other = _char_set(spans["L"] + spans["N"] + spans["S"], negate=True)
        non_blank = _char_set(spans["S"], negate=True)
        self._cut = re.compile(f"(?<={letter}) (?={letter})")
        self._regex = re.compile(
            f"'(?:s|t|re|ve|m|ll|d)| ?{letter}+| ?{number}+| ?{other}+"
            f"|{blank}+(?!{non_blank})|{blank}+"
        )


class SplitWordEncoder(WordEncoder):
    """The ids of texts for a BPE whose words are the pieces of a ``Split`` pattern before a
    ``ByteLevel`` without its regex (Llama 3's, Qwen2's), each distinct word tokenized once."""

    def __init__(self, tok: Tokenizer, dtype: str, pattern: str, nfc: bool):
        # A stretch where no match starts is a piece of its own, as the Split isolates it.
        self._regex = regex.compile(f"(?:{pattern})|(?:(?!(?:{pattern}))[\\s\\S])+")
        self._cut = regex.compile(r"(?<=\p{L}) (?=\p{L})")  # checked by of()'s probes
        self._normalizer = tok.backend.normalizer if nfc else None
        self._last = ("", "")  # the text last normalized, and its normal form
        super().__init__(tok, dtype)

    @classmethod
    def of(cls, tok: Tokenizer, dtype: str) -> SplitWordEncoder | None:
        """A word encoder for ``tok``, or None when its pipeline is not a ``Split`` pattern's
        isolated pieces before a ``ByteLevel`` without its regex or prefix space, with no
        normalizer or NFC, into a BPE without dropout (or when the encoder's ids of the
        structure probes, or its cuts of them, are not the tokenizer's)."""
        b = tok.backend
        if b.truncation is not None or b.padding is not None:
            return None
        if not isinstance(b.model, models.BPE) or b.model.dropout:
            return None
        nfc = isinstance(b.normalizer, normalizers.NFC)
        if b.normalizer is not None and not nfc:
            return None
        pre = json.loads(b.pre_tokenizer.__getstate__())  # its JSON, as pickle takes it
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not steps or len(steps) != 2:
            return None
        split, byte_level = steps
        if split.get("type") != "Split" or split.get("behavior") != "Isolated":
            return None
        pattern = (split.get("pattern") or {}).get("Regex")
        if pattern is None or split.get("invert") or byte_level.get("type") != "ByteLevel":
            return None
        if byte_level.get("add_prefix_space") or byte_level.get("use_regex"):
            return None
        try:
            if regex.compile(pattern).groups:  # findall would give the groups' text
                return None
            words = cls(tok, dtype, pattern, nfc)
        except regex.error:
            return None
        probes = [*STRUCTURE_PROBES, *SPLIT_PROBES]
        if not all(words.accepts(p) and words._agrees(p) for p in probes):
            return None
        ours = [np.frombuffer(words.encode(p), dtype).tolist() for p in probes]
        if ours != tok.encode_plain(probes) or not all(map(words._cuts_agree, probes)):
            return None
        return words

    def accepts(self, text: str) -> bool:
        """Whether :meth:`encode` gives ``text``'s ids: it holds no added token, before or
        after normalizing, and its normal form only characters cut alike by both regex
        engines (new ones are probed now)."""
        return not self._holds_added(text) and super().accepts(self._normal(text))

    def encode(self, text: str) -> bytes:
        """The ids of ``text`` (one :meth:`accepts`), as the bytes of the dtype's items."""
        return super().encode(self._normal(text))

    def _normal(self, text: str) -> str:
        """``text`` as the tokenizer's normalizer leaves it: as it is where Python finds it
        in NFC (a text with a character that Python's Unicode does not know is refused by
        :meth:`accepts`: only there might the tokenizer's newer tables differ), else its
        non-ASCII runs (each with the ASCII character before it) normalized by the tokenizer
        in one call, a line break apart."""
        if self._normalizer is None or unicodedata.is_normalized("NFC", text):
            return text
        if self._last[0] is text:
            return self._last[1]
        parts = _NON_ASCII.split(text)  # ASCII, a run, ASCII, ..., a run, ASCII
        runs = self._normalizer.normalize_str("\n".join(parts[1::2])).split("\n")
        if len(runs) == len(parts) // 2:
            parts[1::2] = runs
            normal = "".join(parts)
        else:
            normal = self._normalizer.normalize_str(text)
        self._last = (text, normal)
        return normal

    def _added_texts(self, tok: Tokenizer) -> set[str]:
        """The texts of the added tokens, also normalized (a token matched in the normalized
        text is found there by its normal form)."""
        texts = super()._added_texts(tok)
        return texts | {self._normal(t) for t in texts}

    def _learn(self, chars: set[str]) -> None:
        """Reject those of ``chars`` whose probes the two engines cut differently (a cut
        that only one engine makes rejects the character whose probes it falls in); probe
        the others again until both engines cut them alike. Under NFC, also those that
        Python's Unicode does not know (its tables vouch for a text's NFC)."""
        if self._normalizer is not None:
            self._rejected |= {c for c in chars if unicodedata.category(c) == "Cn"}
        new = sorted(chars - self._rejected)
        while new:
            text, starts = _split_probes(new)
            theirs = {end for _, (_, end) in self._pre.pre_tokenize_str(text)}
            ours = set(itertools.accumulate(map(len, self._regex.findall(text))))
            bad = {new[bisect.bisect_right(starts, end - 1) - 1] for end in theirs ^ ours}
            if not bad:
                break
            self._rejected |= bad
            new = [c for c in new if c not in bad]
        self._seen |= chars

    def _cuts_agree(self, text: str) -> bool:
        """Whether each place where :meth:`encode` may cut ``text`` into slices is a word's
        end for the tokenizer."""
        ends = {end for _, (_, end) in self._pre.pre_tokenize_str(text)}
        return all(m.start() in ends for m in self._cut.finditer(text))
