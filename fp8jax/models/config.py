"""The model's settings (``ModelConfig``), their vocabulary, the model-family protocol and
registry (``Family``), and size/FLOP accounting.

``fp8jax.spec.parse`` builds a ``ModelConfig`` from a config file's ``model`` and
``fp8`` sections, validated; library users may build one directly. Its fields are those of an
``Architecture`` (what the network is) and of an ``Execution`` (how it runs).
``ModelConfig.style`` names a registered ``Family`` (``fp8jax.models.families``: one module per
family), which says how the block is wired and how the model reads and writes Hugging Face
checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
from flax import linen as nn

from fp8jax.errors import ConfigError, check_choice
from fp8jax.models.hf_table import HfTensor
from fp8jax.ops import remat, scaling

__all__ = [
    "ATTENTION_IMPLS",
    "DTYPES",
    "FAMILIES",
    "FP8_IMPLS",
    "MLPS",
    "MLP_MATRICES",
    "MODEL_FLAGS",
    "MODEL_SIZES",
    "MOE_DISPATCH",
    "MoeSpec",
    "NORMS",
    "POSITIONS",
    "QK_NORMS",
    "REMAT_POLICIES",
    "ROUTERS",
    "STYLES",
    "Architecture",
    "Execution",
    "Family",
    "ModelConfig",
    "RopeScaling",
    "active_matmul_params",
    "count_params",
    "flops_per_token",
    "get_family",
    "matmul_params",
    "matmul_params_read",
    "num_experts",
    "register",
]

ATTENTION_IMPLS = ("", "xla", "cudnn")
# 'flax': flax's own nn.Fp8DirectDotGeneralOp in the same model, for the step benchmark.
FP8_IMPLS = ("fp8jax", "flax")
DTYPES = ("float32", "bfloat16", "float16")
# Remat policy name -> jax.checkpoint policy of each block (docs/performance.md: what each
# keeps for the backward pass). Bytes per element as saved: bf16 activations 2, E4M3 1.
REMAT_POLICIES = {
    "none": None,  # no remat: autodiff keeps every residual (not even a jax.checkpoint)
    "full": None,  # save nothing but the block's input: recompute the whole block
    # plain dots' outputs (2 bytes/elt); sees the per-tensor and rowwise FP8 GEMMs, never their
    # FP8 operands (the backward re-quantizes x and w), nor the block recipe's GPU kernel
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,  # as 'full'
    # dots_saveable without batched dots (attention's QK^T and AV, the batched FP8 einsums)
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # plain dots' and every FP8 GEMM's output (2 bytes/elt), any recipe: dots_saveable at O1+
    "fp8_dots_saveable": remat.fp8_dots_saveable,
    # the FP8 GEMMs' E4M3 operands (1 byte/elt of x; 1 byte per weight and layer for w), their
    # scales: the backward GEMMs read them, no re-quantization; O0: as 'full'
    "fp8_inputs_saveable": remat.fp8_inputs_saveable,
    # both of the above: the backward recomputes only elementwise work, no matmul
    "fp8_dots_and_inputs_saveable": remat.fp8_dots_and_inputs_saveable,
    # every activation the backward reads (attention's residuals, the MLP's hidden layer, the
    # residual stream; 2 bytes/elt) and no FP8 operand: the backward re-applies the norms and
    # re-casts x and w to E4M3 (one layout each), no GEMM or attention recomputed
    "activations_saveable": remat.activations_saveable,
    # the same plus the weights' E4M3 copies (1 byte per weight and layer): the backward
    # re-casts x only, not the weights
    "activations_and_weights_saveable": remat.activations_and_weights_saveable,
    # 'full', but the weights a per-layer fsdp gather brought (comm.gather='layer') are kept
    # for the backward instead of gathered again
    "full_keep_gathered": remat.full_keep_gathered,
}
# Positive sizes of a model.
MODEL_SIZES = ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "max_len")
MODEL_FLAGS = (
    "scan_layers",
    "fused_qkv",
    "tie_block_grads",
    "fp8_lm_head",
    "tie_embeddings",
    "qkv_bias",
    "recompute_elementwise",
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling ('llama3' rope type): long wavelengths slowed by ``factor``.

    Wavelengths above ``original_max_len / low_freq_factor`` are divided by ``factor``, those
    below ``original_max_len / high_freq_factor`` kept, and those between interpolated.
    """

    factor: float  # slow-down of the low frequencies
    low_freq_factor: float  # wavelengths longer than original_max_len / this are scaled
    high_freq_factor: float  # wavelengths shorter than original_max_len / this are kept
    original_max_len: int  # the context length the frequencies were trained at, tokens


