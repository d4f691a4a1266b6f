"""The run spec: every config field lands in it, it is parsed once per run, it is typed.

configs/base.py alone decides each default: library dataclasses that keep defaults for
library users must agree with it, and the spec's own dataclasses carry none.
"""

import collections
import dataclasses
import gzip
import pathlib
import re

import pytest

from fp8jax import errors, models, spec
from fp8jax.configs import fields
from fp8jax.ops import scaling
from fp8jax.optim.levels import LEVELS, Level
from fp8jax.parallel import comm
from fp8jax.trainer import corpus, environment, loop

from fp8_testing import base_config, flat_fields, set_field

ROOT = pathlib.Path(__file__).resolve().parents[1]

MOE = {"model.style": "moe", "model.moe.num_experts": 4}  # a routed-expert model's settings

# Every field of configs/base.py: another valid value, and the RunSpec fields it must change
# (a third element: the settings it applies under, set on both sides of the comparison).
# A field renamed or dropped in base.py, or one parse() ignores, fails
# test_every_base_field_lands_in_the_run_spec.
CHANGES = {
    "seed": (1, {"seed"}),
    "init_from": ("/some/checkpoint", {"init_from"}),
    "model.style": ("llama", {"model"}),
    "model.vocab_size": (1000, {"model"}),
    "model.d_model": (256, {"model"}),
    "model.num_layers": (3, {"model"}),
    "model.num_heads": (8, {"model"}),
    "model.num_kv_heads": (2, {"model"}),
    "model.head_width": (16, {"model"}),
    "model.d_ff": (256, {"model"}),
    "model.max_len": (128, {"model"}),
    "model.dtype": ("bfloat16", {"model"}),
    "model.param_dtype": ("bfloat16", {"model"}),
    "model.scan_layers": (False, {"model"}),
    "model.fused_qkv": (True, {"model"}),
    "model.remat_policy": ("full", {"model"}),
    "model.tie_block_grads": (False, {"model"}),
    "model.fp8_lm_head": (True, {"model"}),
    "model.tie_embeddings": (True, {"model"}),
    "model.qkv_bias": (True, {"model"}),
    "model.norm_eps": (1e-6, {"model"}),
    "model.rope_theta": (5e5, {"model"}),
    "model.attention_impl": ("cudnn", {"model"}),
    "model.decode_attention": ("xla", {"model"}),
    "model.loss_chunk": (4096, {"model"}),
    "model.recompute_elementwise": (True, {"model"}),
    "model.qk_norm": ("head", {"model"}),
    "model.sliding_window": (16, {"model"}),
    # A routed-expert layer needs experts (and the 'moe' style): each MoE field with them set.
    "model.moe.num_experts": (8, {"model"}, MOE),
    "model.moe.top_k": (1, {"model"}, MOE),
    "model.moe.d_ff": (64, {"model"}, MOE),
    "model.moe.shared_d_ff": (64, {"model"}, MOE),
    "model.moe.shared_gate": (True, {"model"}, {**MOE, "model.moe.shared_d_ff": 16}),
    "model.moe.router": ("sigmoid", {"model"}, MOE),
    "model.moe.normalize_top_k": (False, {"model"}, MOE),
    "model.moe.dispatch": ("capacity", {"model"}, MOE),
    "model.moe.capacity_factor": (2.0, {"model"}, MOE),
    "model.moe.aux_loss_coef": (0.1, {"model"}, MOE),
    "model.moe.z_loss_coef": (1e-3, {"model"}, MOE),
    "model.moe.bias_update_rate": (1e-3, {"model"}, {**MOE, "model.moe.router": "sigmoid"}),
    "model.moe.fp8_dispatch": (True, {"model"}, MOE),
    "fp8.level": ("O2", {"fp8"}),
    "fp8.recipe": ("current", {"fp8", "model"}),  # the model's matmuls use the recipe
    "fp8.history_len": (4, {"fp8", "model"}),
    "fp8.amax_compute_algo": ("most_recent", {"fp8", "model"}),
    "fp8.margin": (1, {"fp8", "model"}),
    "fp8.power_of_two": (True, {"fp8", "model"}),
    # Fields of the fine-grained recipes: changed on top of a config that uses one.
    "fp8.block_size": (64, {"fp8", "model"}, {"fp8.recipe": "block"}),
    "fp8.grad_format": ("e5m2", {"fp8", "model"}, {"fp8.recipe": "rowwise"}),
    "fp8.impl": ("flax", {"model"}),
    "fp8.cast_kernel": ("xla", {"model"}),
    "fp8.fuse_activation": (False, {"model"}),
    "fp8.fuse_mlp": (False, {"model"}),
    "fp8.fuse_qkv": (False, {"model"}),
    "fp8.fuse_norm": (False, {"model"}),
    "fp8.m_format": ("e5m2", {"fp8"}),
    "fp8.v_format": ("bfloat16", {"fp8"}),
    "fp8.master_format": ("bfloat16", {"fp8"}),
    "fp8.master_rounding": ("nearest", {"fp8"}),
    "data.format": ("sft", {"data"}),
    "data.packing": (False, {"data"}),
    "data.overlong": ("truncate", {"data"}),
    "data.path": ("corpus.txt", {"data"}),
    "data.val_fraction": (0.1, {"data"}),
    "data.tokenizer": ("tokenizer.json", {"data"}),
    "data.tokenizer_min_frequency": (3, {"data"}),
    "data.encode_workers": (2, {"data"}),
    "data.cache_dir": ("caches", {"data"}),
    "data.sources": ("a/,tokens:b/", {"data"}, {"data.format": "mix", "data.sources": "c/"}),
    "data.weights": ("3,1", {"data"}, {"data.format": "mix", "data.sources": "a/,b/"}),
    "data.allow_corpus_change": (True, {"data"}),
    "data.verify_corpus": (True, {"data"}),
    "dpo.beta": (0.5, {"dpo"}),
    "dpo.label_smoothing": (0.1, {"dpo"}),
    "batch_size": (32, {"optim"}),
    "seq_len": (32, {"optim"}),
    "grad_accum_steps": (2, {"optim"}),
    "grad_accum_dtype": ("", {"optim"}),
    "num_train_steps": (10, {"optim"}),
    "learning_rate": (1e-3, {"optim"}),
    "warmup_steps": (5, {"optim"}),
    "min_lr_ratio": (0.5, {"optim"}),
    "weight_decay": (0.0, {"optim"}),
    "b1": (0.8, {"optim"}),
    "b2": (0.99, {"optim"}),
    "eps": (1e-6, {"optim"}),
    "grad_clip": (0.5, {"optim"}),
    "update_slice_mib": (64.0, {"optim"}),
    "eval_every_steps": (7, {"loop"}),
    "eval_batches": (3, {"loop"}),
    "log_every_steps": (3, {"loop"}),
    "fp8_stats_every_steps": (7, {"loop"}),
    "checkpoint_every_steps": (7, {"loop"}),
    "keep_checkpoints": (3, {"loop"}),
    "max_bad_steps": (2, {"loop"}),
    "sample_tokens": (0, {"loop"}),
    "compilation_cache_dir": ("", {"loop"}),
    "mesh.data": (2, {"mesh"}),
    "mesh.fsdp": (2, {"mesh"}),
    "mesh.tensor": (2, {"mesh"}),
    "mesh.expert": (2, {"mesh"}),
    "distributed": (True, {"distributed"}),
    "comm.enabled": (False, {"comm"}),
    "comm.grad_format": ("e4m3", {"comm"}),
    "comm.wire": ("uint8", {"comm"}),
    "comm.min_fp8_size": (0, {"comm"}),
    "comm.mu_init": (2.0, {"comm"}),
    "comm.mu_growth": (1.0, {"comm"}),
    "comm.saturation_limit": (0.0, {"comm"}),
    "comm.bucket_by_layer": (False, {"comm"}),
    "comm.gather": ("layer", {"comm"}),
}


