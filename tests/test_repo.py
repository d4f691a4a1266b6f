"""Repository invariants: CI runs the README's test command and its Python blocks."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    cmds = [b.strip() for b in blocks if "pytest" in b]
    assert cmds, "README.md must show the test command in a bash block"
    return cmds[0]


def test_ci_runs_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_test_command() in ci, "keep .ci/run's pytest line identical to README's"


def test_readme_main_command_trains_tiny():
    text = (ROOT / "README.md").read_text()
    assert "python train.py --config configs/tiny.py" in text


def test_train_py_turns_triton_gemms_off_unless_set():
    """The trainer (train.py, fp8jax-train) adds --xla_gpu_enable_triton_gemm=false, keeping
    the user's flags and choice."""
    # A fresh process: fp8jax.train defines absl flags that other modules define too.
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); from fp8jax import train\n"
        "for before in sys.argv[2:]:\n"
        "    os.environ['XLA_FLAGS'] = before\n"
        "    train._default_xla_flags()\n"
        "    print(os.environ['XLA_FLAGS'])\n"
    )
    cases = ["--xla_dump_to=/tmp/x", "--xla_gpu_enable_triton_gemm=true"]
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), *cases], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "--xla_dump_to=/tmp/x --xla_gpu_enable_triton_gemm=false",
        "--xla_gpu_enable_triton_gemm=true",
    ]


def test_readme_python_blocks_run_as_written(tmp_path):
    """Every ```python block of the README runs, as written, in a fresh interpreter."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "README.md shows no Python block"
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path
        )
        assert proc.returncode == 0, f"README block {i} failed:\n{block}\n{proc.stderr[-2000:]}"
