"""FP8 serving export (fp8jax.hf.fp8): E4M3 round trip, layouts, the converter command line.

Error bound of one E4M3 value (round to nearest, 3 mantissa bits): a value ``x = w / s`` in
the normal range (``|x| >= 2^-6``) is off by at most half an ulp, ``2^-4 |x|``; below it
(subnormals, spacing ``2^-9``) by at most ``2^-10``. Dequantized, ``|q s - w| <=
max(2^-4 |w|, 2^-10 s)``, with ``s`` the element's own block (or tensor) scale ``amax / 448``.
A BF16 result adds its own rounding, half an ulp of 8 significant bits: ``2^-8 |q s|``.
"""

import json
import math
import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from fp8jax import errors
from fp8jax.hf import architectures, fp8

BF16, E4M3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_scales(w, block):
    """amax / 448 of every ``block`` x ``block`` tile, by loops (1 for an all-zero tile)."""
    rows, cols = w.shape
    s = np.ones((math.ceil(rows / block), math.ceil(cols / block)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = np.abs(w[i * block : (i + 1) * block, j * block : (j + 1) * block]).max()
            s[i, j] = amax / np.float32(448) if amax > 0 else 1.0
    return s


def per_element(s, shape, block):
    """Block scales laid over a ``shape`` weight with np.kron (edge tiles cut)."""
    return np.kron(s, np.ones((block, block), np.float32))[: shape[0], : shape[1]]


def e4m3_bound(w, s_elem):
    """Largest |dequant - w| one E4M3 rounding allows (module docstring), with f32 slack."""
    return np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * s_elem) * (1 + 2.0**-20)


def check_round_trip(w, scheme, block=128):
    """Quantize one decoder weight, check its scales and the element-wise bound; return errors."""
    name = "model.layers.0.mlp.down_proj.weight"
    with np.errstate(all="raise"):  # no 0/0, no overflow anywhere
        out, config = fp8.quantize({name: w}, scheme, block)
        back = fp8.dequantize(out, config, np.float32)[name]
    w = w.astype(np.float32)
    s = reference_scales(w, max(w.shape)) if scheme == "tensor" else reference_scales(w, block)
    stored = out[name + fp8.SUFFIXES[scheme]]
    np.testing.assert_array_equal(stored.reshape(s.shape), s)
    s_elem = per_element(s, w.shape, max(w.shape) if scheme == "tensor" else block)
    err = np.abs(back - w)
    assert (err <= e4m3_bound(w, s_elem)).all(), float((err / e4m3_bound(w, s_elem)).max())
    bf16 = fp8.dequantize(out, config)[name]
    assert bf16.dtype == BF16
    bf16_err = np.abs(bf16.astype(np.float32) - w)
    assert (bf16_err <= e4m3_bound(w, s_elem) + 2.0**-8 * np.abs(back)).all()
    return err, e4m3_bound(w, s_elem)


@pytest.mark.parametrize("scheme", fp8.SCHEMES)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (130, 127), (3, 5)])
def test_round_trip_within_e4m3_rounding(scheme, shape):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 2, shape))).astype(BF16)
    err, bound = check_round_trip(w, scheme)
    assert (err / bound).max() > 0.5  # the bound is tight: the rounding really happened


def test_each_block_saturates_at_its_own_max():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 200)).astype(np.float32) * rng.uniform(0.1, 10, (300, 1))
    out, _ = fp8.quantize({"model.layers.0.mlp.up_proj.weight": w}, "block")
    q_f32 = out["model.layers.0.mlp.up_proj.weight"].astype(np.float32)
    for i in range(3):
        for j in range(2):
            assert np.abs(q_f32[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]).max() == 448


def test_outlier_block_spoils_tensor_scaling_only():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 384)).astype(np.float32)
    w[:128, :128] *= 1e4  # one outlier block
    normal = np.ones(w.shape, bool)
    normal[:128, :128] = False
    rel = {}
    for scheme in fp8.SCHEMES:
        err, _ = check_round_trip(w, scheme)
        rel[scheme] = (err / np.abs(w))[normal & (np.abs(w) > 1e-3)]
    assert rel["block"].max() <= 2.0**-4 * (1 + 2.0**-20)  # every other block keeps its bits
    assert np.median(rel["tensor"]) > 2.0**-4  # one shared scale pushes them into subnormals


