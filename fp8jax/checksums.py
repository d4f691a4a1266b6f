"""Checksums of a checkpoint step's array files, written once the step is final, verified
before a restore.

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

__all__ = ["ARRAYS", "CHECKSUMS", "verify", "write"]

CHECKSUMS = "checksums.json"  # in each step directory: the CRC-32 of every array file
# CRC-32 (zlib's, as zip and gzip use) catches every flipped bit and burst of up to 32 bits,
# and runs several times faster than SHA-256: a checksum against storage faults, not tampering.
_ALGORITHM = "crc32"
# Only the train state's files: the data position (``data/metadata``) is JSON that a user may
# edit as the restore errors advise, and restore validates it itself.
ARRAYS = "state"
_READ_BYTES = 1 << 24


def _crc32(path: str) -> str:
    crc, buffer = 0, bytearray(_READ_BYTES)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(memoryview(buffer)[:n], crc)  # drops the GIL: files in parallel
    return f"{crc:08x}"


def _file_digests(step_dir: str) -> dict[str, str]:
    """CRC-32 of every file under ``<step_dir>/state``, by path relative to ``step_dir``."""
    paths = []
    for root, _, files in os.walk(os.path.join(step_dir, ARRAYS)):
        paths += [os.path.join(root, f) for f in files]
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(_crc32, paths)
        return {os.path.relpath(p, step_dir): d for p, d in zip(paths, digests, strict=True)}


def write(step_dir: str) -> None:
    """Write ``<step_dir>/checksums.json`` atomically (a step deleted meanwhile is skipped)."""
    t0 = time.perf_counter()
    tmp = os.path.join(step_dir, f"{CHECKSUMS}.tmp{os.getpid()}")
    try:
        files = _file_digests(step_dir)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"algorithm": _ALGORITHM, "files": files}, f, indent=1, sort_keys=True)
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
    actual = _file_digests(step_dir)
    changed = [name for name, digest in recorded.items() if actual.get(name) != digest]
    if changed:
        more = f" (and {len(changed) - 1} more files)" if len(changed) > 1 else ""
        return f"the CRC-32 of {changed[0]}{more} differs from the one recorded at save"
    return None
