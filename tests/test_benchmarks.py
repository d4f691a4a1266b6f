"""Pure helpers of benchmarks/: kernel categories, trace summaries, run strings, notebook cells."""

import gzip
import json
import math
import os
import pathlib
import sys

import pytest

from fp8jax.trainer import loop as train_lib

# The benchmarks are scripts, not a package: import them as kernel_profile.py imports step.py.
BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import cast_transpose  # noqa: E402
import kernel_profile  # noqa: E402
import memory_peak  # noqa: E402
import notebooks  # noqa: E402
import parity  # noqa: E402
import prologue  # noqa: E402
import step as step_bench  # noqa: E402

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
    assert kernel_profile.category(name) == expected


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
    s = kernel_profile.summarize_trace(str(tmp_path), steps=2, top=3)
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
    s = kernel_profile.summarize_trace(str(tmp_path / "cpu"), steps=1, top=5)
    assert s["timeline"] == "cpu threads"
    assert s["kernel_ms_per_step"] == pytest.approx(0.3)
    assert [(k["name"], k["calls_per_step"]) for k in s["top"]] == [("loop_add_fusion", 1.0)]
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        kernel_profile.summarize_trace(str(tmp_path / "empty"), steps=1, top=5)


def test_parse_run():
    assert step_bench.parse_run("gpt_1b3:O1") == ("gpt_1b3", "O1", [])
    assert step_bench.parse_run("gpt_1b3:O1:model.scan_layers=False+plain") == (
        "gpt_1b3",
        "O1",
        ["model.scan_layers=False", "plain"],
    )
    # A value may hold ':' (a path); it stays whole.
    assert step_bench.parse_run("tiny:O0:data.path=/a:b")[2] == ["data.path=/a:b"]


def test_apply_overrides():
    c = train_lib.load_config("tiny")
    assert (c.model.scan_layers, c.seq_len, c.model.dtype) == (True, 64, "float32")
    opts = ["model.scan_layers=False", "plain", "seq_len=32", "model.dtype=bfloat16"]
    step_bench.apply_overrides(c, opts)  # 'plain' is a flag, not an override: skipped
    # Literals are parsed (a bool, not the string 'False'); a bare word stays a string.
    assert c.model.scan_layers is False
    assert c.seq_len == 32 and isinstance(c.seq_len, int)
    assert c.model.dtype == "bfloat16"
    with pytest.raises(KeyError, match="model.foo"):
        step_bench.apply_overrides(c, ["model.foo=1"])
    assert "foo" not in c.model  # a typo must not add a field
    with pytest.raises(KeyError, match="unknown config field 'modl.dtype'"):
        step_bench.apply_overrides(c, ["modl.dtype=float32"])  # a misspelled parent too


def test_parity_levels_carry_config_overrides():
    """``--levels O0,O1:model.fp8_lm_head=True``: each level its own config and work dir."""
    c = parity.level_config("tiny", "O1:model.fp8_lm_head=True+seq_len=32", 40, 512, "-1,1,1")
    assert (c.fp8.level, c.model.fp8_lm_head, c.seq_len) == ("O1", True, 32)
    assert (c.num_train_steps, c.eval_every_steps, c.model.vocab_size) == (40, 40, 512)
    plain = parity.level_config("tiny", "O0", 40, 512, "-1,1,1")
    assert (plain.fp8.level, plain.model.fp8_lm_head) == ("O0", False)
    safe = step_bench.safe_name("tiny_O1:model.fp8_lm_head=True")
    assert safe == "tiny_O1_model-fp8_lm_head-True"
    with pytest.raises(KeyError, match="model.fp8_head"):
        parity.level_config("tiny", "O1:model.fp8_head=True", 40, 512, "-1,1,1")


def test_notebook_code_cells(tmp_path):
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": ["# Title\n"]},
            {"cell_type": "code", "source": ["!pip install fp8jax\n", "import fp8jax\n"]},
            {
                "cell_type": "code",
                "source": ["%matplotlib inline\n", "if True:\n", "    !nvidia-smi\n", "y = 7 % 3"],
            },
            {"cell_type": "markdown", "source": "text"},
            {"cell_type": "code", "source": "print(y)"},
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "01_demo.ipynb"
    path.write_text(json.dumps(nb))
    cells = notebooks.code_cells(str(path))
    # The install cell is skipped; indices count every cell; magics become `pass` at their
    # indent (the `if` block stays valid) and `%` as an operator is left alone.
    assert cells == [(2, "pass\nif True:\n    pass\ny = 7 % 3\n"), (4, "print(y)\n")]
    namespace = {}
    exec(compile(cells[0][1], "cell", "exec"), namespace)
    assert namespace["y"] == 1


