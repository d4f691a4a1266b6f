"""Every config field, declared once: its default, valid values, meaning and unit.

Each line reads ``section.field = Kind(default, valid values)  # meaning, unit`` (the kinds:
``fp8jax.configs.fields``). ``get_config()`` is the config of every field at its default, the
tiny CPU run (configs/tiny.py); named configs start from it and override what differs, so a
config file outside the package can do the same. ``fp8jax.spec.parse`` checks each
field against its declaration here and supplies no default of its own. The fields declared
as a plain ``Field``, the scaling recipes', are checked by the recipes themselves
(``fp8jax.ops.scaling``). ``comm``'s valid values are ``fp8jax.parallel.comm``'s, which
``CommConfig`` checks again for library users who build one directly.
"""

import ml_collections

from fp8jax import data_spec
from fp8jax.configs.fields import Bool, Choice, Field, Int, Real, Text, defaults
from fp8jax.models import config as model_lib
from fp8jax.ops import kernels, scaling
from fp8jax.optim.levels import MASTER_ROUNDING, STATE_FORMATS, Level
from fp8jax.parallel import comm as comm_lib

__all__ = ["COMPILATION_CACHE_DIR", "declarations", "get_config"]

INIT_FROM_FIX = (
    "use a checkpoint directory (Hugging Face model or fp8jax work dir) or '' for a random init"
)
GRAD_ACCUM_DTYPE_FIX = "use 'float32' or '' (the gradients' own dtype)"
CACHE_DIR_FIX = "use a directory path, or '' to compile without JAX's persistent cache"
COMPILATION_CACHE_DIR = "~/.cache/fp8jax/jax"  # JAX's persistent cache: runs and command lines


def get_config() -> ml_collections.ConfigDict:
    """All config fields with CPU-sized defaults."""
    return defaults(declarations())


