"""Chat templates and the token ids and loss mask of one fine-tuning example.

A ``{"messages": [...]}`` example is rendered with the tokenizer's Jinja chat template (the
variables transformers' ``apply_chat_template`` passes: ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``) in a sandboxed environment; the loss covers the assistant turns
only, each turn from the end of the generation prompt before it to the end of the turn (its
end-of-turn tokens included, so the model learns to stop). A ``{"prompt", "completion"}``
example takes its loss on the completion tokens and the EOS after them.

Each part (prompt text, assistant turn) is encoded on its own, so a mask boundary never falls
inside a token; the prompt parts are exactly what the tokenizer sees at inference.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np

from fp8jax.errors import DataError

__all__ = [
    "NO_TEMPLATE_FIX",
    "chat_parts",
    "check_record",
    "compile_template",
    "encode",
    "end_of_turn",
    "generation_prompt",
    "plain_ids",
    "render",
    "template_of",
]

NO_TEMPLATE_FIX = (
    "the tokenizer has no chat template: write the data as {'prompt', 'completion'} lines, "
    "or set init_from to a checkpoint whose tokenizer_config.json has a chat_template"
)


def _raise(message: str):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The Jinja template of a chat template string, in a sandboxed environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def render(
    template: str,
    messages: Sequence[dict],
    add_generation_prompt: bool = False,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The text of ``messages`` under the chat ``template`` (as transformers renders it)."""
    return compile_template(template).render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )


def template_of(tokenizer) -> str | None:
    """The tokenizer's chat template string, or None if it has none."""
    return getattr(tokenizer, "chat_template", None) or None


def _special(tokenizer, name: str) -> str:
    """The text of the tokenizer's BOS or EOS token ('' if it has none)."""
    return getattr(tokenizer, name, None) or ""


def chat_parts(tokenizer, messages: Sequence[dict]) -> list[tuple[str, bool]]:
    """``(text, trained)`` pieces of a rendered conversation, in order; trained = assistant.

    Raises ValueError if the template cannot be split into turns (its rendering of the first
    turns is not a prefix of the whole) or refuses the messages.
    """
    template = template_of(tokenizer)
    if template is None:
        raise ValueError(NO_TEMPLATE_FIX)
    specials = dict(
        bos_token=_special(tokenizer, "bos_token"), eos_token=_special(tokenizer, "eos_token")
    )
    try:
        whole = render(template, messages, **specials)
        parts, done = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = render(template, messages[:i], add_generation_prompt=True, **specials)
            turn = render(template, messages[: i + 1], **specials)
            start = len(prompt)
            if not (whole.startswith(turn) and turn.startswith(prompt) and start >= done):
                raise ValueError(
                    "the chat template does not render the conversation turn by turn (an "
                    "earlier turn's text changes with later ones), so the assistant turns "
                    "cannot be located; use {'prompt', 'completion'} lines"
                )
            parts += [(whole[done:start], False), (whole[start : len(turn)], True)]
            done = len(turn)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e
    parts.append((whole[done:], False))
    return [(text, trained) for text, trained in parts if text]


def generation_prompt(tokenizer, user: str, system: str | None = None) -> str:
    """The text a chat model continues: ``user``'s turn (after ``system``'s, if given) under the
    tokenizer's chat template, ending with the start of the assistant's turn. Raises ValueError
    (one line) when the tokenizer has no template or the template fails."""
    template = template_of(tokenizer)
    if template is None:
        raise ValueError("the checkpoint's tokenizer has no chat template")
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    try:
        return render(
            template,
            messages,
            add_generation_prompt=True,
            bos_token=_special(tokenizer, "bos_token"),
            eos_token=_special(tokenizer, "eos_token"),
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from e


def end_of_turn(tokenizer) -> str | None:
    """The text the chat template writes right after an assistant turn's content (its
    end-of-turn token, say ``<|im_end|>``; surrounding whitespace dropped), or None."""
    template = template_of(tokenizer)
    if template is None:
        return None
    mark = "\x00reply\x00"  # text no template writes by itself
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}]
    try:
        whole = render(
            template,
            messages,
            bos_token=_special(tokenizer, "bos_token"),
            eos_token=_special(tokenizer, "eos_token"),
        )
    except jinja2.TemplateError:
        return None
    after = whole[whole.find(mark) + len(mark) :].strip() if mark in whole else ""
    return after or None


def plain_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text without the special tokens a tokenizer adds around any text (a
    HF tokenizer's BOS); special tokens written in the text (a template's) are kept."""
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def check_record(record: Any, where: str) -> str:
    """Which kind of example a parsed .jsonl line is ('messages' or 'prompt'); DataError if none."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        for message in record["messages"]:
            ok = isinstance(message, dict) and isinstance(message.get("role"), str)
            if not (ok and isinstance(message.get("content"), str)):
                raise DataError(f"{where}: each message needs a string 'role' and 'content'")
        return "messages"
    if isinstance(record, dict) and all(
        isinstance(record.get(k), str) for k in ("prompt", "completion")
    ):
        return "prompt"
    raise DataError(
        f"{where}: expected a JSON object with 'messages' (a list of {{'role', 'content'}}) or "
        f"with string 'prompt' and 'completion' fields"
    )


def encode(tokenizer, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32 [n], trained bool [n])`` of one example; trained marks loss tokens."""
    if check_record(record, where) == "prompt":
        prompt = list(tokenizer.encode(record["prompt"]))  # with the BOS the tokenizer adds
        completion = plain_ids(tokenizer, [record["completion"]])[0] + [tokenizer.eos_id]
        ids, trained = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    else:
        try:
            parts = chat_parts(tokenizer, record["messages"])
        except ValueError as e:
            raise DataError(f"{where}: {e}") from e
        ids, trained = [], []
        for part_ids, (_, is_trained) in zip(
            plain_ids(tokenizer, [t for t, _ in parts]), parts, strict=True
        ):
            ids += part_ids
            trained += [is_trained] * len(part_ids)
    return np.asarray(ids, np.int32), np.asarray(trained, bool)