QK_NORMS = ("", "head", "full")  # RMSNorm on q and k: none, per head (Qwen3), whole width (OLMoE)
ROUTERS = (
    "softmax",
    "sigmoid",
)  # MoE router scores: softmax (Mixtral, Qwen, OLMoE), sigmoid (DeepSeek-V3)
MOE_DISPATCH = ("dropless", "capacity")  # every token to its experts, or at most a capacity each


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A Mixture-of-Experts feed-forward layer: routed SwiGLU experts (and optional shared ones).

    Each token goes to its ``top_k`` highest-scoring experts; their outputs are summed with
    the router's weights. The router runs in f32 (never FP8). ``dispatch`` 'dropless' groups
    tokens by expert with none dropped; 'capacity' gives each expert at most
    ``ceil(capacity_factor * tokens * top_k / num_experts)`` tokens and drops the rest.
    """

    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    d_ff: int  # hidden width of each routed expert
    shared_d_ff: int = 0  # hidden width of the always-on shared expert (Qwen2-MoE), 0 = none
    shared_gate: bool = False  # shared expert's output scaled by sigmoid(x . w_gate) (Qwen2-MoE)
    router: str = "softmax"  # ROUTERS
    normalize_top_k: bool = True  # top-k weights renormalised to sum to 1 (Mixtral, Qwen3-MoE)
    dispatch: str = "dropless"  # MOE_DISPATCH
    capacity_factor: float = 1.25  # 'capacity' dispatch: slots per expert over the even share
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch/Mixtral form)
    z_loss_coef: float = 0.0  # router z-loss weight (mean squared logsumexp of the logits)
    bias_update_rate: float = 0.0  # sigmoid router: DeepSeek-V3's balancing bias step, 0 = off
    fp8_dispatch: bool = False  # expert parallelism: tokens sent to other shards as E4M3


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the network is: the fields a checkpoint determines (a Hugging Face config.json, a
    work dir's model.json), whatever runs it (``Execution``)."""

    style: str  # a registered family's name (STYLES): 'gpt' or 'llama'; see .family
    vocab_size: int  # token ids
    d_model: int  # residual width
    num_layers: int  # transformer blocks
    num_heads: int  # attention heads
    num_kv_heads: int  # key/value heads (grouped-query if < num_heads)
    head_width: int  # width of each attention head as declared; 0: d_model / num_heads
    d_ff: int  # MLP hidden width
    max_len: int  # longest sequence, tokens
    tie_embeddings: bool  # the token embedding doubles as the LM head
    norm_eps: float  # epsilon of LayerNorm / RMSNorm
    rope_theta: float  # RoPE base (LLaMA style)
    rope_scaling: RopeScaling | None  # Llama 3's frequency scaling, or None
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2) even where other linears don't
    qk_norm: str  # RMSNorm on q and k before RoPE (QK_NORMS): '', 'head' or 'full'
    # attention sees the last this-many positions, the token's own included (Mistral); 0 = all
    sliding_window: int
    moe: MoeSpec | None  # the routed-expert feed-forward layer; None: a dense MLP

    @property
    def head_dim(self) -> int:
        """The width of each attention head: ``head_width``, or d_model / num_heads."""
        return self.head_width or self.d_model // self.num_heads

    @property
    def family(self) -> Family:
        """The registered model family that ``style`` names (``fp8jax.models.families``)."""
        return get_family(self.style)

    @property
    def use_bias(self) -> bool:
        return self.family.use_bias  # GPT-2 linears carry biases, LLaMA's don't


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the network runs: dtypes, params layout, remat, the FP8 recipe, its kernels and
    fusions. The same architecture's params serve any of them (``hf.weights.relayout`` moves
    them between layer scan and fused Q/K/V layouts)."""

    dtype: Any  # activation/compute dtype (a jnp.dtype)
    param_dtype: Any  # parameter storage dtype (a jnp.dtype)
    scan_layers: bool  # stack the blocks with nn.scan
    fused_qkv: bool  # one GEMM for Q, K and V
    remat_policy: str  # a REMAT_POLICIES name
    tie_block_grads: bool  # a block's input gradient leaves with its weight gradients
    fp8_lm_head: bool  # the LM head in FP8 too
    attention_impl: str | None  # 'xla', 'cudnn', or None (JAX picks)
    # a generation step's attention over the KV cache (ops.decode_attention): 'auto', 'pallas'
    # (the kernel that reads the filled slots only, on CUDA), 'xla', 'interpret'
    decode_attention: str
    recipe: scaling.Recipe | None  # FP8 scaling of the matmuls; None: no FP8 matmuls
    fp8_impl: str  # 'fp8jax', or 'flax' (flax's own FP8 op, for benchmarks)
    cast_kernel: str  # how GEMM operands are quantized: 'pallas', 'xla', 'interpret'
    fuse_activation: bool  # GPT's GELU inside the E4M3 cast of the MLP's second matmul
    fuse_mlp: bool  # GPT's whole MLP as one custom VJP
    fuse_qkv: bool  # the fused Q/K/V projection as one custom VJP (with fused_qkv)
    fuse_norm: bool  # GPT's LayerNorms in the fused Q/K/V's and MLP's E4M3 casts (under rebuild)
    loss_chunk: int  # with targets: tokens per chunk of the LM head's loss (0 = full logits)
    # remat_policy 'none': the MLP's activation recomputed in the backward pass from its input
    # rather than keeping its intermediates (see layers.recomputes_elementwise)
    recompute_elementwise: bool


@dataclasses.dataclass(frozen=True)
class ModelConfig(Execution, Architecture):
    """Everything the network's shape and numerics depend on (hashable: modules keep it): an
    ``Architecture`` and its ``Execution`` as one flat set of fields.

    ``recipe`` is the FP8 scaling recipe of the matmuls, or None for plain matmuls in
    ``dtype`` (level O0).
    """

    @classmethod
    def of(cls, architecture: Architecture, execution: Execution) -> ModelConfig:
        """The model config of ``architecture`` run as ``execution``."""
        return cls(**_fields(architecture, Architecture), **_fields(execution, Execution))

    @property
    def architecture(self) -> Architecture:
        """What the network is (the fields a checkpoint determines)."""
        return Architecture(**_fields(self, Architecture))

    @property
    def execution(self) -> Execution:
        """How the network runs."""
        return Execution(**_fields(self, Execution))


def _fields(value: Any, part: type) -> dict[str, Any]:
    """``value``'s fields of the dataclass ``part`` (``Architecture`` or ``Execution``)."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(part)}