def test_zero_blocks_and_tensors():
    w = np.zeros((200, 256), np.float32)
    w[150:, 200:] = 3.0
    check_round_trip(w, "block")
    for scheme in fp8.SCHEMES:
        out, config = fp8.quantize({"a.q_proj.weight": np.zeros((4, 4), BF16)}, scheme)
        scale = out["a.q_proj.weight" + fp8.SUFFIXES[scheme]]
        assert np.isfinite(scale).all() and (scale > 0).all()
        assert (fp8.dequantize(out, config)["a.q_proj.weight"].astype(np.float32) == 0).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_raises(bad):
    w = np.ones((8, 8), np.float32)
    w[3, 5] = bad
    with pytest.raises(errors.CheckpointMismatchError, match="model.layers.1.mlp.up_proj.weight"):
        fp8.quantize({"model.layers.1.mlp.up_proj.weight": w}, "block")


LLAMA_NAMES = {
    "model.embed_tokens.weight": (40, 32),
    "model.norm.weight": (32,),
    "lm_head.weight": (40, 32),
    "model.layers.0.input_layernorm.weight": (32,),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.self_attn.q_proj.bias": (32,),
    "model.layers.0.self_attn.k_proj.weight": (16, 32),
    "model.layers.0.self_attn.v_proj.weight": (16, 32),
    "model.layers.0.self_attn.o_proj.weight": (32, 32),
    "model.layers.0.mlp.gate_proj.weight": (200, 32),
    "model.layers.0.mlp.up_proj.weight": (200, 32),
    "model.layers.0.mlp.down_proj.weight": (32, 200),
}
GPT2_LINEARS = ["h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight", "h.0.mlp.c_fc.weight"]


def tiny_state(names=LLAMA_NAMES, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shape).astype(BF16) for n, shape in names.items()}


@pytest.mark.parametrize("scheme", fp8.SCHEMES)
def test_layout(scheme):
    tensors = tiny_state()
    out, config = fp8.quantize(tensors, scheme, block=64)
    linears = [n for n in LLAMA_NAMES if n.endswith("proj.weight")]
    suffix = {"tensor": "_scale", "block": "_scale_inv"}[scheme]
    assert set(out) == set(LLAMA_NAMES) | {n + suffix for n in linears}
    for name in linears:
        assert out[name].dtype == E4M3 and out[name].shape == tensors[name].shape
        scale = out[name + suffix]
        rows, cols = tensors[name].shape
        grid = () if scheme == "tensor" else (math.ceil(rows / 64), math.ceil(cols / 64))
        assert scale.dtype == np.float32 and scale.shape == grid
    for name in set(LLAMA_NAMES) - set(linears):  # embeddings, norms, biases, lm_head
        assert out[name] is tensors[name]
    expected = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        expected |= {"fmt": "e4m3", "weight_block_size": [64, 64]}
        expected["modules_to_not_convert"] = ["lm_head", "model.embed_tokens"]
    else:
        expected["ignored_layers"] = ["lm_head", "model.embed_tokens"]
    assert config == expected


def test_default_predicate_and_a_custom_one():
    gpt2 = {n: np.ones((8, 24), BF16) for n in GPT2_LINEARS + ["wte.weight", "wpe.weight"]}
    gpt2["h.0.attn.c_attn.bias"] = np.ones(24, BF16)
    out, config = fp8.quantize(gpt2, "block")  # Conv1D: no FP8 loader swaps it, so BF16
    assert not any(t.dtype == E4M3 for t in out.values())
    listed = {n.removesuffix(".weight") for n in GPT2_LINEARS + ["wte.weight", "wpe.weight"]}
    assert config["modules_to_not_convert"] == sorted(listed | {"lm_head"})  # tied head too
    out, config = fp8.quantize(tiny_state(), "tensor", predicate=lambda n: "mlp" in n)
    assert {n for n, t in out.items() if t.dtype == E4M3} == {
        f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    }
    assert "model.layers.0.self_attn.q_proj" in config["ignored_layers"]


