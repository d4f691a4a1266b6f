"""benchmarks/ as a package: the runner (run specs, overrides, child processes, tables), the
shared measurement helpers, each benchmark's CPU-cheap path, and the package's import rules."""

import argparse
import ast
import gzip
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import (
    block_gemm,
    cast_transpose,
    common,
    decode,
    grouped_gemm,
    parity,
    runner,
    step,
)
from fp8jax import errors
from fp8jax.trainer import loop as train_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
KEPT = [
    "gemm",
    "cast_transpose",
    "act_kernels",
    "qkv_cast",
    "step",
    "kernel_profile",
    "parity",
    "torch_reference",
    "user_path",
    "memory_peak",
    "finetune",
    "finetune_step",
    "block_gemm",
    "memory_sim",
    "grouped_gemm",
    "decode",
    "decode_attention",
    "data",
]
SHARED = {"runner", "common"}  # what a benchmark may import from the package


def _module(name: str, *args: str, env=None, **kw) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<name> args`` from the repository root."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, **kw)


FP8_GEMM = "nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_bias_TNT"

# Kernel names from H200 traces of the gpt_1b3 step (cuBLASLt nvjet, cuDNN, XLA, NCCL).
KERNELS = [
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_ssched_bz_coopA_NTN", "gemm_other"),  # bf16 x bf16
    (FP8_GEMM, "gemm_fp8"),  # E4M3 x E4M3 (forward)
    ("nvjet_sm90_rqtst_144x128_128x6_1x2_h_bz_TNN", "gemm_fp8"),  # E5M2 x E4M3 (dgrad)
    ("nvjet_sm90_qrtst_176x128_128x5_1x2_h_bz_TNN", "gemm_fp8"),  # E4M3 x E5M2 (wgrad)
    (
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1",
        "attention",
    ),
    ("memcpy128", "copy/transpose"),
    ("input_add_reduce_fusion", "reduction fusion"),
    ("loop_convert_fusion", "elementwise fusion"),
    ("ncclDevKernel_AllGather", "collective"),
]


@pytest.mark.parametrize("name,expected", KERNELS, ids=[k[1] + ":" + k[0][:24] for k in KERNELS])
def test_kernel_category(name, expected):
    assert common.category(name) == expected


def _write_trace(root: pathlib.Path, events, pids):
    """A gzipped Chrome trace where jax.profiler writes it: plugins/profile/<run>/."""
    run = root / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    meta = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
        for pid, name in pids.items()
    ]
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def _x(pid, name, ts, dur, tid=1):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


GPU, HOST = 7, 3


def test_bits_reads_each_encoding():
    """``common.bits``, which the kernel benchmarks' "same bits" columns compare, gives each
    format's encoding of 1.0 and -2.0 (OCP FP8, bf16, f32), scalars included."""
    import jax.numpy as jnp

    want = {
        jnp.float8_e4m3fn: [0x38, 0xC0],
        jnp.float8_e5m2: [0x3C, 0xC0],
        jnp.bfloat16: [0x3F80, 0xC000],
        jnp.float32: [0x3F800000, 0xC0000000],
    }
    for dtype, codes in want.items():
        assert common.bits(jnp.asarray([1.0, -2.0], dtype)).tolist() == codes, dtype
        assert common.bits(jnp.asarray(1.0, dtype)).tolist() == codes[:1], dtype


def test_summarize_trace_per_step_numbers(tmp_path):
    events = [
        # Two steps' worth of device kernels, microseconds.
        _x(GPU, "loop_add_fusion_3", 0, 100),
        _x(GPU, "loop_add_fusion_17", 150, 250),  # same fusion kind, another layer
        _x(GPU, FP8_GEMM, 400, 1000),
        _x(GPU, "ncclDevKernel_AllGather", 900, 700, tid=2),  # overlaps the GEMM by 500
        _x(GPU, "memcpy128", 2000, 200),
        _x(GPU, FP8_GEMM, 2500, 1000),
        {"ph": "i", "pid": GPU, "tid": 1, "name": "marker", "ts": 10},  # not a complete event
        {"ph": "M", "name": "thread_name", "pid": GPU, "tid": 1, "args": {"name": "stream 7"}},
        # Host events: ignored, or every number below would move.
        _x(HOST, FP8_GEMM, 0, 50_000),
        _x(HOST, "ExecuteOnLocalDevices", 0, 90_000),
    ]
    _write_trace(tmp_path, events, {GPU: "/device:GPU:0", HOST: "/host:CPU"})
    s = common.summarize_trace(str(tmp_path), steps=2, top=3)
    approx = lambda v: pytest.approx(v, rel=1e-12)
    assert s["timeline"] == "gpu"
    # Kernel sum 3250 us; busy is the union of intervals (the overlap and the gaps don't
    # count): 100 + 250 + [400, 1600] + 200 + 1000 = 2750 us; span 0..3500 us. Over 2 steps.
    assert s["kernel_ms_per_step"] == approx(1.625)
    assert s["busy_ms_per_step"] == approx(1.375)
    assert s["span_ms_per_step"] == approx(1.75)
    # Categories largest first.
    assert list(s["categories"]) == [
        "gemm_fp8",
        "collective",
        "elementwise fusion",
        "copy/transpose",
    ]
    assert list(s["categories"].values()) == [approx(1.0), approx(0.35), approx(0.175), approx(0.1)]
    # Top 3 of 4 kernel names (memcpy128 is cut); the two fusions are one row.
    assert s["top"] == [
        {
            "name": FP8_GEMM,
            "ms_per_step": approx(1.0),
            "share": approx(2000 / 3250),
            "calls_per_step": 1.0,
            "category": "gemm_fp8",
        },
        {
            "name": "ncclDevKernel_AllGather",
            "ms_per_step": approx(0.35),
            "share": approx(700 / 3250),
            "calls_per_step": 0.5,
            "category": "collective",
        },
        {
            "name": "loop_add_fusion",
            "ms_per_step": approx(0.175),
            "share": approx(350 / 3250),
            "calls_per_step": 1.0,
            "category": "elementwise fusion",
        },
    ]


def test_summarize_trace_cpu_threads_and_missing_trace(tmp_path):
    # Without a device process (a CPU smoke run) XLA's Eigen worker threads are the timeline.
    events = [
        {
            "ph": "M",
            "name": "thread_name",
            "pid": HOST,
            "tid": 5,
            "args": {"name": "tf_XLAEigen/5"},
        },
        {"ph": "M", "name": "thread_name", "pid": HOST, "tid": 6, "args": {"name": "python3"}},
        _x(HOST, "loop_add_fusion.2", 0, 300, tid=5),
        _x(HOST, "PjitFunction(train_step)", 0, 5000, tid=6),  # the Python thread: not an op
    ]
    _write_trace(tmp_path / "cpu", events, {HOST: "/host:CPU"})
    s = common.summarize_trace(str(tmp_path / "cpu"), steps=1, top=5)
    assert s["timeline"] == "cpu threads"
    assert s["kernel_ms_per_step"] == pytest.approx(0.3)
    assert [(k["name"], k["calls_per_step"]) for k in s["top"]] == [("loop_add_fusion", 1.0)]
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        common.summarize_trace(str(tmp_path / "empty"), steps=1, top=5)