# The block pieces a family picks, by kind (models.layers and models.transformer build them).
NORMS = ("layernorm", "rmsnorm")  # LayerNorm: scale and bias; RMSNorm: scale only
POSITIONS = ("learned", "rope")  # a learned table added to the embedding, or RoPE on q and k
# GPT-2's tanh-GELU MLP, LLaMA's gated SiLU (SwiGLU), or routed SwiGLU experts (models.moe)
MLPS = ("gelu", "swiglu", "moe")
# weight matrices: GELU in/out, SwiGLU gate/up/out, per expert (MoE: each routed expert's)
MLP_MATRICES = {"gelu": 2, "swiglu": 3, "moe": 3}


class Family:
    """A model family: its block wiring, its config checks and its Hugging Face mapping.

    Each family is one module of ``fp8jax.models.families`` that subclasses ``Family`` and
    registers itself (``@register``) under ``name``, the ``model.style`` that selects it. The
    block is built from the kinds the family picks (``norm``, ``positions``, ``mlp``,
    ``use_bias``); the Hugging Face side is its ``config.json`` mapping and tensor table.
    """

    name: ClassVar[str]  # the model.style that selects the family
    norm: ClassVar[str]  # NORMS
    positions: ClassVar[str]  # POSITIONS
    mlp: ClassVar[str]  # MLPS
    use_bias: ClassVar[bool]  # every linear carries a bias
    hf_architectures: ClassVar[tuple[str, ...]]  # the HF architectures it imports
    hf_model_types: ClassVar[dict[str, str]]  # config.json model_type -> HF architecture

    def matmul_params_per_layer(self, cfg: ModelConfig) -> int:
        """Weights of one block that take part in matmuls: attention's and the MLP's."""
        h = cfg.head_dim
        attn = cfg.d_model * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, k, v, out
        return attn + MLP_MATRICES[self.mlp] * cfg.d_model * cfg.d_ff

    def active_matmul_params_per_layer(self, cfg: ModelConfig) -> int:
        """The weights of one block that a token's matmuls read (its FLOPs): all of them in a
        dense block; a routed-expert block's router, its top_k experts and its shared one."""
        return self.matmul_params_read_per_layer(cfg, 1)

    def matmul_params_read_per_layer(self, cfg: ModelConfig, tokens: int) -> int:
        """The weights of one block that the matmuls over ``tokens`` tokens read at most (a
        decode step's rows): all of them in a dense block."""
        return self.matmul_params_per_layer(cfg)

    def check(self, cfg: Architecture | Any) -> None:
        """Raise a one-line ConfigError where ``cfg``'s sizes do not fit the family's block
        (``cfg``: an Architecture or ModelConfig, or a config file's ``model`` section)."""
        if self.mlp != "moe" and num_experts(cfg):
            raise ConfigError(
                f"model.style={self.name!r} has a dense MLP, not model.moe.num_experts="
                f"{num_experts(cfg)} experts: set model.style='moe' or model.moe.num_experts=0"
            )
        head_dim = cfg.head_width or cfg.d_model // cfg.num_heads
        if self.positions == "rope" and head_dim % 2:
            raise ConfigError(
                f"RoPE needs an even head dim, got {head_dim}: change model.head_width (or "
                f"model.d_model or model.num_heads)"
            )

    def from_hf_config(self, hfc: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
        """The ModelConfig architecture fields of a HF config.json dict of ``architecture``."""
        raise NotImplementedError

    def hf_export_name(self, cfg: ModelConfig) -> str:
        """The HF architecture ``cfg`` exports as."""
        raise NotImplementedError

    def check_hf_export(self, cfg: ModelConfig) -> None:
        """Raise a one-line CheckpointError if ``cfg`` has no HF form (before anything is
        written)."""

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """The family's config.json keys of ``cfg`` (the common ones are added by the caller)."""
        raise NotImplementedError

    def hf_tensors(self, cfg: ModelConfig) -> list[HfTensor]:
        """Every tensor of ``cfg``'s HF state dict, in HF's order."""
        raise NotImplementedError


def num_experts(cfg: Architecture | Any) -> int:
    """Routed experts per block of ``cfg`` (an Architecture, ModelConfig or config ``model``
    section); 0 for a dense MLP."""
    moe = getattr(cfg, "moe", None)
    return 0 if moe is None else int(moe.num_experts)


FAMILIES: dict[str, Family] = {}  # name -> the registered family
STYLES = FAMILIES.keys()  # the registered names (a live view, filled by models.families)


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: register an instance of the family ``cls`` under ``cls.name``."""
    if cls.name in FAMILIES:
        raise ValueError(f"model family {cls.name!r} is registered twice")
    kinds = ((cls.norm, NORMS), (cls.positions, POSITIONS), (cls.mlp, MLPS))
    for kind, known in kinds:
        if kind not in known:
            raise ValueError(f"model family {cls.name!r}: unknown block kind {kind!r} ({known})")
    FAMILIES[cls.name] = cls()
    return cls


def get_family(name: str) -> Family:
    """The registered family ``name``; a one-line ConfigError naming the registered ones."""
    check_choice(name, STYLES, "model.style")
    return FAMILIES[name]


def count_params(params) -> int:
    """Number of parameters in a params tree (arrays, shape structs or partitioned boxes)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params)))


