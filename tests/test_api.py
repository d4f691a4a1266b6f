"""The declared API: what ``import fp8jax`` offers, and ``__all__`` in every public module.

The top-level package exports what a user of the README needs; kernels, formats and whole
modules stay reachable from their packages (``fp8jax.ops.kernels``). Modules are read with
``ast`` (not imported), so a command-line module's flags are not defined here.
"""

import ast
import pathlib
import re

import pytest

import fp8jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fp8jax"

# What the README's user reaches as ``fp8jax.<name>``.
README_API = {
    # scaling recipes
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Recipe",
    "RowwiseScaling",
    "make_recipe",
    # the FP8 matmul and its Flax modules
    "Einsum",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Fp8RaggedDot",
    "dot_general",
    "fp8_dot_general_cls",
    "fp8_einsum",
    "fp8_scan",
    "keep_kernel_dtype",
    "nnx",
    "ragged_dot",
    # FP8 state
    "FP8",
    "FP8_STATS",
    "Fp8Meta",
    "ScaleState",
    "commit",
    "init_meta",
    "keep_if_finite",
    "merge_grads",
    "summarize",
    "update_state",
    # the FP8 AdamW, the coverage report, the trainer
    "CoverageReport",
    "coverage_report",
    "fp8_adamw",
    "train_and_evaluate",
}


def _public_modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file for every module whose path has no ``_private`` part."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            out[".".join(parts)] = path
    return out


def _bound_names(body: list[ast.stmt]) -> set[str]:
    """Names a module body binds at top level (also under ``if`` and ``try``)."""
    names = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try):
            nested = node.body + node.orelse + getattr(node, "finalbody", [])
            nested += [s for h in getattr(node, "handlers", []) for s in h.body]
            names |= _bound_names(nested)
    return names


def _declared_all(tree: ast.Module) -> list[str] | None:
    """The module's ``__all__`` literal, or None when it declares none."""
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return ast.literal_eval(node.value)
    return None


def _api_problems(path: pathlib.Path) -> list[str]:
    """What is wrong with one module's declared API (empty when nothing)."""
    tree = ast.parse(path.read_text())
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    if not body:  # a package whose __init__ is only its docstring declares nothing
        return []
    declared = _declared_all(tree)
    if declared is None:
        return ["declares no __all__"]
    problems = [f"{n!r} twice in __all__" for n in set(declared) if declared.count(n) > 1]
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_")
    }
    problems += [f"public {n!r} is missing from __all__" for n in sorted(defined - set(declared))]
    bound = _bound_names(tree.body)
    if "__getattr__" in bound:  # names imported on first use, listed in a module-level literal
        bound |= {
            c.value
            for node in tree.body
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) != "__all__"
            for c in ast.walk(node.value)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }
    submodules = set()
    if path.name == "__init__.py":  # a package may declare its submodules
        submodules = {p.stem for p in path.parent.glob("*.py")} | {
            p.name for p in path.parent.iterdir() if p.is_dir()
        }
    for name in declared:
        if name not in bound and name not in submodules:
            problems.append(f"__all__ names {name!r}, which it does not define or import")
    return problems


def test_top_level_exports_the_readme_users_names():
    assert set(fp8jax.__all__) == README_API
    assert len(fp8jax.__all__) == len(README_API)
    for name in fp8jax.__all__:
        assert getattr(fp8jax, name) is not None, name


def test_kernels_and_whole_modules_stay_in_their_packages():
    from fp8jax.ops import formats, kernels

    for name in ("kernels", "cast_transpose", "formats", "remat", "scaling", "quantize"):
        assert name not in fp8jax.__all__
    assert callable(kernels.cast_transpose) and callable(formats.quantize)


@pytest.mark.parametrize("name", sorted(_public_modules()))
def test_public_module_declares_all(name):
    assert _api_problems(_public_modules()[name]) == [], name


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _top_level_uses(code: str) -> set[str]:
    """Names a Python block reads as ``fp8jax.<name>`` or imports ``from fp8jax``."""
    tree = ast.parse(code)
    aliases = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name == "fp8jax"
    }
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases:
                used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module == "fp8jax" and node.level == 0:
            used.update(a.name for a in node.names)
    return used


def test_readme_python_blocks_use_only_exported_names():
    blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
    assert blocks, "README.md shows no Python block"
    used = set().union(*(_top_level_uses(b) for b in blocks))
    assert used, "the README's Python blocks use nothing from fp8jax"
    assert used <= set(fp8jax.__all__), sorted(used - set(fp8jax.__all__))


def test_readme_text_names_only_exported_names_or_modules():
    """Inline ``fp8jax.<name>`` in the README's prose is an export or a module of the package."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir()}
    named = set()
    for span in re.findall(r"`([^`\n]+)`", _readme()):
        named.update(re.findall(r"\bfp8jax\.(\w+)", span))
    assert named - modules, "the README's prose names no fp8jax export"
    assert named <= set(fp8jax.__all__) | modules, sorted(named - set(fp8jax.__all__) - modules)


def test_the_api_checks_catch_what_they_look_for(tmp_path):
    missing = tmp_path / "missing.py"
    missing.write_text('"""Doc."""\n\nimport os\n\n\ndef f():\n    return os\n')
    assert _api_problems(missing) == ["declares no __all__"]
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        '"""Doc."""\n\n__all__ = ["f", "g", "f"]\n\n\ndef f():\n    pass\n\n\nclass H:\n    pass\n'
    )
    assert sorted(_api_problems(wrong)) == [
        "'f' twice in __all__",
        "__all__ names 'g', which it does not define or import",
        "public 'H' is missing from __all__",
    ]
    assert _top_level_uses("import fp8jax as f8\nf8.quantize(1)\n") == {"quantize"}
    assert _top_level_uses("from fp8jax import kernels\n") == {"kernels"}
