"""One JAX compilation cache for the whole test run: workers and the processes tests start
(``train.py``, notebooks, benchmarks) compile many of the same programs, and XLA:CPU's compile
time dominates the suite. The cache lives in a temporary folder named after the run, is shared
by pytest-xdist's workers, and is removed when the run ends."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

# Set before any test module imports jax: jax reads these when its config is defined, and
# subprocesses inherit them.
_RUN = os.environ.get("FP8JAX_TEST_RUN") or os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN is None:
    _RUN = uuid.uuid4().hex
    os.environ["FP8JAX_TEST_RUN"] = _RUN
CACHE_DIR = os.path.join(tempfile.gettempdir(), f"fp8jax-test-compile-cache-{_RUN}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
# Programs that compile in under half a second are not worth a disk round trip.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_sessionfinish(session, exitstatus):
    """The controller (not an xdist worker) removes the run's cache."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(CACHE_DIR, ignore_errors=True)
