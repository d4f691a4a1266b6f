"""PyTorch reference of the train step of configs/gpt_1b3.py and configs/llama_1b.py.

    PYTHONUNBUFFERED=1 python -m benchmarks.torch_reference --out "$OUT" --no-optim \
        --runs gpt_1b3:bf16,gpt_1b3:float8,llama_1b:bf16,llama_1b:float8

The shapes are copied here (no jax, fp8jax or ml_collections needed: this runs with torch),
for absolute tokens/s next to ``benchmarks.step``. The models
mirror fp8jax/models (fused K/V and SwiGLU gate/up linears, f32 RoPE and norm statistics, bf16
residual stream, untied LM head, same init and parameter counts); the step mirrors
fp8jax/trainer/step.py:
f32 master params, bf16 autocast, f32 cross-entropy, global-norm clip 1.0, fused AdamW (betas
(0.9, 0.95), eps 1e-8, decay 0.1 on linear weights only, constant peak lr); batch 8 x 2048 random
tokens (targets = inputs, as benchmarks.step). ``float8``: torchao's tensorwise recipe (dynamic
per-tensor scales, E4M3 forward, E5M2 grads) on every block linear, LM head bf16; install
torchao with ``pip install --no-deps .whl/torchao-0.18.0-*.whl``.

One fresh process per run (own peak memory; a failure is an error row). ``torch.compile`` in its
default mode (max-autotune was not used because of its compile time) on the model and loss; clip
and AdamW run eagerly (multi-tensor kernels). 3 warm-up steps, then the median of ``--steps``.
``--no-optim`` adds a fwd+bwd-only row per run; ``--bf16-params`` keeps the weights in bf16
without autocast (the setup of references that train with bf16 weights). A run is
``config:level`` (level ``bf16`` or ``float8``); each writes ``torch_reference_<run>.json``.

    python -m benchmarks.torch_reference --quick --no-compile --runs gpt_1b3:bf16 --out /tmp  # CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import runner

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 datasheet FLOP/s, as benchmarks.step
WARMUP = 3  # torch.compile compiles the forward and backward graphs in the first step
INIT_STD = 0.02  # fp8jax/models/layers.py
NORM_EPS = 1e-5
ROPE_THETA = 10_000.0
BATCH, SEQ = 8, 2048
# configs/gpt_1b3.py and configs/llama_1b.py (vocabulary 32768, untied head, max_len 2048).
CONFIGS = {
    "gpt_1b3": dict(
        style="gpt", vocab=32768, d_model=2048, layers=24, heads=16, kv_heads=16, d_ff=8192, lr=2e-4
    ),
    "llama_1b": dict(
        style="llama",
        vocab=32768,
        d_model=2048,
        layers=22,
        heads=32,
        kv_heads=4,
        d_ff=5632,
        lr=4e-4,
    ),
}


def linear(d_in: int, d_out: int, bias: bool, std: float = INIT_STD) -> nn.Linear:
    """nn.Linear with fp8jax's init: normal(std) weight, zero bias."""
    lin = nn.Linear(d_in, d_out, bias=bias)
    nn.init.normal_(lin.weight, std=std)
    if bias:
        nn.init.zeros_(lin.bias)
    return lin


class Norm(nn.Module):
    """LayerNorm (GPT) or RMSNorm (LLaMA): statistics in f32, output in the input dtype."""

    def __init__(self, d: int, rms: bool):
        super().__init__()
        self.rms = rms
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = None if rms else nn.Parameter(torch.zeros(d))

    def forward(self, x):
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight.float()
        else:
            y = F.layer_norm(xf, xf.shape[-1:], self.weight.float(), self.bias.float(), NORM_EPS)
        return y.to(x.dtype)  # bf16 out, as Flax's norm with dtype=bfloat16