def test_parse_run():
    assert runner.parse_run("gpt_1b3:O1") == ("gpt_1b3", "O1", [])
    assert runner.parse_run("gpt_1b3:O1:model.scan_layers=False+plain") == (
        "gpt_1b3",
        "O1",
        ["model.scan_layers=False", "plain"],
    )
    # A value may hold ':' (a path); it stays whole.
    assert runner.parse_run("tiny:O0:data.path=/a:b")[2] == ["data.path=/a:b"]
    for bad in ("tiny", "tiny:", ":O1"):
        with pytest.raises(ValueError, match="expected config:level"):
            runner.parse_run(bad)


def _one_line_error(call, match: str) -> str:
    """The message of the ConfigError ``call()`` raises: one line, naming ``match``."""
    with pytest.raises(errors.ConfigError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_apply_overrides_through_ml_collections():
    c = train_lib.load_config("tiny")
    assert (c.model.scan_layers, c.seq_len, c.model.dtype) == (True, 64, "float32")
    runner.apply_overrides(c, ["model.scan_layers=False", "seq_len=32", "model.dtype=bfloat16"])
    # Literals are parsed (a bool, not the string 'False'); a str field takes the text as is.
    assert c.model.scan_layers is False
    assert c.seq_len == 32 and isinstance(c.seq_len, int)
    assert c.model.dtype == "bfloat16"
    runner.apply_overrides(c, ["model.dtype=1"])  # a str field: '1' stays a string
    assert c.model.dtype == "1"
    _one_line_error(lambda: runner.apply_overrides(c, ["model.foo=1"]), "'model.foo'")
    assert "foo" not in c.model  # a typo must not add a field
    assert not c.is_locked  # and the config is left as unlocked as it came
    # A misspelled parent too, and a value ml_collections cannot give the field's type.
    msg = "unknown config field 'modl.dtype'"
    _one_line_error(lambda: runner.apply_overrides(c, ["modl.dtype=float32"]), msg)
    _one_line_error(lambda: runner.apply_overrides(c, ["seq_len=long"]), "override 'seq_len=long'")
    assert c.seq_len == 32
    _one_line_error(lambda: runner.apply_overrides(c, ["plain"]), "expected key=value")


def test_load_applies_settings_then_options_then_sets():
    c = runner.load(
        "tiny:O2:seq_len=16+plain",
        sets=["model.d_ff=96"],
        flags={"plain"},
        settings={"seq_len": 8, "batch_size": 2, "model.d_ff": 64},
    )
    assert (c.fp8.level, c.seq_len, c.batch_size, c.model.d_ff) == ("O2", 16, 2, 96)
    c = runner.load("tiny:O1", sets=["seq_len=24"], settings=runner.step_settings(quick=True))
    assert (c.seq_len, c.model.d_model, c.mesh.data, c.model.attention_impl) == (24, 64, -1, "xla")
    _one_line_error(lambda: runner.load("tiny:O1:plian"), "unknown option")
    _one_line_error(lambda: runner.load("tiny:O1", settings={"model.d_modl": 1}), "model.d_modl")


def test_parity_levels_carry_config_overrides():
    """``--levels O0,O1:model.fp8_lm_head=True``: each level its own config and work dir."""
    c = parity.level_config("tiny", "O1:model.fp8_lm_head=True+seq_len=32", 40, 512, "-1,1,1")
    assert (c.fp8.level, c.model.fp8_lm_head, c.seq_len) == ("O1", True, 32)
    assert (c.num_train_steps, c.eval_every_steps, c.model.vocab_size) == (40, 40, 512)
    plain = parity.level_config("tiny", "O0", 40, 512, "-1,1,1", sets=["seq_len=48"])
    assert (plain.fp8.level, plain.model.fp8_lm_head, plain.seq_len) == ("O0", False, 48)
    safe = runner.safe_name("tiny_O1:model.fp8_lm_head=True")
    assert safe == "tiny_O1_model-fp8_lm_head-True"
    with pytest.raises(errors.ConfigError, match="model.fp8_head"):
        parity.level_config("tiny", "O1:model.fp8_head=True", 40, 512, "-1,1,1")


def test_parity_compares_each_seed_with_its_own_first_level():
    """``--seeds``: a run's difference is from the first level at the same seed; the means
    average the seeds, with the standard error of the mean difference; the spread is the first
    level's between seeds."""
    rows = {
        ("O0", 0): {"val_loss": 4.0, "val_load_max_over_mean": 1.6},
        ("O1", 0): {"val_loss": 4.04, "val_load_max_over_mean": 2.0},
        ("O0", 1): {"val_loss": 5.0, "val_load_max_over_mean": 1.0},
        ("O1", 1): {"val_loss": 4.9, "val_load_max_over_mean": 1.1},
    }
    out = parity.compare(rows, ["O0", "O1"], [0, 1])
    assert out[("O1", 0)]["rel_diff_vs_first"] == pytest.approx(0.01)
    assert out[("O1", 1)]["rel_diff_vs_first"] == pytest.approx(-0.02)
    assert out[("O1", 1)]["balance_vs_first"] == pytest.approx(1.1)
    assert out[("O1", "mean")]["rel_diff_vs_first"] == pytest.approx(-0.005)
    # The standard error of the mean difference: stdev(0.01, -0.02) / sqrt(2) = 0.015.
    assert out[("O1", "mean")]["rel_diff_sem"] == pytest.approx(0.015)
    assert out[("O0", "mean")]["rel_diff_sem"] == 0.0
    assert out[("O1", "mean")]["val_loss"] == pytest.approx(4.47)
    assert out[("O1", "mean")]["balance_vs_first"] == pytest.approx((2.0 / 1.6 + 1.1) / 2)
    assert out[("O0", "mean")]["seed_spread"] == pytest.approx(1.0 / 4.5)
    assert "seed_spread" not in out[("O1", "mean")]
    assert (
        parity._row_name("O1", "mean") == "O1 (mean)" and parity._row_name("O1", 2) == "O1 (seed 2)"
    )
    one = parity.compare(
        {("O0", None): {"val_loss": 3.0}, ("O1", None): {"val_loss": 3.3}}, ["O0", "O1"], [None]
    )
    assert list(one) == [("O0", None), ("O1", None)]
    assert one[("O1", None)]["rel_diff_vs_first"] == pytest.approx(0.1)


def test_bad_override_stops_before_any_child(tmp_path):
    """A typo in the second run: one line on stderr, nothing measured, nothing written."""
    runs = "tiny:O1,tiny:O1:model.foo=1"
    proc = _module("step", "--quick", "--runs", runs, "--set", "seq_len=16", "--out", str(tmp_path))
    assert proc.returncode != 0
    assert proc.stderr.strip() == (
        "error: unknown config field 'model.foo' in override 'model.foo=1'"
    ), proc.stderr[-800:]
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


def test_step_refuses_to_time_a_non_finite_loss(tmp_path):
    """A learning rate of 1e38 overflows the params after the first update: the run is an
    error row naming the loss, with no step time (NaN arithmetic runs faster at a power cap)."""
    runs = "tiny:O1"
    proc = _module(
        "step", "--quick", "--runs", runs, "--set", "learning_rate=1e38", "--out", str(tmp_path)
    )
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert "step_ms" not in record, record
    assert "the loss is nan after the timed steps" in record["error"], record["error"]
    assert "ERROR" in proc.stdout
    assert common.finite_loss(runs, np.float32(2.5)) == 2.5
    with pytest.raises(FloatingPointError, match="the loss is inf"):
        common.finite_loss(runs, np.float32("inf"))


def test_every_benchmark_has_a_module_cli():
    """``python -m benchmarks.<name> --help`` for each kept benchmark (the PyTorch reference
    where torch is installed), and nothing left of the retired ones."""
    names = [n for n in KEPT if n != "torch_reference" or importlib.util.find_spec("torch")]
    procs = {
        n: subprocess.Popen(
            [sys.executable, "-m", f"benchmarks.{n}", "--help"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in names
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-800:])
        assert "--out" in out and f"python -m benchmarks.{name}" in out, (name, out)
    assert sorted(p.stem for p in BENCH.glob("*.py")) == sorted(KEPT + ["__init__", *SHARED])


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(top-level modules imported anywhere in the file, benchmarks modules it imports)."""
    tree = ast.parse(path.read_text())
    roots, local = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            roots.add(name.split(".")[0])
            if name.startswith("benchmarks."):
                local.add(name.split(".")[1])
    return roots, local


def test_package_imports_no_sys_path_and_no_cycles():
    graph = {}
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), (
                    f"{path.name}:{node.lineno}: sys.path"
                )
        roots, local = _imports(path)
        assert local <= SHARED, f"{path.name} imports benchmarks {sorted(local - SHARED)}"
        graph[path.stem] = local
    seen, done = set(), set()

    def visit(name, trail):
        assert name not in seen - done, f"import cycle: {' -> '.join([*trail, name])}"
        if name not in seen:
            seen.add(name)
            for dep in graph.get(name, ()):
                visit(dep, [*trail, name])
            done.add(name)

    for name in graph:
        visit(name, [])
    # The runner and the package import nothing of the JAX side at import time, and the
    # PyTorch reference nowhere: it runs with torch alone.
    jax_side = {"jax", "jaxlib", "flax", "fp8jax", "optax", "ml_collections", "numpy"}
    tree = ast.parse((BENCH / "runner.py").read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not top & jax_side, top
    assert not _imports(BENCH / "torch_reference.py")[0] & jax_side
    code = "import sys, benchmarks.runner; print(sorted({'jax', 'fp8jax'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr[-800:]


def test_table_aligns_rows_and_reports_errors():
    rows = [
        {"run": "tiny:O1", "ms": 12.345, "power": None},
        {"run": "a_longer_run:O0", "error": "MemoryError: out of memory"},
        {"run": "x:O2", "ms": 1.0, "power": {"watts": 690.4}},
    ]
    cols = {"ms": lambda r: f"{r['ms']:.1f}", "W": lambda r: f"{r['power']['watts']:.0f}"}
    assert runner.table(rows, cols).splitlines() == [
        "run                ms    W",
        "tiny:O1          12.3    -",
        "a_longer_run:O0  ERROR MemoryError: out of memory",
        "x:O2              1.0  690",
    ]


def test_failed_run_row_keeps_the_compile_line_with_xla_memory():
    """An out-of-memory child: its row names XLA's temp need first, then the exception."""
    script = (
        "import sys\n"
        "print('llama_7b:O1: compiled in 121.0 s; XLA temp 97.52 GiB, arguments 42.00 GiB',"
        " file=sys.stderr)\n"
        "raise MemoryError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate')\n"
    )
    row = runner.run_child([sys.executable, "-c", script], "llama_7b:O1")
    assert row["error"].startswith("llama_7b:O1: compiled in 121.0 s; XLA temp 97.52 GiB"), row
    assert "MemoryError: RESOURCE_EXHAUSTED" in row["error"], row
    ok = f"import json; print({runner.MARK!r} + json.dumps({{'run': 'r', 'ms': 1.5}}))"
    assert runner.run_child([sys.executable, "-c", ok], "r") == {"run": "r", "ms": 1.5}
    slow = "import sys, time; print('r: compiling', file=sys.stderr, flush=True); time.sleep(60)"
    row = runner.run_child([sys.executable, "-c", slow], "r", timeout=1)
    assert row == {"run": "r", "error": "r: compiling | timed out after 1 s"}, row


@pytest.mark.parametrize("program", ["step", "init"])
def test_memory_peak_reads_xla_report_through_the_runner(program, tmp_path):
    """End to end on CPU, parent and child: the compiled tiny O2 step's (init's) peak, by JAX
    operation, in the run's own JSON file."""
    args = ["--quick", "--runs", "tiny:O2", "--set", "seq_len=16", "--program", program]
    proc = _module("memory_peak", *args, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-800:]
    row = json.loads((tmp_path / f"memory_peak_{program}_tiny_O2.json").read_text())
    assert "error" not in row and row["program"] == program, row
    jit_name = {"step": "train_step", "init": "init_state"}[program]
    assert any(f"jit({jit_name})" in b["op"] for b in row["breakdown"]), row["breakdown"]
    assert row["peak_bytes"] > 0 and row["breakdown"] and row["peak_buffers"]
    assert sum(b["bytes"] for b in row["breakdown"]) <= row["peak_bytes"]
    # The compiled allocation holds at least the arguments and temp the report's peak draws on.
    allocated = row["allocated_gib"] * 2**30
    assert allocated >= (row["argument_gib"] + row["temp_gib"]) * 2**30 - 1
    assert row["report_share"] == row["peak_bytes"] / allocated
    assert "temp GiB" in proc.stdout and "tiny:O2" in proc.stdout  # the printed table
    assert "share" in proc.stdout


def test_memory_sim_compiles_sharded_steps_without_allocating(tmp_path):
    """Parent and children on 4 simulated devices: O3's per-device state (fsdp=4) is under a
    third of O2's (replicated over data=4; what O3 shards is most of it), each counted from
    the shardings, with compiled temp bytes and the collectives each device sends."""
    runs = "tiny:O2:mesh.data=4+mesh.fsdp=1,tiny:O3"
    proc = _module(
        "memory_sim", "--quick", "--devices", "4", "--runs", runs, "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr[-800:]
    o2 = json.loads((tmp_path / "memory_sim_tiny_O2_mesh-data-4_mesh-fsdp-1.json").read_text())
    o3 = json.loads((tmp_path / "memory_sim_tiny_O3.json").read_text())
    assert o2["mesh"]["data"] == 4 and o3["mesh"]["fsdp"] == 4, (o2, o3)
    assert 0 < o3["state_gib"] < o2["state_gib"] / 3, (o2, o3)
    assert o3["temp_gib"] > 0 and o3["sent_gb"]["total"] > 0
    assert any(k.startswith("all-gather") for k in o3["sent_gb"]), o3["sent_gb"]
    assert "state GiB" in proc.stdout


def test_memory_sim_lowers_grouped_gemms_one_group_at_a_time():
    """``memory_sim.grouped_loop`` gives ragged_dot_general's values for each form the forward
    and its gradients bind (ragged rows: forward and dx; ragged contraction: dw), an empty
    group and rows past the groups included."""
    import jax
    import jax.extend
    import jax.numpy as jnp

    from benchmarks import memory_sim

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((24, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 8, 5)), jnp.float32)
    sizes = jnp.asarray([5, 0, 11, 6], jnp.int32)  # 22 of 24 rows: the last two give 0
    ct = jnp.asarray(rng.standard_normal((24, 5)), jnp.float32)
    loss = lambda x, w, sizes: jnp.sum(jax.lax.ragged_dot(x, w, sizes) * ct)  # noqa: E731
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, sizes)
    env = dict(zip(closed.jaxpr.invars, (x, w, sizes), strict=True))
    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]  # noqa: E731
    forms = set()
    for eqn in closed.jaxpr.eqns:  # the gradient's program, each grouped GEMM checked
        args = [read(v) for v in eqn.invars]
        out = eqn.primitive.bind(*args, **eqn.params)
        if eqn.primitive.name == "ragged_dot_general":
            dn = eqn.params["ragged_dot_dimension_numbers"]
            forms.add((tuple(dn.lhs_ragged_dimensions), tuple(dn.rhs_group_dimensions)))
            got = memory_sim.grouped_loop(*args, **eqn.params)
            np.testing.assert_allclose(got, out, rtol=1e-5, atol=1e-5)
        outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs, strict=True))
    assert len(forms) == 2, forms  # ragged rows (forward, dx) and ragged contraction (dw)