def changed_sections(a: spec.RunSpec, b: spec.RunSpec) -> set[str]:
    """The RunSpec fields in which ``a`` and ``b`` differ."""
    names = [f.name for f in dataclasses.fields(spec.RunSpec)]
    return {name for name in names if getattr(a, name) != getattr(b, name)}


def test_every_base_field_lands_in_the_run_spec():
    fields = flat_fields(base_config())
    assert fields == set(CHANGES), (
        f"base.py fields without a CHANGES entry: {sorted(fields - set(CHANGES))}; entries for "
        f"no field: {sorted(set(CHANGES) - fields)}"
    )
    for field, (value, sections, *context) in CHANGES.items():
        base, c = base_config(), base_config()
        for key, v in (context[0] if context else {}).items():
            set_field(base, key, v)
            set_field(c, key, v)
        set_field(c, field, value)
        assert changed_sections(spec.parse(base), spec.parse(c)) == sections, field


def test_parse_reads_no_field_twice_and_needs_every_one():
    """A config without one of base.py's fields is refused by name (no hidden default)."""
    for field in ("fp8.cast_kernel", "fp8.master_rounding", "distributed", "comm.wire"):
        c = base_config()
        *parents, leaf = field.split(".")
        section = c
        for part in parents:
            section = section[part]
        del section[leaf]
        with pytest.raises(errors.ConfigError, match=rf"no field '{leaf}'.*configs/base.py"):
            spec.parse(c)