def test_notebook_keys_and_numbers():
    assert notebooks.nb_key("colab/01_fp8_in_your_flax_model.ipynb") == "nb01"
    assert notebooks.nb_key("/x/scratch.ipynb") == "scratch"
    rec = {
        "notebook": "colab/01_fp8_in_your_flax_model.ipynb",
        "results": {"final_loss": {"O0": 3.21, "O1": 3.25}, "compiled_fp8_gemms": 12},
    }
    assert notebooks.key_numbers(rec) == "final loss O0 3.21, O1 3.25; compiled FP8 GEMMs 12"
    assert notebooks.key_numbers({"notebook": "colab/02_x.ipynb"}) == "(no results)"


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
    out = memory_peak.parse_live_range(LIVE_RANGE, top=2)
    assert out["peak_bytes"] == 10165479754
    assert [b["buffer"] for b in out["peak_buffers"]] == ["multiply_add_fusion.14", "divide_fusion"]
    # First-level entries only (params is inside state), largest first.
    assert [(b["op"], b["bytes"]) for b in out["breakdown"]] == [
        ("jit(train_step)/add", 3372220424),
        ("jit(train_step)/div", 1820491780),
    ]


@pytest.mark.parametrize("program", ["step", "init"])
def test_memory_peak_script_reads_xla_report(program, tmp_path):
    """End to end on CPU: the compiled tiny O2 step's (init's) peak, by JAX operation."""
    import subprocess

    cmd = [sys.executable, str(BENCH / "memory_peak.py"), "--quick", "--runs", "tiny:O2"]
    cmd += ["--program", program, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-800:]
    (row,) = json.loads((tmp_path / "memory_peak.json").read_text())
    assert "error" not in row and row["program"] == program, row
    jit_name = {"step": "train_step", "init": "init_state"}[program]
    assert any(f"jit({jit_name})" in b["op"] for b in row["breakdown"]), row["breakdown"]
    assert row["peak_bytes"] > 0 and row["breakdown"] and row["peak_buffers"]
    assert sum(b["bytes"] for b in row["breakdown"]) <= row["peak_bytes"]


