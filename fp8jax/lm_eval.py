"""Downstream tasks through lm-evaluation-harness: the ``fp8jax`` model backend and its command.

    python -m fp8jax.lm_eval --model fp8jax --model_args ckpt=/tmp/fp8jax_sft \\
        --tasks fp8jax_novel_choice,fp8jax_novel_title
    python -m fp8jax.lm_eval --model fp8jax --model_args ckpt=DIR,level=O1,batch_size=16 \\
        --tasks hellaswag,arc_easy

Every argument is lm-eval's own (``lm_eval run --help``); ``--model_args`` of ``fp8jax``:
``ckpt`` (a work dir or a Hugging Face model dir), ``level`` (O0 or O1; default O1 when the
checkpoint holds trained FP8 scales), ``batch_size`` (rows per forward pass, default 8),
``dtype`` (compute dtype; default bfloat16 on an accelerator, float32 on a CPU) and
``max_gen_toks`` (default 256). lm-eval finds models only in its registry, which this module
joins as ``fp8jax`` when imported: ``python -m fp8jax.lm_eval`` (or ``fp8jax-lm-eval``) imports
it, passes the local tasks of ``TASKS_DIR`` (held-out passages of the shipped novels, no
download) as ``--include_path`` unless given one, and runs lm-eval's command line; in Python, pass
``fp8jax.lm_eval.FP8JaxLM(ckpt=DIR)`` as ``lm_eval.simple_evaluate``'s model. A task name
lm-eval does not know, and every other bad input, exits 2 with one line on stderr.

The backend (``Backend``) needs no lm-eval: it scores ``(context, continuation)`` token ids
(``fp8jax.trainer.scoring``) and generates until stop strings (``fp8jax.trainer.generate``),
batched; the lm-eval class around it (``FP8JaxLM``, ``model_class()``) is built on first use.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8jax import cli, errors

DEFAULT_BATCH_SIZE = 8  # rows per forward pass when neither model_args nor --batch_size says
MODEL_ARGS = ("ckpt", "level", "dtype", "batch_size", "max_gen_toks")  # fp8jax's --model_args
DTYPES = ("float32", "bfloat16", "float16")  # the compute dtypes of --model_args dtype
TASKS_DIR = Path(__file__).resolve().parent / "trainer" / "lm_eval_tasks"
INSTALL_FIX = "pip install 'fp8jax[lm-eval]'"
_LAZY = {"FP8JaxLM"}


def __getattr__(name: str):
    if name in _LAZY:  # built (and registered with lm-eval) on first use
        return model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Backend",
    "DEFAULT_BATCH_SIZE",
    "DTYPES",
    "FP8JaxLM",  # noqa: F822 (built by __getattr__ on first use)
    "MODEL_ARGS",
    "TASKS_DIR",
    "main",
    "model_class",
    "run",
]


class Backend:
    """An fp8jax checkpoint answering lm-eval's three kinds of request, batched.

    ``ckpt``: a work dir or a Hugging Face model dir, loaded at ``level`` ('O0', 'O1'; None:
    O1 if it holds trained FP8 scales) computing in ``dtype`` (None: ``default_dtype()``).
    """

    def __init__(
        self,
        ckpt: str,
        level: str | None = None,
        dtype: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_gen_toks: int = 256,
    ):
        from fp8jax.trainer import inference, scoring
        from fp8jax.trainer import step as step_lib

        errors.check_int(batch_size, "--model_args batch_size", 1)
        errors.check_int(max_gen_toks, "--model_args max_gen_toks", 1)
        try:
            self.inf = inference.load(str(ckpt), level, dtype or inference.default_dtype())
        except errors.USER_ERRORS as e:  # named as lm_eval's command line spells it
            raise type(e)(str(e).replace("--ckpt ", "--model_args ckpt=")) from None
        self.tokenizer = self.inf.tokenizer
        self.max_len = self.inf.model.cfg.max_len
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        collection = step_lib.state_collection(self.inf.model)
        self.scorer = scoring.scorer_for(self.inf.model.cfg, collection, batch_size)

    @property
    def prefix_id(self) -> int:
        """The token an empty context is (BOS if the tokenizer has one, else EOS), as in
        lm-eval's Hugging Face backend."""
        bos = getattr(self.tokenizer, "bos_id", None)
        return self.tokenizer.eos_id if bos is None else bos

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text``; the tokenizer's own special tokens (a BOS) unless told, or
        unless ``text`` already starts with the BOS text."""
        if add_special_tokens is None:
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special_tokens = not (bos and text.startswith(bos))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def loglikelihoods(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[tuple[float, bool]]:
        """``(log-likelihood, greedy)`` of each ``(context ids, continuation ids)``."""
        return self.scorer(self.inf.params, self.inf.fp8_state, requests, self.inf.moe_state)

    def rolling(self, token_lists: Sequence[Sequence[int]]) -> list[float]:
        """The log-likelihood of each whole token list, scored in windows of the model's
        context, each token predicted once, the first from ``prefix_id``."""
        from lm_eval import utils as lm_utils

        windows, owners = [], []
        for i, ids in enumerate(token_lists):
            for pair in lm_utils.get_rolling_token_windows(
                token_list=list(ids),
                prefix_token=self.prefix_id,
                max_seq_len=self.max_len,
                context_len=1,
            ):
                windows.append(lm_utils.make_disjoint_window(pair))
                owners.append(i)
        totals = [0.0] * len(token_lists)
        for i, (logp, _) in zip(owners, self.loglikelihoods(windows), strict=True):
            totals[i] += logp
        return totals

    def generate(
        self,
        contexts: Sequence[str],
        until: Sequence[str],
        max_gen_toks: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[str]:
        """The text generated after each context, up to ``max_gen_toks`` tokens, EOS or the
        first of the ``until`` strings (left out); contexts lose their oldest tokens to fit."""
        from fp8jax.trainer import generate as generate_lib

        room = self.max_len - max_gen_toks
        if room < 1:
            raise errors.ConfigError(
                f"max_gen_toks={max_gen_toks} leaves no room for a context in the model's "
                f"{self.max_len} tokens: pass max_gen_toks below {self.max_len} in --model_args "
                f"or --gen_kwargs"
            )
        ids = [self.encode(c)[-room:] for c in contexts]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # similar lengths a batch
        out = [""] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            texts = generate_lib.generate(
                self.inf.model,
                self.inf.params,
                self.inf.fp8_state,
                self.tokenizer,
                [contexts[i] for i in chunk],
                max_gen_toks,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop=list(until),
                prompt_ids=[ids[i] for i in chunk],
                moe_state=self.inf.moe_state,
            )
            for i, text in zip(chunk, texts, strict=True):
                out[i] = text
        return out


def _batch_size(value: Any) -> Any:
    """A batch size from model_args or lm-eval's --batch_size ('auto': the default); what is
    not a whole number is left for ``Backend`` to refuse, not rounded."""
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


@functools.cache
def model_class() -> type:
    """lm-eval's model class of fp8jax checkpoints, registered as ``fp8jax`` (needs lm-eval)."""
    try:
        from lm_eval.api import registry
        from lm_eval.api.model import TemplateLM
        from lm_eval.models import utils as model_utils
    except ImportError:
        raise errors.ConfigError(f"lm-eval is not installed: {INSTALL_FIX}") from None
    registered = registry.model_registry.get("fp8jax", None)
    if registered is not None and not isinstance(registered, str):
        return registered  # registered by an earlier import of this module
    from fp8jax.trainer import chat

    @registry.register_model("fp8jax")
    class FP8JaxLM(TemplateLM):
        """An fp8jax work dir or Hugging Face model dir under lm-evaluation-harness."""

        def __init__(
            self,
            ckpt: str | None = None,
            level: str | None = None,
            dtype: str | None = None,
            batch_size: int | str | None = None,
            max_gen_toks: int = 256,
            **unused: Any,  # lm-eval's device and max_batch_size: JAX places the arrays
        ):
            super().__init__()
            if not ckpt:
                raise errors.ConfigError("no checkpoint: pass --model_args ckpt=DIR")
            from fp8jax.trainer import environment, inference

            for name, value, choices in (
                ("level", level, inference.LEVELS),
                ("dtype", dtype, DTYPES),
            ):
                if value is not None:  # named as the user set them, before the checkpoint loads
                    errors.check_choice(value, choices, f"--model_args {name}")
            if dtype is not None:
                environment.check_compute_dtype(dtype, "--model_args dtype")
            self.backend_ = Backend(ckpt, level, dtype, _batch_size(batch_size), max_gen_toks)
            self.tokenizer = self.backend_.tokenizer
            self.ckpt = str(ckpt)

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
            """An instance from ``--model_args`` text; its values win over lm-eval's flags."""
            from lm_eval import utils as lm_utils

            return cls.create_from_arg_obj(
                lm_utils.simple_parse_args_string(arg_string), additional_config
            )

        @classmethod
        def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
            """An instance from a dict of model args; they win over lm-eval's flags."""
            unknown = sorted(set(arg_dict) - set(MODEL_ARGS))
            if unknown:  # a misspelt one would otherwise be dropped unseen
                raise errors.ConfigError(
                    f"unknown --model_args {', '.join(unknown)} of fp8jax: use "
                    f"{', '.join(MODEL_ARGS)}"
                )
            extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
            return cls(**{**extra, **arg_dict})

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_id

        @property
        def prefix_token_id(self) -> int:
            return self.backend_.prefix_id

        @property
        def max_length(self) -> int:
            return self.backend_.max_len

        @property
        def tokenizer_name(self) -> str:
            return self.ckpt

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
            return self.backend_.encode(string, add_special_tokens)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            results = self.backend_.loglikelihoods([(c, t) for _, c, t in requests])
            for (pair, _, _), result in zip(requests, results, strict=True):
                if pair is not None:
                    self.cache_hook.add_partial("loglikelihood", pair, result)
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            strings = [req.args[0] for req in requests]
            totals = self.backend_.rolling([self.tok_encode(s) for s in strings])
            for string, total in zip(strings, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            eos = self.tokenizer.decode([self.eot_token_id])
            groups: dict[str, list[int]] = {}
            for i, req in enumerate(requests):
                groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(
                    i
                )
            out = [""] * len(requests)
            for members in groups.values():
                raw = dict(requests[members[0]].args[1])
                kwargs = model_utils.normalize_gen_kwargs(raw, self.backend_.max_gen_toks)
                until = model_utils.handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                sample = bool(kwargs.get("do_sample"))
                texts = self.backend_.generate(
                    [requests[i].args[0] for i in members],
                    until,
                    int(kwargs["max_gen_toks"]),
                    temperature=float(kwargs.get("temperature") or 0.0) if sample else 0.0,
                    top_k=int(kwargs.get("top_k") or 0),
                    top_p=float(kwargs.get("top_p") or 1.0),
                    seed=int(kwargs.get("seed") or 0),
                )
                for i, text in zip(members, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
            return out

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return chat.template_of(self.tokenizer) if chat_template else None

        def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
            template = chat.template_of(self.tokenizer)
            if template is None:
                raise errors.ConfigError(
                    f"{self.ckpt}'s tokenizer has no chat template: drop --apply_chat_template"
                )
            return chat.render(
                template,
                chat_history,
                add_generation_prompt=add_generation_prompt,
                bos_token=getattr(self.tokenizer, "bos_token", None) or "",
                eos_token=getattr(self.tokenizer, "eos_token", None) or "",
            )

    FP8JaxLM.__qualname__ = "FP8JaxLM"  # as if defined at module level, where lm-eval shows it
    return FP8JaxLM


def _with_local_tasks(argv: list[str]) -> list[str]:
    """lm-eval's arguments with ``--include_path TASKS_DIR`` unless they name their own (lm-eval
    takes one include path)."""
    if any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        return list(argv)
    return [*argv, "--include_path", str(TASKS_DIR)]


def _check_limit(args: Sequence[str]) -> None:
    """A ConfigError for a ``--limit`` (``-L``) that leaves no document: lm-eval reads it as a
    count of documents per task from 1, or below 1 as a fraction of them."""
    for i, arg in enumerate(args):
        if arg in ("--limit", "-L") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--limit="):
            value = arg.removeprefix("--limit=")
        else:
            continue
        try:
            limit = float(value)
        except ValueError:
            continue  # lm-eval's own parser names it
        if not limit > 0:
            raise errors.ConfigError(
                f"--limit {value}: evaluates no document; give a number of documents per task "
                f"(>= 1) or a fraction of them in (0, 1)"
            )


def run(argv: Sequence[str]) -> None:
    """lm-eval's command line on ``argv`` (without the program name), ``fp8jax`` registered and
    the local tasks included; a task lm-eval does not know is a ConfigError."""
    model_class()
    from lm_eval import __main__ as lm_main

    args = list(argv)
    if args and not args[0].startswith("-") and args[0] in ("run", "ls", "validate"):
        command, rest = args[0], args[1:]
    else:
        command, rest = "run", args  # lm-eval's own command line defaults to 'run' likewise
    rest = _with_local_tasks(rest)  # each of lm-eval's commands takes --include_path
    _check_limit(rest)
    old_argv = sys.argv
    sys.argv = ["lm_eval", command, *rest]
    try:
        lm_main.cli_evaluate()
    except ValueError as e:
        if str(e).startswith("Tasks not found:"):
            missing = str(e).removeprefix("Tasks not found:").strip()
            raise errors.ConfigError(
                f"lm-eval knows no task {missing}: list them with `python -m fp8jax.lm_eval ls "
                f"tasks` (the local ones start with fp8jax_)"
            ) from None
        if "did not find any docs" in str(e):  # lm-eval's own check, raised as it builds one
            raise errors.ConfigError(
                "lm-eval found no documents to evaluate in a task: check its dataset split "
                "and --limit"
            ) from None
        raise
    finally:
        sys.argv = old_argv


def main() -> None:
    """``python -m fp8jax.lm_eval ARGS``: lm-eval's command line with fp8jax's backend."""
    cli.quiet_jax_backend_probe()
    cli.drop_closed_event_loop_errors()
    with cli.user_errors():
        run(sys.argv[1:])


if __name__ == "__main__":
    main()
