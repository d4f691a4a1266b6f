"""The colab/ notebooks: stored clean, well-formed, and run top to bottom on CPU."""

import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import time
import tomllib

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
EXPECTED = [
    "01_fp8_in_your_flax_model.ipynb",
    "02_train_gpt_fp8_vs_bf16.ipynb",
    "03_fp8_optimizer_memory.ipynb",
    "04_finetune_hf_checkpoint.ipynb",
    "05_mixture_of_experts_fp8.ipynb",
]
REPO_URL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
GITHUB = REPO_URL.removeprefix("https://github.com/")
BADGE = f"https://colab.research.google.com/github/{GITHUB}/blob/main/colab/{{}}"
ids = [p.stem for p in NOTEBOOKS]


def _read(path):
    return nbformat.read(path, as_version=4)


def _install_cell(path) -> str:
    return [c for c in _read(path).cells if c.cell_type == "code"][0].source


def test_the_notebooks_exist():
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
    assert f'REPO_URL = "{REPO_URL}"' in install, "the URL of pyproject's [project.urls]"
    assert "[notebooks]" in install, "installs the notebooks extra (matplotlib)"
    for prev, cell in zip(cells, cells[1:], strict=False):
        if cell.cell_type == "code":
            assert prev.cell_type == "markdown", f"{path.name}: markdown before every code cell"
    text = "\n".join(c.source for c in code)
    assert "FP8JAX_NB_WORKDIR" in text, "work folder from FP8JAX_NB_WORKDIR"
    assert 'jax.default_backend() == "gpu"' in text, "sizes picked by backend"
    assert "matplotlib" in text


def _run_install_cell(path, cwd, monkeypatch, importable=("fp8jax", "matplotlib")):
    """Run a notebook's install cell in cwd with pip and git stubbed out; the commands it ran."""
    calls = []
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("fp8jax", "matplotlib") and name not in importable:
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(list(cmd)))
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(compile(_install_cell(path), str(path), "exec"), {"__name__": "__main__"})
    return calls


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_install_cell_does_nothing_in_an_installed_checkout(path, monkeypatch):
    assert _run_install_cell(path, COLAB, monkeypatch) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_install_cell_installs_the_checkout_it_sits_in(path, monkeypatch):
    calls = _run_install_cell(path, COLAB, monkeypatch, importable=("fp8jax",))
    assert len(calls) == 1 and calls[0][-2:] == ["-e", f"{ROOT}[notebooks]"], calls
    assert sys.path[0] == str(ROOT), "importable without restarting the kernel"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_install_cell_clones_the_repository_on_colab(path, tmp_path, monkeypatch):
    calls = _run_install_cell(path, tmp_path, monkeypatch, importable=())
    clone = tmp_path.resolve() / "fp8jax_repo"
    assert calls[0] == ["git", "clone", "-q", "--depth", "1", REPO_URL, str(clone)], calls
    assert calls[1][-2:] == ["-e", f"{clone}[notebooks]"], calls


def test_finetune_notebook_downloads_nothing_by_default():
    """04 imports a local checkpoint dir; empty, it makes its own: the test path downloads none."""
    code = [
        c.source
        for c in _read(COLAB / "04_finetune_hf_checkpoint.ipynb").cells
        if c.cell_type == "code"
    ]
    assert sum('CHECKPOINT = ""' in src for src in code) == 1
    assert not [src for src in code if "snapshot_download" in src or 'from_pretrained("' in src]


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
    data = json.loads(results.read_text())
    assert data["backend"] == "cpu"
    # Each count of FP8 GEMMs a notebook reports, [in FP8, in all], is all of them.
    counts = {k: v for k, v in data.items() if k.endswith("_in_fp8") or k == "fp8_dot_generals"}
    assert all(n == total > 0 for n, total in counts.values()), counts
    text = "".join(o.get("text", "") for o in outputs)
    assert re.search(r"\S", text)
    # A run dir given the notebook's tokenizer reuses it (a retrain would redo the tokens too).
    assert "retraining it" not in text, f"{path.name}: a run retrained the tokenizer"
