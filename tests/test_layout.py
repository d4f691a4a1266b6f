"""Package layout rules, read from the source with ``ast`` (nothing is imported).

* No module uses another module's private names: what two modules share is public in one of
  them (``from fp8jax.x import _y`` and ``<fp8jax module>._y`` both fail).
* No module is over ``MAX_LINES`` lines.
* No import cycle between modules (module-level imports), and none between subpackages.
* ``fp8jax.parallel`` does not import ``fp8jax.trainer``.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fp8jax"
MAX_LINES = 460


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
                if _is_private(a.name)
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
        if aliases[head] + (f".{rest}" if rest else "") in modules:
            found.append(f"line {node.lineno}: {base}.{node.attr}")
    return sorted(found, key=lambda f: int(f.split(":")[0].removeprefix("line ")))


def import_graph(modules) -> dict[str, set[str]]:
    """Module -> package modules it imports at module level (not inside functions)."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets: set[str] = set()
        stack = list(tree.body)
        while stack:  # module level, including under if/try (TYPE_CHECKING, fallbacks)
            node = stack.pop()
            if isinstance(node, ast.If | ast.Try):
                stack += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
                stack += [s for h in getattr(node, "handlers", []) for s in h.body]
            targets.update(_imported(node, modules))
        graph[name] = targets - {name}
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


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""  # '' for fp8jax itself and its top-level modules


def _is_entry_point(path: pathlib.Path) -> bool:
    """A command-line module (``if __name__ == "__main__"``): it sits above every layer."""
    return '__name__ == "__main__"' in path.read_text()


def subpackage_graph(modules, graph) -> dict[str, set[str]]:
    """Subpackage -> subpackages it imports, without entry points and allowed edges."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for name, targets in graph.items():
        if _is_entry_point(modules[name]) or not _subpackage(name):
            continue
        for t in targets:
            edge = (_subpackage(name), _subpackage(t))
            if _subpackage(t) and edge[0] != edge[1]:
                out[edge[0]].add(edge[1])
    return out


MODULES = _modules()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_across_modules(name):
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found = private_uses(tree, MODULES)
    assert not found, f"{name} uses private names of other modules: {found}; make them public"


def test_modules_stay_short():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them by responsibility"


def test_no_import_cycles():
    graph = import_graph(MODULES)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    subs = subpackage_graph(MODULES, graph)
    cycle = find_cycle(subs)
    assert cycle is None, f"subpackage import cycle: {' -> '.join(cycle)}"


def test_parallel_does_not_import_the_trainer():
    lazy_too = {  # imports inside functions count too
        name: {
            t for node in ast.walk(ast.parse(path.read_text())) for t in _imported(node, MODULES)
        }
        for name, path in MODULES.items()
        if name.startswith("fp8jax.parallel")
    }
    bad = {n: sorted(t for t in ts if t.startswith("fp8jax.trainer")) for n, ts in lazy_too.items()}
    assert not any(bad.values()), f"fp8jax.parallel imports the trainer: {bad}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """Each rule fails on a package written to break it."""
    pkg = tmp_path / "fp8jax"
    (pkg / "a").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "a" / "__init__.py"):
        init.write_text("")
    (pkg / "a" / "x.py").write_text("import fp8jax.a.y\n\ndef _hidden():\n    pass\n")
    (pkg / "a" / "y.py").write_text(
        "from fp8jax.a import x\nfrom fp8jax.a.x import _hidden\nimport fp8jax\n"
        "from fp8jax.a import x as xx\n\nx._hidden()\nxx._hidden()\nfp8jax.a.x._hidden()\n"
        "x.__name__\n"
    )
    modules = _modules(pkg)
    found = private_uses(ast.parse((pkg / "a" / "y.py").read_text()), modules)
    assert [f.split(":")[0] for f in found] == ["line 2", "line 6", "line 7", "line 8"]
    assert find_cycle(import_graph(modules)) == ["fp8jax.a.x", "fp8jax.a.y", "fp8jax.a.x"]
    assert find_cycle({"ops": {"nn"}, "nn": {"ops"}}) == ["nn", "ops", "nn"]
    assert find_cycle({"ops": set(), "nn": {"ops"}}) is None
