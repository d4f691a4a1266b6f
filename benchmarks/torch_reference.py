"""PyTorch reference of the train step of configs/gpt_1b3.py, configs/llama_1b.py and the MoE
configs olmoe_1b7b and qwen3_30b_a3b:1gpu.

    PYTHONUNBUFFERED=1 python -m benchmarks.torch_reference --out "$OUT" --no-optim \
        --runs gpt_1b3:bf16,gpt_1b3:float8,llama_1b:bf16,llama_1b:float8
    python -m benchmarks.torch_reference --out "$OUT" --runs olmoe_1b7b:bf16,qwen3_30b_a3b@1gpu:bf16

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

The MoE models mirror fp8jax/models/moe.py: q/k RMSNorm (over the whole projection or per
head), an f32 softmax router (f32 weights and logits), top-k (renormalised or not), the
token-expert pairs sorted by expert (dropless) through two bf16 grouped GEMMs (gate/up, then
down; ``torch._grouped_mm`` on a CUDA GPU, one matmul per expert elsewhere), unsorted and
summed with the router weights in f32, and the load-balancing and z losses added to the loss;
their configs' batch (4 x 2048). ``float8`` converts their attention linears to torchao's
tensorwise float8 linear and runs the experts on torchao's FP8 grouped GEMM (rowwise dynamic
scales, E4M3 operands forward and backward; ``torch._scaled_grouped_mm``), each group padded to
a multiple of 16 rows as that kernel takes them.

One fresh process per run (own peak memory; a failure is an error row). ``torch.compile`` in its
default mode (max-autotune was not used because of its compile time) on the model and loss; clip
and AdamW run eagerly (multi-tensor kernels). 3 warm-up steps, then the median of ``--steps``.
``--no-optim`` adds a fwd+bwd-only row per run; ``--bf16-params`` keeps the weights in bf16
without autocast (the setup of references that train with bf16 weights). A run is
``config:level`` (level ``bf16`` or ``float8``); each writes ``torch_reference_<run>.json``.
``--layers N`` builds N blocks instead of the config's (the reduced-depth runs of
``benchmarks.step``, which passes its ``--set model.num_layers`` on to its ``--torch`` runs).

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
# configs/gpt_1b3.py and configs/llama_1b.py (vocabulary 32768, untied head, max_len 2048),
# configs/olmoe_1b7b.py and configs/qwen3_30b_a3b.py:1gpu (d_ff: an expert's width).
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
    "olmoe_1b7b": dict(
        style="moe",
        vocab=50304,
        d_model=2048,
        layers=16,
        heads=16,
        kv_heads=16,
        qk_norm="full",
        d_ff=1024,
        experts=64,
        top_k=8,
        normalize_top_k=False,
        aux_loss=0.01,
        z_loss=1e-3,
        lr=4e-4,
        batch=4,
    ),
    "qwen3_30b_a3b@1gpu": dict(
        style="moe",
        vocab=151936,
        d_model=2048,
        layers=6,
        heads=32,
        kv_heads=4,
        head_width=128,
        qk_norm="head",
        d_ff=768,
        experts=128,
        top_k=8,
        normalize_top_k=True,
        aux_loss=0.001,
        z_loss=0.0,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        lr=3e-4,
        batch=4,
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

    def __init__(self, d: int, rms: bool, eps: float = NORM_EPS):
        super().__init__()
        self.rms, self.eps = rms, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = None if rms else nn.Parameter(torch.zeros(d))

    def forward(self, x):
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        else:
            y = F.layer_norm(xf, xf.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)  # bf16 out, as Flax's norm with dtype=bfloat16


def rope(x, theta: float = ROPE_THETA):
    """Rotary embedding of x [B, L, heads, H], rotate-half layout, angles and rotation in f32."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)[:, None] * inv_freq
    sin, cos = angle.sin()[:, None], angle.cos()[:, None]  # [L, 1, H/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def grouped_mm(x_MxK, w_GxKxN, counts_G):
    """Rows of ``x`` sorted by group times their group's matrix: ``torch._grouped_mm`` on a
    CUDA GPU that has it, else one matmul per group (eager only: the sizes go to the host)."""
    if x_MxK.is_cuda and hasattr(torch, "_grouped_mm"):
        offs = torch.cumsum(counts_G, 0, dtype=torch.int32)  # each group's end row
        return torch._grouped_mm(x_MxK, w_GxKxN, offs=offs)
    parts = torch.split(x_MxK, counts_G.tolist())
    return torch.cat([p @ w_GxKxN[g] for g, p in enumerate(parts)])


def padded_group_rows(counts_G, rows: int, align: int):
    """``(dest_M, ends_G)``: where each of ``rows`` group-sorted rows sits once every group
    starts at a multiple of ``align`` rows, and the padded groups' end rows (int32)."""
    padded_G = (counts_G + align - 1) // align * align
    ends_G = torch.cumsum(padded_G, 0)
    shift_G = (ends_G - padded_G) - (torch.cumsum(counts_G, 0) - counts_G)  # new start - start
    groups = torch.arange(len(counts_G), device=counts_G.device)
    group_M = torch.repeat_interleave(groups, counts_G, output_size=rows)
    return torch.arange(rows, device=counts_G.device) + shift_G[group_M], ends_G.to(torch.int32)


