"""Checksums of a checkpoint step's array files, written once the step is final, verified
before a restore (and, through ``file_digests``, of the corpus a token cache was built from).

``write(step_dir)`` records the CRC-32 of every file under ``<step_dir>/state`` in
``<step_dir>/checksums.json`` (atomically); ``verify(step_dir)`` says which file no longer
matches, so a flipped bit on disk is refused instead of resuming with different numbers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import time
import zlib

from absl import logging

__all__ = ["ARRAYS", "BLOCK_BYTES", "CHECKSUMS", "file_digests", "verify", "write"]

CHECKSUMS = "checksums.json"  # in each step directory: the CRC-32 of every array file
# CRC-32 (zlib's, as zip and gzip use) catches every flipped bit and burst of up to 32 bits,
# and runs several times faster than SHA-256: a checksum against storage faults, not tampering.
_ALGORITHM = "crc32"
# Only the train state's files: the data position (``data/metadata``) is JSON that a user may
# edit as the restore errors advise, and restore validates it itself.
ARRAYS = "state"
_READ_BYTES = 1 << 24
# Each file is checked in blocks of this many bytes, every block on its own thread: a step's
# few multi-GB files then hash at the speed of the machine, not of one core.
BLOCK_BYTES = 1 << 26


def _crc32(path: str, start: int, length: int) -> str:
    """CRC-32 of ``length`` bytes of ``path`` from offset ``start``."""
    crc, buffer = 0, memoryview(bytearray(min(_READ_BYTES, max(length, 1))))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while length > 0 and (n := f.readinto(buffer[: min(len(buffer), length)])):
            crc = zlib.crc32(buffer[:n], crc)  # drops the GIL: blocks in parallel
            length -= n
    return f"{crc:08x}"


def file_digests(paths: list[str], block_bytes: int | None = BLOCK_BYTES) -> list[list[str]]:
    """The CRC-32s of each file of ``paths`` (in their order), one per ``block_bytes`` (None:
    one per file), the blocks of all of them on up to 16 threads."""
    blocks = []
    for k, path in enumerate(paths):
        size = os.path.getsize(path)
        step = block_bytes or max(size, 1)
        # An empty file is one empty block (its CRC-32 is recorded too).
        starts = range(0, max(size, 1), step)
        blocks += [(k, path, start, min(step, size - start)) for start in starts]
    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda block: _crc32(*block[1:]), blocks))
    out: list[list[str]] = [[] for _ in paths]
    for (k, *_), digest in zip(blocks, digests, strict=True):
        out[k].append(digest)
    return out


def _file_digests(step_dir: str, block_bytes: int | None) -> dict[str, list[str]]:
    """CRC-32s of every file under ``<step_dir>/state``, one per ``block_bytes`` (None: one per
    file), by path relative to ``step_dir``."""
    paths = [
        os.path.join(root, name)
        for root, _, files in os.walk(os.path.join(step_dir, ARRAYS))
        for name in files
    ]
    digests = file_digests(paths, block_bytes)
    return {os.path.relpath(p, step_dir): d for p, d in zip(paths, digests, strict=True)}


def write(step_dir: str) -> None:
    """Write ``<step_dir>/checksums.json`` atomically (a step deleted meanwhile is skipped)."""
    t0 = time.perf_counter()
    tmp = os.path.join(step_dir, f"{CHECKSUMS}.tmp{os.getpid()}")
    try:
        files = _file_digests(step_dir, BLOCK_BYTES)
        with open(tmp, "w", encoding="utf-8") as f:
            manifest = {"algorithm": _ALGORITHM, "block_bytes": BLOCK_BYTES, "files": files}
            json.dump(manifest, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(step_dir, CHECKSUMS))
    except FileNotFoundError:  # the step was rotated out (keep_checkpoints) while hashing
        return
    except OSError as e:  # e.g. a full disk: the step stays, restored unverified
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        logging.warning("cannot write the checksums of %s (%s)", step_dir, e.strerror or e)
        return
    logging.info("checksums of %s written in %.2f s", step_dir, time.perf_counter() - t0)


def verify(step_dir: str) -> str | None:
    """What differs between ``step_dir`` and its ``checksums.json``, or None if all match.

    A step without checksums (saved by an older fp8jax, or by a run killed before they were
    written) is restored unverified, with a warning.
    """
    try:
        with open(os.path.join(step_dir, CHECKSUMS), encoding="utf-8") as f:
            manifest = json.load(f)
        recorded, algorithm = dict(manifest["files"]), manifest["algorithm"]
        block_bytes = manifest.get("block_bytes")  # absent: one CRC-32 per file
        if block_bytes is not None and (not isinstance(block_bytes, int) or block_bytes < 1):
            raise ValueError(block_bytes)
    except FileNotFoundError:
        logging.warning("checkpoint %s has no %s; restoring it unverified", step_dir, CHECKSUMS)
        return None
    except (ValueError, KeyError, TypeError) as e:
        return f"its {CHECKSUMS} is unreadable: {type(e).__name__}"
    if algorithm != _ALGORITHM:
        return f"its {CHECKSUMS} uses {algorithm!r}, not {_ALGORITHM!r}"
    missing = [name for name in recorded if not os.path.isfile(os.path.join(step_dir, name))]
    if missing:
        return f"{missing[0]} is missing"
    actual = _file_digests(step_dir, block_bytes)
    as_list = lambda digest: [digest] if isinstance(digest, str) else list(digest)
    changed = [name for name, digest in recorded.items() if actual.get(name) != as_list(digest)]
    if changed:
        more = f" (and {len(changed) - 1} more files)" if len(changed) > 1 else ""
        return f"the CRC-32 of {changed[0]}{more} differs from the one recorded at save"
    return None
