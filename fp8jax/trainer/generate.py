"""Using a trained model: text generation (KV cache).

Generation runs two jitted programs (``Decoder``): the prefill runs the prompt batch once,
fills the key/value cache (``fp8jax.models.decode``) and picks the first tokens; the decode
program runs the remaining tokens as a ``lax.while_loop`` of one-token steps against that cache.
The params and FP8 state are their arguments (never constants baked into a program); the
prefill compiles once per (batch, prompt length, cache length) bucket and the decode program
once per (batch, cache length) bucket, whatever the number of tokens, the prompts or the
sampling settings. At O1+ the FP8 matmuls use the stored delayed scales as they are; decoding
never updates them. Where the recipe allows it, the prefill quantizes each FP8 weight once and
the decode steps read those E4M3 copies (``decode.prefill``): a step reads one byte per FP8
weight and casts only its activations.

A watched decode (``TextStream``: streaming text, stop strings, the time of the first token)
compiles a second decode program whose every step hands its tokens to the host (an ordered
``io_callback``) and reads back which rows a stop string ended; the unwatched program has no
callback and never waits on the host. The trainer's end-of-run sample compiles its programs
in the background while the run trains (``compile_sample``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import io_callback

from fp8jax import errors, models
from fp8jax._tree import leaf_name
from fp8jax.models import decode, moe
from fp8jax.nn.state import FP8_WEIGHTS
from fp8jax.optim import adam as optim
from fp8jax.trainer import sampling as sampling_lib
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.sampling import GREEDY, Sampling

__all__ = [
    "BANDWIDTH",
    "Buckets",
    "COMPILE_THREAD",
    "Decoder",
    "MIN_BUCKET",
    "SAMPLE_TEMPERATURE",
    "NonFinite",
    "TextStream",
    "allowed_ids",
    "bucket",
    "buckets_for",
    "compile_ahead",
    "compile_sample",
    "compiling_ahead",
    "cut_at_stop",
    "decoder_for",
    "device_bandwidth",
    "end_sample",
    "generate",
    "generate_ids",
    "wait_for_compile",
]

MIN_BUCKET = 8  # smallest padded prompt / cache length (powers of two above it)
# Memory bandwidth, bytes/s, of the GPUs by a word of their device_kind (the SXM parts' data
# sheets): decoding one token reads every weight once, so weight bytes / bandwidth bounds it.
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12}


def device_bandwidth(device: jax.Device | None = None) -> float | None:
    """The memory bandwidth (bytes/s) of ``device`` (default: the first), None where unknown."""
    kind = (device or jax.devices()[0]).device_kind
    return next((bw for word, bw in BANDWIDTH.items() if word in kind), None)


def bucket(n: int, cap: int) -> int:
    """``n`` rounded up to a power of two (at least MIN_BUCKET), at most ``cap``."""
    return min(cap, max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded sizes of one generate call: rows, prompt length, cache slots."""

    batch: int
    prompt: int
    cache: int


def buckets_for(lengths: Sequence[int], max_new_tokens: int, max_len: int) -> Buckets:
    """The buckets for prompts of ``lengths`` tokens; a ConfigError if one does not fit."""
    errors.check_int(max_new_tokens, "--max_new_tokens", 1)
    longest = max(lengths)
    if longest + max_new_tokens > max_len:
        i = int(np.argmax(lengths))
        room = max_len - max_new_tokens
        fix = (
            f"shorten the prompt to at most {room} tokens or lower --max_new_tokens"
            if room >= 1
            else f"lower --max_new_tokens to at most {max_len - longest}"
            if longest < max_len
            else f"shorten the prompt below {max_len} tokens and lower --max_new_tokens"
        )
        raise errors.ConfigError(
            f"prompt {i} has {longest} tokens and --max_new_tokens is {max_new_tokens}: "
            f"together over the model's context of {max_len} tokens; {fix}"
        )
    return Buckets(
        batch=bucket(len(lengths), 1 << 30) if len(lengths) > 1 else 1,
        prompt=bucket(longest, max_len),
        cache=bucket(longest + max_new_tokens, max_len),
    )