def test_library_defaults_agree_with_base():
    """Defaults kept for library users equal configs/base.py's, the one place that decides."""
    run = spec.parse(base_config())
    assert comm.CommConfig() == run.comm
    assert Level.O2.storage() == spec.with_level(run, Level.O2).fp8.storage
    assert scaling.DelayedScaling() == run.fp8.recipe
    with pytest.raises(errors.ConfigError, match="most_recent"):  # the spec checks the recipe's
        bad = base_config()
        bad.fp8.amax_compute_algo = "mean"
        spec.parse(bad)
    # The spec's own dataclasses (and the model's) carry no defaults at all.
    for cls in (
        spec.RunSpec,
        spec.Fp8Spec,
        spec.DataSpec,
        spec.OptimSpec,
        spec.LoopSpec,
        spec.MeshSpec,
        models.ModelConfig,
    ):
        for f in dataclasses.fields(cls):
            assert f.default is dataclasses.MISSING, f"{cls.__name__}.{f.name}"
            assert f.default_factory is dataclasses.MISSING, f"{cls.__name__}.{f.name}"


def test_no_config_defaults_in_the_library():
    """No ``.get(field, default)`` on a config anywhere in fp8jax/, and only the edge (spec,
    the loop's entry point, the command lines and their shared flag parsing, inspect's main and
    the config files themselves) knows ml_collections."""
    edge = {"spec.py", "trainer/loop.py", "diagnostics/inspect.py", "errors.py", "train.py"}
    edge |= {"cli.py"}
    edge |= {f"configs/{p.name}" for p in (ROOT / "fp8jax" / "configs").glob("*.py")}
    sections = r"config\w*|c|cfg|m|f|d|fp8|data|model|comm|mesh|optim|loop"
    pattern = re.compile(rf"\b({sections})\.get\(")
    for path in sorted((ROOT / "fp8jax").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT / "fp8jax").as_posix()
        assert not pattern.search(text), f"{name}: {pattern.search(text).group(0)}"
        if name not in edge:
            assert "ml_collections" not in text and "ConfigDict" not in text, name


def test_level_is_one_ordered_type_with_one_table():
    assert [Level.parse(name) for name in LEVELS] == list(Level)
    assert Level.O2 > Level.O1 and f"{Level.O3}" == str(Level.O3) == "O3"
    with pytest.raises(ValueError, match=r"unknown fp8.level 'O4'.*'O0', 'O1', 'O2', 'O3'"):
        Level.parse("O4")
    rows = [level.capabilities for level in Level]
    for name in ("fp8_gemms", "fp8_grad_comm", "fp8_adam", "sharded_state"):
        flags = [getattr(r, name) for r in rows]
        assert flags == sorted(flags), name  # each level adds to the one before it
    assert Level.O1.storage().master_format == "float32"  # O1 keeps f32 masters
    assert Level.O2.storage("e5m2", "bfloat16", "bfloat16").m_format == "e5m2"


def test_with_level_keeps_model_and_fp8_in_step():
    run = spec.parse(base_config())
    o0 = spec.with_level(run, Level.O0)
    assert o0.model.recipe is None and o0.fp8.recipe == run.fp8.recipe
    assert spec.with_level(o0, Level.O1) == run
    with pytest.raises(ValueError, match="with_level"):
        dataclasses.replace(run, fp8=dataclasses.replace(run.fp8, level=Level.O0))


def test_setup_is_a_frozen_dataclass_without_string_keys():
    c = base_config()
    c.model.num_layers, c.model.d_model, c.model.d_ff = 1, 64, 128
    env = loop.setup(spec.parse(c))
    names = {f.name for f in dataclasses.fields(loop.Setup)}
    assert names == {
        "run",
        "mesh",
        "model",
        "objective",
        "tx",
        "init",
        "abstract",
        "state_shardings",
        "batch_sharding",
        "train_step",
        "eval_step",
        "stats_step",
    }
    with pytest.raises(TypeError):
        env["train_step"]  # noqa: B018
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.train_step = None
    assert env.model.cfg == env.run.model


