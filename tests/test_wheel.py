"""The built wheel works without a checkout: train, generate, evaluate and ``hf.load``.

The wheel is built from a copy of the repository and installed (without its dependencies) into
a fresh venv, which sees this environment's packages through a ``.pth`` line placed after its
own site-packages, so the wheel's ``fp8jax`` is the one imported. Every command then runs from
a folder outside the repository, with no ``PYTHONPATH``: what the wheel lacks fails here.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

from fp8_testing import TINY_RUN

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# A tiny run: one 64-wide layer for 3 steps on a slice of the shipped corpus, no cache.
TRAIN_FIELDS = {
    **TINY_RUN,
    "num_train_steps": 3,
    "warmup_steps": 1,
    "eval_every_steps": 2,
    "checkpoint_every_steps": 2,
    "sample_tokens": 4,
    "compilation_cache_dir": "",
}


def _run(args: list[str], cwd: pathlib.Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``args`` in ``cwd`` without PYTHONPATH; fails the test with its stderr unless it exits 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin dir, folder outside the repository, its corpus, trained work dir)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy: the build writes build/ and *.egg-info next to its input
    skip = shutil.ignore_patterns(
        ".git", "__pycache__", "build", "dist", "*.egg-info", ".venv", "runs", ".*_cache"
    )
    shutil.copytree(ROOT, source, symlinks=True, ignore=skip)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(tmp / "dist"),
            str(source),
        ],
        tmp,
    )
    (wheel,) = (tmp / "dist").glob("fp8jax-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp)
    # This environment's packages (jax, flax, ...) after the venv's own site-packages.
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp
    ).stdout.strip()
    pathlib.Path(site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    outside = tmp / "user"
    outside.mkdir()
    corpus = outside / "corpus.txt"
    shipped = ROOT / "fp8jax" / "data" / "pride-and-prejudice.txt.gz"
    corpus.write_text(gzip.open(shipped, "rt").read()[:60_000])
    workdir = outside / "wd"
    overrides = [f"--config.{k}={v}" for k, v in {**TRAIN_FIELDS, "data.path": corpus}.items()]
    _run(
        [
            str(venv / "bin" / "fp8jax-train"),
            "--config",
            "tiny",
            f"--workdir={workdir}",
            *overrides,
        ],
        outside,
    )
    return python, outside, corpus, workdir


def test_the_wheel_runs_outside_the_checkout(installed):
    """From a folder outside the repository, with the wheel's fp8jax (one test: under xdist the
    module's fixture, a wheel build and a training run, then runs once)."""
    python, outside, corpus, workdir = installed
    code = "import fp8jax.configs as c; print(c.__file__); print(c.names())"
    where, names = _run([str(python), "-c", code], outside).stdout.splitlines()
    assert pathlib.Path(where).is_relative_to(python.parents[1]), where  # the venv's copy
    assert "tiny" in names and "base" in names

    # fp8jax-train --config tiny ran its steps and left a summary and a checkpoint.
    assert (
        json.loads((workdir / "summary.json").read_text())["step"]
        == TRAIN_FIELDS["num_train_steps"]
    )
    assert (workdir / "checkpoints").is_dir()

    args = ["-m", "fp8jax.generate", f"--ckpt={workdir}", "--prompt=It is", "--max_new_tokens=4"]
    assert _run([str(python), *args], outside).stdout.startswith("It is")

    args = ["-m", "fp8jax.evaluate", f"--ckpt={workdir}", f"--data={corpus}", "--num_batches=1"]
    assert "loss" in json.loads(_run([str(python), *args], outside).stdout)

    code = f"import fp8jax.hf as hf; print(hf.load({str(workdir)!r}).model_cfg.d_model)"
    out = _run([str(python), "-c", code], outside).stdout.split()
    assert out == [str(TRAIN_FIELDS["model.d_model"])]

    # python -m fp8jax.train is the same command: a bad config name is one line and exit 2.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(python), "-m", "fp8jax.train", "--config", "no_such_preset", "--workdir=wd"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "tiny" in proc.stderr  # the shipped configs' names, read from the wheel