class Decoder:
    """The jitted prefill and decode programs of one model; ``traces`` counts each one's
    compilations (``'prefill'``, ``'decode'``).

    ``prefill`` (one program per batch, prompt and cache bucket) runs the prompts, fills the
    key/value cache, quantizes the FP8 weights once where the recipe allows it
    (``decode.prefill``), at O0 casts the matmul weights to the compute dtype once
    (``step_params``), and picks each row's first token; ``decode`` (one program per batch and
    cache bucket, whatever the prompt bucket) runs the rest as a ``lax.while_loop`` on that
    cache and those weights: every step reads each weight once, in the bytes it computes in.
    """

    def __init__(self, model_cfg: models.ModelConfig, collection: str):
        self.model = models.build_model(decode.decoding_config(model_cfg))
        self.collection = collection
        self.traces: collections.Counter = collections.Counter()
        self.watcher: Callable | None = None  # (t, tok_B, done_B) -> stop_B of a watched call
        self.prefill = jax.jit(self._prefill, static_argnames=("cache_len",))
        # The cache and the output buffer are updated in place (donated to the loop, which
        # hands the cache back so that XLA can alias it).
        self.decode = jax.jit(self._decode, static_argnames=("watch",), donate_argnums=(4, 5))

    def __call__(
        self,
        params,
        fp8_state,
        tokens_BxP,
        lengths_B,
        max_new_tokens,
        s: Sampling,
        eos_ids: Sequence[int],
        cache_len: int,
        allowed_V=None,
        moe_state=None,
        watcher: Callable | None = None,
    ):
        """Tokens [B, cache_len] (prompt, then generated), the number of steps run and the
        first step with non-finite logits (``NonFinite``). ``allowed_V``: the ids that may be
        generated (the tokenizer's, without padding), all of them if None. ``moe_state``: an
        MoE model's router biases (``TrainState.moe_state``), if it has any. ``watcher(t, tok_B,
        done_B)`` (optional) sees each step's tokens on the host, in order, and returns the
        rows (bool [B]) to stop."""
        knobs = (jnp.float32(s.temperature), jnp.int32(s.top_k), jnp.float32(s.top_p))
        key = jax.random.PRNGKey(s.seed)
        eos_E = np.asarray(list(eos_ids) or [-1], np.int32)  # -1: no id stops a row
        if allowed_V is None:
            allowed_V = np.ones((self.model.cfg.vocab_size,), bool)
        lengths_B = jnp.asarray(lengths_B, jnp.int32)
        pick = (key, *knobs, eos_E, allowed_V)
        fixed = (params, fp8_state, moe_state or {})
        cast, weights, cache, out_BxM, tok_B, done_B, bad = self.prefill(
            *fixed, tokens_BxP, lengths_B, *pick, cache_len=cache_len
        )
        loop = (lengths_B, jnp.int32(max_new_tokens), *pick)
        if watcher is not None:
            # The first token reaches the host from the prefill's output; the loop's by callback.
            # Only the padding rows count as done before it (an EOS row is the watcher's to end).
            stop_B = watcher(0, np.asarray(tok_B), np.asarray(lengths_B) == 0)
            done_B = np.asarray(done_B) | np.asarray(stop_B, bool)  # on the host: no program
        self.watcher = watcher
        try:
            prefilled = (cast, weights, cache, out_BxM, tok_B, done_B, bad)
            out_BxM, t, bad, _ = self.decode(
                *self.decode_args(fixed, prefilled), *loop, watch=watcher is not None
            )
            if watcher is not None:  # its callbacks run until the loop ends: keep it till then
                jax.block_until_ready(out_BxM)
        finally:
            self.watcher = None
        return out_BxM, t, bad

    def compile(
        self, params, fp8_state, moe_state, b: Buckets, num_eos: int, watch: bool = False
    ) -> None:
        """Compile the prefill and the decode (``watch``: the watched one) of bucket ``b`` ahead
        of a call, from the shapes and shardings of ``params``, ``fp8_state`` and ``moe_state``
        (arrays or ``jax.ShapeDtypeStruct``s; the arrays may be donated meanwhile), for
        ``num_eos`` EOS ids: the call that follows reuses the programs (safe from another
        thread)."""
        fixed = jax.tree.map(_spec, (params, fp8_state, moe_state or {}))
        committed = any(x.sharding is not None for x in jax.tree.leaves(fixed))
        i32, S = jnp.int32, jax.ShapeDtypeStruct
        knobs = (S((), jnp.float32), S((), i32), S((), jnp.float32))
        key = jax.eval_shape(jax.random.PRNGKey, 0)
        vocab = self.model.cfg.vocab_size
        pick = (key, *knobs, S((max(num_eos, 1),), i32), S((vocab,), jnp.bool_))
        prompt = (S((b.batch, b.prompt), i32), S((b.batch,), i32))
        traced = self.prefill.trace(*fixed, *prompt, *pick, cache_len=b.cache)
        loop = (S((b.batch,), i32), S((), i32), *pick)
        if committed:  # the decode takes the shardings the prefill's compile gives its outputs
            out = traced.lower().compile().out_info
            out = jax.tree.map(lambda o: S(o.shape, o.dtype, sharding=o.sharding), out)
            self.decode.trace(*self.decode_args(fixed, out), *loop, watch=watch).lower().compile()
            return
        # Uncommitted inputs give uncommitted outputs: the decode traces from the prefill's
        # traced shapes, and XLA compiles the two programs at once (it releases the GIL). The
        # second compile's thread is a daemon, as ``compile_ahead``'s.
        out = jax.tree.map(lambda o: S(o.shape, o.dtype), traced.out_info)
        decode_args = (*self.decode_args(fixed, out), *loop)
        decode_lowered = self.decode.trace(*decode_args, watch=watch).lower()
        failed: list[BaseException] = []

        def compile_decode() -> None:
            try:
                decode_lowered.compile()
            except BaseException as e:  # raised in the caller's thread below
                failed.append(e)

        thread = threading.Thread(target=compile_decode, name=COMPILE_THREAD, daemon=True)
        thread.start()
        traced.lower().compile()
        thread.join()
        if failed:
            raise failed[0]

    @staticmethod
    def decode_args(fixed: tuple, prefilled: tuple) -> tuple:
        """The ``decode`` program's arguments before the loop's, from the call's ``(params,
        fp8_state, moe_state)`` and the ``prefill``'s outputs: the steps read the params the
        prefill cast (``step_params``) where it cast any, then the prefill's other outputs."""
        cast, *rest = prefilled
        return (cast or fixed[0], *fixed[1:], *rest)

    def _watch(self, t, tok_B, done_B) -> np.ndarray:
        """The host side of a watched step: the current ``watcher``'s stop rows."""
        return np.asarray(self.watcher(int(t), np.asarray(tok_B), np.asarray(done_B)), bool)

    def _variables(self, params, fp8, moe_state, weights=None) -> dict:
        variables = {"params": optim.materialize(params), self.collection: fp8}
        if moe_state:
            variables[moe.MOE_STATE] = moe_state
        if weights:
            variables[FP8_WEIGHTS] = weights
        return variables

    def _pick(self, logits_BxV, t, done_B, bad, key, temp, top_k, top_p, eos_E, allowed_V):
        """Each row's token from its logits at step ``t``, and the first non-finite step."""
        step_key = jax.random.fold_in(key, t)
        masked_BxV = jnp.where(allowed_V, logits_BxV, -jnp.inf)  # ids past the tokenizer
        tok_B = sampling_lib.next_tokens(masked_BxV, step_key, temp, top_k, top_p)
        # The first step whose live rows' logits hold NaN or Inf stops every row.
        live_BxV = allowed_V & ~done_B[:, None]
        nan, inf = (jnp.any(f(logits_BxV) & live_BxV) for f in (jnp.isnan, jnp.isinf))
        first = (bad.step < 0) & (nan | inf)
        bad = NonFinite(
            step=jnp.where(first, t, bad.step),
            nan=jnp.where(first, nan, bad.nan),
            inf=jnp.where(first, inf, bad.inf),
        )
        return jnp.where(done_B, eos_E[0], tok_B), bad

    def step_params(self, params) -> dict:
        """At O0, the params the decode steps read: materialized, each matmul weight and
        embedding table in the compute dtype (the cast their layers make at every step, made
        once: the same values); ``{}`` where that changes nothing, or at O1, whose FP8 weights
        ``decode.prefill`` quantizes once from the masters."""
        dtype = jnp.dtype(self.model.cfg.dtype)
        if self.model.cfg.recipe is not None:
            return {}

        def read_in_dtype(path, p) -> bool:
            return optim.is_matmul_weight(path, p) or leaf_name(path) == "embedding"

        def cast(path, p):
            p = optim.materialize(p)
            return p.astype(dtype) if read_in_dtype(path, p) else p

        def changes(path, p) -> bool:  # a master to materialize, or a weight to cast
            return optim.is_scaled(p) or (read_in_dtype(path, p) and p.dtype != dtype)

        leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=optim.is_scaled)
        if not any(changes(path, p) for path, p in leaves):
            return {}
        return jax.tree_util.tree_map_with_path(cast, params, is_leaf=optim.is_scaled)

    def _prefill(self, params, fp8, moe_state, tokens_BxP, lengths_B, *pick, cache_len):
        self.traces["prefill"] += 1  # runs only while tracing: one per compilation
        batch, prompt_len = tokens_BxP.shape
        eos_E = pick[4]
        cast = self.step_params(params)
        variables = self._variables(cast or params, fp8, moe_state)
        cache = decode.init_cache(self.model, variables, batch, cache_len)
        rows_B = jnp.arange(batch)
        positions_BxP = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
        logits_BxPxV, cache, weights = decode.prefill(
            self.model, variables, cache, tokens_BxP, positions_BxP
        )
        done_B = lengths_B == 0  # padding rows of the batch bucket
        no = jnp.zeros((), bool)
        bad = NonFinite(step=jnp.int32(-1), nan=no, inf=no)
        last_BxV = logits_BxPxV[rows_B, jnp.maximum(lengths_B - 1, 0)]
        tok_B, bad = self._pick(last_BxV, 0, done_B, bad, *pick)
        out_BxM = jnp.zeros((batch, cache_len), jnp.int32).at[:, :prompt_len].set(tokens_BxP)
        out_BxM = out_BxM.at[rows_B, lengths_B].set(tok_B, mode="drop")
        done_B = done_B | jnp.any(tok_B[:, None] == eos_E[None, :], axis=-1)
        return cast, weights, cache, out_BxM, tok_B, done_B, bad

    def _decode(
        self,
        params,
        fp8,
        moe_state,
        weights,
        cache,
        out_BxM,
        tok_B,
        done_B,
        bad,
        lengths_B,
        max_new,
        *pick,
        watch,
    ):
        self.traces["decode"] += 1  # runs only while tracing: one per compilation
        eos_E = pick[4]
        variables = self._variables(params, fp8, moe_state, weights)
        rows_B = jnp.arange(out_BxM.shape[0])

        def stops(tok_B, t, done_B):
            """Rows that ``tok_B`` ends: an EOS id, or (watched) a stop string on the host."""
            ended_B = jnp.any(tok_B[:, None] == eos_E[None, :], axis=-1)
            if not watch:
                return ended_B
            shape = jax.ShapeDtypeStruct(done_B.shape, jnp.bool_)
            return ended_B | io_callback(self._watch, shape, t, tok_B, done_B, ordered=True)

        def more(carry):
            t, _, done_B, _, _, bad = carry
            return (t < max_new) & ~jnp.all(done_B) & (bad.step < 0)

        def one_token(carry):
            # Token t - 1 sits at position length + t - 1; its logits give token t.
            t, tok_B, done_B, cache, out_BxM, bad = carry
            pos_Bx1 = (lengths_B + t - 1)[:, None]
            logits_Bx1xV, cache = decode.step(self.model, variables, cache, tok_B[:, None], pos_Bx1)
            tok_B, bad = self._pick(logits_Bx1xV[:, 0], t, done_B, bad, *pick)
            out_BxM = out_BxM.at[rows_B, lengths_B + t].set(tok_B, mode="drop")
            return t + 1, tok_B, done_B | stops(tok_B, t, done_B), cache, out_BxM, bad

        carry = (jnp.int32(1), tok_B, done_B, cache, out_BxM, bad)
        t, _, _, cache, out_BxM, bad = jax.lax.while_loop(more, one_token, carry)
        return out_BxM, t, bad, cache


