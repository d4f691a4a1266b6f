"""Every registered FP8 recipe, by the same properties: built by name, its fresh state, its matmul
and gradients against f32 within the bound its formats allow, its state update; and no code
outside ``fp8jax/recipes`` asks which recipe it holds.

The properties run over ``scaling.RECIPES``, so a newly registered recipe is tested here without
a line of its own. Each recipe's matmul compiles once and serves every property.
"""

import ast
import dataclasses
import functools
import json
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import dot, formats, scaling

from fp8_testing import amax

NAMES = sorted(scaling.RECIPES)
DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
M, K, N = 16, 32, 16
EPS32 = float(jnp.finfo(jnp.float32).eps)
DIV_RTOL = 2 * EPS32  # 2 ulp of f32: XLA:GPU divides through a reciprocal, CPU rounds exactly
PACKAGE = pathlib.Path(fp8jax.__file__).resolve().parent


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K), np.float32)
    w = rng.standard_normal((K, N), np.float32) * np.float32(0.1)
    g = rng.standard_normal((M, N), np.float32)  # the output gradient dy
    return x, w, g


@jax.jit
def _step(x, w, g, meta):
    """y, the meta after the forward, dx, dw and the meta's cotangent (dy's amax) in one program."""
    (y, new_meta), vjp = jax.vjp(lambda x, w, m: dot.dot_general(x, w, DENSE, m), x, w, meta)
    dx, dw, dmeta = vjp((g, jax.tree.map(jnp.zeros_like, new_meta)))
    return y, new_meta, dx, dw, dmeta


@functools.cache
def _run(name: str):
    """The recipe's fresh meta and ``_step``'s results on ``_inputs`` (one compile per recipe)."""
    meta = fp8jax.init_meta(fp8jax.make_recipe(name))
    x, w, g = _inputs()
    return meta, jax.device_get(_step(x, w, g, meta))


class Rounding(NamedTuple):
    """How far quantizing an operand to its format moves each element: at most ``most``; on
    average (squared) at most ``var``."""

    most: np.ndarray
    var: np.ndarray


def _scale(fmt: str, a: float, recipe) -> float:
    """``fmax / (a * 2**margin)``, rounded down to a power of two if the recipe says so."""
    scale = formats.fmax(fmt) / (a * 2.0**recipe.margin)
    return 2.0 ** np.floor(np.log2(scale)) if recipe.power_of_two else scale


def _rounding(a: np.ndarray, fmt: str, stored_scale, recipe) -> Rounding:
    """Quantizing ``a`` to ``fmt``: at most half a unit in the last place (``u = eps / 2``
    relative) in the normal range, half the smallest subnormal (over the scale) below it. Spread
    evenly over that interval, as rounding is, its mean square is a third of the square of that
    width; relative to a value within a binade, at most ``u^2 / 3``.

    The scale is at least the stored one (what a recipe that keeps scales uses) or the one the
    tensor's own amax gives (a scale from the call's amax, per tensor, row or tile: a row's or a
    tile's amax is at most the tensor's), whichever is smaller."""
    info = jnp.finfo(formats.as_dtype(fmt))
    scale = min(float(stored_scale), _scale(fmt, amax(a), recipe))
    rel, sub = float(info.eps) / 2 * np.abs(a), float(info.smallest_subnormal) / 2 / scale
    return Rounding(rel + sub, (rel**2 + sub**2) / 3)


def _check_close(got, a, ra: Rounding, b, rb: Rounding):
    """``got`` against ``a . b`` in float64, the operands rounded by ``ra`` and ``rb``.

    Each element within the worst case (every product's error at its largest, in one
    direction); the squared errors summed within their mean's bound (independent roundings:
    each product's error variance from its operands'), which a sum over this many elements
    meets to within a few percent and which an operand in a coarser format exceeds.
    """
    err = np.asarray(got, np.float64) - a @ b
    abs_ab = np.abs(a) @ np.abs(b)
    f32 = (a.shape[1] + 4) * EPS32 * abs_ab  # the sum's roundings, the unscale multiplications
    most = ra.most @ np.abs(b) + np.abs(a) @ rb.most + ra.most @ rb.most + f32
    assert np.all(np.abs(err) <= most), f"largest excess {np.max(np.abs(err) - most)}"
    var = ra.var @ b**2 + a**2 @ rb.var + ra.var @ rb.var + f32**2
    assert np.sum(err**2) <= np.sum(var), f"mean square error {np.mean(err**2)} over its bound"
    assert np.max(np.abs(err)) > np.max(f32), "no FP8 rounding: the matmul ran in high precision"


def test_registry_holds_the_four_recipes():
    assert set(NAMES) >= {"delayed", "current", "rowwise", "block"}
    assert scaling.DEFAULT in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_make_recipe_round_trips_by_name_and_record(name):
    recipe = fp8jax.make_recipe(name)
    assert type(recipe) is scaling.RECIPES[name] and recipe.name == name
    assert scaling.recipe_name(recipe) == name
    # model.json's record (provenance.record_model) builds the same recipe back, equal and
    # with the same hash: compiled programs key on it.
    record = json.loads(json.dumps({"name": recipe.name, **dataclasses.asdict(recipe)}))
    again = fp8jax.make_recipe(record.pop("name"), **record)
    assert again == recipe and hash(again) == hash(recipe)
    # Fields another recipe has (fp8.block_size, fp8.grad_format) are ignored, not errors.
    assert fp8jax.make_recipe(name, block_size=64, grad_format="e5m2", other=1).name == name
    # The class is reachable by its name from ops.scaling.
    assert getattr(scaling, type(recipe).__name__) is type(recipe)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.margin = 1