def test_state_per_device_o3_shards_o2_state(tmp_path):
    """tiny on 4 simulated devices: O3's train state per device is O2's over 4 (+ scalars)."""
    import subprocess

    cmd = [sys.executable, str(BENCH / "state_per_device.py"), "--config", "tiny", "--devices", "4"]
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    proc = subprocess.run(cmd + ["--out", str(tmp_path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-800:]
    r = json.loads((tmp_path / "state_per_device.json").read_text())
    o2, o3 = r["O2"], r["O3"]
    assert o2["opt_state"] > o2["params"] > 0 and o3["matmul_params"] == o2["matmul_params"]
    # Replicated per-tensor scales, norms and biases are all that O3 does not divide by 4.
    assert o2["state"] / 4 <= o3["state"] <= 1.05 * o2["state"] / 4


def test_step_child_times_and_profiles_one_run(tmp_path):
    """One quick run of benchmarks/step.py's child: timings, loss, kernel summary, HLO file."""
    rec = step_bench.child("tiny:O1", quick=True, steps=1, profile=1, hlo_dir=str(tmp_path))
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


def test_prologue_rows_check_each_formula_against_xla_gelu():
    """Through the interpreter every formula gives the exact GELU's FP8 codes (the kernel's
    hardware tanh only exists on GPUs); rounding GELU to bf16 first, as the unfused path does,
    changes some of them."""
    import jax.numpy as jnp
    import numpy as np

    h = jnp.asarray(np.random.default_rng(0).standard_normal((32, 128)) * 2, jnp.bfloat16)
    rows = prologue.measure(h, jnp.float32(64.0), True, reps=1, iters=1, tunings=[(16, 128, 4)])
    assert [r["variant"] for r in rows] == [
        "cast only (no GELU)",
        "XLA GELU (bf16) then cast",
        *(f"kernel GELU {f}" for f in prologue.FORMULAS),
    ]
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
    assert rows[1]["differ"] > 0.01
    assert all(r["differ"] == 0 for r in rows[2:]), rows


def test_cast_transpose_loop_times_xla_amax_inside_the_loop():
    """XLA's amax depends on x alone: without vary_input, XLA hoists it out of the timed loop."""
    import re

    import jax
    import jax.numpy as jnp

    from fp8jax.ops import kernels
    from fp8jax.parallel import comm

    x, scale = jnp.ones((64, 32), jnp.bfloat16), jnp.float32(8.0)
    cast = lambda x, s: kernels.cast_transpose(x, s, "e4m3", "xla")  # noqa: E731

    def reduces_in_body(vary):
        loop = cast_transpose._in_loop(cast, 3, vary_input=vary)
        hlo = loop.lower(x, scale).compile().as_text()
        body = re.search(r"while\(.*?body=%([\w.]+)", hlo).group(1)
        text = "\n".join(comm._computations(hlo)[0][body])
        out = jax.device_get(loop(x, scale))
        assert all((a == b).all() for a, b in zip(out, jax.device_get(cast(x, scale)), strict=True))
        return "reduce" in text

    assert not reduces_in_body(False)  # the hoisting the flag exists for
    assert reduces_in_body(True)


def test_failed_run_row_keeps_the_compile_line_with_xla_memory():
    """An out-of-memory child: its row names XLA's temp need first, then the exception."""
    script = (
        "import sys\n"
        "print('llama_7b:O1: compiled in 121.0 s; XLA temp 97.52 GiB, arguments 42.00 GiB',"
        " file=sys.stderr)\n"
        "raise MemoryError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate')\n"
    )
    row = step_bench.run_child([sys.executable, "-c", script], "MARK", "llama_7b:O1")
    assert row["error"].startswith("llama_7b:O1: compiled in 121.0 s; XLA temp 97.52 GiB"), row
    assert "MemoryError: RESOURCE_EXHAUSTED" in row["error"], row


def test_gemm_epilogue_forms_compute_the_same_linear():
    """Each way of writing the FP8 linear gives y = x.w / (sx sw) + b up to bf16 rounding."""
    import gemm_epilogue

    rows = gemm_epilogue.measure(64, 32, 48, reps=1, iters=1)
    assert [r["form"] for r in rows] == list(gemm_epilogue.FORMS)
    for r in rows:
        assert "error" not in r, r
        # One or two bf16 roundings of outputs up to max_abs_out: a few ulps at most.
        assert r["max_abs_diff_vs_direct"] <= 2**-6 * r["max_abs_out"], r
        assert r["f8_gemms"] == 0 and r["kernels"] > 0  # CPU: no cuBLASLt


def test_power_samples_parse_and_summarize():
    text = "690.12, 1545\n[N/A], 1980\n680.00, 1605\n"  # one unreadable sample is skipped
    assert step_bench.parse_power(text) == [(690.12, 1545.0), (680.0, 1605.0)]
    power = step_bench._GpuPower()
    power.samples = step_bench.parse_power(text)
    s = power.summary(200.0)
    assert s["watts"] == pytest.approx(685.06) and s["sm_mhz"] == pytest.approx(1575.0)
    assert s["joules_per_step"] == pytest.approx(685.06 * 0.2) and s["samples"] == 2
    power.samples = []
    assert power.summary(200.0) is None


def test_energy_pieces_keep_every_layer_and_kernel():
    """benchmarks/energy.py: 3 GEMMs per linear per layer, 12 casts per layer on CUDA."""
    import energy

    s = energy.QUICK
    for fp8 in (False, True):
        fn, args = energy.gemms(s, fp8)
        text = fn.trace(*args).lower().as_text()
        dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
        assert len(dots) == 3 * 4 * s["layers"]
        assert all(("f8E" in ln) == fp8 for ln in dots)
    fn, args = energy.casts(s, "pallas")
    cuda = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("__gpu$xla.gpu.triton") == 12 * s["layers"]
    row = energy.measure(*energy.casts(s, "interpret"), seconds=0.0)
    assert row["ms"] > 0 and row["power"] is None and row["f8_gemms"] == 0


def test_energy_step_with_pass_times_each_variant():
    import energy

    rec = energy.step_with_pass("tiny:O1", [1e-6, 2e-6], steps=2, quick=True)
    assert rec["step"]["ms"] > 0 and rec["step"]["power"] is None  # no nvidia-smi here
    assert [r["gb"] for r in rec["passes"]] == [1e-6, 2e-6]
    for r in rec["passes"]:
        for name in ("pass", "with_pass", "step_after"):
            assert r[name]["ms"] > 0 and r[name]["power"] is None
        assert r["with_pass"]["ms"] > r["pass"]["ms"]
        assert (
            r["cost_ms"] == r["with_pass"]["ms"] - (rec["step"]["ms"] + r["step_after"]["ms"]) / 2
        )
