"""The colab/ notebooks: stored clean, well-formed, and run top to bottom on CPU."""

import json
import pathlib
import re
import sys
import time

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
EXPECTED = [
    "01_fp8_in_your_flax_model.ipynb",
    "02_train_gpt_fp8_vs_bf16.ipynb",
    "03_fp8_optimizer_memory.ipynb",
]
BADGE = "https://colab.research.google.com/github/fp8jax/fp8jax/blob/main/colab/{}"
ids = [p.stem for p in NOTEBOOKS]


def _read(path):
    return nbformat.read(path, as_version=4)


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_stored_without_outputs(path):
    nb = _read(path)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has stored outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_structure(path):
    """Colab badge first, an install cell that is a no-op where fp8jax imports, prose first."""
    cells = _read(path).cells
    assert cells[0].cell_type == "markdown"
    assert BADGE.format(path.name) in cells[0].source, "first cell: the Open in Colab badge"
    code = [c for c in cells if c.cell_type == "code"]
    install = code[0].source
    assert 'find_spec("fp8jax") is None' in install and "pip" in install, "first code cell: install"
    assert "github.com/fp8jax/fp8jax" in install
    for prev, cell in zip(cells, cells[1:], strict=False):
        if cell.cell_type == "code":
            assert prev.cell_type == "markdown", f"{path.name}: markdown before every code cell"
    text = "\n".join(c.source for c in code)
    assert "FP8JAX_NB_WORKDIR" in text, "work folder from FP8JAX_NB_WORKDIR"
    assert 'jax.default_backend() == "gpu"' in text, "sizes picked by backend"
    assert "matplotlib" in text


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec running this interpreter, so the notebooks use the test environment."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "fp8jax-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "fp8jax test", "language": "python"})
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_runs_on_cpu(path, tmp_path, kernel_env, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(kernel_env))
    monkeypatch.setenv("FP8JAX_NB_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = _read(path)
    client = NotebookClient(
        nb,
        kernel_name="fp8jax-test",
        timeout=600,
        resources={"metadata": {"path": str(COLAB)}},
    )
    before = {p.name for p in COLAB.iterdir()}
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    seconds = time.perf_counter() - t0
    print(f"{path.name}: {seconds:.1f} s")
    assert {p.name for p in COLAB.iterdir()} == before, "notebooks must write to the work folder"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no plot"
    results = tmp_path / "work" / f"nb{path.name[:2]}_results.json"
    assert results.is_file(), "the key-numbers cell writes nbXX_results.json"
    assert json.loads(results.read_text())["backend"] == "cpu"
    assert re.search(r"\S", "".join(o.get("text", "") for o in outputs))
