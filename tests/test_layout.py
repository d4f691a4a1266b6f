"""Package layout rules, read from the source with ``ast`` (nothing is imported).

* No module uses another module's private names: what two modules share is public in one of
  them (``from fp8jax.x import _y`` and ``<fp8jax module>._y`` both fail). The private utility
  modules (``fp8jax/_tree.py``, ``fp8jax/_timing.py``) are the exception: their public names may
  be imported anywhere.
* Every import counts: module level, inside functions, and under ``if TYPE_CHECKING:`` (it
  does not run, but a type named in a lower layer's signature is still a dependency on the
  higher one).
* No import cycle between modules, and none between units (a subpackage, or a top-level module).
* Each unit imports only its own modules and units of lower layers (``LAYERS``, lowest first).
  A command-line module (``if __name__ == "__main__"``) sits above every layer: it may import
  any unit, and no module imports it.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fp8jax"
# Units from the lowest layer up; a unit imports only itself and units of earlier layers.
LAYERS = (
    ("errors", "_tree", "_timing"),  # the UserError family; pytree helpers; stage timings
    ("ops",),  # FP8 formats, scaling recipes, the custom-VJP matmuls and their kernels
    ("recipes",),  # the scaling recipes, one module each, registered by name
    ("nn",),  # Flax modules around ops
    ("optim",),  # FP8/FP16 optimizer state and masters
    ("parallel",),  # meshes, shardings, FP8 communication
    ("models",),  # the transformer
    ("diagnostics",),  # coverage, memory, HLO of a program
    ("tokenizer",),
    ("provenance", "data_spec", "checksums"),  # work-dir records; data sections; checksums
    ("configs",),  # the shipped config files and their field declarations
    ("spec",),  # the run spec: config files -> typed dataclasses
    ("hf",),  # Hugging Face and work-dir checkpoints in and out
    ("trainer",),  # loop, step, data, checkpoints, generation
    ("cli",),  # what the command lines set up for their process
    ("fp8jax",),  # the package's public API (fp8jax/__init__.py)
)


def _modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_private_use(name: str, owner: str, modules) -> bool:
    """Whether ``owner.name`` is another module's private name (not a private utility module)."""
    return _is_private(name) and f"{owner}.{name}" not in modules


def _imported(node: ast.AST, modules) -> list[str]:
    """The package's modules an import statement binds or reads from."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
        return [
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
            for a in node.names
        ]
    return []


def _aliases(tree: ast.Module, modules) -> dict[str, str]:
    """Local name -> package module, for every import in the file that binds a module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    # 'import fp8jax.ops.dot' binds 'fp8jax'; 'import x.y as z' binds z
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "fp8jax"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    out[a.asname or a.name] = full
    return out


def _dotted(node: ast.AST) -> str | None:
    """'a.b.c' for a chain of attribute reads on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(tree: ast.Module, modules) -> list[str]:
    """Descriptions of every use of another package module's private name in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            found += [
                f"line {node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if _is_private_use(a.name, node.module, modules)
            ]
    aliases = _aliases(tree, modules)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        base = _dotted(node.value)
        if base is None:
            continue
        head, _, rest = base.partition(".")
        if head not in aliases:
            continue
        owner = aliases[head] + (f".{rest}" if rest else "")
        if owner in modules and _is_private_use(node.attr, owner, modules):
            found.append(f"line {node.lineno}: {base}.{node.attr}")
    return sorted(found, key=lambda f: int(f.split(":")[0].removeprefix("line ")))


