"""Fine-tuning an imported checkpoint: the SFT and DPO steps' tokens/s and peak memory per level.

Per run (``sft_llama_1b:O1``, ``dpo_llama_1b:O2``: a fine-tuning or preference-tuning config
and a level, options as in ``benchmarks.step``), in a child process of its own: a random BF16
Hugging Face checkpoint of the config's architecture (``llama_1b`` / ``llama_7b``, written once
per shape with ``fp8jax.hf.save_hf`` into ``--ckpt-dir``, a temporary folder by default) is
imported as a user imports one (``init_from``, ``loop.from_checkpoint``); the step is the
trainer's (``loop.setup``). SFT batches are the config's packed rows of the novel task
(``sft_data``); DPO batches are padded (chosen, rejected) row pairs of the novel task's
preference pairs (``tasks.preference_pairs``, ``dpo_data``), and its step runs the frozen
reference's forward besides the policy's step. It reports the step time, per step and
pipelined, tokens/s (every row's tokens, padding included), MFU (dense FLOPs of full rows; DPO:
the reference's forward added), XLA's compiled memory (``diagnostics.memory``) and the
device's peak.

    PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \\
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m benchmarks.finetune_step --out "$OUT"

Batch and sequence come from ``configs/{sft,dpo}_llama_*.py`` (``--batch`` or ``--set``
override them); ``--runs dpo_llama_1b:O0,dpo_llama_1b:O2`` times the DPO steps. ``--tiny`` runs
the same path on CPU with the architecture and rows shrunk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import common, runner

# The pre-training config whose architecture each fine-tuning config's checkpoint has.
SHAPES = {
    "sft_llama_1b": "llama_1b",
    "sft_llama_7b": "llama_7b",
    "dpo_llama_1b": "llama_1b",
    "dpo_llama_7b": "llama_7b",
}
RUNS = ",".join(f"{c}:{lv}" for c in ("sft_llama_1b", "sft_llama_7b") for lv in ("O0", "O1", "O2"))
DPO_RUNS = ",".join(f"{c}:{lv}" for c in ("dpo_llama_1b", "dpo_llama_7b") for lv in ("O0", "O2"))
# --tiny: a CPU-sized architecture (written into the checkpoint) and rows.
TINY_MODEL = {k: v for k, v in runner.QUICK.items() if k.startswith("model.")}
TINY_MODEL.update({"model.max_len": 128, "model.vocab_size": 512})
TINY_RUN = {
    "seq_len": 128,
    "batch_size": 4,
    "model.dtype": "float32",
    "model.attention_impl": "xla",
}


def shape_of(run: str) -> str:
    """The architecture config of a run's checkpoint ('sft_llama_1b:O1' -> 'llama_1b')."""
    name = runner.parse_run(run)[0]
    if name not in SHAPES:
        raise ValueError(f"run {run!r}: the config is one of {sorted(SHAPES)}")
    return SHAPES[name]


def config_for(run: str, ckpt: str, tiny: bool, batch: int = 0, sets=()):
    """The ConfigDict of one run, fine-tuning the checkpoint ``ckpt`` on the novel task."""
    settings = {
        **runner.step_settings(batch=batch),
        "init_from": ckpt,
        "data.path": "",
        **(TINY_RUN if tiny else {}),
    }
    if tiny and batch:
        settings["batch_size"] = batch
    return runner.load(run, sets, settings)