def declarations() -> ml_collections.ConfigDict:
    """Every config field's declaration (``fp8jax.configs.fields``), sections as in a config."""
    c = ml_collections.ConfigDict()
    c.seed = Int(0, 0, 2**32 - 1)  # PRNG seed for parameters and data order
    # Start from a checkpoint: a Hugging Face model dir or an fp8jax work dir ('' = random init).
    # Its architecture replaces the model's sizes below and its tokenizer the learned BPE; the
    # training fields (dtype, remat, scan, FP8 level and recipe) stay this config's. A resumed
    # run continues from its own checkpoint in the work dir, not from this one.
    c.init_from = Text("", INIT_FROM_FIX)  # checkpoint directory to fine-tune, or '' (random init)

    # --- model ---
    c.model = m = ml_collections.ConfigDict()
    # 'gpt': learned positions, LayerNorm, GELU; 'llama': RoPE, RMSNorm, SwiGLU
    m.style = Choice("gpt", model_lib.STYLES)
    m.vocab_size = Int(512, 1)  # tokenizer vocabulary (BPE trained locally to this size)
    m.d_model = Int(128, 1)  # residual width
    m.num_layers = Int(2, 1)  # transformer blocks
    m.num_heads = Int(4, 1)  # attention heads (must divide d_model)
    m.num_kv_heads = Int(4, 1)  # key/value heads (grouped-query if < num_heads)
    m.head_width = Int(0, 0)  # width of each attention head; 0 = d_model / num_heads
    m.d_ff = Int(512, 1)  # MLP hidden width
    m.max_len = Int(64, 1)  # longest sequence (learned position table size), tokens
    m.dtype = Choice("float32", model_lib.DTYPES)  # activation/compute dtype ('bfloat16' on GPU)
    m.param_dtype = Choice("float32", model_lib.DTYPES)  # parameter storage dtype
    m.scan_layers = Bool(True)  # stack blocks with nn.scan (one compiled block)
    # one GEMM for Q, K and V (kernel [embed, kv_heads, group + 2, head_dim])
    m.fused_qkv = Bool(False)
    # Block recompute, what each policy keeps: docs/performance.md. jax's 'dots_saveable',
    # 'nothing_saveable', 'dots_with_no_batch_dims_saveable'; the FP8 GEMMs' named residuals:
    # 'fp8_dots_saveable' (outputs), 'fp8_inputs_saveable' (E4M3 operands, 1 byte/element),
    # 'fp8_dots_and_inputs_saveable' (both); 'activations_saveable' (every bf16 activation the
    # backward reads, no E4M3 copy: re-casts x and w); 'activations_and_weights_saveable' (the
    # same plus the weights' E4M3 copies: re-casts x only); 'full_keep_gathered' ('full' keeping
    # the weights per-layer fsdp gathers brought: comm.gather).
    # 'none': keep every activation; 'full': recompute each block
    m.remat_policy = Choice("none", tuple(model_lib.REMAT_POLICIES))
    # With remat, unrolled: XLA:GPU may not defer a block's weight-gradient GEMMs (memory).
    m.tie_block_grads = Bool(True)  # a block's input gradient leaves with its weight gradients
    m.fp8_lm_head = Bool(False)  # also run the LM head in FP8 (a little faster, a little more loss)
    m.tie_embeddings = Bool(False)  # share the token embedding with the LM head
    m.qkv_bias = Bool(False)  # biases on the q/k/v projections also in 'llama' style (Qwen2)
    m.norm_eps = Real(1e-5, "(0, 1)")  # LayerNorm / RMSNorm epsilon
    m.rope_theta = Real(10_000.0, "(1, inf)")  # RoPE base ('llama' style; Llama 3 uses 500000)
    # dot_product_attention implementation: 'xla', 'cudnn', '' (JAX picks)
    m.attention_impl = Choice("xla", model_lib.ATTENTION_IMPLS, also=(None,))
    # A generation step's attention over the KV cache: 'auto' (the Pallas decode kernel on CUDA
    # GPUs, which reads only each row's filled slots of a 16-bit cache; XLA elsewhere), 'xla'
    # (reads every slot of the cache bucket), 'pallas', 'interpret' (the kernel in Pallas'
    # interpreter: tests)
    m.decode_attention = Choice(kernels.AUTO, (kernels.AUTO, *kernels.IMPLS))
    # The loss runs the LM head over this many tokens (of batch x seq_len) at a time, under a
    # custom VJP that recomputes each chunk's logits in the backward: no [batch, seq, vocab] f32
    # logits, their copy or their gradient alive. Needs fp8_lm_head=False. 0 = the full logits.
    m.loss_chunk = Int(0, 0)  # tokens per chunk of the LM head's loss (0 = off)
    # With remat_policy='none': the MLP keeps only its first matmul's output for the backward
    # pass (the activation is recomputed, a few elementwise passes) instead of the activation's
    # intermediates. Saves most at O0 (benchmarks/RESULTS.md, "gpt_1b3 memory against
    # PyTorch"): GPT's at no measured cost, LLaMA's for ~2% of the step's speed. GPT's fused FP8
    # MLP also rebuilds wo's E4M3 input (the wgrad operand) in the backward.
    m.recompute_elementwise = Bool(False)  # recompute the MLP activation in the backward
    # RMSNorm on q and k before RoPE: '' none, 'head' over each head (Qwen3, Qwen3-MoE),
    # 'full' over all heads' width (OLMoE)
    m.qk_norm = Choice("", model_lib.QK_NORMS)
    # Sliding-window attention (Mistral): each token attends to the last this-many positions,
    # itself included; 0 = the whole causal prefix. Tokens
    m.sliding_window = Int(0, 0)
    # --- Mixture of Experts (the 'moe' family): routed SwiGLU experts in place of the MLP ---
    m.moe = e = ml_collections.ConfigDict()
    e.num_experts = Int(0, 0)  # routed experts per block (0: a dense MLP)
    e.top_k = Int(2, 1)  # experts each token is routed to (at most num_experts)
    e.d_ff = Int(128, 1)  # hidden width of each routed expert
    e.shared_d_ff = Int(0, 0)  # hidden width of an always-on shared expert (Qwen2-MoE), 0 = none
    e.shared_gate = Bool(False)  # the shared expert's output scaled by a sigmoid gate (Qwen2-MoE)
    # router scores: 'softmax' (Mixtral, Qwen-MoE, OLMoE) or 'sigmoid' (DeepSeek-V3)
    e.router = Choice("softmax", model_lib.ROUTERS)
    e.normalize_top_k = Bool(True)  # top-k weights renormalised to sum to 1 (OLMoE: False)
    # 'dropless': every token reaches its top_k experts (grouped GEMM over sorted tokens);
    # 'capacity': each expert takes at most capacity_factor x its even share, the rest dropped
    e.dispatch = Choice("dropless", model_lib.MOE_DISPATCH)
    e.capacity_factor = Real(1.25, "(0, inf)")  # 'capacity': slots per expert / even share
    e.aux_loss_coef = Real(0.01, "[0, inf)")  # load-balancing auxiliary loss weight
    e.z_loss_coef = Real(0.0, "[0, inf)")  # router z-loss weight
    # 'sigmoid' router: step of DeepSeek-V3's auxiliary-loss-free balancing bias, 0 = off
    e.bias_update_rate = Real(0.0, "[0, inf)")
    e.fp8_dispatch = Bool(False)  # expert parallelism: tokens cross shards as E4M3

    # --- FP8 (FP8-LM levels) ---
    c.fp8 = f = ml_collections.ConfigDict()
    # 'O0' bf16/f32, 'O1' FP8 GEMMs + FP8 grad comms, 'O2' + FP8 Adam, 'O3' + FSDP
    f.level = Choice("O1", tuple(Level.__members__))
    # 'delayed' (per-tensor, amax history), 'current' (per-tensor, this step's amax), 'rowwise'
    # (one scale per row along each GEMM's contraction) or 'block' (DeepSeek-V3: 1 x block_size
    # tiles for activations and gradients, block_size^2 for weights, fp8jax's block-scaled GEMM).
    f.recipe = Choice("delayed", tuple(sorted(scaling.RECIPES)))
    f.block_size = Int(128, 1)  # 'block' recipe: elements per scale along K (a power of two, >= 16)
    f.grad_format = Field("e4m3")  # 'rowwise'/'block': dy's FP8 format ('e4m3' or 'e5m2')
    f.history_len = Int(16, 1)  # delayed scaling: steps of amax history
    f.amax_compute_algo = Field("max")  # delayed scaling: 'max' over the window or 'most_recent'
    # Negative margins clip on purpose, positive ones leave headroom; past 16 binades either
    # way an E4M3 operand would clip or flush almost entirely.
    f.margin = Int(0, -16, 16)  # scale = fmax / (amax * 2**margin)
    f.power_of_two = Bool(False)  # round scales down to powers of two
    # FP8 matmul: 'fp8jax'; 'flax' = flax's Fp8DirectDotGeneralOp (benchmarks)
    f.impl = Choice("fp8jax", model_lib.FP8_IMPLS)
    # 'pallas': one fused cast+transpose+amax kernel per operand on GPUs, XLA ops elsewhere
    # (faster than XLA's casts; measured: docs/performance.md); 'xla': XLA fusions only;
    # 'interpret': the kernel through Pallas' interpreter (tests).
    # how GEMM operands are quantized: 'pallas', 'xla', 'interpret'
    f.cast_kernel = Choice("pallas", kernels.IMPLS)
    # GPT's GELU runs inside the E4M3 cast of the MLP's second matmul, and the backward keeps
    # only the pre-activation (recomputing tanh): a lower peak at the same step time.
    f.fuse_activation = Bool(True)  # False: a separate GELU, autodiff keeping its intermediates
    # GPT's whole MLP as one custom VJP: the backward folds GELU's derivative and the bias
    # gradient into wi's E5M2 cast (fp8jax/ops/mlp.py): a faster step at the same peak. Applies
    # to GPT's GELU MLP with fuse_activation, delayed scaling and the fused casts; ignored
    # elsewhere (LLaMA).
    f.fuse_mlp = Bool(True)  # False: the MLP as two FP8 matmuls, autodiff between them
    # The fused Q/K/V projection (model.fused_qkv) as one custom VJP: the backward casts dq, dk
    # and dv to E5M2 in their places, never writing them side by side in bf16 first
    # (fp8jax/ops/qkv.py). Applies with delayed scaling and the fused casts; ignored elsewhere.
    f.fuse_qkv = Bool(True)  # False: one FP8 matmul, its output sliced, autodiff concatenating back
    # GPT's LayerNorms folded into the E4M3 cast of the fused Q/K/V projection and the fused
    # MLP (fuse_qkv, fuse_mlp) under a remat policy that casts their input again in the
    # backward (activations_saveable, activations_and_weights_saveable): the casts read the
    # norm's input and row statistics, so the normalized tensor is never written in bf16 and
    # the backward runs no norm pass for it (fp8jax/ops/norm.py). Ignored elsewhere.
    f.fuse_norm = Bool(True)  # False: nn.LayerNorm's bf16 output, then the cast
    # O2+ storage formats, each one of 'e4m3', 'e5m2', 'float16', 'bfloat16', 'float32':
    f.m_format = Choice("e4m3", STATE_FORMATS)  # Adam first moment (with a per-tensor scale)
    f.v_format = Choice("float16", STATE_FORMATS)  # Adam second moment (with a per-tensor scale)
    # master copy of the matmul weights (with a per-tensor scale)
    f.master_format = Choice("float16", STATE_FORMATS)
    # 'stochastic': narrow masters round up with probability equal to the remainder, so updates
    # below half an FP16 step (warm-up at 7B) still move the weights; 'nearest': FP8-LM's rule.
    # how O2+ masters are re-quantized after each update
    f.master_rounding = Choice("stochastic", MASTER_ROUNDING)

    # --- data ---
    c.data = d = ml_collections.ConfigDict()
    # 'text': pre-training on a corpus; 'sft': supervised fine-tuning on .jsonl examples, each
    # {"messages": [{"role", "content"}, ...]} (loss on the assistant turns; needs a tokenizer
    # with a chat template) or {"prompt", "completion"} (loss on the completion and EOS);
    # 'dpo': preference tuning on .jsonl pairs {"prompt", "chosen", "rejected"} (strings, or
    # lists of messages under the chat template), the DPO loss of section dpo below.
    # 'tokens': pre-training on token shards (.npy, or .bin with the header of
    # fp8jax.trainer.token_shards) written with data.tokenizer, which must be given.
    # 'mix': pre-training on the weighted mixture of data.sources (data.path unused).
    # what data.path holds: 'text', 'tokens', 'mix', 'sft' or 'dpo'
    d.format = Choice("text", data_spec.DATA_FORMATS)
    # text: a text file, a folder of .txt, .txt.gz, .jsonl(.gz) ('text' field per line) or
    # .parquet ('text' column, pip install 'fp8jax[parquet]') files; '' = the shipped corpus.
    # tokens: a .npy or .bin token shard or a folder of them.
    # sft/dpo: a .jsonl file or a folder of them; '' = the novel task of the shipped corpus.
    # Any of them may be a glob pattern ('web/**/*.parquet'): the files and folders it matches.
    d.path = Text("", data_spec.DATA_FIX)  # the data file, folder or pattern (see above)
    # share held out for validation: of tokens, examples (sft) or pairs
    d.val_fraction = Real(0.05, "(0, 1)")
    # sft: True concatenates examples into rows of seq_len tokens (positions restart and
    # attention stays within each example); False puts one example per row, padded (dpo: False
    # is required, each pair a (chosen, rejected) row pair).
    d.packing = Bool(True)  # sft: pack several examples per row
    # sft: an example over seq_len + 1 tokens is 'drop'ped (and counted) or 'truncate'd.
    d.overlong = Choice("drop", data_spec.OVERLONG)
    # An existing tokenizer: a tokenizer.json file or a Hugging Face model dir holding one
    # ('' = learn a byte-level BPE of model.vocab_size ids on the corpus). The model's
    # vocabulary then follows it (model.vocab_size is its size rounded up to a multiple of
    # 128), and the work dir and its exports carry it. init_from brings its own tokenizer.
    d.tokenizer = Text("", "name a tokenizer.json or a Hugging Face model dir ('' = learn a BPE)")
    d.tokenizer_min_frequency = Int(2, 0)  # BPE merges need at least this many occurrences
    # text: processes that encode the corpus, each a range of a file (0 = one per CPU core)
    d.encode_workers = Int(0, 0)
    # text: a folder of token caches shared by runs, one per corpus contents, tokenizer and
    # split (a new work dir on the same corpus and tokenizer encodes nothing); '' = each work
    # dir's own tokens/. The contents are every byte of a corpus up to 256 MiB; past that each
    # file's size and sampled blocks (a same-size edit between the blocks is not seen).
    d.cache_dir = Text("", "name a folder for the shared token caches ('' = the work dir)")
    # mix: the mixed sources, comma-separated, each '[text:|tokens:]path' (a text corpus or
    # token shards as data.path names them; 'text:' by default), e.g. 'books/,tokens:web/'.
    # Training windows are drawn from each in proportion to data.weights, in a fixed
    # interleaving (deterministic, resumable from the step); validation windows spread over
    # every source's held-out split. '' for the other formats.
    d.sources = Text("", "name the mixed sources as '[text:|tokens:]path,...' ('' = no mix)")
    # mix: one weight > 0 per source, comma-separated, relative ('3,1': 75% and 25% of the
    # training windows); '' = equal weights
    d.weights = Text("", "give one weight > 0 per data.sources entry, e.g. '3,1' ('' = equal)")
    # Resuming (a checkpoint in the work dir) on another corpus, corpus contents or val_fraction
    # is refused unless True: then the token cache and validation split are rebuilt for the new
    # data and the tokenizer stays the checkpoint's (its ids are in the embeddings).
    d.allow_corpus_change = Bool(False)  # continue a checkpointed run on changed data (see above)
    # text: a corpus over 256 MiB is fingerprinted by sizes and sampled blocks, so a start does
    # not re-read it; True reads every byte of it before reusing a token cache and refuses the
    # cache if a file differs from the CRC-32s recorded when the cache was built.
    d.verify_corpus = Bool(False)  # check the whole corpus against its token cache's record

    # --- preference tuning (data.format='dpo') ---
    # The policy starts from init_from (or a random init) and a frozen copy of it, the
    # reference, stays in the train state. Implicit reward r = beta * (log pi - log pi_ref) of a
    # response (summed over its tokens); loss -log sigmoid(r_chosen - r_rejected) per pair.
    c.dpo = dpo = ml_collections.ConfigDict()
    # reward scale: larger keeps the policy closer to the reference
    dpo.beta = Real(0.1, "(0, inf)")
    # assumed share of flipped preference labels (0 = standard DPO)
    dpo.label_smoothing = Real(0.0, "[0, 0.5)")

    # --- optimisation ---
    c.batch_size = Int(16, 1)  # sequences per optimizer step (global)
    c.seq_len = Int(64, 1)  # tokens per sequence
    c.grad_accum_steps = Int(1, 1)  # micro-batches per step (batch_size must divide evenly)
    # '' sums in the gradients' own dtype: bf16 at O2+, 2 bytes/param less while accumulating.
    # dtype of the micro-batch gradients' running sum, or ''
    c.grad_accum_dtype = Choice("float32", ("float32", ""), fix=GRAD_ACCUM_DTYPE_FIX)
    c.num_train_steps = Int(300, 0)  # optimizer steps
    c.learning_rate = Real(3e-3, "(0, inf)")  # peak learning rate
    c.warmup_steps = Int(30, 0)  # linear warm-up steps
    c.min_lr_ratio = Real(0.1, "[0, 1]")  # cosine decays to this fraction of the peak
    c.weight_decay = Real(0.1, "[0, inf)")  # decoupled (AdamW) weight decay on matmul weights
    c.b1 = Real(0.9, "[0, 1)")  # Adam beta1
    c.b2 = Real(0.95, "[0, 1)")  # Adam beta2
    c.eps = Real(1e-8, "(0, inf)")  # Adam epsilon
    c.grad_clip = Real(1.0, "[0, inf)")  # global-norm gradient clipping (0 = off)
    # O2+: a leaf stacked over the layers (scan_layers) has its optimizer update done in groups
    # of layers whose f32 values (m, v, update, master) take at most this many MiB each, so the
    # update holds no f32 copy of the whole leaf; the loops cost step time on small models.
    # MiB of f32 per value updated at a time; 0 = each leaf whole
    c.update_slice_mib = Real(0.0, "[0, inf)")

    # --- loop ---
    c.eval_every_steps = Int(100, 1)  # validate every N steps
    c.eval_batches = Int(8, 1)  # validation batches per evaluation
    c.log_every_steps = Int(20, 1)  # console/TensorBoard scalars every N steps
    # per-layer FP8 health (amax, scale, saturation) every N steps
    c.fp8_stats_every_steps = Int(100, 1)
    c.checkpoint_every_steps = Int(100, 0)  # save every N steps (and at the end)
    c.keep_checkpoints = Int(2, 1)  # checkpoints kept in the work dir
    c.max_bad_steps = Int(5, 1)  # stop after this many consecutive non-finite steps
    c.sample_tokens = Int(48, 0)  # tokens of text sampled at the end (0 = off)
    # JAX's persistent compilation cache: a rerun or resume loads the compiled steps from here
    # instead of compiling them again ('' = off; JAX_COMPILATION_CACHE_DIR, if set, wins).
    # directory of compiled XLA programs
    c.compilation_cache_dir = Text(COMPILATION_CACHE_DIR, CACHE_DIR_FIX)

    # --- parallelism (see README: sharded training) ---
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = Int(-1, 1, also=(-1,))  # data-parallel axis size (-1 = all remaining devices)
    c.mesh.fsdp = Int(1, 1, also=(-1,))  # fully-sharded axis size
    c.mesh.tensor = Int(1, 1, also=(-1,))  # tensor-parallel axis size
    # MoE expert parallelism: the routed experts split over this many devices (it must divide
    # model.moe.num_experts), which also split the batch; tokens reach their experts by
    # all-to-all (model.moe.fp8_dispatch: as E4M3). A dense model uses it as data parallelism.
    c.mesh.expert = Int(1, 1)  # expert-parallel axis size
    c.distributed = Bool(False)  # call jax.distributed.initialize() (multi-host)

    # --- FP8 gradient communication (O1+, more than one data-parallel replica) ---
    c.comm = cm = ml_collections.ConfigDict()
    # reduce gradients in FP8 with a shared scale (False: XLA's f32 all-reduce)
    cm.enabled = Bool(True)
    # FP8 format of gradients on the wire: 'e5m2' (range) or 'e4m3'
    cm.grad_format = Choice("e5m2", comm_lib.GRAD_FORMATS)
    # 'auto', 'fp8' (FP8-typed collectives) or 'uint8' (FP8 bit patterns)
    cm.wire = Choice("auto", comm_lib.WIRES)
    cm.min_fp8_size = Int(4096, 0)  # gradients with fewer elements are reduced in f32, elements
    cm.mu_init = Real(1.0, comm_lib.INTERVALS["mu_init"])  # FP8-LM auto-scaling factor mu at step 0
    # mu's growth per step without saturation (a factor >= 1)
    cm.mu_growth = Real(2.0 ** (1.0 / 1000), comm_lib.INTERVALS["mu_growth"])
    # halve mu when more than this share (0.001%) of values clips
    cm.saturation_limit = Real(1e-5, comm_lib.INTERVALS["saturation_limit"])
    # one FP8 collective per layer (overlaps the backward) or one for all
    cm.bucket_by_layer = Bool(True)
    # Where fsdp-sharded weights are gathered: 'layer' (just before each layer runs, again for
    # its backward; each layer's gradients reduce-scattered as soon as they exist: ZeRO-3),
    # 'upfront' (all before the forward pass, gradients reduced after the backward), 'auto'
    # ('layer' at O3, 'upfront' below).
    cm.gather = Choice("auto", comm_lib.GATHERS)
    return c
