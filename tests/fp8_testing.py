"""Shared tolerances and helpers of the tests (FP8 core: dot, linen, nnx; small configs)."""

import functools
import gzip
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Tolerances on the relative Frobenius error vs an f32 reference. Round-to-nearest leaves a
# relative error uniform in +-2^-(m+1) (rms ~ 2^-(m+1)/sqrt(3) before mantissa averaging):
# ~0.026 per E4M3 operand, ~0.05 per E5M2 operand; errors of two operands add in quadrature.
# Measured: fwd ~0.038, grads ~0.06; the bounds keep ~30% headroom and still fail on any bug
# that costs a bit of mantissa (one bit doubles the error).
FWD_TOL = 0.05  # E4M3 x E4M3
GRAD_TOL = 0.08  # E5M2 x E4M3 (dgrad) and E4M3 x E5M2 (wgrad)
MIN_ERR = 0.01  # quantization really happened (a silent f32 fallback would be ~1e-7)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
ROOT = pathlib.Path(__file__).resolve().parents[1]
# A 1-layer, 64-wide run of the tiny config that logs every step and evaluates, samples and
# checks FP8 health as little as possible: the end-to-end reliability tests' base overrides.
TINY_RUN = {
    "model.num_layers": 1,
    "model.d_model": 64,
    "model.num_heads": 2,
    "model.num_kv_heads": 2,
    "model.d_ff": 128,
    "model.vocab_size": 320,
    "model.max_len": 32,
    "seq_len": 32,
    "batch_size": 4,
    "log_every_steps": 1,
    "eval_every_steps": 1000,
    "eval_batches": 1,
    "fp8_stats_every_steps": 1000,
    "sample_tokens": 0,
    "keep_checkpoints": 2,
}


