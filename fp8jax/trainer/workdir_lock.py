"""One training process per work dir: an advisory lock on ``<workdir>/.lock``, and the work
dir's own housekeeping (creating it, removing what killed or refused runs left).

The lock is ``fcntl.flock`` on an open file, so the operating system drops it when its process
ends, however it ends (``kill -9`` included): a lock file left by a dead run never blocks a
resume. The holder writes who it is (pid, host, start time, command) into the file, and a second
process is refused with a one-line ``WorkdirBusyError`` naming it, before it writes anything.
A run refused later (a ``UserError``) puts the lock file back as it found it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator

from absl import logging

from fp8jax.errors import ConfigError, UserError

__all__ = [
    "LOCK_FILE",
    "WorkdirBusyError",
    "hold",
    "make_workdir",
    "owner",
    "remove_if_unused",
    "remove_stale_staging",
]

LOCK_FILE = ".lock"  # in the work dir; holds the owner's description while it runs


class WorkdirBusyError(UserError, RuntimeError):
    """Another live process is training in the same work dir."""


def owner(workdir: str | os.PathLike) -> str:
    """The description the lock's last holder wrote ('' if none): pid, host, start time."""
    try:
        with open(os.path.join(workdir, LOCK_FILE), encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def _describe() -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
    command = " ".join(sys.argv)[:200]
    return f"pid {os.getpid()} on host {socket.gethostname()}, started {started} ({command})"


@contextlib.contextmanager
def hold(workdir: str | os.PathLike) -> Iterator[None]:
    """Hold the work dir's lock for the block; refuse at once if another process holds it.

    A file system without ``flock`` (some network mounts) logs a warning and runs unlocked.
    """
    path = os.path.join(workdir, LOCK_FILE)
    created = not os.path.exists(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only mount, another user's folder
        raise ConfigError(
            f"cannot write in --workdir {workdir} ({e.strerror or e}); make it writable or pass "
            f"a folder you can write"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logging.warning("cannot lock %s (%s); not guarding against a second run", path, e)
                yield
                return
            who = owner(workdir) or "another process"
            raise WorkdirBusyError(
                f"work dir {os.path.abspath(workdir)} is in use by {who}; wait for it to end or "
                f"stop it (a killed run releases it), or pass another --workdir"
            ) from None
        before, stat = os.pread(fd, 1 << 16, 0), os.fstat(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_describe() + "\n").encode(), 0)
        remove_stale_staging(workdir)  # no live process of another run stages here now
        try:
            yield
        except UserError:  # a refused run leaves the work dir as it was, lock file included
            if created:
                os.unlink(path)
            else:
                os.ftruncate(fd, 0)
                os.pwrite(fd, before, 0)
                os.utime(fd, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            raise
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def make_workdir(workdir: str | os.PathLike) -> None:
    """Create ``workdir`` (and its parents) or raise a one-line ConfigError saying why not."""
    if os.path.lexists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir {workdir} is a file, not a folder; pass a folder path")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create --workdir {workdir} ({e.strerror or e}); pass a folder you can write"
        ) from None


# Staging files and folders named '<name>.tmp<pid>' (token caches, tokenizer.json, JSON records).
_STAGING = re.compile(r".+\.tmp(\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to another user
        return True
    return True


def remove_stale_staging(workdir: str | os.PathLike) -> list[str]:
    """Delete the ``*.tmp<pid>`` staging entries of ``workdir`` whose process is gone.

    A killed cache build leaves ``tokens.tmp<pid>/`` (as large as the token cache); a live
    process's staging (another host's pid that happens to exist here included) is kept.
    Returns the names removed.
    """
    removed = []
    for entry in os.scandir(workdir):
        match = _STAGING.match(entry.name)
        if not match or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        logging.info("removed %s, left by a process that is gone", entry.path)
        removed.append(entry.name)
    return removed


def remove_if_unused(workdir: str | os.PathLike) -> None:
    """Delete ``workdir`` if it holds nothing but the lock file and empty folders."""
    if not os.path.isdir(workdir):
        return
    for root, _, files in os.walk(workdir):
        if any(not (root == str(workdir) and name == LOCK_FILE) for name in files):
            return
    shutil.rmtree(workdir, ignore_errors=True)
