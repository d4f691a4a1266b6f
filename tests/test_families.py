"""Every registered model family: a tiny model builds and runs, its matmul-parameter count is
what the model holds, and its Hugging Face mapping round-trips (config.json and the tensor
table). Also: no code outside the family modules tests which family (``style``) it holds."""

import ast
import dataclasses
import pathlib

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util

from fp8jax import errors, models, spec
from fp8jax.hf import architectures, weights
from fp8jax.models import families
from fp8jax.trainer import loop as train_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILY_DIR = ROOT / "fp8jax" / "models" / "families"
NAMES = sorted(families.FAMILIES)
B, L = 2, 8


def model_cfg(style: str, **model) -> models.ModelConfig:
    """configs/base.py's model at O0 in family ``style``, 2 layers 64 wide, with overrides."""
    config = train_lib.load_config("base")
    config.fp8.level = "O0"
    config.model.update({**dict(d_model=64, num_heads=4, num_kv_heads=4, d_ff=96), **model})
    config.model.style = style
    if families.get_family(style).mlp == "moe":  # routed experts in place of the MLP
        config.model.moe.update(num_experts=4, top_k=2, d_ff=32, shared_d_ff=16, shared_gate=True)
    return spec.parse(config).model


def random_params(cfg: models.ModelConfig) -> dict:
    """Flat random params of ``cfg``'s model (norm scales and biases random too)."""
    tokens = np.zeros((1, 1), np.int32)
    params = models.build_model(cfg).init(jax.random.key(0), tokens)["params"]
    flat = traverse_util.flatten_dict(nn.unbox(params))
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in flat.items()}


def style_tests(tree: ast.AST) -> list[int]:
    """Lines of every comparison that reads a ``style`` (``x.style == ...``, ``style in ...``)."""

    def is_style(node):
        return (isinstance(node, ast.Attribute) and node.attr == "style") or (
            isinstance(node, ast.Name) and node.id == "style"
        )

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(map(is_style, [node.left, *node.comparators]))
    ]