def _spec(x) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype, and its sharding where it is committed to one (as a jitted
    call's cache key tells them apart)."""
    if isinstance(x, jax.Array):
        sharding = x.sharding if x.committed else None
    else:  # a ShapeDtypeStruct (its sharding, if any) or a host array (none)
        sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class NonFinite(NamedTuple):
    """The first decode step whose logits held NaN/Inf (-1: none), and which of the two."""

    step: jax.Array
    nan: jax.Array
    inf: jax.Array


RESERVED_PREFIX = "<|reserved_"  # fp8jax's BPE pads a vocabulary it could not fill with these


def allowed_ids(tokenizer: Any, vocab_size: int) -> np.ndarray | None:
    """Which of the model's ``vocab_size`` ids ``tokenizer`` can produce (bool [V]), or None.

    A padded embedding (a Hugging Face vocabulary rounded up, or fp8jax's BPE that learned fewer
    tokens than ``vocab_size`` and holds ``<|reserved_*|>`` placeholders) has ids that decode to
    nothing a user should see; generation never picks them. None: every id is allowed.
    """
    size = getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int):
        return None
    allowed_V = np.arange(vocab_size) < size
    id_to_token = getattr(tokenizer, "id_to_token", None)
    if id_to_token is not None:
        for i in range(min(size, vocab_size) - 1, -1, -1):  # placeholders are the last ids
            if not str(id_to_token(i)).startswith(RESERVED_PREFIX):
                break
            allowed_V[i] = False
    return None if allowed_V.all() else allowed_V


