"""Encode a corpus into token shards once, ahead of training (on a CPU box, say).

    python -m fp8jax.prepare corpus/ --tokenizer tokenizer.json --out shards/ --workers 16

``SRC`` is what ``config.data.path`` names for ``data.format='text'`` (a text file, a folder
of .txt, .txt.gz, .jsonl(.gz) or .parquet files, or a glob pattern of them such as
``'web/**/*.parquet'``, quoted for the shell); ``--tokenizer`` a tokenizer.json or a
Hugging Face model dir. ``--out`` (a new folder) receives ``.bin`` token shards
(``fp8jax.trainer.token_shards``) of about ``--shard_tokens`` ids each, cut after a
document's EOS, a copy of the tokenizer in ``tokenizer/`` and ``prepare.json`` (the source,
its fingerprint, the counts). Train on them with

    train.py --config.data.format=tokens --config.data.path=shards/ \\
        --config.data.tokenizer=shards/tokenizer

The encoder is the trainer's (files cut into ranges, ``--workers`` processes); a progress bar
shows MB/s and the time left, and the last line the throughput. Bad input exits 2 with one
line on stderr and writes nothing (the shards are staged beside ``--out`` and renamed at the
end; FP8JAX_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from absl import flags

from fp8jax import cli

__all__ = ["main", "prepare", "run"]

_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.json or Hugging Face model dir.")
_OUT = flags.DEFINE_string("out", None, "New folder for the token shards.")
_WORKERS = flags.DEFINE_integer("workers", 0, "Encoding processes (0: one per CPU core).")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", 1 << 28, "Ids per shard, about.")

MANIFEST = "prepare.json"  # what --out holds and where it came from (token_shards.MANIFEST)
TOKENIZER_DIR = "tokenizer"  # the tokenizer's copy in --out (config.data.tokenizer)


class _Shards:
    """Writes ids into ``.bin`` shards of about ``size`` ids, each cut after an EOS."""

    def __init__(self, out: Path, size: int, eos: int, dtype: str):
        self.out, self.size, self.eos, self.dtype = out, size, eos, dtype
        self.pending: list[np.ndarray] = []
        self.pending_len, self.count, self.tokens = 0, 0, 0

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.pending_len += len(ids)
        while self.pending_len >= self.size:
            flat = np.concatenate(self.pending)
            ends = np.flatnonzero(flat[: self.size] == self.eos)
            cut = int(ends[-1]) + 1 if len(ends) else self.size  # no EOS: at the size
            self._write(flat[:cut])
            self.pending, self.pending_len = [flat[cut:]], len(flat) - cut

    def close(self) -> None:
        if self.pending_len:
            self._write(np.concatenate(self.pending))

    def _write(self, ids: np.ndarray) -> None:
        from fp8jax.trainer import token_shards

        path = self.out / f"{self.count:05d}.bin"
        token_shards.write_bin(path, ids.astype(self.dtype, copy=False))
        self.count += 1
        self.tokens += len(ids)


def _copy_tokenizer(path: str, out: Path) -> None:
    """The tokenizer.json ``path`` names and the special-token files beside it, into ``out``."""
    from fp8jax import tokenizer as tokenizer_lib

    src = Path(path).expanduser()
    file = src / tokenizer_lib.HF_TOKENIZER if src.is_dir() else src
    out.mkdir()
    shutil.copyfile(file, out / tokenizer_lib.HF_TOKENIZER)
    for name in tokenizer_lib.HF_SPECIAL_FILES:
        if (file.parent / name).is_file():
            shutil.copyfile(file.parent / name, out / name)


def prepare(
    src: str, tokenizer: str, out: str, workers: int = 0, shard_tokens: int = 1 << 28
) -> dict:
    """Encode the corpus ``src`` with ``tokenizer`` into token shards in the new folder
    ``out``; returns its manifest. A DataError (nothing written) for bad input."""
    from fp8jax import errors, provenance
    from fp8jax import tokenizer as tokenizer_lib
    from fp8jax.trainer import corpus as corpus_lib
    from fp8jax.trainer import data_format, encode, token_shards

    errors.check_int(workers, "--workers", 0)
    errors.check_int(shard_tokens, "--shard_tokens", 1)
    target = Path(out).expanduser()
    provenance.check_new_output(target, "--out", errors.DataError)
    fix = "name a text file, a folder of them or a glob pattern of them as SRC"
    files, desc = corpus_lib.source_files(src, fix=fix)
    if files[0].name.endswith(token_shards.readers()):
        raise errors.DataError(f"{files[0]} is a token shard, not text: it needs no preparing")
    with errors.reraise_as(errors.DataError, ValueError):
        tok = tokenizer_lib.load(tokenizer)
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    stage = target.parent / f".{target.name}.tmp{os.getpid()}"
    t0, chars = time.perf_counter(), 0
    try:
        stage.mkdir()
    except OSError as e:
        raise errors.DataError(
            f"--out {str(target)!r}: cannot create a folder beside it ({e.strerror}); name an "
            f"--out in a folder you can write to"
        ) from None
    # The shards' size for a full disk's message: about one id per 4 bytes of text (BPE, prose).
    needed = lambda: corpus_lib.text_size(files) * np.dtype(dtype).itemsize // 4  # noqa: E731
    try:
        shards = _Shards(stage, shard_tokens, tok.eos_id, dtype)
        with (
            errors.reraise_as(errors.DataError, ValueError),
            data_format.disk_space(
                target.parent, "the token shards", needed, "name an --out on a disk with room"
            ),
        ):
            for ids, n in encode.encode(files, tok, dtype, workers, "SRC", progress=True):
                shards.add(ids)
                chars += n
            shards.close()
            if not shards.tokens:
                raise errors.DataError(f"no text found in {desc}")
            _copy_tokenizer(tokenizer, stage / TOKENIZER_DIR)
            manifest = dict(
                source=desc,
                corpus=corpus_lib.fingerprint(files),
                tokenizer=str(Path(tokenizer).expanduser().resolve()),
                tokenizer_sha256=tokenizer_lib.sha256(tok.to_str()),  # checked by the trainer
                dtype=dtype,
                shards=shards.count,
                tokens=shards.tokens,
                text_bytes=corpus_lib.text_size(files),
                seconds=round(time.perf_counter() - t0, 3),
            )
            (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if target.exists():
                target.rmdir()  # empty (checked above)
            os.rename(stage, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest


def main(argv: list[str]) -> None:
    """``python -m fp8jax.prepare SRC --tokenizer ... --out ...``."""
    if len(argv) != 2:
        cli.fail("name one corpus: python -m fp8jax.prepare SRC --tokenizer TOK --out DIR")
    if not _TOKENIZER.value or not _OUT.value:
        cli.fail("--tokenizer and --out are required: the tokenizer to encode with, a new folder")
    with cli.user_errors():
        m = prepare(argv[1], _TOKENIZER.value, _OUT.value, _WORKERS.value, _SHARD_TOKENS.value)
    mb, secs = m["text_bytes"] / 1e6, max(m["seconds"], 1e-9)
    print(
        f"prepared {m['tokens']} ids in {m['shards']} shards of {_OUT.value} from {mb:.1f} MB "
        f"in {secs:.1f}s ({mb / secs:.2f} MB/s)"
    )
    sys.stdout.flush()


def run() -> None:
    """The ``fp8jax-prepare`` console script (a bad flag is one stderr line, exit 2)."""
    cli.run(main)


if __name__ == "__main__":
    run()
