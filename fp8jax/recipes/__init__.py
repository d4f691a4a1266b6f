"""FP8 scaling recipes: one module each, registered by name in ``ops.scaling.RECIPES``.

A recipe is a frozen dataclass behind ``ops.scaling.Recipe``: what the matmuls, the Flax modules,
the FSDP gathers and the checkpoint code ask of it, it answers. Importing this package registers
the four below; a new recipe is one more module here that subclasses ``Recipe`` (or one of the
shared bases ``TensorRecipe``, ``TiledRecipe``) under ``@register``, imported below.
"""

from fp8jax.ops.scaling import RECIPES, Recipe, init_meta, make_recipe, register
from fp8jax.recipes.block import BlockScaling
from fp8jax.recipes.current import CurrentScaling
from fp8jax.recipes.delayed import DelayedScaling
from fp8jax.recipes.rowwise import RowwiseScaling
from fp8jax.recipes.tensor import TensorRecipe
from fp8jax.recipes.tiled import TiledRecipe

__all__ = [
    "RECIPES",
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Recipe",
    "RowwiseScaling",
    "TensorRecipe",
    "TiledRecipe",
    "init_meta",
    "make_recipe",
    "register",
]