def rope(x):
    """Rotary embedding of x [B, L, heads, H], rotate-half layout, angles and rotation in f32."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)[:, None] * inv_freq
    sin, cos = angle.sin()[:, None], angle.cos()[:, None]  # [L, 1, H/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Block(nn.Module):
    """Pre-norm block: causal attention (MHA/GQA) then GELU MLP or SwiGLU."""

    def __init__(self, c: dict):
        super().__init__()
        d, n, k, f = c["d_model"], c["heads"], c["kv_heads"], c["d_ff"]
        self.n, self.k, self.h, self.llama = n, k, d // n, c["style"] == "llama"
        bias, rms = not self.llama, self.llama
        out_std = INIT_STD / (2 * c["layers"]) ** 0.5  # GPT-2 residual-projection scaling
        self.attn_norm, self.mlp_norm = Norm(d, rms), Norm(d, rms)
        self.q = linear(d, n * self.h, bias)
        self.kv = linear(d, 2 * k * self.h, bias)  # K and V fused into one GEMM, as fp8jax
        self.o = linear(n * self.h, d, bias, out_std)
        self.wi = linear(d, 2 * f if self.llama else f, bias)  # SwiGLU gate/up fused, as fp8jax
        self.wo = linear(f, d, bias, out_std)

    def forward(self, x):
        b, length, _ = x.shape
        y = self.attn_norm(x)
        q = self.q(y).view(b, length, self.n, self.h)
        k, v = self.kv(y).view(b, length, 2, self.k, self.h).unbind(2)  # fp8jax's [2, K, H]
        if self.llama:
            q, k = rope(q), rope(k)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.k != self.n,
        )
        x = x + self.o(o.transpose(1, 2).reshape(b, length, self.n * self.h))
        h = self.wi(self.mlp_norm(x))
        if self.llama:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return x + self.wo(h)


class Transformer(nn.Module):
    """``(tokens, targets) [B, L] -> mean f32 cross-entropy``, fp8jax's decoder."""

    def __init__(self, c: dict, max_len: int):
        super().__init__()
        d, gpt = c["d_model"], c["style"] == "gpt"
        self.embed = nn.Embedding(c["vocab"], d)
        nn.init.normal_(self.embed.weight, std=INIT_STD)
        self.pos = nn.Parameter(torch.randn(max_len, d) * INIT_STD) if gpt else None
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.final_norm = Norm(d, rms=not gpt)
        self.head = linear(d, c["vocab"], bias=False)

    def forward(self, tokens, targets):
        # The residual stream is bf16 as in fp8jax (Embed dtype=bfloat16); under autocast
        # it would otherwise stay f32 through every residual add.
        x = self.embed(tokens).to(torch.bfloat16)
        if self.pos is not None:
            x = x + self.pos[: tokens.shape[1]].to(torch.bfloat16)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x)).float()  # bf16 GEMM, loss and softmax in f32
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def flops_per_token(c: dict, seq: int) -> float:
    """fp8jax.models.flops_per_token: 6 x matmul params + 12 x layers x d_model x seq."""
    d, h = c["d_model"], c["d_model"] // c["heads"]
    attn = d * h * (2 * c["heads"] + 2 * c["kv_heads"])
    mlp = (2 if c["style"] == "gpt" else 3) * d * c["d_ff"]
    return 6.0 * (c["layers"] * (attn + mlp) + d * c["vocab"]) + 12 * c["layers"] * d * seq