def import_graph(modules) -> dict[str, set[str]]:
    """Module -> package modules it imports anywhere: module level, in functions, in branches."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {t for node in ast.walk(tree) for t in _imported(node, modules)} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def unit(module: str) -> str:
    """The layer unit of a module: its subpackage or top-level module ('fp8jax': the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_entry_point(path: pathlib.Path) -> bool:
    """A command-line module (``if __name__ == "__main__"``): it sits above every layer."""
    return '__name__ == "__main__"' in path.read_text()


def unit_graph(modules, graph) -> dict[str, set[str]]:
    """Unit -> other units it imports, without the imports of command-line modules."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for name, targets in graph.items():
        if _is_entry_point(modules[name]):
            continue
        out[unit(name)].update(unit(t) for t in targets if unit(t) != unit(name))
    return out


def layer_violations(units: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """'a -> b' for each unit import that does not go down the layers (or names no layer)."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    bad = [f"{u} is in no layer of LAYERS" for u in sorted(units) if u not in rank]
    bad += [f"{u} -> {t}" for u, ts in sorted(units.items()) for t in sorted(ts) if t not in rank]
    bad += [
        f"{u} -> {t}"
        for u, ts in sorted(units.items())
        for t in sorted(ts)
        if u in rank and t in rank and rank[t] >= rank[u]
    ]
    return bad


def entry_point_importers(modules, graph) -> dict[str, list[str]]:
    """Module -> the command-line modules it imports, for every module that imports one."""
    entry_points = {name for name, path in modules.items() if _is_entry_point(path)}
    return {name: sorted(ts & entry_points) for name, ts in graph.items() if ts & entry_points}


MODULES = _modules()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_across_modules(name):
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found = private_uses(tree, MODULES)
    assert not found, f"{name} uses private names of other modules: {found}; make them public"


def test_no_import_cycles():
    graph = import_graph(MODULES)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    cycle = find_cycle(unit_graph(MODULES, graph))
    assert cycle is None, f"import cycle between units: {' -> '.join(cycle)}"


def test_units_import_only_lower_layers():
    graph = import_graph(MODULES)
    bad = layer_violations(unit_graph(MODULES, graph))
    assert not bad, f"imports against the layers (LAYERS in {__name__}): {bad}"
    importers = entry_point_importers(MODULES, graph)
    assert not importers, f"command-line modules are imported by: {importers}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """Each rule fails on a package written to break it."""
    pkg = tmp_path / "fp8jax"
    (pkg / "a").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "a" / "__init__.py"):
        init.write_text("")
    (pkg / "_util.py").write_text("def helper():\n    pass\n\ndef _secret():\n    pass\n")
    # The cycle x -> y -> x closes through an import inside a function.
    (pkg / "a" / "x.py").write_text("def f():\n    import fp8jax.a.y\n\ndef _hidden():\n    pass\n")
    (pkg / "a" / "y.py").write_text(
        "from fp8jax.a import x\nfrom fp8jax.a.x import _hidden\nimport fp8jax\n"
        "from fp8jax.a import x as xx\n\nx._hidden()\nxx._hidden()\nfp8jax.a.x._hidden()\n"
        "x.__name__\nfrom fp8jax import _util\nfrom fp8jax._util import helper, _secret\n"
        "_util.helper()\nfp8jax._util.helper()\n_util._secret()\n"
    )
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fp8jax.a import x\n"
        "def g():\n    from fp8jax import cmd\n"
    )
    (pkg / "cmd.py").write_text('import fp8jax.b\nif __name__ == "__main__":\n    pass\n')
    modules = _modules(pkg)
    found = private_uses(ast.parse((pkg / "a" / "y.py").read_text()), modules)
    expected = ["line 2", "line 6", "line 7", "line 8", "line 11", "line 14"]
    assert [f.split(":")[0] for f in found] == expected
    graph = import_graph(modules)
    assert find_cycle(graph) == ["fp8jax.a.x", "fp8jax.a.y", "fp8jax.a.x"]
    assert find_cycle({"ops": {"nn"}, "nn": {"ops"}}) == ["nn", "ops", "nn"]
    assert find_cycle({"ops": set(), "nn": {"ops"}}) is None
    units = unit_graph(modules, graph)  # cmd's own imports do not count; imports of it do
    assert dict(units) == {
        "fp8jax": set(),
        "_util": set(),
        "a": {"_util", "fp8jax"},
        "b": {"a", "cmd"},
    }
    assert layer_violations(units, (("_util", "cmd"), ("fp8jax",), ("a",), ("b",))) == []
    assert layer_violations(units, (("_util", "cmd"), ("fp8jax",), ("b",), ("a",))) == ["b -> a"]
    assert layer_violations(units, (("_util", "fp8jax", "a"), ("cmd", "b"))) == [
        "a -> _util",
        "a -> fp8jax",
        "b -> cmd",
    ]
    assert layer_violations(units, (("cmd", "fp8jax"), ("a",), ("b",))) == [
        "_util is in no layer of LAYERS",
        "a -> _util",
    ]
    assert entry_point_importers(modules, graph) == {"fp8jax.b": ["fp8jax.cmd"]}