O3_STATE = """
import json, math, sys
import jax
from benchmarks import runner
from fp8jax.optim.master import is_matmul_weight, is_scaled

def state_bytes(level, mesh):
    s = runner.build(runner.load(f"tiny:{level}", settings=runner.step_settings(mesh=mesh)))
    out = {}
    for part in ("params", "opt_state", "fp8"):
        leaves = jax.tree.leaves(getattr(s.abstract, part))
        shardings = jax.tree.leaves(getattr(s.state_shardings, part))
        out[part] = sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
                        for x, sh in zip(leaves, shardings, strict=True))
    flat = jax.tree_util.tree_flatten_with_path(s.abstract.params, is_leaf=is_scaled)[0]
    out["matmul_params"] = sum(math.prod(x.shape) for p, x in flat if is_matmul_weight(p, x))
    return out

print(json.dumps({"O2": state_bytes("O2", "4,1,1"), "O3": state_bytes("O3", "1,4,1")}))
"""


def test_o3_shards_the_o2_state_over_fsdp():
    """tiny on 4 simulated devices: O3's train state per device is O2's over 4 (+ scalars)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run(
        [sys.executable, "-c", O3_STATE], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-800:]
    r = json.loads(proc.stdout.splitlines()[-1])
    o2, o3 = (sum(r[lv][k] for k in ("params", "opt_state", "fp8")) for lv in ("O2", "O3"))
    assert r["O2"]["opt_state"] > r["O2"]["params"] > 0
    assert r["O3"]["matmul_params"] == r["O2"]["matmul_params"] > 0
    # Replicated per-tensor scales, norms and biases are all that O3 does not divide by 4.
    assert o2 / 4 <= o3 <= 1.05 * o2 / 4, r


def test_build_gives_the_setup_fields_and_a_plain_step():
    c = runner.load("tiny:O1", settings=runner.step_settings(quick=True))
    s, plain = runner.build(c), runner.build(c, plain=True)
    for name in ("mesh", "model", "tx", "init", "abstract", "state_shardings", "batch_sharding"):
        assert getattr(s, name) is not None and getattr(plain, name) is not None
    assert s.mesh.size == 1 and s.train_step is not plain.train_step
    assert s.eval_step is not None and s.stats_step is not None


# The shape of XLA's *-live-range.txt (jaxlib 0.10.2, CPU), trimmed.
LIVE_RANGE = """HloLiveRange (max 12):
  Live ranges at 9 (peak):
    multiply_add_fusion.14{}: 360710144 bytes (cumulative: 360710144 bytes)
    copy.3{}: 1024 bytes (cumulative: 360711168 bytes)
    divide_fusion{}: 180355072 bytes (cumulative: 541066240 bytes)
  Stack trace breakdown for peak usage: 10 165 479 754 bytes
    main.350 (100.0%, total: 10 165 479 754 bytes, current: 0 bytes, remaining: 1 bytes)
      ├── jit(train_step)/add (33.2%, total: 3 372 220 424 bytes, current: 3 bytes)
      ├── state (9.0%, total: 910 245 892 bytes, current: 0 bytes, remaining: 1 bytes)
      │   ├── params (9.0%, total: 910 245 888 bytes, current: 0 bytes, remaining: 1 bytes)
      └── jit(train_step)/div (17.9%, total: 1 820 491 780 bytes, current: 1 bytes)
  Other section