def test_dequantize_deepseek_style():
    """Stacked experts with block scales, E8M0 scales, per-channel scales, static input scales."""
    rng = np.random.default_rng(3)
    q = rng.uniform(-448, 448, (2, 3, 160, 100)).astype(E4M3)
    s = np.exp2(rng.integers(-9, 3, (2, 3, 2, 1))).astype(np.float32)
    per_row = rng.uniform(0.5, 2, (160, 1)).astype(np.float32)
    tensors = {
        "experts.w1.weight": q,
        "experts.w1.weight_scale_inv": s,
        "e8m0.weight": q[0, 0],
        "e8m0.weight_scale_inv": s[0, 0].astype(ml_dtypes.float8_e8m0fnu),
        "channel.weight": q[1, 1],
        "channel.weight_scale": per_row,
        "channel.input_scale": np.float32(0.5),
        "norm.weight": np.ones(100, BF16),
    }
    config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    out = fp8.dequantize(tensors, config, np.float32)
    assert set(out) == {"experts.w1.weight", "e8m0.weight", "channel.weight", "norm.weight"}
    q_f32 = q.astype(np.float32)
    for e in range(2):
        for x in range(3):
            expect = q_f32[e, x] * per_element(s[e, x], (160, 100), 128)
            np.testing.assert_array_equal(out["experts.w1.weight"][e, x], expect)
    np.testing.assert_array_equal(
        out["e8m0.weight"], q_f32[0, 0] * per_element(s[0, 0], (160, 100), 128)
    )
    np.testing.assert_array_equal(out["channel.weight"], q_f32[1, 1] * per_row)
    bytes_ue8m0 = (np.log2(s[0, 0]) + 127).astype(np.uint8)  # scale_fmt 'ue8m0' as raw bytes
    raw = {"e8m0.weight": q[0, 0], "e8m0.weight_scale_inv": bytes_ue8m0}
    ue8m0 = fp8.dequantize(raw, config | {"scale_fmt": "ue8m0"}, np.float32)["e8m0.weight"]
    np.testing.assert_array_equal(ue8m0, out["e8m0.weight"])


def test_dequantize_rejects_a_missing_or_misshapen_scale():
    q = np.ones((4, 4), E4M3)
    with pytest.raises(errors.CheckpointMismatchError, match="'a.weight' has no scale"):
        fp8.dequantize({"a.weight": q}, {"weight_block_size": [128, 128]})
    bad = {"a.weight": q, "a.weight_scale_inv": np.ones((3, 2), np.float32)}
    with pytest.raises(errors.CheckpointMismatchError, match="scale of 'a.weight'"):
        fp8.dequantize(bad, {"weight_block_size": [128, 128]})


def write_hf_dir(path, tensors, shards=None, quantization_config=None):
    """A tiny HF dir: config.json, a tokenizer file and safetensors (``shards``: name -> file)."""
    import safetensors.numpy

    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32}
    if quantization_config:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text('{"model": "tiny"}')
    shards = shards or dict.fromkeys(tensors, "model.safetensors")
    for file in sorted(set(shards.values())):
        part = {n: np.asarray(t, order="C") for n, t in tensors.items() if shards[n] == file}
        safetensors.numpy.save_file(part, str(path / file), metadata={"format": "pt"})
    if len(set(shards.values())) > 1:
        index = {"metadata": {"total_size": 0}, "weight_map": shards}
        (path / fp8.INDEX).write_text(json.dumps(index))
    return path


def two_shards(names):
    """The first half of ``names`` in one file, the rest in another."""
    names = sorted(names)
    return {
        n: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors"
        for i, n in enumerate(names)
    }


def read_dir(path):
    """{name: array} of every safetensors file of ``path``, and {name: file}."""
    tensors, where = {}, {}
    for file in sorted(p.name for p in path.glob("*.safetensors")):
        part = fp8.load_tensors(path / file)
        tensors |= part
        where |= dict.fromkeys(part, file)
    return tensors, where


def assert_same(a, b):
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        bits_a, bits_b = (np.asarray(t).reshape(-1).view(np.uint8) for t in (a[name], b[name]))
        np.testing.assert_array_equal(bits_a, bits_b, name)


def test_reader_matches_safetensors(tmp_path):
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4).astype(E4M3)}
    tensors |= {
        "b": np.float32(2.5).reshape(()),
        "c": np.ones((2, 0), BF16),
        "d": tiny_state()["lm_head.weight"],
    }
    write_hf_dir(tmp_path / "hf", tensors)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf/model.safetensors"), "np") as f:
        assert {n: f.get_slice(n).get_dtype() for n in f.keys()} == {
            "a": "F8_E4M3",
            "b": "F32",
            "c": "BF16",
            "d": "BF16",
        }
    assert_same(fp8.load_tensors(tmp_path / "hf/model.safetensors"), tensors)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("scheme", fp8.SCHEMES)