def test_unknown_and_duplicate_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown FP8 scaling recipe 'nope'"):
        fp8jax.make_recipe("nope")

    @dataclasses.dataclass(frozen=True)
    class Impostor(scaling.RECIPES["delayed"]):
        pass

    with pytest.raises(ValueError, match="'delayed' is taken"):
        scaling.register(Impostor)
    assert scaling.RECIPES["delayed"] is not Impostor


@pytest.mark.parametrize("name", NAMES)
def test_init_meta_shapes_and_formats(name):
    recipe = fp8jax.make_recipe(name)
    meta = fp8jax.init_meta(recipe)
    assert recipe.dy_format in formats.FORMATS
    for state, fmt in ((meta.x, "e4m3"), (meta.w, "e4m3"), (meta.dy, recipe.dy_format)):
        assert state.fmt == fmt and state.recipe == recipe
        assert state.scale.shape == () and float(state.scale) == 1.0
        assert state.amax_history.shape == (recipe.history_len + 1,)
        assert not np.any(np.asarray(state.amax_history))
    # The pytree: three scales and three histories; the recipe rides in the treedef.
    assert len(jax.tree.leaves(meta)) == 6
    assert jax.tree.structure(meta) == jax.tree.structure(fp8jax.init_meta(recipe))


@pytest.mark.parametrize("name", NAMES)
def test_forward_within_the_fp8_bound_of_f32(name):
    meta, (y, *_) = _run(name)
    x, w, _ = (a.astype(np.float64) for a in _inputs())
    rx, rw = (_rounding(a, s.fmt, s.scale, s.recipe) for a, s in ((x, meta.x), (w, meta.w)))
    _check_close(y, x, rx, w, rw)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_within_the_fp8_bound_of_f32(name):
    meta, (_, _, dx, dw, _) = _run(name)
    x, w, g = (a.astype(np.float64) for a in _inputs())
    rx, rw, rg = (
        _rounding(a, s.fmt, s.scale, s.recipe) for a, s in ((x, meta.x), (w, meta.w), (g, meta.dy))
    )
    transposed = lambda r: Rounding(r.most.T, r.var.T)  # noqa: E731
    _check_close(dx, g, rg, w.T, transposed(rw))  # dgrad: N contracted
    _check_close(dw, x.T, transposed(rx), g, rg)  # wgrad: M contracted


@pytest.mark.parametrize("name", NAMES)
def test_state_records_the_amaxes_and_commit_sets_the_scales(name):
    _, (_, new_meta, _, _, dmeta) = _run(name)
    x, w, g = _inputs()
    # The forward records x's and w's amax in the pending slot; the backward sends dy's back as
    # the meta's cotangent, and nothing else (x's and w's cotangents are zero).
    assert float(new_meta.x.amax_history[0]) == amax(x)
    assert float(new_meta.w.amax_history[0]) == amax(w)
    assert float(dmeta.dy.amax_history[0]) == amax(g)
    for s in (dmeta.x, dmeta.w):
        assert not np.any(np.asarray(s.amax_history)) and float(s.scale) == 0.0
    # The step's end: each pending amax moves into the history and sets the next scale.
    done = fp8jax.update_state(*jax.tree.map(jnp.asarray, (new_meta, dmeta)))
    for s, a in ((done.x, amax(x)), (done.w, amax(w)), (done.dy, amax(g))):
        assert float(s.amax_history[0]) == 0.0 and float(s.amax_history[1]) == a
        assert float(s.scale) == pytest.approx(_scale(s.fmt, a, s.recipe), rel=DIV_RTOL)


# -- no recipe-type tests outside the recipe modules -------------------------------------------

RECIPE_DIR = PACKAGE / "recipes"
TYPE_TESTS = ("is_fine", "is_delayed")


def _mentions_recipe_type(node: ast.AST) -> bool:
    names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    names += [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)]
    return any(n.endswith("Scaling") or "Recipe" in n for n in names)


def _mentions_recipe(node: ast.AST) -> bool:
    return "recipe" in ast.unparse(node).lower()


def recipe_type_tests(tree: ast.AST) -> list[str]:
    """Lines of ``tree`` that ask which recipe they hold: ``isinstance``/``issubclass`` against a
    recipe class, ``type(<recipe>)``, ``is_fine``/``is_delayed``, or a recipe's name compared
    with a registered name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fn, args = node.func.id, node.args
            if fn in ("isinstance", "issubclass") and len(args) == 2:
                if _mentions_recipe_type(args[1]):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif fn == "type" and args and _mentions_recipe(args[0]):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name | ast.Attribute):
            if (node.id if isinstance(node, ast.Name) else node.attr) in TYPE_TESTS:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Constant) and s.value in scaling.RECIPES for s in sides)
            if named and any(_mentions_recipe(s) for s in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[0].removeprefix("line ")))


def test_the_detector_sees_each_kind_of_recipe_type_test():
    src = (
        "isinstance(r, BlockScaling)\nisinstance(r, scaling.RowwiseScaling | Foo)\n"
        "scaling.is_fine(r)\nis_delayed(r)\ntype(meta.x.recipe) is A\ncfg.recipe.name == 'block'\n"
        "isinstance(x, int)\ntype(x)\nscheme == 'block'\nrecipe.name == other.name\n"
    )
    assert [f.split(":")[0] for f in recipe_type_tests(ast.parse(src))] == [
        f"line {i}" for i in range(1, 7)
    ]


def test_no_recipe_type_tests_outside_the_recipe_modules():
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if RECIPE_DIR not in path.parents
        and (hits := recipe_type_tests(ast.parse(path.read_text(), str(path))))
    }
    assert not found, f"modules that ask which recipe they hold: {found}; ask the recipe instead"