def child(name: str, level: str, optim: bool, a) -> dict:
    """Build, compile and time one config at one level (runs inside the child process)."""
    c, batch, seq = dict(CONFIGS[name]), BATCH, SEQ
    if a.quick:
        c.update(vocab=256, d_model=64, layers=2, heads=4, d_ff=128)
        c["kv_heads"] = 2 if c["style"] == "llama" else 4  # keep GQA in the LLaMA smoke test
        batch, seq = 4, 32
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")  # TF32 for any f32 matmul autocast leaves
    if dev.type == "cuda" and a.attn == "flash":
        # Flash attention only (fp8jax's reference is flash; recent torch may pick cuDNN on
        # Hopper): a shape flash can't take then fails loudly instead of falling back.
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
    model = Transformer(c, seq).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    if a.bf16_params:
        model.to(torch.bfloat16)
    torchao_version = None
    if level == "float8":
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        torchao_version = torchao.__version__
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            raise RuntimeError(f"float8 needs a CUDA GPU with FP8 tensor cores (sm89+), not {dev}")
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name("tensorwise"),
            module_filter_fn=lambda mod, fqn: fqn != "head",  # LM head stays bf16, as fp8jax
        )
    elif level != "bf16":
        raise ValueError(f"unknown level {level!r}: use bf16 or float8")
    run_model = model if a.no_compile else torch.compile(model)
    opt = None
    if optim:
        # Decay on matmul weights only (fp8jax's is_matmul_weight): not embeddings, norms, biases.
        decay = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
        ids = {id(p) for p in decay}
        rest = [p for p in model.parameters() if id(p) not in ids]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=c["lr"], betas=(0.9, 0.95), eps=1e-8, fused=True)
    tokens = torch.randint(0, c["vocab"], (batch, seq), device=dev)

    amp = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not a.bf16_params)

    def step():
        model.zero_grad(set_to_none=True)  # fresh grads each step, nothing accumulated
        with amp():
            loss = run_model(tokens, tokens)
        loss.backward()  # outside autocast, as the autocast docs recommend
        if opt is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
        return loss

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    step()
    sync()
    compile_s = time.perf_counter() - t0  # the first step: compilation plus one step
    for _ in range(WARMUP - 1):
        step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # peak of the steady-state steps, not compilation
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
    # Pipelined: steps back to back, one synchronize at the end (as benchmarks.step does).
    t = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    ms_pipe = (time.perf_counter() - t) * 1e3 / a.steps
    ms = statistics.median(times) * 1e3
    tokens_per_s = batch * seq / (ms / 1e3)
    return {
        "config": name,
        "level": level,
        "optimizer": optim,
        "param_dtype": "bfloat16" if a.bf16_params else "float32",
        "attention": a.attn,
        "compiled": not a.no_compile,
        "batch": batch,
        "seq": seq,
        "n_params": n_params,
        "step_ms": ms,
        "tokens_per_s": tokens_per_s,
        "step_ms_pipelined": ms_pipe,
        "tokens_per_s_pipelined": batch * seq / (ms_pipe / 1e3),
        "mfu": flops_per_token(c, seq) * tokens_per_s / PEAK_BF16,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
        "compile_s": compile_s,
        "loss": float(loss.detach()),
        "torch": torch.__version__,
        "torchao": torchao_version,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }


LEVELS = ("bf16", "float8")


def parse(run: str) -> tuple[str, str, bool]:
    """'gpt_1b3:bf16:optim' -> ('gpt_1b3', 'bf16', True): config, level, with the optimizer."""
    name, level, optim = run.split(":")
    if name not in CONFIGS or level not in LEVELS or optim not in ("optim", "fwdbwd"):
        raise ValueError(f"run {run!r}: use one of {sorted(CONFIGS)}, then {'/'.join(LEVELS)}")
    return name, level, optim == "optim"


COLUMNS = {
    **runner.STEP_COLUMNS,
    "peak GiB": lambda r: f"{r['peak_gib']:.2f}",
    "compile s": lambda r: f"{r['compile_s']:.1f}",
    "loss": lambda r: f"{r['loss']:.3f}",
}


def main(argv=None):
    p = runner.parser(__doc__)
    p.add_argument("--runs", default="gpt_1b3:bf16,gpt_1b3:float8,llama_1b:bf16,llama_1b:float8")
    p.add_argument("--steps", type=int, default=5, help="timed steps after 3 warm-up steps")
    p.add_argument("--no-optim", action="store_true", help="also measure fwd+bwd only")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--no-compile", action="store_true", help="eager (CPU smoke test)")
    p.add_argument("--bf16-params", action="store_true", help="bf16 weights, no autocast")
    p.add_argument("--attn", choices=("flash", "default"), default="flash", help="SDPA backends")
    p.add_argument("--timeout", type=int, default=540, help="seconds per run")
    a = runner.parse_args(p, argv)
    optims = ("optim", "fwdbwd") if a.no_optim else ("optim",)
    runs = [f"{run}:{optim}" for run in a.runs.split(",") for optim in optims]

    def measure(run: str, a: argparse.Namespace) -> dict:
        return {"run": run, **child(*parse(run), a)}

    rows = runner.drive("torch_reference", a, measure, runs, check=parse, timeout=a.timeout)
    if rows is None:
        return
    print("\n" + runner.table(rows, COLUMNS))


if __name__ == "__main__":
    sys.exit(main())
