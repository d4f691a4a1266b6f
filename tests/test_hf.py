"""Hugging Face import/export against transformers itself: logits, tensors, tokenizers, errors."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hf_testing import (
    FAMILIES,
    MAX_POS,
    VOCAB,
    build,
    byte_bpe,
    edit_json,
    rel_max,
    save_hf_tokenizer,
    torch_logits,
)

from fp8jax import errors, hf
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.hf import io, weights
from fp8jax.models import build_model
from fp8jax.models.config import MoeSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 48))
# f32 logits: the same math in another order; ~5e-7 measured, any mapping error is O(1).
F32_TOL = 1e-4
TEXTS = ["Hello world, how are you?", "Café naïve résumé", "東京と大阪", "emoji 🙂🚀 ok", "a b c"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Every family's tiny random checkpoint (llama3's sharded), with its torch model."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        shard = dict(max_shard_size="40KB") if family == "llama3" else {}
        model = build(family, d, **shard)
        save_hf_tokenizer(byte_bpe(TEXTS, bos=family != "gpt2"), d, "{{ messages }}")
        out[family] = (d, model)
    return out


def fp8jax_logits(directory, **training):
    base = dataclasses.replace(hf.default_model_cfg(), **training)
    loaded = hf.load(directory, base)
    return logits(loaded.model_cfg, loaded.params)


LAYOUTS = [  # (family, scan_layers, fused_qkv): every family, both layouts of attention
    ("llama3", True, False),
    ("llama3", False, True),
    ("llama", True, True),
    ("mistral", False, False),
    ("qwen2", True, False),
    ("qwen2", False, True),
    ("qwen3", True, False),
    ("qwen3", False, True),
    ("mixtral", True, False),
    ("qwen2_moe", False, True),
    ("qwen3_moe", True, True),
    ("olmoe", False, False),
    ("gpt2", True, False),
    ("gpt2", False, True),
]


@pytest.mark.parametrize("family,scan,fused", LAYOUTS)
def test_logits_match_transformers(ckpts, family, scan, fused):
    d, model = ckpts[family]
    ours = fp8jax_logits(d, scan_layers=scan, fused_qkv=fused)
    assert rel_max(ours, torch_logits(model, TOKENS)) <= F32_TOL


def test_architecture_fields(ckpts):
    llama3 = hf.architecture(ckpts["llama3"][0])
    assert (llama3["num_kv_heads"], llama3["tie_embeddings"], llama3["rope_theta"]) == (
        2,
        True,
        5e5,
    )
    assert llama3["rope_scaling"].factor == 8.0 and llama3["rope_scaling"].original_max_len == 16
    # Mistral: max_len is max_position_embeddings (128), the window (64) is sliding_window.
    mistral = hf.architecture(ckpts["mistral"][0])
    assert (mistral["max_len"], mistral["sliding_window"]) == (128, MAX_POS)
    assert hf.architecture(ckpts["qwen2"][0])["qkv_bias"] is True
    assert hf.architecture(ckpts["qwen3"][0])["qk_norm"] == "head"
    assert hf.architecture(ckpts["mixtral"][0])["sliding_window"] == 0  # null: none
    moe = {k: hf.architecture(ckpts[k][0]) for k in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")}
    assert [moe[k]["style"] for k in moe] == ["moe"] * 4
    assert [moe[k]["qk_norm"] for k in moe] == ["", "", "head", "full"]
    assert [moe[k]["moe"].normalize_top_k for k in moe] == [True, False, True, False]
    assert [moe[k]["moe"].d_ff for k in moe] == [48, 32, 32, 32]
    qwen2_moe = moe["qwen2_moe"]["moe"]
    assert (qwen2_moe.shared_d_ff, qwen2_moe.shared_gate, moe["qwen2_moe"]["qkv_bias"]) == (
        48,
        True,
        True,
    )
    # transformers' router_aux_loss_coef defaults: Mixtral and Qwen 0.001, OLMoE 0.01
    assert [moe[k]["moe"].aux_loss_coef for k in moe] == [0.001, 0.001, 0.001, 0.01]
    assert hf.architecture(ckpts["gpt2"][0])["d_ff"] == 96
    assert (ckpts["llama3"][0] / io.SAFETENSORS_INDEX).is_file()  # the sharded import path


def test_greedy_generation_from_an_moe_import_equals_transformers(ckpts):
    """Qwen3-MoE through the KV-cache decoder (q/k norms before the cache, experts per token)
    generates transformers' greedy tokens."""
    import torch

    from fp8jax.trainer import generate

    d, model = ckpts["qwen3_moe"]
    loaded = hf.load(d)
    prompts = [TOKENS[0, :5].tolist(), TOKENS[1, :2].tolist()]
    ours = generate.generate_ids(build_model(loaded.model_cfg), loaded.params, {}, prompts, 8)
    for p, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None
            )
        assert got == out[0, len(p) :].tolist()