def test_a_run_parses_its_config_once(tmp_path, monkeypatch):
    """One train_and_evaluate: parse, each section's checks, the comm and level parsing and the
    environment checks all run exactly once; nothing below the entry point parses again."""

    counts = collections.Counter()

    def counted(owner, name):
        real, key = getattr(owner, name), f"{owner.__name__}.{name}"

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    checks = (
        "parse",
        "_fp8_and_model",
        "_recipe_fields",
        "_optim",
        "parse_data",
        "parse_dpo",
        "_comm",
    )
    env_checks = ("check_corpus", "check_environment")
    for name in checks:
        counted(spec, name)
    for name in env_checks:
        counted(environment, name)
    counted(spec.Level, "parse")
    counted(fields, "validate")  # each declared field against configs/base.py, once
    real_post_init = comm.CommConfig.__post_init__

    def post_init(self):
        counts["CommConfig"] += 1
        real_post_init(self)

    monkeypatch.setattr(comm.CommConfig, "__post_init__", post_init)
    text = gzip.open(corpus.SHIPPED_DIR / "persuasion.txt.gz", "rt").read()[:60_000]
    (tmp_path / "corpus.txt").write_text(text)
    c = loop.load_config("tiny")
    c.model.update(num_layers=1, d_model=64, num_heads=2, num_kv_heads=2, d_ff=128)
    c.model.update(vocab_size=300, max_len=16)
    c.data.path = str(tmp_path / "corpus.txt")
    c.seq_len, c.batch_size, c.num_train_steps, c.eval_batches = 16, 4, 1, 1
    c.sample_tokens, c.compilation_cache_dir = 0, ""
    summary = loop.train_and_evaluate(c, str(tmp_path / "work"))
    assert summary["step"] == 1
    expected = {f"{spec.__name__}.{name}" for name in checks} | {"Level.parse", "CommConfig"}
    expected.add(f"{fields.__name__}.validate")
    expected |= {f"{environment.__name__}.{name}" for name in env_checks}
    assert counts == dict.fromkeys(expected, 1), dict(counts)


def test_each_field_is_declared_once_with_a_valid_default():
    """configs/base.py declares every field with a kind; its default passes its own check, and
    the ConfigDict that config files override is exactly those defaults."""
    from fp8jax.configs import base

    declared = fields.declared(base.declarations())
    assert set(declared) == flat_fields(base_config())
    for name, decl in declared.items():
        decl.check(decl.default, name)
    assert base.get_config().to_dict() == base_config().to_dict()
    assert fields.defaults(base.declarations()).seed == declared["seed"].default


def test_a_field_kind_refuses_by_name():
    """Each kind's refusal names the field and value (what spec.parse surfaces as one line)."""
    cases = [
        (fields.Int(1, 1), 0, "config.x=0: use an integer >= 1"),
        (fields.Int(1, 1, also=(-1,)), -2, "(or -1)"),
        (fields.Real(0.5, "[0, 1)"), 1.0, "config.x=1.0: use a finite number in [0, 1)"),
        (fields.Bool(True), 1, "config.x=1: use True or False"),
        (fields.Choice("a", ("a", "b")), "c", "unknown x 'c': use one of ['a', 'b']"),
        (fields.Choice("a", ("a",), fix="use 'a'"), "c", "config.x='c': use 'a'"),
        (fields.Text("", "use a path"), 3, "config.x=3: use a path"),
    ]
    for decl, bad, message in cases:
        with pytest.raises(errors.ConfigError, match=re.escape(message)):
            decl.check(bad, "x")
    fields.Choice("a", ("a",), also=(None,)).check(None, "x")
    fields.Field(0).check(object(), "x")  # checked by what it configures


def test_recipe_fields_are_checked_by_the_recipes():
    """A recipe field's value is refused by the recipe's own validation, under any recipe."""
    c = base_config()
    assert c.fp8.recipe == "delayed"
    c.fp8.block_size = 96  # the block recipe's: not a power of two
    with pytest.raises(errors.ConfigError, match=r"config.fp8.block_size=96: .*power of two"):
        spec.parse(c)
    with pytest.raises(ValueError, match="power of two"):
        scaling.BlockScaling(block_size=96)
