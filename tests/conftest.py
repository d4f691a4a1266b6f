"""Fixtures shared by the test modules, the XLA:CPU flag the tests compile with, and the order in
which the modules are handed out.

CI runs the suite on two pytest-xdist workers with ``--dist loadfile`` (README's test command):
each module runs whole on one worker, so its module-scoped fixtures (a trained work dir, the
8-device subprocess of tests/sharded_checks.py) are built once, and the modules that take
longest go first, so the two workers finish at about the same time.
"""

import os
import pathlib
import pkgutil

import pytest
import xla_cpu


def _accelerator_plugin() -> bool:
    """Whether a JAX GPU plugin is installed (``jax_plugins.xla_cuda*``/``xla_rocm*``), found
    without importing JAX: the tests then compile for the GPU, as a user's programs do, and the
    CPU compile settings below are left alone."""
    try:
        import jax_plugins
    except ImportError:
        return False
    return any(
        m.name.startswith(("xla_cuda", "xla_rocm"))
        for m in pkgutil.iter_modules(jax_plugins.__path__)
    )


if _accelerator_plugin():
    # The workers (README's ``-n 2``) and the processes they start share one GPU: each takes
    # the memory it uses, not JAX's default 75% of the device at its first array.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
    # XLA:CPU's elemental emitters in every test process and in the processes it starts
    # (train.py runs, notebook kernels, benchmark children), read when JAX first compiles
    # (tests/xla_cpu.py: where the installed XLA has the flag).
    xla_cpu.add_emitter_flag()
    # Most of XLA's optimisations off in the same processes
    # (``jax_disable_most_optimizations``: the backend's code generation at its lowest level;
    # the HLO passes, fusions and rewrites as always): the programs are tiny and their compiles
    # take about half as long. A test that compares the bits of two different programs, as a
    # user's optimised compile makes them, takes the marker ``optimized`` (the
    # ``_optimized_compiles`` fixture below).
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402 (after the flags above, which JAX reads at import)

# Also where a plugin imported JAX before this file set the variable.
jax.config.update(
    "jax_disable_most_optimizations", os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1"
)

from fp8_testing import novel  # noqa: E402

# The modules that take longest on two CPU cores (a full run's --durations), longest first;
# the others follow in collection order. A module missing here only starts later.
LONGEST_FIRST = (
    "test_sharding.py",
    "test_notebooks.py",
    "test_reliability.py",
    "test_train.py",
    "test_benchmarks.py",
    "test_generate.py",
    "test_optim.py",
    "test_lm_eval.py",
    "test_integrity.py",
    "test_remat.py",
    "test_expert_parallel.py",
    "test_moe.py",
    "test_moe_state.py",
    "test_wheel.py",
    "test_models.py",
    "test_fine_mlp.py",
    "test_dpo.py",
    "test_mlp.py",
    "test_sft.py",
    "test_loss_chunk.py",
    "test_signals.py",
    "test_multiprocess.py",
    "test_qkv.py",
    "test_families.py",
    "test_norm.py",
    "test_hf.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the ``LONGEST_FIRST`` modules first (a stable sort: each module keeps its order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _optimized_compiles(request: pytest.FixtureRequest):
    """XLA's optimisations on for a test marked ``optimized``, with JAX's caches emptied on the
    way in and out, so that no program compiled under the other setting is reused."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        jax.clear_caches()


@pytest.fixture(scope="session")
def novel_file(tmp_path_factory: pytest.TempPathFactory):
    """``novel_file(book, num_chars, start=0)``: a text file holding that slice of a shipped
    novel (``fp8_testing.novel``), written once per test run; tests only read it."""
    root = tmp_path_factory.mktemp("novels")

    def write(book: str, num_chars: int, start: int = 0) -> pathlib.Path:
        path = root / f"{book}-{start}-{num_chars}.txt"
        if not path.exists():
            path.write_text(novel(book, num_chars, start))
        return path

    return write