@functools.lru_cache(maxsize=8)
def decoder_for(model_cfg: models.ModelConfig, collection: str) -> Decoder:
    """The (cached) ``Decoder`` of a model: one per model config and FP8 state collection."""
    return Decoder(model_cfg, collection)


def generate_ids(
    model,
    params,
    fp8_state,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    eos_ids: Sequence[int] = (),
    allowed_V: np.ndarray | None = None,
    moe_state=None,
    watcher: Callable | None = None,
) -> list[list[int]]:
    """The token ids generated after each prompt (ids), up to ``max_new_tokens`` or EOS.

    Any of ``eos_ids`` stops a row when generated and is left out of its output. ``params`` and
    ``fp8_state`` are the model's (a ``TrainState``'s ``params`` and ``fp8``; O2+ masters are
    materialized inside the jitted program). A prompt with more than ``max_len -
    max_new_tokens`` tokens raises a ConfigError naming the lengths. ``allowed_V`` (bool [V],
    see ``allowed_ids``) masks the ids that may not be generated. Logits holding NaN or Inf
    stop generation with a one-line ``NonFiniteOutputError`` naming the step. ``moe_state``: an
    MoE model's router biases (a ``TrainState``'s ``moe_state``), if it has any. ``watcher``
    (a ``TextStream``, say) sees every step's tokens on the host and may stop rows; a row it
    stops keeps the token it stopped on.
    """
    cfg = model.cfg
    prompts = [list(p) for p in prompts]
    if not prompts:
        return []
    if any(not p for p in prompts):
        raise errors.ConfigError("an empty prompt: give every prompt at least one token")
    for i, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= cfg.vocab_size:
            raise errors.ConfigError(
                f"prompt {i} holds token ids outside [0, {cfg.vocab_size}): the tokenizer does "
                f"not match the model's vocabulary"
            )
    lengths = [len(p) for p in prompts]
    b = buckets_for(lengths, max_new_tokens, cfg.max_len)
    tokens_BxP = np.zeros((b.batch, b.prompt), np.int32)
    lengths_B = np.zeros((b.batch,), np.int32)  # 0: a row padding the batch bucket
    for i, p in enumerate(prompts):
        tokens_BxP[i, : len(p)], lengths_B[i] = p, len(p)
    eos_ids = tuple(int(e) for e in eos_ids)
    decoder = decoder_for(cfg, step_lib.state_collection(model))
    out_BxM, _, bad = decoder(
        params,
        fp8_state,
        tokens_BxP,
        lengths_B,
        max_new_tokens,
        sampling,
        eos_ids,
        b.cache,
        allowed_V,
        moe_state,
        watcher,
    )
    out_BxM, bad = jax.device_get((out_BxM, bad))
    if bad.step >= 0:
        what = " and ".join(name for name, hit in (("NaN", bad.nan), ("Inf", bad.inf)) if hit)
        raise errors.NonFiniteOutputError(
            f"the model's logits hold {what} at generated token {int(bad.step) + 1} (from the "
            f"{'prompt' if bad.step == 0 else 'previous token'}), so no token can be chosen; "
            f"the checkpoint's weights or FP8 scales are not finite: use an earlier checkpoint"
        )
    out_BxM = np.asarray(out_BxM)
    results = []
    for i, n in enumerate(lengths):
        ids = out_BxM[i, n : n + max_new_tokens].tolist()
        stop = [ids.index(e) for e in eos_ids if e in ids]
        results.append(ids[: min(stop)] if stop else ids)
    return results


