"""FP8-LM's optimisation levels O0..O3: what each runs in FP8 and what the train state stores.

``Level`` is the one level type of the library: the trainer's step, the memory account, the
models and the gradient communication all read it. ``LEVELS`` is the one table behind it.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "LEVELS",
    "MASTER_ROUNDING",
    "STATE_FORMATS",
    "Capabilities",
    "Level",
    "Storage",
]

# Storage formats the O2+ optimizer may use for Adam moments and master weights.
STATE_FORMATS = ("e4m3", "e5m2", "float16", "bfloat16", "float32")
MASTER_ROUNDING = ("stochastic", "nearest")  # how O2+ masters are re-quantized


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one level runs in FP8 and how its train state is stored."""

    fp8_gemms: bool  # matmuls in FP8, with their scale state in the train state
    fp8_grad_comm: bool  # data-parallel gradients reduced in FP8 (fp8jax.parallel.comm)
    fp8_adam: bool  # Adam moments and matmul masters in narrow formats, each with a scale
    sharded_state: bool  # masters and Adam state sharded over fsdp, kernels gathered in FP8


# The table: each level adds to the one before it.
LEVELS = {
    "O0": Capabilities(fp8_gemms=False, fp8_grad_comm=False, fp8_adam=False, sharded_state=False),
    "O1": Capabilities(fp8_gemms=True, fp8_grad_comm=True, fp8_adam=False, sharded_state=False),
    "O2": Capabilities(fp8_gemms=True, fp8_grad_comm=True, fp8_adam=True, sharded_state=False),
    "O3": Capabilities(fp8_gemms=True, fp8_grad_comm=True, fp8_adam=True, sharded_state=True),
}


@dataclasses.dataclass(frozen=True)
class Storage:
    """What the train state stores for the matmul weights: masters and Adam moments."""

    fp8_adam: bool  # fp8jax's Adam with scaled moments (else optax's f32 AdamW)
    master_format: str  # master copy of the matmul weights ('float32': plain f32 params)
    m_format: str  # Adam first moment
    v_format: str  # Adam second moment


def _capability(field: str, doc: str) -> property:
    """A ``Level`` property: one field of the level's row of ``LEVELS``."""
    return property(lambda level: getattr(LEVELS[level.name], field), doc=doc)


class Level(enum.IntEnum):
    """An FP8-LM level; ordered (``Level.O2 > Level.O1``), printed as its name ('O2')."""

    O0 = 0
    O1 = 1
    O2 = 2
    O3 = 3

    @classmethod
    def parse(cls, name: str) -> Level:
        """The level named ``name`` ('O0'..'O3'); ValueError naming the choices otherwise."""
        if not isinstance(name, str) or name not in LEVELS:
            raise ValueError(f"unknown fp8.level {name!r}: use one of {list(LEVELS)}")
        return cls[name]

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

    @property
    def capabilities(self) -> Capabilities:
        """This level's row of ``LEVELS``."""
        return LEVELS[self.name]

    fp8_gemms = _capability("fp8_gemms", "Matmuls run in FP8 (O1+).")
    fp8_grad_comm = _capability(
        "fp8_grad_comm", "Data-parallel gradients are reduced in FP8 (O1+)."
    )
    fp8_adam = _capability(
        "fp8_adam", "Adam moments and matmul masters are stored narrow, with scales (O2+)."
    )
    sharded_state = _capability(
        "sharded_state",
        "Masters and Adam state are sharded over fsdp, kernels gathered in FP8 (O3).",
    )

    def storage(
        self, m_format: str = "e4m3", v_format: str = "float16", master_format: str = "float16"
    ) -> Storage:
        """The state's formats at this level: the given ones where it stores narrow (O2+),
        f32 otherwise. The defaults are fp8jax/configs/base.py's (a test keeps them equal)."""
        if not self.fp8_adam:
            return Storage(False, "float32", "float32", "float32")
        return Storage(True, master_format, m_format, v_format)