def test_command_line_round_trip(tmp_path, scheme, sharded):
    tensors = tiny_state()
    src = write_hf_dir(tmp_path / "src", tensors, two_shards(tensors) if sharded else None)
    assert fp8.main([str(src), str(tmp_path / "q"), "--to", f"fp8-{scheme}", "--block", "64"]) == 0
    expect, expect_config = fp8.quantize(tensors, scheme, block=64)
    got, where = read_dir(tmp_path / "q")
    assert_same(got, expect)
    config = json.loads((tmp_path / "q/config.json").read_text())
    assert config["quantization_config"] == expect_config and config["hidden_size"] == 32
    assert (tmp_path / "q/tokenizer.json").read_text() == '{"model": "tiny"}'
    if sharded:  # each scale next to its weight, the index says where each tensor is
        index = json.loads((tmp_path / "q" / fp8.INDEX).read_text())
        assert index["weight_map"] == where
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())
        for name, file in where.items():
            if fp8.weight_of_scale(name):
                assert file == where[fp8.weight_of_scale(name)]
    assert fp8.main([str(tmp_path / "q"), str(tmp_path / "back")]) == 0  # FP8 in: BF16 out
    back, _ = read_dir(tmp_path / "back")
    assert_same(back, fp8.dequantize(expect, expect_config))
    config = json.loads((tmp_path / "back/config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["back", "q", "src"]  # no temp dir left behind


def test_fp8_source_with_scales_in_another_shard(tmp_path):
    tensors, config = fp8.quantize(tiny_state(), "block")
    shards = dict.fromkeys(tensors, "model-00001-of-00002.safetensors")
    for name in tensors:
        if fp8.weight_of_scale(name):
            shards[name] = "model-00002-of-00002.safetensors"
    src = write_hf_dir(tmp_path / "src", tensors, shards, config)
    assert fp8.main([str(src), str(tmp_path / "bf16"), "--to", "bf16"]) == 0
    assert_same(read_dir(tmp_path / "bf16")[0], fp8.dequantize(tensors, config))
    assert fp8.main([str(src), str(tmp_path / "t"), "--to", "fp8-tensor"]) == 0
    requantized = fp8.quantize(fp8.dequantize(tensors, config, np.float32), "tensor")[0]
    assert_same(read_dir(tmp_path / "t")[0], requantized)


def bad_input_cases(tmp_path):
    good = write_hf_dir(tmp_path / "good", tiny_state())
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    nan_state = tiny_state() | {
        "model.layers.0.mlp.up_proj.weight": np.full((200, 32), np.nan, BF16)
    }
    nan = write_hf_dir(tmp_path / "nan", nan_state, two_shards(nan_state))
    other = write_hf_dir(
        tmp_path / "awq", tiny_state(), quantization_config={"quant_method": "awq"}
    )
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    run = tmp_path / "run"  # a work dir, whose checkpoints/ its run manages
    (run / "checkpoints").mkdir(parents=True)
    (run / "model.json").write_text("{}")
    return {
        "is not a directory": [str(tmp_path / "missing")],
        "no \\*.safetensors": [str(empty)],
        "unknown --to 'fp8-row'": [str(good), "--to", "fp8-row"],
        "block size 100 is not a power of two": [str(good), "--block", "100"],
        "block size 0": [str(good), "--block", "0"],
        "invalid int value": [str(good), "--block", "x"],
        "exists and is not empty": [str(good), str(full)],
        "non-finite values": [str(nan)],
        "quantized with 'awq'": [str(other)],
        "its parent folder does not exist": [str(good), str(tmp_path / "no/such/out")],
        "the checkpoints/ folder that the run in": [str(good), str(run / "checkpoints" / "fp8")],
    }


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    for message, args in bad_input_cases(tmp_path).items():
        if len(args) == 1 or args[1].startswith("--"):
            args = [args[0], str(tmp_path / "out"), *args[1:]]
        before = sorted(os.walk(tmp_path))
        assert fp8.main(args) == 2, message
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith("error: ") and re.search(message, captured.err), captured.err
        assert sorted(os.walk(tmp_path)) == before, message
    assert (tmp_path / "full/keep.txt").read_text() == "mine"


def test_module_command_line_exit_code(tmp_path):
    cmd = [sys.executable, "-m", "fp8jax.hf.fp8", str(tmp_path / "missing"), str(tmp_path / "out")]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "is not a directory" in proc.stderr and not (tmp_path / "out").exists()


def torch_block_fp8(w, block=128):
    """Reference block quantization in torch: per-tile amax / 448, E4M3 cast, dequant to BF16."""
    import torch

    w = w.float()
    rows, cols = w.shape
    pad_r, pad_c = -rows % block, -cols % block
    tiles = torch.nn.functional.pad(w.abs(), (0, pad_c, 0, pad_r))
    tiles = tiles.reshape((rows + pad_r) // block, block, (cols + pad_c) // block, block)
    amax = tiles.amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    s_elem = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (w / s_elem).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * s_elem).bfloat16()


def test_transformers_loads_the_block_export_on_cpu(tmp_path):
    """transformers' FineGrainedFP8 loader reads the 'block' export; without a GPU it dequantizes
    to BF16 on load (it needs accelerate). Its weights must be torch's own block quantization of
    the BF16 model's, bit for bit, so its logits are the quantized model's."""
    # The test extra's reference packages: a missing one fails here rather than skipping.
    import accelerate  # noqa: F401  (transformers' FP8 loader refuses to run without it)
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,  # multiples of 128: see docs/hf.md on partial blocks
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert fp8.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--to", "fp8-block"]) == 0
    load = transformers.AutoModelForCausalLM.from_pretrained
    loaded, reference, model = (load(tmp_path / d).eval() for d in ("fp8", "bf16", "bf16"))
    state = model.state_dict()
    for name, w in state.items():
        if fp8.is_decoder_linear(name):
            state[name] = torch_block_fp8(w)
    reference.load_state_dict(state)
    got = loaded.state_dict()
    assert set(got) == set(state)
    for name, w in state.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], w), name
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        logits, want, bf16 = (m(ids).logits.float() for m in (loaded, reference, model))
    assert torch.equal(logits, want)
    rel = float((logits - bf16).norm() / bf16.norm())
    assert 1e-3 < rel < 0.1, rel  # quantized (not the BF16 weights), and still the same model


