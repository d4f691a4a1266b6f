"""Stage timings a command line reports: each a JAX monitoring event named ``EVENT + stage``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import jax

__all__ = ["EVENT", "stage"]

EVENT = "/fp8jax/stage/"  # the prefix of the events ``stage`` records


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Record the seconds the ``with`` block takes as the event ``EVENT + name`` (listeners
    registered with ``jax.monitoring`` see it; nothing is kept otherwise)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        jax.monitoring.record_event_duration_secs(EVENT + name, time.perf_counter() - start)
