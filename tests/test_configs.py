"""Every shipped config (fp8jax/configs/, a checkout's configs/) loads as train.py loads it,
validates, and builds its model."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from fp8jax import configs, models, spec
from fp8jax.trainer import environment
from fp8jax.trainer import loop as train_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"  # the path README's commands use
CONFIG_FILES = sorted(f"{name}.py" for name in configs.names())
# Named size of each config, for a +-10% check of the parameter count.
NAMED_SIZES = {
    "gpt2_125m.py": 125e6,
    "gpt_1b3.py": 1.3e9,
    "llama_1b.py": 1.1e9,
    "llama_7b.py": 6.7e9,
    "llama_70b.py": 69e9,
}


def load(name: str, variant: str | None = None):
    """Load ``configs/<name>`` by file path, as ml_collections' config_flags does."""
    return train_lib.load_config(str(CONFIG_DIR / name), variant or None)


def flat_keys(config, prefix=""):
    out = set()
    for k, v in config.items():
        out |= flat_keys(v, f"{prefix}{k}.") if hasattr(v, "items") else {prefix + k}
    return out


def test_named_configs_exist():
    assert set(NAMED_SIZES) <= set(CONFIG_FILES)


def test_checkout_configs_are_the_shipped_ones():
    """configs/ is the package's folder (one copy of each file), and a name loads its file."""
    assert CONFIG_DIR.resolve() == configs.CONFIG_DIR
    shipped = [p.name for p in CONFIG_DIR.glob("*.py") if p.stem not in configs.NOT_CONFIGS]
    assert sorted(shipped) == CONFIG_FILES
    assert configs.load("tiny", "llama").to_dict() == load("tiny.py", "llama").to_dict()
    with pytest.raises(FileNotFoundError, match="tiny"):
        configs.load("tinyy")


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_builds_and_initialises(name):
    config = load(name)
    assert flat_keys(config) == flat_keys(load("tiny.py")), "configs must share tiny.py's fields"
    run = spec.parse(config)  # every field in range, the fields consistent
    environment.check_corpus(run)
    if jax.default_backend() != "gpu":
        config.model.attention_impl = "xla"  # cuDNN attention does not even trace without a GPU
    model = models.build_model(spec.parse(config).model)
    tokens = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    n = models.count_params(variables["params"])
    if name in NAMED_SIZES:
        assert abs(n / NAMED_SIZES[name] - 1) < 0.1, f"{name}: {n / 1e6:.1f}M params"
    logits = jax.eval_shape(model.apply, variables, tokens)
    assert logits.shape == (1, config.seq_len, config.model.vocab_size)
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(set(CONFIG_FILES) - {"base.py"}))
def test_docstring_starts_with_command(name):
    doc = (CONFIG_DIR / name).read_text().split('"""')[1]
    first = doc.splitlines()[0]
    assert re.fullmatch(rf"python train\.py --config configs/{name} --workdir /tmp/\w+", first)


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_field_commented(name):
    """Each field a config sets says what it means: on its line, or (too long) the line above."""
    lines = (CONFIG_DIR / name).read_text().splitlines()
    for above, line in zip(["", *lines], lines, strict=False):
        if re.match(r"\s+(c|m|f|d|cm|dpo|c\.\w+)\.\w+ = ", line) and "ConfigDict()" not in line:
            commented = "  # " in line or above.strip().startswith("# ")
            assert commented, f"{name}: field without a comment: {line.strip()}"


def test_tiny_llama_variant():
    config = load("tiny.py", "llama")
    assert config.model.style == "llama" and config.model.num_kv_heads == 2
    spec.parse(config)


def test_gpu_defaults():
    for name in NAMED_SIZES:
        m = load(name).model
        assert (m.dtype, m.attention_impl) == ("bfloat16", "cudnn"), name