def test_moe_import_keeps_the_base_configs_run_settings(ckpts):
    """The checkpoint says what the experts are; a base config with experts says how they run."""
    spec = MoeSpec(8, 1, 16, dispatch="capacity", capacity_factor=2.0, aux_loss_coef=0.05)
    base = dataclasses.replace(hf.default_model_cfg(), style="moe", moe=spec)
    got = hf.load(ckpts["qwen2_moe"][0], base).model_cfg.moe
    want = hf.architecture(ckpts["qwen2_moe"][0])["moe"]
    assert got == dataclasses.replace(
        want, dispatch="capacity", capacity_factor=2.0, aux_loss_coef=0.05
    )
    assert (got.num_experts, got.top_k, got.d_ff, got.shared_d_ff) == (4, 2, 32, 48)
    assert hf.load(ckpts["qwen2_moe"][0]).model_cfg.moe == want  # no experts in the base


def test_bf16_logits_within_bf16_rounding(ckpts):
    """bf16 params and compute: fp8jax's logits stray from the f32 reference no further than
    transformers' own bf16 model does (both round every activation to 8 mantissa bits, in
    other places), with a factor 2 for the different rounding points."""
    d, model = ckpts["llama3"]
    ref = torch_logits(model, TOKENS)
    bf16 = jnp.dtype(jnp.bfloat16)
    ours = fp8jax_logits(d, dtype=bf16, param_dtype=bf16)
    theirs = torch_logits(__import__("copy").deepcopy(model).bfloat16(), TOKENS)
    assert rel_max(ours, ref) <= 2 * rel_max(theirs, ref) + 1e-3
    assert rel_max(ours, ref) > 1e-5  # really computed in bf16


def read_tensors(directory):
    out = {}
    for f in io.safetensors_files(directory):
        out.update(safetensors.numpy.load_file(str(f)))
    return out


@pytest.mark.parametrize(
    "family", ["llama3", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt2"]
)
def test_hf_round_trip_is_bit_identical_in_bf16(tmp_path, family):
    src = tmp_path / "src"
    build(family, src, dtype="bfloat16")
    save_hf_tokenizer(byte_bpe(TEXTS, bos=True), src)
    hf.export(src, tmp_path / "out", max_shard_bytes=30_000)  # several shards + index
    before, after = read_tensors(src), read_tensors(tmp_path / "out")
    assert sorted(after) == sorted(before)
    for name, x in before.items():
        assert after[name].dtype == ml_dtypes.bfloat16 and after[name].shape == x.shape, name
        assert np.array_equal(after[name].view(np.uint16), x.view(np.uint16)), name
    assert (tmp_path / "out" / io.SAFETENSORS_INDEX).is_file()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        src / "tokenizer.json"
    ).read_bytes()


