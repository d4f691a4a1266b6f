"""The XLA:CPU flag the test processes compile with, where the installed XLA knows it.

``--xla_cpu_use_fusion_emitters=false`` picks XLA:CPU's elemental emitters: the same HLO compiled
in about half the time of the fusion emitters, and compiles dominate the suite. jaxlib 0.11's XLA
no longer has the flag and aborts at its first compile on an unknown one ("Unknown flag in
XLA_FLAGS"), so it is added only for an older jaxlib. Read from the installed package's metadata,
without importing JAX (the flag must be set before JAX starts).
"""

from __future__ import annotations

import importlib.metadata
import os
import re

__all__ = ["EMITTER_FLAG", "add_emitter_flag"]

EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _knows_emitter_flag() -> bool:
    """Whether the installed jaxlib's XLA has ``EMITTER_FLAG`` (jaxlib before 0.11)."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return False
    m = re.match(r"(\d+)\.(\d+)", version)
    return bool(m) and (int(m.group(1)), int(m.group(2))) < (0, 11)


def add_emitter_flag(env: dict | os._Environ = os.environ) -> None:
    """Add ``EMITTER_FLAG`` to ``env['XLA_FLAGS']`` where the installed XLA knows it."""
    flags = env.get("XLA_FLAGS", "")
    if _knows_emitter_flag() and EMITTER_FLAG not in flags:
        env["XLA_FLAGS"] = f"{flags} {EMITTER_FLAG}".strip()