def generate(
    model,
    params,
    fp8_state,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    moe_state=None,
    stop: Sequence[str] = (),
    stream: TextStream | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
) -> list[str]:
    """The text generated after each prompt (the prompt not repeated); greedy by default.

    ``tokenizer`` has ``encode(str) -> ids``, ``decode(ids) -> str``, ``eos_id`` (int or None)
    and optionally ``eos_ids`` (every id that ends a turn). An empty prompt starts from EOS, the
    document separator the model was trained with. ``moe_state``: as ``generate_ids``'. A
    completion ends before the first of the ``stop`` strings it holds (the decode of that row
    stops there too); ``stream`` (a ``TextStream`` over the same stop strings) sees the text as
    it is generated. ``prompt_ids``: the prompts already encoded (a chat template's special
    tokens, say).
    """
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    eos_id = getattr(tokenizer, "eos_id", None)
    eos_ids = _eos_ids(tokenizer)
    if prompt_ids is None:
        prompt_ids = [tokenizer.encode(p) for p in prompts]
    ids = [list(p) or ([] if eos_id is None else [eos_id]) for p in prompt_ids]
    allowed_V = allowed_ids(tokenizer, model.cfg.vocab_size)
    if stream is None and stop:
        stream = TextStream(tokenizer, len(ids), stop)
    out = generate_ids(
        model, params, fp8_state, ids, max_new_tokens, s, eos_ids, allowed_V, moe_state, stream
    )
    for row in range(len(out) if stream is not None else 0):
        stream.finish(row)  # rows that ran to max_new_tokens
    return [cut_at_stop(tokenizer.decode(o), stop)[0] for o in out]