def random_params(model_cfg, seed=0):
    """Random params of ``model_cfg``'s shapes (numpy: no init to compile); 1-D ones
    (norm scales, biases) around 1 so that each matters."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, shape in weights.param_shapes(model_cfg).items():
        x = rng.standard_normal(shape.shape).astype(np.float32)
        out[k] = x * 0.3 + 1 if x.ndim == 1 else x * 0.08
    return out


def logits(model_cfg, params):
    return np.asarray(jax.jit(build_model(model_cfg).apply)({"params": params}, TOKENS))


FP8JAX_MODELS = {  # style and switches exported as each HF family
    "llama": dict(style="llama", num_kv_heads=2, qkv_bias=False, tie_embeddings=False),
    "qwen2": dict(style="llama", num_kv_heads=2, qkv_bias=True, tie_embeddings=True),
    "qwen3": dict(
        style="llama", num_kv_heads=2, qkv_bias=False, qk_norm="head", tie_embeddings=False
    ),
    "mixtral": dict(style="moe", num_kv_heads=2, tie_embeddings=False, moe=MoeSpec(4, 2, 32)),
    "qwen2_moe": dict(
        style="moe",
        num_kv_heads=2,
        qkv_bias=True,
        tie_embeddings=True,
        moe=MoeSpec(4, 2, 32, shared_d_ff=48, shared_gate=True, normalize_top_k=False),
    ),
    "qwen3_moe": dict(
        style="moe",
        num_kv_heads=2,
        qk_norm="head",
        tie_embeddings=False,
        moe=MoeSpec(4, 2, 32, normalize_top_k=False),
    ),
    "olmoe": dict(
        style="moe", num_kv_heads=4, qk_norm="full", tie_embeddings=False, moe=MoeSpec(4, 2, 32)
    ),
    "gpt2": dict(style="gpt", num_kv_heads=4, qkv_bias=False, tie_embeddings=True),
}


@pytest.mark.parametrize("kind", sorted(FP8JAX_MODELS))
def test_fp8jax_to_transformers_logits(tmp_path, kind):
    import transformers

    m = dataclasses.replace(
        hf.default_model_cfg(),
        vocab_size=VOCAB,
        d_model=64,
        num_heads=4,
        d_ff=96,
        max_len=MAX_POS,
        norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling=None,
        **FP8JAX_MODELS[kind],
    )
    # bf16-representable params: the export is then exact and both sides compute in f32.
    flat = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in random_params(m).items()}
    params = weights.unflatten(flat)
    tok = tokenizer_lib.train(TEXTS * 4, VOCAB, min_frequency=1)
    hf.save_hf(tmp_path / "out", m, params, tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="float32")
    assert model.config.model_type == kind
    ours = logits(m, params)
    assert rel_max(ours, torch_logits(model.eval(), TOKENS)) <= F32_TOL
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert fast(TEXTS[2])["input_ids"] == tok.encode(TEXTS[2]) and fast.eos_token_id == tok.eos_id


@pytest.mark.parametrize(
    "changes,words",
    [
        (dict(style="llama", qk_norm="full"), "style has qk_norm 'full'"),
        (dict(style="llama", qk_norm="head", qkv_bias=True), "set model.qkv_bias=False"),
        (dict(style="gpt", qk_norm="head"), "GPT-2 has no q/k norms"),
        (dict(style="llama", qk_norm="head", sliding_window=8), "set model.sliding_window=0"),
        (
            dict(style="moe", qk_norm="full", sliding_window=8, moe=MoeSpec(4, 2, 32)),
            "only Mixtral's attention has one",
        ),
        (dict(style="moe", moe=MoeSpec(4, 2, 32, router="sigmoid")), "router 'sigmoid'"),
        (
            dict(style="moe", moe=MoeSpec(4, 2, 32, normalize_top_k=False)),
            r"\(MixtralForCausalLM\).*normalize_top_k=True",
        ),
        (dict(style="moe", qkv_bias=True, moe=MoeSpec(4, 2, 32)), "set model.qkv_bias=False"),
    ],
)
def test_export_refuses_what_the_hf_architecture_lacks(tmp_path, changes, words):
    m = dataclasses.replace(hf.default_model_cfg(), num_kv_heads=4, **changes)
    tok = tokenizer_lib.train(TEXTS * 4, VOCAB, min_frequency=1)
    with pytest.raises(errors.CheckpointError, match=words):
        hf.save_hf(tmp_path / "out", m, None, tok)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bos", [False, True])
def test_tokenizer_ids_equal_transformers(tmp_path, bos):
    import transformers

    save_hf_tokenizer(byte_bpe(TEXTS, bos=bos), tmp_path, chat_template="{{ bos_token }}")
    ours = tokenizer_lib.load_hf(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in [*TEXTS, "Ünïcödé ✓ 日本語テキスト 👍🏽", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == text
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (0, 1, 2)
    assert ours.bos_id == theirs.bos_token_id and ours.eos_id == theirs.eos_token_id
    assert ours.chat_template == "{{ bos_token }}" and ours.eos_token == "</s>"
    assert (ours.encode("a b")[0] == 0) is bos


@pytest.mark.parametrize("text", ['{"eos_token": "</s>"', '["eos_token"]'])
def test_special_tokens_file_that_is_no_json_object_is_one_line(tmp_path, text):
    """A tokenizer_config.json cut short (or not an object) is refused naming it: its EOS, BOS
    and chat template must not vanish unseen."""
    save_hf_tokenizer(byte_bpe(TEXTS, bos=True), tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json (is unreadable|holds a list)"):
        tokenizer_lib.load_hf(tmp_path)


def test_fp8jax_tokenizer_unchanged(tmp_path):
    tok = tokenizer_lib.train(TEXTS * 4, 300, min_frequency=1)
    tok.save(tmp_path / "t.json")
    again = tokenizer_lib.Tokenizer.load(tmp_path / "t.json")
    assert again.eos_id == tok.token_to_id(tokenizer_lib.EOS) and again.chat_template is None
    assert again.bos_id is None and again.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_bad_inputs_name_the_problem(ckpts, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpts["qwen2"][0], d)
    edit_json(d / "config.json", architectures=["FalconForCausalLM"])
    with pytest.raises(errors.CheckpointError, match="FalconForCausalLM.*LlamaForCausalLM, Mist"):
        hf.architecture(d)
    for change, words in [
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope type 'yarn'"),
    ]:
        edit_json(d / "config.json", architectures=["LlamaForCausalLM"], **change)
        with pytest.raises(errors.CheckpointError, match=words):
            hf.architecture(d)
        edit_json(d / "config.json", hidden_act="silu", head_dim=16, rope_scaling=None)
    edit_json(d / "config.json", architectures=["LlamaForCausalLM"], attention_bias=True)
    with pytest.raises(errors.CheckpointError, match="attention_bias=True"):
        hf.architecture(d)
    edit_json(d / "config.json", architectures=["Qwen2ForCausalLM"], attention_bias=False)
    tensors = safetensors.numpy.load_file(str(d / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    good = tensors[name]
    tensors[name] = good[:16]
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(errors.CheckpointError, match=rf"tensor {name} .* \[16, 64\].*\[32, 64\]"):
        hf.load(d)
    del tensors[name]
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(errors.CheckpointError, match=f"lacks tensor {name}"):
        hf.load(d)
    tensors[name], tensors["model.extra.weight"] = good, good
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(errors.CheckpointError, match="model.extra.weight"):
        hf.load(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(errors.CheckpointError, match="tokenizer.json is missing.*save_pretrained"):
        hf.load(d)


@pytest.mark.parametrize(
    "family,change,words",
    [
        ("qwen2_moe", dict(decoder_sparse_step=2), "dense blocks among the MoE ones"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), "dense blocks among the MoE ones"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "no shared expert"),
        ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0"),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
        ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok 5 > 4 experts"),
    ],
)
def test_moe_configs_fp8jax_cannot_import(ckpts, tmp_path, family, change, words):
    import shutil

    shutil.copyfile(ckpts[family][0] / "config.json", tmp_path / "config.json")
    edit_json(tmp_path / "config.json", **change)
    with pytest.raises(errors.CheckpointError, match=words):
        hf.architecture(tmp_path)


def test_missing_expert_tensor_is_one_line_exit_2(ckpts, tmp_path):
    """A checkpoint without one expert's tensor: one line naming it (library and CLI)."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(ckpts["qwen3_moe"][0], d)
    tensors = safetensors.numpy.load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    del tensors[name]
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(errors.CheckpointError, match=f"lacks tensor {name}; it is incomplete"):
        hf.load(d)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fp8jax.hf.export_cli", str(d), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"lacks tensor {name}" in lines[0] and not out.exists()