"""


def test_parse_live_range():
    out = common.parse_live_range(LIVE_RANGE, top=2)
    assert out["peak_bytes"] == 10165479754
    assert [b["buffer"] for b in out["peak_buffers"]] == ["multiply_add_fusion.14", "divide_fusion"]
    # First-level entries only (params is inside state), largest first.
    assert [(b["op"], b["bytes"]) for b in out["breakdown"]] == [
        ("jit(train_step)/add", 3372220424),
        ("jit(train_step)/div", 1820491780),
    ]


def test_parse_live_range_sums_an_op_over_layers():
    text = LIVE_RANGE.replace("jit(train_step)/add", "jit(train_step)/block_0/mul").replace(
        "jit(train_step)/div", "jit(train_step)/block_12/mul"
    )
    out = common.parse_live_range(text, top=5)
    assert out["by_op_over_layers"][0] == {
        "op": "jit(train_step)/block_*/mul",
        "bytes": 3372220424 + 1820491780,
    }
    assert [b["op"] for b in out["by_op_over_layers"]][1:] == ["state"]


def test_step_child_times_and_profiles_one_run(tmp_path):
    """One quick run of benchmarks.step's child: timings, loss, kernel summary, HLO file."""
    rec = step.child("tiny:O1", quick=True, steps=1, profile=1, hlo_dir=str(tmp_path))
    with gzip.open(tmp_path / "hlo_tiny_O1.txt.gz", "rt") as f:
        assert "HloModule" in f.read()
    assert rec["step_ms"] > 0 and rec["tokens_per_s"] > 0 and rec["devices"] == 1
    assert 0 < rec["host_ms_per_step"] <= rec["step_ms"]  # the enqueue is part of the step
    # The host's dispatch time is part of each pipelined timing (three loops, one wait each).
    pipelined = [rec["step_ms_pipelined"], rec["dispatch_ms_pipelined"]]
    for ms, dispatch in (pipelined, rec["pipelined_metrics_dropped"], rec["pipelined_two_batches"]):
        assert 0 < dispatch <= ms
    assert rec["power"] is None  # no nvidia-smi on a CPU machine: no power figures, no error
    assert 0 < rec["setup_s"] + rec["init_s"] <= rec["build_s"]
    assert math.isfinite(rec["loss"]) and 0 < rec["loss"] < 10
    assert 0 < rec["state_gib"] * 2**30 < 2**24 and rec["init_peak_gib"] >= 0  # tiny: < 16 MiB
    ops, small = rec["hlo_ops_and_small"]
    assert 0 < small < ops  # tiny's O1 step has both scale-state scalars and real tensors
    prof = rec["profile"]
    assert prof["kernel_ms_per_step"] > 0 and 0 < len(prof["top"]) <= 10
    assert sum(prof["categories"].values()) == pytest.approx(prof["kernel_ms_per_step"])