def test_no_style_tests_outside_the_family_modules():
    found = {}
    for path in sorted([*(ROOT / "fp8jax").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        if FAMILY_DIR in path.parents:
            continue
        lines = style_tests(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"ask cfg.family instead of testing model.style: {found}"


def test_the_style_check_finds_each_form():
    source = "a = cfg.style == 'gpt'\nb = m.style != 'x'\nc = style in ('gpt',)\nd = x.mlp == 1\n"
    assert style_tests(ast.parse(source)) == [1, 2, 3]


def test_registry():
    assert list(models.config.STYLES) == list(families.FAMILIES)
    with pytest.raises(errors.ConfigError, match=r"unknown model.style 'bert': use one of"):
        families.get_family("bert")
    with pytest.raises(ValueError, match="registered twice"):
        families.register(type(families.get_family(NAMES[0])))
    supported = [a for f in families.FAMILIES.values() for a in f.hf_architectures]
    assert sorted(supported) == sorted(architectures.SUPPORTED)
    assert len(set(supported)) == len(supported)  # each HF architecture imports as one family


def test_architecture_and_execution_split_the_model_config():
    """Each ModelConfig field is either what the network is or how it runs, never both; a
    checkpoint records exactly the architecture."""
    arch = {f.name for f in dataclasses.fields(models.Architecture)}
    run = {f.name for f in dataclasses.fields(models.Execution)}
    assert not arch & run
    assert arch | run == {f.name for f in dataclasses.fields(models.ModelConfig)}
    assert set(architectures.ARCHITECTURE_FIELDS) == arch
    cfg = model_cfg(NAMES[0])
    assert models.ModelConfig.of(cfg.architecture, cfg.execution) == cfg
    assert architectures.fields_of(cfg) == dataclasses.asdict(cfg.architecture)


@pytest.mark.parametrize("style", NAMES)
def test_tiny_model_runs_and_counts_its_matmul_params(style):
    cfg = model_cfg(style)
    assert cfg.family is families.get_family(style) and cfg.family.name == style
    model = models.build_model(cfg)
    tokens = np.arange(B * L, dtype=np.int32).reshape(B, L) % cfg.vocab_size
    variables = model.init(jax.random.key(0), tokens)
    logits = jax.jit(model.apply)(variables, tokens)
    assert logits.shape == (B, L, cfg.vocab_size) and np.isfinite(logits).all()
    flat = traverse_util.flatten_dict(nn.unbox(variables["params"]))
    kernels = {k: v.size for k, v in flat.items() if k[-1] == "kernel"}
    per_layer = sum(n for k, n in kernels.items() if k[0] == "blocks") // cfg.num_layers
    assert per_layer == cfg.family.matmul_params_per_layer(cfg)
    assert models.matmul_params(cfg) == sum(kernels.values())
    # A token's forward reads them all, but a routed-expert block's experts beyond its top_k.
    moe = cfg.moe
    idle = 0 if moe is None else 3 * cfg.d_model * moe.d_ff * (moe.num_experts - moe.top_k)
    assert cfg.family.active_matmul_params_per_layer(cfg) == per_layer - idle
    # A step over t tokens (a decode step's rows) reads the experts t x top_k can reach.
    for t in (1, 2, 10**6):
        unread = 0 if moe is None else moe.num_experts - min(moe.num_experts, t * moe.top_k)
        reached = per_layer - (0 if moe is None else 3 * cfg.d_model * moe.d_ff * unread)
        assert cfg.family.matmul_params_read_per_layer(cfg, t) == reached, t
    assert models.matmul_params_read(cfg, 10**6) == models.matmul_params(cfg)
    has_bias = any(k[-1] == "bias" and "mlp" in k for k in flat)
    assert has_bias == cfg.family.use_bias


@pytest.mark.parametrize("style", NAMES)
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_hf_config_round_trip(style, num_kv_heads):
    cfg = model_cfg(style, num_kv_heads=num_kv_heads)
    if not cfg.family.hf_architectures:
        pytest.skip(f"model.style={style!r} has no Hugging Face form")
    try:
        cfg.family.check_hf_export(cfg)
    except errors.CheckpointError:
        assert num_kv_heads < cfg.num_heads, "the family refuses plain multi-head attention"
        return
    hfc = architectures.hf_config(cfg, eos_id=0)
    assert hfc["architectures"] == [cfg.family.hf_export_name(cfg)]
    assert architectures.family_of(hfc["architectures"][0]) is cfg.family
    fields = architectures.from_hf_config(hfc)
    assert fields == architectures.fields_of(cfg)
    assert architectures.from_json(architectures.to_json(fields), "model.json") == fields


@pytest.mark.parametrize("style", NAMES)
@pytest.mark.parametrize("scan_layers, fused_qkv", [(True, False), (False, True)])
def test_hf_tensor_table_round_trip(style, scan_layers, fused_qkv):
    """Export (gather) then import (fill) through the family's table gives back every param."""
    cfg = model_cfg(style, scan_layers=scan_layers, fused_qkv=fused_qkv, num_kv_heads=2)
    if not cfg.family.hf_architectures:
        pytest.skip(f"model.style={style!r} has no Hugging Face form")
    cfg = dataclasses.replace(cfg, tie_embeddings=False)  # the head's row too
    try:
        cfg.family.check_hf_export(cfg)
    except errors.CheckpointError:  # a family without grouped-query attention
        cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_heads)
    table = weights.hf_tensors(cfg)
    assert len({t.name for t in table}) == len(table)
    weights.check_coverage(cfg, table)
    flat = random_params(cfg)
    hf_state = {t.name: weights.gather(cfg, flat, t, np.float32) for t in table}
    assert all(hf_state[t.name].shape == t.shape for t in table)
    buffers = weights.empty_params(cfg)
    for t in table:
        weights.fill(cfg, buffers, t, hf_state[t.name])
    assert buffers.keys() == flat.keys()
    for k in flat:
        np.testing.assert_array_equal(buffers[k], flat[k], err_msg=str(k))