TINY_HF = {  # config.json sizes of a one-block model; GPT2Config maps these names to its own
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "n_inner": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    # MoE architectures: 4 experts of width 128 (Qwen's key), 2 per token; dense ones ignore these
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
}


def hf_architectures():
    """(model_type, architecture) of every HF architecture a registered family exports."""
    from fp8jax.models.families import FAMILIES

    return [(t, a) for f in FAMILIES.values() for t, a in f.hf_model_types.items()]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("model_type,architecture", hf_architectures())
def test_block_export_matches_what_transformers_swaps(tmp_path, model_type, architecture, tied):
    """The 'block' export of every family's HF architecture, as transformers' FP8 loader sees it
    (no GPU needed): its quantizer swaps the model's modules on the meta device, and then every
    stored scale belongs to a swapped FP8Linear or to one expert of a swapped FP8Experts (each
    expert's projections stored E4M3 with scales), every FP8Linear has an E4M3 weight and its
    scale in the file (a tied head has none: it must be listed), and every linear weight (or
    GPT-2 Conv1D, which the loader never swaps) left in BF16 is in modules_to_not_convert."""
    import torch
    import transformers
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    config = transformers.AutoConfig.for_model(model_type, tie_word_embeddings=tied, **TINY_HF)
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    assert fp8.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--to", "fp8-block"]) == 0
    stored = fp8.load_tensors(tmp_path / "fp8/model.safetensors")
    qconfig = json.loads((tmp_path / "fp8/config.json").read_text())["quantization_config"]
    quantizer = AutoHfQuantizer.from_config(qconfig, pre_quantized=True)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    quantizer.preprocess_model(meta)  # the module swap of a GPU load (validate_environment skipped)
    swapped = {n for n, m in meta.named_modules() if isinstance(m, FP8Linear)}
    experts = {n for n, m in meta.named_modules() if isinstance(m, FP8Experts)}
    scaled = {
        fp8.weight_of_scale(n).removesuffix(".weight") for n in stored if fp8.weight_of_scale(n)
    }
    per_expert = {n for n in scaled if re.search(r"\.experts\.\d+\.", n)}
    assert scaled - per_expert == swapped, (sorted((scaled - per_expert) ^ swapped), qconfig)
    # Each FP8Experts module (Mixtral's block_sparse_moe is transformers' mlp): its 4 experts'
    # gate, up and down projections, stored one by one
    renamed = {re.sub(r"\.block_sparse_moe\.", ".mlp.", n) for n in per_expert}
    assert {re.sub(r"\.\d+\.\w+$", "", n) for n in renamed} == experts
    assert len(per_expert) == 3 * 4 * len(experts)
    for name in per_expert:
        assert stored[name + ".weight"].dtype == E4M3, name
    for name in swapped:
        assert stored[name + ".weight"].dtype == E4M3, name
        assert stored[name + ".weight_scale_inv"].dtype == np.float32, name
    skip = qconfig.get("modules_to_not_convert", [])
    linears = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    for name in linears - swapped:
        weight = stored.get(name + ".weight")  # None: a tied head, no tensor of its own
        assert weight is None or weight.dtype != E4M3, name
        assert not should_convert_module(name, skip), (name, skip)
    if model_type != "gpt2":  # LLaMA-style blocks are nn.Linear: all seven are quantized
        moe = architectures.family_of(architecture).mlp == "moe"
        shared = 3 if model_type == "qwen2_moe" else 0  # its shared expert is a dense MLP
        linears_per_block = 4 + shared if moe else 7
        assert len(swapped) == linears_per_block * config.num_hidden_layers, sorted(swapped)
        assert len(experts) == (config.num_hidden_layers if moe else 0)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_transformers_loads_an_moe_block_export_on_cpu(tmp_path, model_type):
    """The 'block' export of an MoE checkpoint (one tensor per expert and projection, Mixtral's
    w1/w3/w2 names too) loads in transformers, which stacks the experts: its logits equal those
    of the BF16 model whose every quantized tensor is torch's block quantization of it."""
    import safetensors.torch
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **TINY_HF)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    assert fp8.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--to", "fp8-block"]) == 0
    state = safetensors.torch.load_file(str(tmp_path / "bf16/model.safetensors"))
    quantized = [name for name in state if fp8.is_decoder_linear(name)]
    assert sum(".experts." in name for name in quantized) == 3 * 4  # 4 experts, 3 projections
    for name in quantized:
        state[name] = torch_block_fp8(state[name])
    (tmp_path / "ref").mkdir()
    safetensors.torch.save_file(state, str(tmp_path / "ref/model.safetensors"), {"format": "pt"})
    (tmp_path / "ref/config.json").write_text((tmp_path / "bf16/config.json").read_text())
    load = transformers.AutoModelForCausalLM.from_pretrained
    loaded, reference = (load(tmp_path / d).eval() for d in ("fp8", "ref"))
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        logits, want, bf16 = (m(ids).logits.float() for m in (loaded, reference, model.eval()))
    assert torch.equal(logits, want)
    rel = float((logits - bf16).norm() / bf16.norm())
    assert 1e-3 < rel < 0.1, rel  # quantized (not the BF16 weights), and still the same model


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="transformers' FP8 load swaps modules on a CUDA GPU only")
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("model_type,architecture", hf_architectures())
def test_transformers_loads_the_block_export_on_a_gpu(tmp_path, model_type, architecture, tied):
    """The 'block' export of every family's architecture loads through transformers' GPU FP8
    path with no missing or unexpected tensor (a tied head's scale included), its decoder
    linears swapped for FP8 modules (GPT-2's Conv1D layers stay BF16 and load as the BF16
    model); with transformers' FP8 kernels installed (the `kernels` package), its logits are
    those of the BF16 model with torch's block quantization of every quantized weight."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, tie_word_embeddings=tied, **TINY_HF)
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    assert fp8.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--to", "fp8-block"]) == 0
    load = transformers.AutoModelForCausalLM.from_pretrained
    loaded, info = load(tmp_path / "fp8", device_map="cuda", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    swapped = [n for n, m in loaded.named_modules() if type(m).__name__.startswith("FP8")]
    assert bool(swapped) == (model_type != "gpt2"), swapped
    pytest.importorskip("kernels", reason="transformers' GPU FP8 kernels come from `kernels`")
    reference = getattr(transformers, architecture)(config).to(torch.bfloat16)
    state = model.state_dict()
    for name, w in state.items():
        if fp8.is_decoder_linear(name) and w.ndim == 2:
            state[name] = torch_block_fp8(w)
    reference.load_state_dict(state)
    ids = torch.randint(0, TINY_HF["vocab_size"], (2, 16), device="cuda")
    with torch.no_grad():
        got = loaded.eval()(ids).logits.float()
        want = reference.cuda().eval()(ids).logits.float()
    # The FP8 kernels also quantize the activations (per token, 1 x 128): within a few percent.
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 0.05