def test_cast_transpose_sweep_checks_each_tuning_against_xla():
    import jax.numpy as jnp
    import numpy as np

    from fp8jax.ops import kernels

    x = jnp.asarray(np.random.default_rng(0).standard_normal((128, 64)) * 300, jnp.bfloat16)
    scale = jnp.float32(2.0)  # some values saturate at E4M3's 448
    ref = kernels.cast_transpose(x, scale, "e4m3", "xla")
    rows = cast_transpose.sweep(x, scale, "e4m3", ref, moved=4 * x.size, iters=1, interpret=True)
    fits = [t for t in cast_transpose.TUNINGS if 128 % t[0] == 0 and 64 % t[1] == 0]
    keys = ("bm", "bk", "warps", "stages", "cast_first")
    assert [tuple(r[k] for k in keys) for r in rows] == fits
    assert all(r["same_bits"] and r["us"] > 0 and "error" not in r for r in rows), rows


def test_act_kernels_checks_each_tuning_and_the_rebuilt_input():
    """benchmarks.act_kernels on small shapes through the interpreter: every tuning's bits
    equal the first tuning's, and the GELU' pass's rebuilt wo input equals the forward's."""
    from benchmarks import act_kernels

    rows = act_kernels.measure((128, 128), 1, True, act_kernels.TUNINGS[:2])
    assert [r["kernel"] for r in rows] == ["fwd"] * 2 + ["grad"] * 2 + ["grad+act"] * 2
    assert all(r["same_bits"] and r["us"] > 0 and "error" not in r for r in rows), rows
    assert all(r["same_as_fwd"] for r in rows if r["kernel"] == "grad+act")


def test_qkv_cast_checks_the_parts_against_the_concatenation():
    """benchmarks.qkv_cast on small shapes through the interpreter: the parts cast in place
    give the concatenation's cast bit for bit, and its column sums."""
    from benchmarks import qkv_cast

    rows = qkv_cast.measure(64, (2, 2, 32), 1, True)
    assert [r["cast"] for r in rows] == ["parts in place", "concatenate + cast"]
    assert all(r["same_bits"] and r["us"] > 0 and r["sums_rel"] < 1e-6 for r in rows), rows


def test_cast_transpose_loop_times_xla_amax_inside_the_loop():
    """XLA's amax depends on x alone: without vary_input, XLA hoists it out of the timed loop."""
    import re

    import jax
    import jax.numpy as jnp

    from fp8jax.diagnostics import hlo as hlo_lib
    from fp8jax.ops import kernels

    x, scale = jnp.ones((64, 32), jnp.bfloat16), jnp.float32(8.0)
    cast = lambda x, s: kernels.cast_transpose(x, s, "e4m3", "xla")  # noqa: E731

    def reduces_in_body(vary):
        loop = common.in_loop(cast, 3, vary_input=vary)
        hlo = loop.lower(x, scale).compile().as_text()
        body = re.search(r"while\(.*?body=%([\w.]+)", hlo).group(1)
        text = "\n".join(hlo_lib.computations(hlo)[0][body])
        out = jax.device_get(loop(x, scale))
        assert all((a == b).all() for a, b in zip(out, jax.device_get(cast(x, scale)), strict=True))
        return "reduce" in text

    assert not reduces_in_body(False)  # the hoisting the flag exists for
    assert reduces_in_body(True)


def test_cast_transpose_rowwise_checks_the_kernels_and_their_tunings():
    """--rowwise on a CPU: the kernels through Pallas' interpreter, each tuning that fits."""
    import jax.numpy as jnp

    row = cast_transpose.measure_rows("x", (32, 128), jnp.bfloat16, "e4m3", 1, True, False)
    assert row["same_bits"] and row["xla_us"] > 0 and row["kernel_us"] > 0, row
    fits = [t for t in cast_transpose.ROW_TUNINGS if 32 % t[0] == 0 and 128 % t[1] == 0]
    assert len(row["sweep"]) == len(fits) >= 1
    assert all(t["same_bits"] and t["amax_us"] > 0 and t["cast_us"] > 0 for t in row["sweep"])
    assert "x" in cast_transpose.runner.table([row], cast_transpose.ROW_COLUMNS, "tensor")


def test_block_gemm_measures_a_layout_and_checks_the_kernel():
    """One GEMM's row (Pallas' interpreter on CPU) and the kernel-vs-reference check."""
    args = argparse.Namespace(reps=1, min_rep_s=0.0, max_iters=1)  # one call per timing
    rec = block_gemm.measure("wgrad", (32, 160, 48), block_gemm.QUICK_SWEEP[:1], args, True)
    assert rec["dims"] == [160, 48, 32] and rec["best"]["bm"] == 64 and rec["triton_calls"] == 0
    assert rec["block_tflops"] > 0 and rec["bf16_tflops"] > 0 and rec["f8_gemms"] == 0
    (res,) = block_gemm.check((16, 256, 32), True, block_gemm.CHECK_CASES[2:])  # E5M2 x E4M3
    assert (res["layout"], res["b"], res["max_rel_diff"]) == ("dgrad", "float8_e5m2", 0.0), res
    assert 0 < res["kernel_vs_f64"] < 1e-6, res


def test_grouped_gemm_times_each_variant_of_the_expert_pair():
    """The tiny shape's rows: O0 and an FP8 recipe timed, FLOPs of the pair's fwd + bwd, dx
    against O0's; the routed rows per expert sum to tokens * k."""
    args = argparse.Namespace(
        tokens=8, routing="random", reps=1, min_rep_s=0.0, max_iters=1, rows="dispatched"
    )
    (d, e, k, f) = grouped_gemm.QUICK_SHAPES["tiny"]
    assert grouped_gemm.group_sizes(8, e, k, "random").sum() == 8 * k
    assert list(grouped_gemm.group_sizes(5, 4, 2, "balanced")) == [3, 3, 2, 2]
    rows = grouped_gemm.measure("tiny", (d, e, k, f), ["bf16", "delayed"], args)
    bf16, fp8 = rows
    assert "error" not in bf16 and "error" not in fp8, rows
    assert bf16["M"] == 8 * k and bf16["over_bf16"] == 1.0 and fp8["tflops"] > 0
    assert bf16["tflops"] == pytest.approx(18 * bf16["M"] * d * f / (bf16["ms"] / 1e3) / 1e12)
    assert 0.001 < fp8["dx_rel_err"] < 0.1  # E4M3 / E5M2 rounding, not a different product
    assert "variant" in runner.table(rows, grouped_gemm.COLUMNS, "variant")
    assert fp8["padded_rows"] is None  # not whole 128 tiles: the sorted rows


