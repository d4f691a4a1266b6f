"""Generate text from a checkpoint (an fp8jax work dir or a Hugging Face model dir).

    python -m fp8jax.generate --ckpt /tmp/fp8jax_tiny --prompt "It is a truth" --max_new_tokens 32
    python -m fp8jax.generate --ckpt DIR --prompts_file prompts.txt --temperature 0.8 --top_p 0.9
    python -m fp8jax.generate --ckpt DIR --chat --system "Be brief." --prompt "Who is Emma?"

One prompt per ``--prompt`` flag (repeatable) or per line of ``--prompts_file``. A single prompt's
completion streams to stdout as it is generated; several prompts decode as one batch and each
prints after its prompt (``--nostream``: one prompt too, without the per-token host callback).
``--chat`` renders each prompt as a user turn (after ``--system``'s) with the checkpoint's chat
template and prints the reply only; the template's end-of-turn text and every ``--stop`` string
end a completion (and are left out of it). ``--output jsonl`` prints one JSON object per prompt
(prompt, completion, token counts, timings) for scripts; ``--verbose`` reports on stderr the
load and compile time, the time to the first token, decode tokens/s and the bound that reading
the weights once per token sets. Greedy unless ``--temperature`` > 0. ``--level O1`` runs the FP8
matmuls with the checkpoint's trained scales (the default when it has them); the compute dtype
is bfloat16 on a GPU, float32 on a CPU, unless ``--dtype`` says. The programs compile while the
weights load; nothing is written but JAX's compilation cache (``--compilation_cache_dir``). Bad
input exits 2 with one line on stderr (FP8JAX_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time

from absl import flags

from fp8jax import _timing, cli
from fp8jax.configs import base

__all__ = [
    "bound_share",
    "encoded",
    "main",
    "prompts",
    "report",
    "timings",
    "write_now",
]
_CKPT = flags.DEFINE_string("ckpt", None, "Work dir or Hugging Face model dir.")
flags.DEFINE_alias("workdir", "ckpt")  # train.py's name for a work dir
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt (repeat the flag for a batch).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "A text file of prompts, one a line.")
_MAX_NEW = flags.DEFINE_integer(
    "max_new_tokens",
    64,
    "Tokens to generate per prompt, at most (left unset: also at most what the context leaves).",
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Keep the nucleus of this probability (1 = all).")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the sampling.")
_LEVEL = flags.DEFINE_enum("level", None, ["O0", "O1"], "O0 plain matmuls, O1 FP8 matmuls.")
_DTYPE = flags.DEFINE_enum(
    "dtype",
    None,
    ["float32", "bfloat16", "float16"],
    "Compute dtype (default: bfloat16 on a GPU, float32 on a CPU).",
)
_CHAT = flags.DEFINE_bool(
    "chat", False, "Render each prompt as a user turn with the checkpoint's chat template."
)
_SYSTEM = flags.DEFINE_string("system", None, "A system turn before each prompt (with --chat).")
_STOP = flags.DEFINE_multi_string(
    "stop", [], "A string that ends a completion, left out of it (repeat the flag for more)."
)
_OUTPUT = flags.DEFINE_enum(
    "output",
    "text",
    ["text", "jsonl"],
    "text: each prompt and its completion; jsonl: one JSON object per prompt, for scripts.",
)
_STREAM = flags.DEFINE_bool(
    "stream", True, "Print a single prompt's completion as it is generated (text output)."
)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Report times, decode tokens/s and the weight-bandwidth bound on stderr."
)
_CACHE = flags.DEFINE_string(
    "compilation_cache_dir",
    base.COMPILATION_CACHE_DIR,
    "JAX's persistent compilation cache: a later call with the same shapes loads its programs "
    "from here ('' = off; JAX_COMPILATION_CACHE_DIR, if set, wins). A streamed decode calls "
    "the host every token, which JAX does not cache.",
)
flags.mark_flag_as_required("ckpt")


def prompts() -> list[str]:
    """The prompts of ``--prompt`` and ``--prompts_file``, in that order."""
    from fp8jax import errors

    found = list(_PROMPT.value)
    if _PROMPTS_FILE.value:
        try:
            with open(_PROMPTS_FILE.value, encoding="utf-8") as f:
                found += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise errors.ConfigError(f"--prompts_file: {e.strerror}: {e.filename}") from None
        except UnicodeDecodeError as e:
            raise errors.ConfigError(
                f"--prompts_file {_PROMPTS_FILE.value} is not UTF-8 text (byte {e.start}): save "
                "it as UTF-8"
            ) from None
    if not found and _PROMPTS_FILE.value:
        raise errors.ConfigError(
            f"--prompts_file {_PROMPTS_FILE.value} holds no prompt: write one prompt a line"
        )
    if not found:
        raise errors.ConfigError("no prompt: pass --prompt TEXT or --prompts_file FILE")
    return found


def encoded(tokenizer, texts: list[str]) -> tuple[list[list[int]], list[str]]:
    """The prompts' token ids (``--chat``: rendered with the chat template) and the stop strings
    (``--stop``'s, and with ``--chat`` the template's end of turn)."""
    from fp8jax import errors
    from fp8jax.trainer import chat

    stop = list(_STOP.value)
    if "" in stop:
        raise errors.ConfigError(
            "--stop '': an empty string would end every completion at once; drop it, or "
            "give the text to stop at"
        )
    if not _CHAT.value:
        if _SYSTEM.value is not None:
            raise errors.ConfigError("--system is a chat turn: pass --chat too")
        return [list(tokenizer.encode(t)) for t in texts], stop
    if chat.template_of(tokenizer) is None:
        raise errors.ConfigError(
            f"--chat: the tokenizer of {_CKPT.value} has no chat template; drop --chat and "
            f"write the prompt as the model expects"
        )
    try:
        rendered = [chat.generation_prompt(tokenizer, t, _SYSTEM.value) for t in texts]
    except ValueError as e:
        raise errors.ConfigError(f"--chat: {e}") from None
    end = chat.end_of_turn(tokenizer)
    return chat.plain_ids(tokenizer, rendered), stop + ([end] if end else [])


def timings(inf, stream, start: float, end: float, compiles: list[tuple[float, float]]) -> dict:
    """Seconds and rates of one generate call (``stream``: its ``TextStream``, or None;
    ``compiles``: (host time it ended, seconds) of each compile during the call)."""
    import jax

    from fp8jax import models
    from fp8jax.trainer import generate

    out = {"total_s": end - start, "compile_s": sum(d for _, d in compiles)}
    if stream is None or stream.first_token_at is None:
        return out
    # The prefill's compile comes before the first token, the decode loop's after it.
    before = sum(d for at, d in compiles if at <= stream.first_token_at)
    out["first_token_s"] = stream.first_token_at - start - before
    later = sum(max(len(ids) - 1, 0) for ids in stream.ids)
    after = out["compile_s"] - before  # the decode loop's, between the first token and the rest
    span = stream.last_token_at - stream.first_token_at - after
    out["decode_tokens_per_s"] = later / span if span > 0 and later else None
    out["rows"] = len(stream.ids)  # a decode step makes one token of each row
    # The weights as the compute dtype holds them (f32 masters are not what a step needs),
    # less the routed experts that none of a step's rows can reach (an MoE model's).
    cfg = inf.model.cfg
    itemsize = jax.numpy.dtype(cfg.dtype).itemsize
    weight_bytes = sum(
        x.size * min(x.dtype.itemsize, itemsize) for x in jax.tree.leaves(inf.params)
    )
    unread = models.matmul_params(cfg) - models.matmul_params_read(cfg, out["rows"])
    weight_bytes -= unread * min(jax.numpy.dtype(cfg.param_dtype).itemsize, itemsize)
    bandwidth = generate.device_bandwidth()
    out["weight_bytes"] = weight_bytes
    out["bound_s_per_token"] = weight_bytes / bandwidth if bandwidth else None
    return out


def bound_share(bound_s: float, tokens_per_s: float, rows: int) -> float:
    """The weight-bandwidth bound of a decode step over its measured time: a step reads the
    weights once (``bound_s``) and makes one token of each of ``rows`` rows, so it takes
    ``rows / tokens_per_s`` seconds; 1.0 decodes at the bound."""
    return bound_s * tokens_per_s / rows


def report(t: dict, load_s: float, level: str, dtype: str, stages: dict | None = None) -> str:
    """The ``--verbose`` lines of ``timings`` (``stages``: seconds of the load's stages)."""
    parts = ", ".join(f"{name} {s:.1f} s" for name, s in (stages or {}).items())
    compiled = f"compiled in {t['compile_s']:.1f} s"
    if t.get("compile_ahead_s"):  # the programs compiled while the weights were read
        compiled = (
            f"traced and compiled in {t['compile_ahead_s']:.1f} s beside the load (waited "
            f"{t.get('compile_wait_s', 0.0):.1f} s after it), {t['compile_s']:.1f} s in the call"
        )
    lines = [
        f"loaded in {load_s:.1f} s{f' ({parts})' if parts else ''} at {level}, computing in "
        f"{dtype}; {compiled}; generated in {t['total_s']:.2f} s"
    ]
    if "first_token_s" in t:
        rate = t["decode_tokens_per_s"]
        lines.append(
            f"first token {t['first_token_s'] * 1e3:.0f} ms after the call (compile excluded); "
            f"decode {'n/a' if rate is None else f'{rate:.1f}'} tokens/s"
        )
        bound = t["bound_s_per_token"]
        weights = f"{t['weight_bytes'] / 2**20:.1f} MiB of weights read per token"
        if bound is None:
            lines.append(f"{weights}; device bandwidth unknown, so no bound")
        else:
            # A step reads the weights once for all rows: it takes rows / rate seconds.
            share = bound_share(bound, rate, t["rows"]) if rate else None
            got = "" if share is None else f"; decode steps at {100 * share:.0f}% of it"
            lines.append(f"{weights}; bandwidth bound {bound * 1e3:.3f} ms/token{got}")
    return "".join(f"{line}\n" for line in lines)


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]}; pass prompts as --prompt TEXT")
    with cli.user_errors():
        import jax

        from fp8jax import errors, models
        from fp8jax.trainer import environment, generate, inference, loop, sampling

        texts = prompts()
        try:  # the sampling flags first, named as the command line spells them
            sampling.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _SEED.value)
        except errors.ConfigError as e:
            raise errors.ConfigError(f"--{e}") from None  # each message starts with the field
        loop.use_compilation_cache(_CACHE.value, "--compilation_cache_dir")
        t0 = time.perf_counter()
        dtype = _DTYPE.value or inference.default_dtype()
        environment.check_compute_dtype(dtype, "--dtype")
        stages: dict[str, float] = {}
        compiles = []

        def listener(event, duration, **kw):
            if event.startswith(_timing.EVENT):  # checksums, metadata, read, trace, to device
                name = event[len(_timing.EVENT) :]
                stages[name] = stages.get(name, 0.0) + duration
            elif event.startswith("/jax/core/compile/"):  # tracing, lowering, XLA's compile
                compiles.append((time.perf_counter(), duration))

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            planned = inference.plan(_CKPT.value, _LEVEL.value, dtype)
            ids, stop = encoded(planned.tokenizer, texts)
            max_new = _MAX_NEW.value
            if not flags.FLAGS["max_new_tokens"].present:  # the default fits the model's context
                longest, context = max(len(p) for p in ids) or 1, planned.model_cfg.max_len
                if longest >= context:  # no room for one token: the prompt is what to change
                    raise errors.ConfigError(
                        f"a prompt has {longest} tokens, the model's context {context}: shorten "
                        f"it to at most {context - 1} tokens"
                    )
                max_new = min(max_new, context - longest)
            # Checked before anything is printed, compiled or read.
            generate.buckets_for([len(p) for p in ids], max_new, planned.model_cfg.max_len)
            jsonl = _OUTPUT.value == "jsonl"
            streaming = _STREAM.value and not jsonl and len(texts) == 1
            watched = streaming or stop or jsonl or _VERBOSE.value
            # The model traces and its programs compile while the weights are read.
            ahead_from = time.perf_counter()
            ahead = generate.compile_ahead(
                models.build_model(planned.model_cfg),
                planned.shapes,
                planned.tokenizer,
                [len(p) for p in ids],
                max_new,
                watch=bool(watched),
            )
            inf = _load_beside(planned, ahead)
            load_s = time.perf_counter() - t0
            wait_s = generate.wait_for_compile(ahead)
            ahead_s = time.perf_counter() - ahead_from if ahead is not None else 0.0
            stream = None
            if watched:
                on_text = write_now if streaming else None
                stream = generate.TextStream(inf.tokenizer, len(ids), stop, on_text)
            if streaming and not _CHAT.value:
                write_now(0, texts[0])
            start = time.perf_counter()
            out = generate.generate(
                inf.model,
                inf.params,
                inf.fp8_state,
                inf.tokenizer,
                texts,
                max_new,
                temperature=_TEMPERATURE.value,
                top_k=_TOP_K.value,
                top_p=_TOP_P.value,
                seed=_SEED.value,
                stop=stop,
                stream=stream,
                prompt_ids=ids,
                moe_state=inf.moe_state,
            )
            end = time.perf_counter()
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        t = timings(inf, stream, start, end, [c for c in compiles if c[0] >= start])
        t["compile_ahead_s"] = ahead_s  # from its start to the end of the wait for it
        t["compile_wait_s"] = wait_s
    for i, (prompt, completion) in enumerate(zip(texts, out, strict=True)):
        if jsonl:
            record = dict(prompt=prompt, completion=completion, prompt_tokens=len(ids[i]))
            record.update(tokens=len(stream.ids[i]), timings=t)
            sys.stdout.write(json.dumps(record) + "\n")
        elif streaming:
            sys.stdout.write("\n")
        else:
            sys.stdout.write(f"{completion if _CHAT.value else prompt + completion}\n")
    if _VERBOSE.value:
        sys.stderr.write(report(t, load_s, inf.level, dtype, stages))


def _load_beside(planned, ahead):
    """``planned.load()`` while ``ahead`` compiles; a load that fails waits for the compile
    first (an interpreter that exits while a compile returns can abort)."""
    try:
        return planned.load()
    except BaseException:
        if ahead is not None:
            concurrent.futures.wait([ahead])
        raise


def write_now(row: int, text: str) -> None:
    """Print streamed ``text`` at once (``row``: the one row a stream prints)."""
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    cli.run(main)