def matmul_params(model_cfg: ModelConfig) -> int:
    """Weights that take part in matmuls: block linears and the LM head (not embedding lookups)."""
    m = model_cfg
    return m.num_layers * m.family.matmul_params_per_layer(m) + m.d_model * m.vocab_size


def active_matmul_params(model_cfg: ModelConfig) -> int:
    """The matmul weights one token's forward pass reads (``matmul_params`` less the routed
    experts it does not go to)."""
    m = model_cfg
    return m.num_layers * m.family.active_matmul_params_per_layer(m) + m.d_model * m.vocab_size


def matmul_params_read(model_cfg: ModelConfig, tokens: int) -> int:
    """The matmul weights a forward pass over ``tokens`` tokens reads at most: ``matmul_params``
    less the routed experts none of them can go to (each token reads its own top_k)."""
    m = model_cfg
    per_layer = m.family.matmul_params_read_per_layer(m, tokens)
    return m.num_layers * per_layer + m.d_model * m.vocab_size


def flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N (N = active matmul params) + attention, PaLM convention.

    Attention counts QK^T and AV over the full sequence (12 * layers * heads * head_dim *
    seq_len for forward + backward), not halved for the causal mask, so MFU stays comparable
    with PaLM, MaxText and torchtitan numbers.
    """
    m = model_cfg
    attn = 12 * m.num_layers * m.num_heads * m.head_dim * seq_len
    return 6.0 * active_matmul_params(m) + attn