@functools.cache
def _shipped(book: str) -> str:
    from fp8jax.trainer import corpus as corpus_lib

    with gzip.open(corpus_lib.SHIPPED_DIR / f"{book}.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def novel(book: str, num_chars: int, start: int = 0) -> str:
    """Characters ``start`` to ``start + num_chars`` of a shipped novel ('persuasion',
    'pride-and-prejudice'), the text the corpus tests train and tokenize on."""
    return _shipped(book)[start : start + num_chars]


def rel_err(a, b) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b``, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def amax(a) -> float:
    """Largest absolute value, as a Python float."""
    return float(np.abs(np.asarray(a)).max())


def f32_div(a, b):
    """fmax / amax as the scale update computes it, to within the 2 ulp of XLA:GPU's division."""
    return pytest.approx(float(np.float32(a) / np.float32(b)), rel=2.5e-7)


def randn(seed, shape, scale=1.0):
    """Normal f32 data from numpy (eager jax.random compiles a kernel per shape on CPU)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32) * scale)


def nnx_grads(model, x, r):
    """Output and grads of sum(model(x) * r) w.r.t. an NNX model's params and FP8 state."""
    from flax import nnx

    from fp8jax.nn import nnx as fnnx

    def loss(model):
        y = model(x)
        return jnp.sum(y * r), y

    (_, y), grads = nnx.value_and_grad(loss, argnums=fnnx.diff_state(), has_aux=True)(model)
    return y, *fnnx.split_grads(grads)


def with_overrides(config, overrides: dict):
    """``config`` with each dotted key of ``overrides`` (``'model.d_model'``) set in place."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        functools.reduce(lambda d, k: d[k], parents, config)[leaf] = value
    return config


def data_run(path, vocab, seed=0, val_fraction=0.2, batch_size=4, seq_len=16, **data):
    """configs/tiny.py's run spec with these data settings (``data``: more ``run.data`` fields).

    Built past ``spec.parse``'s checks, so library-only values (``val_fraction=0``) get through.
    """
    import dataclasses

    from fp8jax import spec
    from fp8jax.trainer import loop

    run = spec.parse(loop.load_config("tiny"))
    return dataclasses.replace(
        run,
        seed=seed,
        model=dataclasses.replace(run.model, vocab_size=vocab),
        data=dataclasses.replace(run.data, path=str(path), val_fraction=val_fraction, **data),
        optim=dataclasses.replace(run.optim, batch_size=batch_size, seq_len=seq_len),
    )


def base_config():
    """configs/base.py's ``get_config()``: every field, with its default."""
    module_spec = importlib.util.spec_from_file_location("fp8jax_base", ROOT / "configs/base.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config()


def flat_fields(config, prefix="") -> set[str]:
    """Dotted names of every leaf field of a ConfigDict."""
    out = set()
    for k, v in config.items():
        out |= flat_fields(v, f"{prefix}{k}.") if hasattr(v, "items") else {prefix + k}
    return out


def set_field(config, field: str, value) -> None:
    """``config.<field> = value``, past ml_collections' type check (a config file may do so)."""
    section, _, key = field.rpartition(".")
    target = config
    for part in filter(None, section.split(".")):
        target = target[part]
    with target.ignore_type():
        target[key] = value


def bits(x) -> np.ndarray:
    """The bit patterns of ``x`` as unsigned integers of its width (FP8: uint8)."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def lm_grads(config, variables, tok):
    """``((loss, new fp8_state), (param grads, fp8_state cotangents))`` of ``config``'s model:
    next-token cross entropy on ``tok`` [B, L], jitted."""
    from fp8jax import FP8, models, spec

    model = models.build_model(spec.parse(config).model)

    def loss(params, fp8):
        logits, mutated = model.apply({"params": params, FP8: fp8}, tok, mutable=[FP8])
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1)), mutated[FP8]

    grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    return jax.jit(grad_fn)(variables["params"], variables[FP8])


def same_step_grads(fused, plain, tok):
    """Two configs of one model (a fused op on and off): asserts the same params (paths and
    initial values), loss, new FP8 state and FP8 cotangents; returns both param grads."""
    from flax import linen as nn

    from fp8jax import models, spec

    fused_model, plain_model = (models.build_model(spec.parse(c).model) for c in (fused, plain))
    variables = nn.unbox(jax.jit(fused_model.init)(jax.random.key(0), tok))
    plain_vars = nn.unbox(jax.jit(plain_model.init)(jax.random.key(0), tok))
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(plain_vars), strict=True):
        np.testing.assert_array_equal(a, b)
    (loss_f, fp8_f), (g_f, gm_f) = lm_grads(fused, variables, tok)
    (loss_p, fp8_p), (g_p, gm_p) = lm_grads(plain, variables, tok)
    assert float(loss_f) == float(loss_p)
    for a, b in zip(jax.tree.leaves((fp8_f, gm_f)), jax.tree.leaves((fp8_p, gm_p)), strict=True):
        np.testing.assert_array_equal(a, b)
    return g_f, g_p


def scatter_results(stablehlo: str) -> list[str]:
    """The result type of each ``stablehlo.scatter`` in a lowered program's text (its region
    ends on the ``}) : (...) -> T`` line)."""
    lines, out = stablehlo.splitlines(), []
    for i, line in enumerate(lines):
        if "stablehlo.scatter" in line:
            end = next(j for j in range(i, len(lines)) if "}) : (" in lines[j])
            out.append(lines[end].rsplit("->", 1)[1].strip())
    return out


def pallas_calls(jaxpr) -> list:
    """Every ``pallas_call`` equation of a jaxpr, nested ones (jit, scan, custom VJPs)
    included, in program order."""
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                calls.append(eqn)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr)
    return calls


def pallas_name(eqn) -> str:
    """A ``pallas_call`` equation's kernel name (``name=`` of the call)."""
    name = eqn.params.get("name", eqn.params.get("name_and_src_info"))
    return getattr(name, "name", name)  # a NameAndSrcInfo in some jax versions