def random_checkpoint(out_dir: str, shape: str, tiny: bool, seed: int = 0) -> str:
    """Write a HF checkpoint of ``shape``'s architecture with random weights (BF16), unless
    ``out_dir`` holds one already; its tokenizer is a BPE learned on the novel task."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    import numpy as np

    from fp8jax import hf, spec
    from fp8jax import tokenizer as tokenizer_lib
    from fp8jax.hf import weights
    from fp8jax.trainer import sft_data

    config = runner.load(f"{shape}:O0", settings={**TINY_MODEL, "seq_len": 128} if tiny else {})
    model_cfg = spec.parse(config).model
    rng = np.random.default_rng(seed)
    flat = {}
    for path, s in weights.param_shapes(model_cfg).items():
        if path[-1] == "scale":  # norm gains
            flat[path] = np.ones(s.shape, np.float32)
        elif path[-1] == "bias":
            flat[path] = np.zeros(s.shape, np.float32)
        else:  # 0.02: the usual init's scale, so activations and FP8 amaxes are typical
            flat[path] = rng.standard_normal(s.shape, np.float32)
            flat[path] *= 0.02
    texts = sft_data.record_texts([(r, "") for r in sft_data.novel_task(passage_words=64)])
    tok = tokenizer_lib.train(texts, min(model_cfg.vocab_size, 8192))
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    hf.save_hf(out_dir, model_cfg, weights.unflatten(flat), tok, "bfloat16")
    return out_dir


def is_dpo(run: str) -> bool:
    """Whether a run is of a preference-tuning (DPO) config."""
    return runner.parse_run(run)[0].startswith("dpo_")


def preference_data(config, workdir: str) -> None:
    """Point a DPO ``config``'s data at a .jsonl of the novel task's preference pairs, written
    in ``workdir``: passages of a third of seq_len in words, enough pairs for the timed
    batches and a held-out split."""
    from fp8jax.trainer import tasks

    train, _ = tasks.novel_split(max(96, 2 * config.batch_size), 6, max(8, config.seq_len // 3))
    path = tasks.write_jsonl(os.path.join(workdir, "pairs.jsonl"), tasks.preference_pairs(train))
    config.data.path = str(path)
    config.data.val_fraction = 0.05


def child(run: str, ckpt_root: str, tiny: bool, steps: int, batch: int = 0, sets=()) -> dict:
    """Import the run's checkpoint, build its SFT or DPO step and data, and time the step."""
    import jax

    from fp8jax import models, spec
    from fp8jax.diagnostics import memory
    from fp8jax.parallel import sharding
    from fp8jax.trainer import dpo_data, loop, sft_data

    t0 = time.perf_counter()
    ckpt = random_checkpoint(os.path.join(ckpt_root, shape_of(run)), shape_of(run), tiny)
    write_s = time.perf_counter() - t0
    print(f"{run}: checkpoint {ckpt} ready in {write_s:.1f} s", file=sys.stderr, flush=True)
    c = config_for(run, ckpt, tiny, batch, sets)
    workdir = tempfile.mkdtemp(prefix="finetune_step_")  # the data's tokenizer and manifest
    try:
        if is_dpo(run):
            preference_data(c, workdir)
        t0 = time.perf_counter()
        r, tok, params = loop.from_checkpoint(spec.parse(c), workdir)
        import_s = time.perf_counter() - t0
        dataset = (dpo_data if is_dpo(run) else sft_data).build(r, workdir, tok)
        s = loop.setup(r)
        state = s.init(jax.random.PRNGKey(0), params)  # DPO: with the frozen reference
        del params
        it = dataset.train_iter()
        batches = [sharding.put_batch(next(it), s.batch_sharding) for _ in range(2)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    build_s = time.perf_counter() - t0
    dev = jax.devices()[0]
    init_peak = common.peak_bytes(dev)
    print(f"{run}: imported in {import_s:.1f} s, compiling", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    compiled = s.train_step.lower(state, loop.abstract_batch(r)).compile()
    compile_s = time.perf_counter() - t0
    mem = memory.compiled_memory(compiled) or {}
    # XLA's needs, known before a step runs: an out-of-memory row still shows them.
    temp, args = (mem.get(k, 0) / 2**30 for k in ("temp", "argument"))
    print(
        f"{run}: compiled in {compile_s:.1f} s; XLA temp {temp:.2f} GiB, arguments {args:.2f} GiB",
        file=sys.stderr,
        flush=True,
    )
    for i in range(2):  # warm-up
        state, metrics = compiled(state, batches[i])
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        state, metrics = compiled(state, batches[i % 2])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    state, ms_pipe, dispatch_ms = common.pipelined(compiled, state, batches, steps, keep=True)
    ms = statistics.median(times) * 1e3
    tokens = r.optim.batch_size * r.optim.seq_len
    flops = models.flops_per_token(s.run.model, r.optim.seq_len) * tokens
    if is_dpo(run):  # the reference's forward: a third of the policy's forward and backward
        flops *= 4 / 3
    name, level, _ = runner.parse_run(run)
    return {
        "run": run,
        "config": name,
        "shape": shape_of(run),
        "level": level,
        "batch": r.optim.batch_size,
        "seq": r.optim.seq_len,
        "params_b": sum(x.size for x in jax.tree.leaves(s.abstract.params)) / 1e9,
        "step_ms": ms,
        "tokens_per_s": tokens / (ms / 1e3),
        "step_ms_pipelined": ms_pipe,
        "dispatch_ms_pipelined": dispatch_ms,
        "tokens_per_s_pipelined": tokens / (ms_pipe / 1e3),
        # Share of tokens in a row that are an example's (the rest is padding of the packing).
        "row_fill": float(sum((b["segment_ids"] > 0).sum() for b in batches)) / (2 * tokens),
        "mfu": flops / (ms / 1e3) / common.PEAK_BF16 / s.mesh.size,
        "devices": s.mesh.size,
        "peak_gib": common.peak_bytes(dev) / 2**30,
        "init_peak_gib": init_peak / 2**30,
        "compiled_gib": {k: v / 2**30 for k, v in mem.items()},
        "temp_gib": mem.get("temp", 0) / 2**30,
        "loss": common.finite_loss(run, metrics["loss"]),
        **(
            {k: float(metrics[k]) for k in ("reward_accuracy", "reward_margin")}
            if is_dpo(run)
            else {}
        ),
        "checkpoint_s": write_s,
        "import_s": import_s,
        "build_s": build_s,
        "compile_s": compile_s,
        "jax": jax.__version__,
        "device": str(dev.device_kind),
    }


COLUMNS = {
    **runner.STEP_COLUMNS,
    "peak GiB": lambda r: f"{r['peak_gib']:.2f}",
    "temp GiB": lambda r: f"{r['temp_gib']:.2f}",
    "fill": lambda r: f"{r['row_fill']:.2f}",
    "compile s": lambda r: f"{r['compile_s']:.0f}",
}


def main(argv=None):
    p = runner.parser(__doc__, sets=True)
    p.add_argument("--runs", default=RUNS, help=f"default: the SFT runs; DPO: {DPO_RUNS}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU: shrunk architecture and rows")
    p.add_argument("--batch", type=int, default=0, help="override batch_size (0: config's)")
    p.add_argument("--ckpt-dir", default="", help="where the random checkpoints go (kept)")
    p.add_argument("--timeout", type=int, default=0, help="seconds per run (0: none)")
    a = runner.parse_args(p, argv)

    def measure(run: str, a: argparse.Namespace) -> dict:
        return child(run, a.ckpt_dir, a.tiny, a.steps, a.batch, a.set)

    if a.child is not None:
        runner.drive("finetune_step", a, measure, [])
        return
    runs = a.runs.split(",")
    own = not a.ckpt_dir
    ckpt_root = a.ckpt_dir or tempfile.mkdtemp(prefix="finetune_step_ckpt_")
    if own:  # the children write the checkpoints there
        a.argv = [*a.argv, f"--ckpt-dir={ckpt_root}"]
    check = lambda run: (shape_of(run), config_for(run, ckpt_root, a.tiny, a.batch, a.set))  # noqa: E731
    try:
        rows = runner.drive(
            "finetune_step", a, measure, runs, check=check, timeout=a.timeout or None
        )
    finally:
        if own:
            shutil.rmtree(ckpt_root, ignore_errors=True)
    print("\n" + runner.table(rows, COLUMNS))


if __name__ == "__main__":
    sys.exit(main())