def test_grouped_gemm_hands_whole_tiles_their_dispatched_layout():
    """At whole 128 tiles the per-tensor and block recipes take the rows in their padded layout
    (as the MoE dispatch writes them) and give the sorted rows' dx and dw up to FP8 rounding;
    with ``--rows sorted`` none does."""
    shape = (128, 2, 1, 128)
    for mode in grouped_gemm.ROWS:
        args = argparse.Namespace(
            tokens=8, routing="random", reps=1, min_rep_s=0.0, max_iters=1, rows=mode
        )
        rows = grouped_gemm.measure("whole", shape, ["bf16", "delayed", "block"], args)
        assert all("error" not in r for r in rows), rows
        padded = [r["padded_rows"] for r in rows]
        whole = -(-(8 + 2 * 127) // 128) * 128  # 8 rows, 2 groups: up to 127 padding rows each
        assert padded == ([None, whole, whole] if mode == "dispatched" else [None] * 3)
        for r in rows[1:]:
            assert 0.001 < r["dx_rel_err"] < 0.1 and 0.001 < r["dw_rel_err"] < 0.1, r


def test_power_samples_parse_and_summarize():
    text = "690.12, 1545\n[N/A], 1980\n680.00, 1605\n"  # one unreadable sample is skipped
    assert common.parse_power(text) == [(690.12, 1545.0), (680.0, 1605.0)]
    power = common.GpuPower()
    power.samples = common.parse_power(text)
    s = power.summary(200.0)
    assert s["watts"] == pytest.approx(685.06) and s["sm_mhz"] == pytest.approx(1575.0)
    assert s["joules_per_step"] == pytest.approx(685.06 * 0.2) and s["samples"] == 2
    power.samples = []
    assert power.summary(200.0) is None


DOWNSTREAM_LIMIT = 4  # documents per lm-eval task in the tiny finetune run's downstream table


def test_finetune_tiny_scores_each_stage(tmp_path):
    """Pre-train, SFT at O1 from it, DPO at O1 from that: one JSON per stage with its exact
    match on the held-out passages (a share), chance beside it, and the level each work dir
    decoded at; the DPO stage's held-out pair statistics before and after; the downstream table
    of the pre-trained and SFT work dirs (``check_downstream``)."""
    args = [
        "--size",
        "tiny",
        "--levels",
        "O1",
        "--pretrain-steps",
        "3",
        "--sft-steps",
        "3",
        "--dpo-steps",
        "3",
        "--downstream-limit",
        str(DOWNSTREAM_LIMIT),
    ]
    proc = _module("finetune", *args, "--set", "compilation_cache_dir=", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-800:]
    rows = {
        stem: json.loads((tmp_path / f"finetune_{stem}.json").read_text())
        for stem in ("pretrain", "sft_O1", "dpo_O1")
    }
    for stem, row in rows.items():
        assert 0 <= row["exact_match"] <= 1 and 0 <= row["valid_title"] <= 1, (stem, row)
        assert row["chance"] == pytest.approx(1 / 6) and row["num_test"] == 48
        assert math.isfinite(row["val_loss"]) and row["train_tokens_per_s"] > 0, (stem, row)
        assert len(row["examples"]) == 6 and all(e["expected"] for e in row["examples"])
    # O1 fine-tuning leaves trained FP8 scales, which decoding uses; O0 pre-training has none.
    assert [rows[s]["decode_level"] for s in rows] == ["O0", "O1", "O1"]
    assert [rows[s]["level"] for s in rows] == ["O0", "O1", "O1"]
    train = (tmp_path / "finetune_work" / "data" / "train.jsonl").read_text().splitlines()
    assert len(train) == 192 and "sft O1" in proc.stdout and "dpo O1" in proc.stdout
    pairs = (tmp_path / "finetune_work" / "data" / "dpo_train.jsonl").read_text().splitlines()
    assert [json.loads(p)["prompt"] for p in pairs] == [json.loads(r)["prompt"] for r in train]
    dpo = rows["dpo_O1"]
    assert 0 <= dpo["train_reward_accuracy"] <= 1 and math.isfinite(dpo["train_reward_margin"])
    held = dpo["held_out"]
    assert 0 < held["num_pairs"] <= 48 and held["num_pairs"] + held["dropped_pairs"] == 48
    before, after = held["before"], held["after"]
    # At the start the policy is the reference: every implicit reward is exactly 0.
    assert before["reward_accuracy"] == 0 and before["reward_margin"] == 0, before
    assert before["loss"] == pytest.approx(math.log(2)), before
    for stats in (before, after):
        assert set(stats) == {
            "loss",
            "reward_accuracy",
            "reward_margin",
            "chosen_logp",
            "rejected_logp",
            "preference_accuracy",
        }, stats
        assert 0 <= stats["reward_accuracy"] <= 1 and 0 <= stats["preference_accuracy"] <= 1
        assert stats["chosen_logp"] < 0 and stats["rejected_logp"] < 0, stats
    # The end is the trained policy, not the start (three steps moved its log-probs).
    assert after["chosen_logp"] != before["chosen_logp"], (before, after)
    check_downstream(tmp_path, rows, proc.stdout)


def check_downstream(out: pathlib.Path, rows: dict, stdout: str) -> None:
    """The finetune run's downstream table: the pre-trained and SFT stages scored on both local
    lm-eval tasks (scores in [0, 1]) at the level their exact match decoded at, chance from each
    task's documents, and the SFT stage's multiple-choice scores those of lm-eval run here on
    its work dir through the ``fp8jax`` backend at O1; without lm-eval, one line naming it."""
    from benchmarks import finetune

    if importlib.util.find_spec("lm_eval") is None:
        assert "pip install 'fp8jax[lm-eval]'" in stdout, stdout[-800:]
        assert not any("downstream" in r for r in rows.values())
        return
    import lm_eval

    from fp8jax import lm_eval as backend
    from fp8jax.trainer import tasks

    words = finetune.SIZES["tiny"].passage_words  # the fine-tuning's passages' length
    manager = finetune.task_manager(words)
    defs = manager.load(list(finetune.DOWNSTREAM_TASKS))["tasks"]
    assert "downstream" not in rows["dpo_O1"]
    for stem in ("pretrain", "sft_O1"):
        down = rows[stem]["downstream"]
        assert down["level"] == rows[stem]["decode_level"] and down["limit"] == DOWNSTREAM_LIMIT
        assert down["passage_words"] == words
        assert sorted(down["tasks"]) == sorted(finetune.DOWNSTREAM_TASKS), down
        for name, t in down["tasks"].items():
            assert t["num_docs"] == DOWNSTREAM_LIMIT and t["metrics"], (stem, name, t)
            assert all(0 <= v <= 1 for v in t["metrics"].values()), (stem, name, t)
            for metric in t["metrics"]:  # a line of the printed table per metric
                shown = metric.split(",")[0]
                assert any(
                    name in ln and shown in ln and stem.split("_")[0] in ln
                    for ln in stdout.splitlines()
                ), (metric, stdout[-1500:])
            docs = list(defs[name].eval_docs)
            # The scored passages are as long as the trained ones (prompt: passage, "Novel:").
            assert {len(d["prompt"].split()) for d in docs} == {words + 1}, name
            if name == "fp8jax_novel_choice":  # a uniform guess among each document's choices
                chance = np.mean([1 / len(d["choices"]) for d in docs[:DOWNSTREAM_LIMIT]])
                assert set(t["metrics"]) == {"acc,none"}
            else:  # a uniform guess among the task's titles
                chance = 1 / len({d["title"] for d in docs})
                assert set(t["metrics"]) == {"exact_match,strip"}
            assert chance == pytest.approx(1 / len(tasks.novel_titles()))
            assert t["chance"] == pytest.approx(chance), (stem, name, t)
    choice = "fp8jax_novel_choice"
    sft_dir = out / "finetune_work" / "sft_O1"
    direct = lm_eval.simple_evaluate(
        model=backend.FP8JaxLM(ckpt=str(sft_dir), level="O1", dtype="float32"),
        tasks=[choice],
        task_manager=manager,
        limit=DOWNSTREAM_LIMIT,
        log_samples=True,
    )
    got = rows["sft_O1"]["downstream"]["tasks"][choice]
    assert got["metrics"]["acc,none"] == direct["results"][choice]["acc,none"]
    samples = sorted(direct["samples"][choice], key=lambda s: s["doc_id"])
    want = [[r[0] for r in s["filtered_resps"]] for s in samples]
    assert len(got["examples"]) == DOWNSTREAM_LIMIT
    np.testing.assert_allclose([e["loglikelihoods"] for e in got["examples"]], want, rtol=1e-6)
    assert [e["expected"] for e in got["examples"]] == [s["doc"]["title"] for s in samples]


def test_finetune_negative_downstream_limit_stops_at_once(tmp_path):
    from benchmarks import finetune

    with pytest.raises(SystemExit, match=r"^error: --downstream-limit -1: use 0"):
        finetune.main(["--size", "tiny", "--downstream-limit", "-1", "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_finetune_without_lm_eval_says_how_to_install(monkeypatch):
    """Without lm-eval the benchmark's downstream check is one line naming the extra."""
    from benchmarks import finetune
    from fp8jax import lm_eval as backend

    for name in ("lm_eval", "lm_eval.api", "lm_eval.api.model"):
        monkeypatch.setitem(sys.modules, name, None)
    backend.model_class.cache_clear()
    try:
        line = finetune.downstream_unavailable()
    finally:
        monkeypatch.undo()
        backend.model_class.cache_clear()
    assert line is not None and "\n" not in line and backend.INSTALL_FIX in line, line
    if importlib.util.find_spec("lm_eval") is not None:
        assert finetune.downstream_unavailable() is None


def test_novel_split_keeps_test_passages_apart_and_scores_exactly():
    from fp8jax.trainer import tasks

    train, test = tasks.novel_split(300, 12, passage_words=10, seed=3)
    titles = tasks.novel_titles()
    assert len(titles) == 6 and len(train) == 300 and len(test) == 12
    for part in (train, test):  # the same number of passages from each novel
        counts = {t: sum(tasks.title_in(r) == t for r in part) for t in titles}
        assert set(counts.values()) == {len(part) // 6}, counts
    # Test passages lie in the last tenth of their novel's words, training ones before it.
    for f in tasks.novel_files():
        words = gzip.open(f, "rt", encoding="utf-8").read().split()
        cut = int(len(words) * 0.9)
        head, tail = " ".join(words[:cut]), " ".join(words[cut:])
        title = tasks.title_of(f)
        for part, inside, outside in ((test, tail, head), (train, head, tail)):
            passages = [
                r["prompt"].removesuffix(tasks.PROMPT_SUFFIX)
                for r in part
                if tasks.title_in(r) == title
            ]
            assert passages and all(p in inside and p not in outside for p in passages)
    pairs = tasks.preference_pairs(test, seed=1)
    assert all(
        p["chosen"] == r["completion"] and p["rejected"] != p["chosen"]
        for p, r in zip(pairs, test, strict=True)
    )
    assert all(p["rejected"].strip() in titles for p in pairs)
    assert tasks.exact_match([" Emma", "Persuasion\n", "Emma "], ["Emma", "Persuasion", "Emm"]) == (
        pytest.approx(2 / 3)
    )
    with pytest.raises(ValueError, match="2 predictions for 1"):
        tasks.exact_match(["a", "b"], ["a"])


def test_finetune_step_tiny_times_an_imported_checkpoint(tmp_path):
    """CPU: a random llama-shaped HF checkpoint written, imported with init_from, its SFT step
    timed on packed novel-task rows; a run of an unknown config stops before any child."""
    ckpt = tmp_path / "ckpt"
    runs = "sft_llama_1b:O1,dpo_llama_1b:O2"
    args = ["--tiny", "--runs", runs, "--steps", "1", "--ckpt-dir", str(ckpt)]
    proc = _module("finetune_step", *args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-800:]
    for run in runs.split(","):
        stem = run.replace(":", "_")
        row = json.loads((tmp_path / "out" / f"finetune_step_{stem}.json").read_text())
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_pipelined"] > 0
        assert 0 < row["dispatch_ms_pipelined"] <= row["step_ms_pipelined"]
        assert (row["batch"], row["seq"], row["level"]) == (4, 128, run[-2:])
        assert 0 < row["row_fill"] <= 1 and row["compiled_gib"]["temp"] > 0
        assert math.isfinite(row["loss"]) and row["loss"] > 0
    # The DPO step: its loss and pair statistics (a batch of 2 pairs).
    assert 0 <= row["reward_accuracy"] <= 1 and math.isfinite(row["reward_margin"]), row
    from fp8jax import hf

    arch = hf.architecture(ckpt / "llama_1b")  # the shape of configs/llama_1b.py, shrunk
    assert (arch["style"], arch["num_layers"], arch["max_len"]) == ("llama", 2, 128)
    bad = _module("finetune_step", "--tiny", "--runs", "llama_1b:O1", "--out", str(tmp_path / "b"))
    assert bad.returncode != 0 and "the config is one of" in bad.stderr, bad.stderr[-800:]
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


@pytest.mark.parametrize("normalize", [True, False])
def test_torch_reference_moe_layer_equals_fp8jax(normalize):
    """The PyTorch MoE layer with fp8jax's MoeMlp weights: the same output (within its bf16
    expert GEMMs) and the same auxiliary loss."""
    torch = pytest.importorskip("torch")
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    from benchmarks import torch_reference
    from fp8jax import spec
    from fp8jax.models import moe

    c = train_lib.load_config("moe_tiny")
    c.fp8.level = "O0"  # f32 matmuls: what differs is the reference's bf16 expert GEMMs
    c.model.update(d_model=32, num_heads=2, num_kv_heads=2)
    c.model.moe.update(num_experts=4, top_k=2, d_ff=16, normalize_top_k=normalize)
    c.model.moe.update(aux_loss_coef=0.5, z_loss_coef=0.1)
    cfg = spec.parse(c).model
    x = jax.random.normal(jax.random.key(1), (2, 8, 32), jnp.float32)
    variables = nn.unbox(moe.MoeMlp(cfg).init(jax.random.key(0), x))
    y, sown = moe.MoeMlp(cfg).apply(variables, x, mutable=[moe.MOE_LOSSES])
    p = jax.tree.map(np.asarray, variables["params"])
    layer = torch_reference.Moe(
        dict(
            d_model=32,
            experts=4,
            top_k=2,
            d_ff=16,
            normalize_top_k=normalize,
            aux_loss=0.5,
            z_loss=0.1,
        ),
        out_std=0.02,
    )
    with torch.no_grad():
        layer.router.copy_(torch.tensor(p["router"]["kernel"]))
        layer.wi.copy_(torch.tensor(p["experts_wi"]["kernel"].reshape(4, 32, 32)))  # gate, up
        layer.wo.copy_(torch.tensor(p["experts_wo"]["kernel"]))
        got, aux = layer(torch.tensor(np.asarray(x)))
    want = np.asarray(y)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-2 * np.abs(want).max())
    np.testing.assert_allclose(float(aux), float(sown[moe.MOE_LOSSES]["aux_loss"][0]), rtol=1e-5)


def test_torch_reference_pads_each_group_for_the_fp8_grouped_gemm():
    """The padded layout that torchao's FP8 grouped GEMM reads: each group starts at a multiple
    of the alignment, rows keep their order, and the grouped GEMM on it (the per-group matmuls
    on a CPU) gives each row the product it gets unpadded, empty groups included."""
    torch = pytest.importorskip("torch")
    from benchmarks import torch_reference

    counts = torch.tensor([5, 0, 16, 1, 17])
    rows, align = int(counts.sum()), 16
    dest, ends = torch_reference.padded_group_rows(counts, rows, align)
    assert ends.dtype == torch.int32 and ends.tolist() == [16, 16, 32, 48, 80]
    starts = (ends - (counts + align - 1) // align * align).tolist()
    firsts = torch.cumsum(counts, 0) - counts
    for g, n in enumerate(counts.tolist()):  # group g's rows in order from its padded start
        assert dest[firsts[g] : firsts[g] + n].tolist() == list(range(starts[g], starts[g] + n))
    x = torch.randn(rows, 8, dtype=torch.float64)
    w = torch.randn(len(counts), 8, 3, dtype=torch.float64)
    xp = x.new_zeros(rows + len(counts) * (align - 1), 8).index_copy(0, dest, x)
    padded_counts = torch.diff(ends.long(), prepend=torch.zeros(1, dtype=torch.long))
    pad = xp.shape[0] - int(ends[-1])  # rows past the last group: a group of their own, unread
    y = torch_reference.grouped_mm(
        xp, torch.cat([w, w[:1]]), torch.cat([padded_counts, torch.tensor([pad])])
    )
    torch.testing.assert_close(y[dest], torch_reference.grouped_mm(x, w, counts))


def test_decode_attention_times_the_kernel_at_each_split_against_xla():
    """benchmarks.decode_attention on small shapes through the interpreter: a row per batch
    and fill, each split count's result within the kernel's bf16 roundings of XLA's (per split
    its partial output, its correction and its share of the sum, then the normalization: unit
    roundoff 2**-8 of the largest |v| each)."""
    from benchmarks import decode_attention as bench

    rows = bench.measure([2], [5, 40], [4, 2], 1, True, heads=2, head_dim=16, slots=64)
    assert [(r["batch"], r["slots_filled"]) for r in rows] == [(2, 6), (2, 41)]
    for r in rows:
        assert r["xla_us"] > 0 and r["s4_us"] > 0 and r["s2_us"] > 0, r
        for splits in (4, 2):
            assert r[f"s{splits}_err"] <= (2 * splits + 2) * 2.0**-8 * r["v_max"], r


def test_decode_times_prefill_and_decode_against_the_weight_bound():
    """The decode benchmark on a tiny O1 model: every row runs all its tokens (no EOS), the
    share of the bound is the bf16 weights' read time over a step's, the FP8 matmuls' E4M3
    copies (one per matmul) lower the bound, and ``--profile`` traces a decode call per batch."""
    import jax

    from fp8jax import spec
    from fp8jax.ops import scaling
    from fp8jax.trainer import inference

    r = decode.measure(
        "tiny:O1", True, [1, 3], prompt=8, new=8, bandwidth=1e9, reps=1, profile=True
    )
    model_cfg = spec.parse(decode.config_for("tiny:O1", True)).model
    is_meta = lambda m: isinstance(m, scaling.Fp8Meta)  # noqa: E731
    matmuls = len(jax.tree.leaves(inference.fresh_fp8_state(model_cfg), is_leaf=is_meta))
    assert [b["batch"] for b in r["batches"]] == [1, 3]
    for b in r["batches"]:
        assert b["steps"] == 8 and b["ttft_ms"] > 0 and b["step_ms"] > 0
        assert b["decode_tokens_per_s"] == pytest.approx(b["batch"] / b["step_ms"] * 1e3)
        assert b["bound_ms"] == pytest.approx(2 * r["params"] / 1e9 * 1e3)
        assert b["bound_share"] == pytest.approx(b["bound_ms"] / b["step_ms"])
        assert b["fp8_weights"] == matmuls > 0
        assert b["fp8_bound_ms"] < b["bound_ms"]
        # --profile: one traced decode call, its kernel time per token by category.
        t = b["profile"]
        assert t["kernel_ms_per_step"] > 0 and t["top"]
        assert sum(t["categories"].values()) == pytest.approx(t["kernel_ms_per_step"])
    assert "TTFT ms" in decode.table([r])
    lines = decode.profile_lines([r])
    assert "tiny:O1 batch 1: " in lines and "tiny:O1 batch 3: " in lines


def test_data_quick_counts_the_prepared_ids_and_reuses_the_shared_cache(tmp_path):
    """``benchmarks.data --quick`` on a folder corpus: the prepare row's ids are those the
    trainer's encoder gives the corpus, and its shards hold them (a header each); the first
    text run encodes the corpus (its log says so) into the shared cache, the same ids; the
    second, in a new work dir, encodes nothing and reuses that cache; the run on the shards
    reaches a step; every row has its memory peak and CPU time, and the table prints."""
    from fp8jax import tokenizer
    from fp8jax.trainer import encode, token_shards

    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--quick", "--formats", "folder", "--workers", "2", "--work-dir", str(work)]
    proc = _module("data", *args, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-800:]
    record = json.loads((out / "data.json").read_text())
    rows = {(r["stage"], r["format"]): r for r in record["rows"]}
    assert list(rows) == [
        ("prepare", "folder"),
        ("train", "text"),
        ("train", "text_cached"),
        ("train", "tokens"),
    ]
    files = sorted(pathlib.Path(record["corpus"]["paths"]["folder"]).iterdir())
    tok = tokenizer.load(record["tokenizer"])
    want = sum(len(ids) for ids, _ in encode.encode(files, tok, "uint16", 1))
    prep = rows["prepare", "folder"]
    itemsize = np.dtype(prep["dtype"]).itemsize
    assert prep["tokens"] == want and prep["workers"] == 2
    assert prep["shard_bytes"] == want * itemsize + token_shards.HEADER_BYTES * prep["shards"]
    first, again, shards = (rows["train", k] for k in ("text", "text_cached", "tokens"))
    mb = record["corpus"]["bytes"]["folder"] / 1e6
    # The encoder's log line gives MB to one decimal: within half of 0.1 MB of the bytes.
    assert first["encoded_mb"] == pytest.approx(mb, abs=0.05) and not first["reused_cache"]
    assert first["cache_tokens"] == want
    assert again["encoded_mb"] == 0 and again["reused_cache"], again
    assert again["cache_train_tokens"] == first["cache_train_tokens"]
    assert shards["encoded_mb"] == 0 and not shards["reused_cache"]
    for r in record["rows"]:
        assert r["rc"] == 0 and r["peak_pss_mb"] > 0 and r["cpu_s"] > 0, r
    for r in (first, again, shards):
        assert 0 < r["data_s"] < r["first_step_s"] <= r["wall_s"], r
    table = proc.stdout[proc.stdout.rindex("run ") :]
    assert all(f"{s} {f}" in table for s, f in rows), table