def fp8_grouped_mm(x_MxK, w_GxKxN, counts_G):
    """``grouped_mm`` through torchao's FP8 grouped GEMM (rowwise dynamic scales, E4M3 operands
    forward and backward, ``torch._scaled_grouped_mm``), on a padded copy of ``x``: the kernel
    takes groups of multiples of 16 rows and a per-group column-major ``w``."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    align = 16
    dest_M, ends_G = padded_group_rows(counts_G, x_MxK.shape[0], align)
    rows = x_MxK.shape[0] + len(counts_G) * (align - 1)  # room for every group's padding
    xp_MxK = x_MxK.new_zeros(rows, x_MxK.shape[1]).index_copy(0, dest_M, x_MxK)
    w_col_GxKxN = w_GxKxN.transpose(-2, -1).contiguous().transpose(-2, -1)
    yp_MxN = _to_fp8_rowwise_then_scaled_grouped_mm(
        xp_MxK, w_col_GxKxN, ends_G, torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )
    return yp_MxN[dest_M]


class Moe(nn.Module):
    """fp8jax's MoeMlp: f32 softmax router, top-k, dropless grouped SwiGLU experts (bf16)."""

    def __init__(self, c: dict, out_std: float):
        super().__init__()
        d, e, f = c["d_model"], c["experts"], c["d_ff"]
        self.e, self.k, self.normalize = e, c["top_k"], c["normalize_top_k"]
        self.aux_coef, self.z_coef = c["aux_loss"], c["z_loss"]
        self.router = nn.Parameter(torch.randn(d, e) * INIT_STD)  # f32 at every level
        self.wi = nn.Parameter(torch.randn(e, d, 2 * f) * INIT_STD)  # gate, then up
        self.wo = nn.Parameter(torch.randn(e, f, d) * out_std)
        self.fp8 = False  # level float8: the experts on torchao's FP8 grouped GEMM

    def forward(self, x):
        """``(y, weighted auxiliary loss)`` of ``x [B, L, D]``."""
        b, length, d = x.shape
        x_TxD = x.reshape(-1, d)
        with torch.autocast(x.device.type, enabled=False):  # the router in f32, no TF32 either
            logits_TxE = x_TxD.float() @ self.router.float()
        probs_TxE = logits_TxE.softmax(-1)
        p_Txk, idx_Txk = probs_TxE.topk(self.k, dim=-1)
        if self.normalize:
            p_Txk = p_Txk / p_Txk.sum(-1, keepdim=True)
        expert_N = idx_Txk.flatten()  # pair n = t * k + j
        order_N = expert_N.argsort(stable=True)  # pairs grouped by expert, in token order
        counts_E = torch.zeros(self.e, dtype=torch.int64, device=x.device)
        counts_E = counts_E.scatter_add(0, expert_N, torch.ones_like(expert_N))
        xs_NxD = x_TxD[order_N // self.k].to(torch.bfloat16)
        mm = fp8_grouped_mm if self.fp8 else grouped_mm
        gate, up = mm(xs_NxD, self.wi.to(torch.bfloat16), counts_E).chunk(2, dim=-1)
        ys_NxD = mm(F.silu(gate) * up, self.wo.to(torch.bfloat16), counts_E)
        y_NxD = torch.empty_like(ys_NxD).index_copy(0, order_N, ys_NxD)  # unsorted
        y_TxD = (y_NxD.view(-1, self.k, d).float() * p_Txk.unsqueeze(-1)).sum(1)
        load_E = counts_E.float() / expert_N.numel()
        balance = self.e * (load_E * probs_TxE.mean(0)).sum()
        z = torch.logsumexp(logits_TxE, -1).pow(2).mean()
        aux = self.aux_coef * balance + self.z_coef * z
        return y_TxD.to(x.dtype).view(b, length, d), aux


class Block(nn.Module):
    """Pre-norm block: causal attention (MHA/GQA, q/k norms) then GELU MLP, SwiGLU or MoE."""

    def __init__(self, c: dict):
        super().__init__()
        d, n, k, f = c["d_model"], c["heads"], c["kv_heads"], c["d_ff"]
        self.n, self.k, self.h = n, k, c.get("head_width") or d // n
        self.llama = c["style"] in ("llama", "moe")  # RoPE, RMSNorm, no biases, SwiGLU
        self.theta, eps = c.get("rope_theta", ROPE_THETA), c.get("norm_eps", NORM_EPS)
        bias, rms = not self.llama, self.llama
        out_std = INIT_STD / (2 * c["layers"]) ** 0.5  # GPT-2 residual-projection scaling
        self.attn_norm, self.mlp_norm = Norm(d, rms, eps), Norm(d, rms, eps)
        self.q = linear(d, n * self.h, bias)
        self.kv = linear(d, 2 * k * self.h, bias)  # K and V fused into one GEMM, as fp8jax
        self.o = linear(n * self.h, d, bias, out_std)
        self.qk_norm = c.get("qk_norm", "")  # 'full' (OLMoE), 'head' (Qwen3) or none
        if self.qk_norm:
            width = self.h if self.qk_norm == "head" else None
            self.q_norm = Norm(width or n * self.h, True, eps)
            self.k_norm = Norm(width or k * self.h, True, eps)
        self.moe = Moe(c, out_std) if c["style"] == "moe" else None
        if self.moe is None:
            self.wi = linear(d, 2 * f if self.llama else f, bias)  # SwiGLU gate/up fused
            self.wo = linear(f, d, bias, out_std)

    def forward(self, x):
        """``(x after the block, its weighted MoE auxiliary loss)`` (0 for a dense block)."""
        b, length, _ = x.shape
        y = self.attn_norm(x)
        q = self.q(y)
        k, v = self.kv(y).view(b, length, 2, self.k * self.h).unbind(2)  # fp8jax's [2, K, H]
        if self.qk_norm == "full":  # over every head's q (and k) at once
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, length, self.n, self.h)
        k, v = k.view(b, length, self.k, self.h), v.view(b, length, self.k, self.h)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.llama:
            q, k = rope(q, self.theta), rope(k, self.theta)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.k != self.n,
        )
        x = x + self.o(o.transpose(1, 2).reshape(b, length, self.n * self.h))
        if self.moe is not None:
            h, aux = self.moe(self.mlp_norm(x))
            return x + h, aux
        h = self.wi(self.mlp_norm(x))
        if self.llama:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return x + self.wo(h), 0.0


