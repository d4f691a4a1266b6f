"""Training objectives by name: the language-model loss (``lm``) and DPO (``dpo``).

A new objective is one module here that subclasses :class:`Objective` and registers itself
(``@register``), imported below; a data format names the objective it trains
(``DataFormat.objective``).
"""

from fp8jax.trainer.objectives import dpo, lm
from fp8jax.trainer.objectives.base import Objective, get, names, register

__all__ = ["Objective", "dpo", "get", "names", "register", "lm"]