def _eos_ids(tokenizer: Any) -> list[int]:
    """Every id that ends a row: the tokenizer's ``eos_ids``, else its ``eos_id`` if any."""
    eos_id = getattr(tokenizer, "eos_id", None)
    return list(getattr(tokenizer, "eos_ids", None) or ([] if eos_id is None else [eos_id]))


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first of the ``stop`` strings it holds, and whether it held one."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` might start a stop string (or an unfinished
    UTF-8 character): they are shown only once the next tokens decide."""
    held = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return max(held, len(text) - len(text.rstrip("\ufffd")))


class TextStream:
    """The text of each row of a decode as it is generated, cut at the ``stop`` strings.

    A ``watcher`` for ``generate_ids``: it decodes each row's tokens so far, calls
    ``on_text(row, new_text)`` with what became final (text that might still begin a stop
    string, or an unfinished UTF-8 character, waits), stops the rows that reached a stop string,
    and records the host time of the first token and of the last step (``first_token_at``,
    ``last_token_at``, ``time.perf_counter`` seconds) and the tokens each row generated.
    """

    def __init__(
        self,
        tokenizer: Any,
        rows: int,
        stop: Sequence[str] = (),
        on_text: Callable[[int, str], None] | None = None,
    ):
        self.tokenizer, self.stop, self.on_text = tokenizer, tuple(s for s in stop if s), on_text
        eos_id = getattr(tokenizer, "eos_id", None)
        self.eos_ids = set(
            getattr(tokenizer, "eos_ids", None) or ([] if eos_id is None else [eos_id])
        )
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.shown = [0] * rows  # characters passed to on_text
        self.ended = [False] * rows
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def __call__(self, t: int, tok_B: np.ndarray, done_B: np.ndarray) -> np.ndarray:
        """The rows (bool [B]) whose text now holds a stop string, after adding ``tok_B``."""
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        stop_B = np.zeros(tok_B.shape, bool)
        for row in range(min(len(self.ids), len(tok_B))):
            if done_B[row] or self.ended[row]:
                continue
            if int(tok_B[row]) in self.eos_ids:
                self.finish(row)
                continue
            self.ids[row].append(int(tok_B[row]))
            text, hit = cut_at_stop(self.tokenizer.decode(self.ids[row]), self.stop)
            if hit:
                stop_B[row] = True
                self.finish(row, text)
            else:
                self._show(row, text[: len(text) - _held_back(text, self.stop)])
        return stop_B

    def finish(self, row: int, text: str | None = None) -> None:
        """End ``row``: show the rest of its text (``text``: cut at a stop string)."""
        if self.ended[row]:
            return
        if text is None:
            text = cut_at_stop(self.tokenizer.decode(self.ids[row]), self.stop)[0]
        self._show(row, text)
        self.ended[row] = True

    def _show(self, row: int, text: str) -> None:
        if len(text) > self.shown[row] and self.on_text is not None:
            self.on_text(row, text[self.shown[row] :])
        self.shown[row] = max(self.shown[row], len(text))


SAMPLE_TEMPERATURE = 0.8  # the end-of-run sample's
COMPILE_THREAD = "fp8jax_compile"  # the name of ``compile_ahead``'s threads


def _sample_length(model, tokenizer: Any, max_new_tokens: int, prompt: str) -> tuple[int, int]:
    """``(prompt tokens, tokens to sample)`` of the end-of-run sample of ``prompt``."""
    prompt_len = max(len(tokenizer.encode(prompt)), 1)  # an empty prompt starts from EOS
    return prompt_len, min(max_new_tokens, model.cfg.max_len - prompt_len)


def compile_ahead(
    model,
    shapes: tuple | Callable[[], tuple],
    tokenizer: Any,
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    watch: bool = False,
) -> concurrent.futures.Future | None:
    """Compile the programs that ``generate`` will run for prompts of ``prompt_lengths`` tokens
    in a background thread, from ``shapes`` = ``(params, fp8_state, moe_state)`` (arrays or
    ``jax.ShapeDtypeStruct``s, read now: the arrays may be donated meanwhile; or a function
    returning them, called in the thread: tracing the model there too); ``watch``: the
    decode that streams its tokens (a call with a ``TextStream``). The future's ``result()``
    waits for them; wait for it before the call (a call meanwhile would compile them again).
    None where the call cannot be planned (the call itself then says why).

    The thread (named ``COMPILE_THREAD``) is a daemon: a process that fails before the call
    does not wait for the compile, which nothing then needs, and neither does the interpreter's
    exit (an executor's threads are joined there). A compile that returns while the interpreter
    shuts down can abort the process: ``compiling_ahead`` tells a command line to end with
    ``os._exit`` instead, or it waits for the future."""
    lengths = [max(n, 1) for n in prompt_lengths]  # an empty prompt starts from EOS
    try:
        b = buckets_for(lengths, max_new_tokens, model.cfg.max_len)
    except errors.ConfigError:
        return None
    specs = lambda tree: jax.tree.map(_spec, (*tree[:2], tree[2] or {}))
    fixed = None if callable(shapes) else specs(shapes)
    decoder = decoder_for(model.cfg, step_lib.state_collection(model))
    num_eos = len(_eos_ids(tokenizer))
    future: concurrent.futures.Future = concurrent.futures.Future()

    def compile_programs() -> None:
        if not future.set_running_or_notify_cancel():  # cancelled before it started
            return
        try:
            args = specs(shapes()) if fixed is None else fixed
            future.set_result(decoder.compile(*args, b, num_eos, watch=watch))
        except BaseException as e:  # the call logs it and compiles the programs itself
            future.set_exception(e)

    threading.Thread(target=compile_programs, name=COMPILE_THREAD, daemon=True).start()
    return future


def compile_sample(
    model, state, tokenizer: Any, max_new_tokens: int, prompt: str = "The "
) -> concurrent.futures.Future | None:
    """Compile ``end_sample``'s programs in the background (``compile_ahead``), from ``state``'s
    shapes and shardings, so that the sample at the end of a run finds them compiled."""
    prompt_len, n = _sample_length(model, tokenizer, max_new_tokens, prompt)
    shapes = (state.params, state.fp8, state.moe_state)
    return compile_ahead(model, shapes, tokenizer, [prompt_len], n)


def wait_for_compile(ahead: concurrent.futures.Future | None) -> float:
    """Seconds spent waiting for ``compile_ahead``'s future (None: 0); a failed compile is
    logged, and the call that follows compiles its programs itself."""
    if ahead is None:
        return 0.0
    t0 = time.perf_counter()
    try:
        ahead.result()
    except Exception as e:
        logging.warning("compiling ahead failed (%s); compiling in the call", e)
    return time.perf_counter() - t0


def compiling_ahead() -> bool:
    """Whether a ``compile_ahead`` thread is still compiling in this process."""
    return any(t.name == COMPILE_THREAD and t.is_alive() for t in threading.enumerate())


def end_sample(
    model,
    state,
    tokenizer: Any,
    max_new_tokens: int,
    prompt: str = "The ",
    compiled: concurrent.futures.Future | None = None,
) -> str:
    """``prompt`` and up to ``max_new_tokens`` sampled after it (temperature 0.8), logged with
    its time: the text a training run ends with. ``compiled``: ``compile_sample``'s future,
    waited for first (a failed compile is logged and the call compiles as usual)."""
    t0 = time.perf_counter()
    wait = wait_for_compile(compiled)
    _, n = _sample_length(model, tokenizer, max_new_tokens, prompt)
    (text,) = generate(
        model,
        state.params,
        state.fp8,
        tokenizer,
        [prompt],
        n,
        temperature=SAMPLE_TEMPERATURE,
        moe_state=state.moe_state,
    )
    total = time.perf_counter() - t0
    logging.info("sample (%.1f s, %.1f s waiting for its compile): %s", total, wait, prompt + text)
    return prompt + text
