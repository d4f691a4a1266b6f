"""One persistent XLA compilation cache for the whole test session.

Many tests compile the same small programs, in this process, in the other xdist worker and in
the ``train.py``, benchmark and notebook subprocesses they start. JAX reads
``JAX_COMPILATION_CACHE_DIR`` when it is imported, so setting it here, before any test module
imports jax, gives every one of those processes (they inherit the environment) the same cache:
a program compiles once per session. The directory is fresh for each session, so no result
comes from an earlier run, and the process that made it removes it at the end. A user's own
``JAX_COMPILATION_CACHE_DIR`` is left as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_OWNED = None  # the cache directory this process made, removed when its session ends
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWNED = tempfile.mkdtemp(prefix="fp8jax-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWNED
    # Programs that compile in under a second are cheaper to compile than to look up.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


def pytest_sessionfinish(session, exitstatus):
    if _OWNED is not None:
        shutil.rmtree(_OWNED, ignore_errors=True)