class Transformer(nn.Module):
    """``(tokens, targets) [B, L] -> mean f32 cross-entropy``, fp8jax's decoder."""

    def __init__(self, c: dict, max_len: int):
        super().__init__()
        d, gpt = c["d_model"], c["style"] == "gpt"
        self.embed = nn.Embedding(c["vocab"], d)
        nn.init.normal_(self.embed.weight, std=INIT_STD)
        self.pos = nn.Parameter(torch.randn(max_len, d) * INIT_STD) if gpt else None
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.final_norm = Norm(d, not gpt, c.get("norm_eps", NORM_EPS))
        self.head = linear(d, c["vocab"], bias=False)

    def forward(self, tokens, targets):
        # The residual stream is bf16 as in fp8jax (Embed dtype=bfloat16); under autocast
        # it would otherwise stay f32 through every residual add.
        x = self.embed(tokens).to(torch.bfloat16)
        if self.pos is not None:
            x = x + self.pos[: tokens.shape[1]].to(torch.bfloat16)
        aux = 0.0  # an MoE model's auxiliary losses, added to the loss as fp8jax's step does
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        logits = self.head(self.final_norm(x)).float()  # bf16 GEMM, loss and softmax in f32
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux


def flops_per_token(c: dict, seq: int) -> float:
    """fp8jax.models.flops_per_token: 6 x active matmul params + 12 x layers x heads x head
    width x seq (an MoE block's active params: its router and top_k experts)."""
    d, h = c["d_model"], c.get("head_width") or c["d_model"] // c["heads"]
    attn = d * h * (2 * c["heads"] + 2 * c["kv_heads"])
    mlp = (2 if c["style"] == "gpt" else 3) * d * c["d_ff"]
    if c["style"] == "moe":
        mlp = d * c["experts"] + 3 * d * c["d_ff"] * c["top_k"]
    attention = 12 * c["layers"] * c["heads"] * h * seq
    return 6.0 * (c["layers"] * (attn + mlp) + d * c["vocab"]) + attention


def child(name: str, level: str, optim: bool, a) -> dict:
    """Build, compile and time one config at one level (runs inside the child process)."""
    c, seq = dict(CONFIGS[name]), SEQ
    batch = c.get("batch", BATCH)
    if a.layers:
        c["layers"] = a.layers  # a reduced depth, as benchmarks.step's --set model.num_layers
    if a.quick:
        c.update(vocab=256, d_model=64, layers=2, heads=4, d_ff=128, head_width=0)
        c["kv_heads"] = 2 if c["style"] != "gpt" else 4  # keep GQA in the LLaMA smoke test
        if c["style"] == "moe":
            c.update(experts=8, top_k=2, d_ff=32)
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
        for m in model.modules():
            if isinstance(m, Moe):
                m.fp8 = True
    elif level != "bf16":
        raise ValueError(f"unknown level {level!r}: use bf16 or float8")
    run_model = model if a.no_compile else torch.compile(model)
    opt = None
    if optim:
        # Decay on matmul weights only (fp8jax's is_matmul_weight): not embeddings, norms, biases,
        # an MoE router.
        decay = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
        decay += [w for m in model.modules() if isinstance(m, Moe) for w in (m.wi, m.wo)]
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
    p.add_argument("--layers", type=int, default=0, help="blocks (0: the config's)")
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