def test_the_export_command_module_leaves_hf_export_the_function():
    """Loading the command-line module binds no ``hf.export`` attribute over the function."""
    import importlib

    importlib.import_module("fp8jax.hf.export_cli")
    assert hf.export is io.export and callable(hf.export)


def test_export_refuses_a_non_empty_output(ckpts, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(errors.CheckpointError, match="not empty"):
        hf.export(ckpts["gpt2"][0], tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir left behind


def test_export_refuses_an_output_inside_a_work_dirs_managed_folder(ckpts, tmp_path):
    """An export into another work dir's checkpoints/ (which its run manages) is refused,
    nothing written; beside those folders it is written."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "model.json").write_text("{}")
    out = run / "checkpoints" / "export"
    with pytest.raises(errors.ConfigError, match=r"output .*export is inside .*checkpoints, the "):
        hf.export(ckpts["gpt2"][0], out)
    assert not out.exists() and [p.name for p in (run / "checkpoints").iterdir()] == []
    hf.export(ckpts["gpt2"][0], run / "export")
    assert (run / "export" / "config.json").is_file()


def make_workdir(path, level: str):
    """A work dir as the trainer leaves it: a checkpoint at ``level``, model.json, tokenizer."""
    from fp8jax import provenance, spec
    from fp8jax.trainer import loop
    from fp8jax.trainer.checkpoint import Checkpointer

    config = loop.load_config("tiny", "llama")
    config.fp8.level, config.fp8.cast_kernel, config.model.vocab_size = level, "xla", VOCAB
    config.model.norm_eps, config.model.rope_theta = 1e-6, 5e5
    env = loop.setup(spec.parse(config))
    state = env.init(jax.random.PRNGKey(1))
    ckpt = Checkpointer(str(path), every=1)
    ckpt.save(0, state, {"step": 0}, force=True, wait=True)
    ckpt.close()
    provenance.record_model(path, env.run.model)
    tokenizer_lib.train(TEXTS * 4, VOCAB, min_frequency=1).save(path / "tokenizer.json")
    return env, state


def test_workdir_load_and_export_o2(tmp_path):
    """O2 stores the matmul kernels as FP16 masters with scales: load dequantizes them."""
    import transformers

    from fp8jax.optim import master

    env, state = make_workdir(tmp_path / "wd", "O2")
    loaded = hf.load(tmp_path / "wd")
    assert loaded.model_cfg.recipe is None and loaded.model_cfg.rope_theta == 5e5
    want = weights.flatten(master.materialize(state.params))
    got = weights.flatten(loaded.params)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], np.asarray(want[k]), err_msg=str(k))
    proc = subprocess.run(
        [sys.executable, "-m", "fp8jax.hf.export_cli", str(tmp_path / "wd"), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="float32")
    bf16 = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), loaded.params)
    ours = logits(loaded.model_cfg, bf16)
    assert rel_max(ours, torch_logits(model.eval(), TOKENS)) <= F32_TOL


def test_export_cli_bad_input_exit_2(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fp8jax.hf.export_cli", str(tmp_path / "nothing"), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "neither a Hugging Face model dir" in lines[0] and not out.exists()
