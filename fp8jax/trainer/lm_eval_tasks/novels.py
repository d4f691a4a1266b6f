"""The documents of the local lm-eval tasks: held-out passages of the shipped novels.

Each document is a passage from the last tenth of one novel's words (the part
``fp8jax.trainer.tasks.novel_split`` holds out of training), the same number from each novel:
``prompt`` is the passage and ``"\\nNovel:"``, ``title`` its novel's title, ``choices`` the six
titles and ``label`` the index of the right one (chance: 1/6). lm-eval calls these functions
with the task's ``metadata`` (``num_examples``, ``passage_words``, ``seed``).
"""

from __future__ import annotations

from typing import Any

from fp8jax.trainer import tasks

__all__ = [
    "novel_docs",
    "passage_docs",
]


def _records(num_examples: int, passage_words: int, seed: int) -> list[dict]:
    _, test = tasks.novel_split(0, int(num_examples), int(passage_words), seed=int(seed))
    titles = tasks.novel_titles()
    out = []
    for record in test:
        title = record["completion"].strip()
        passage = record["prompt"].removesuffix(tasks.PROMPT_SUFFIX)
        out.append(
            dict(
                prompt=record["prompt"],
                passage=passage,
                title=title,
                choices=titles,
                label=titles.index(title),
            )
        )
    return out


def novel_docs(
    num_examples: int = 60, passage_words: int = 16, seed: int = 1, **unused: Any
) -> dict:
    """``{"test": Dataset}`` of passage -> title documents (see the module docstring)."""
    import datasets  # lm-eval's dependency: these functions run only under lm-eval

    return {"test": datasets.Dataset.from_list(_records(num_examples, passage_words, seed))}


def passage_docs(
    num_examples: int = 30, passage_words: int = 48, seed: int = 2, **unused: Any
) -> dict:
    """``{"test": Dataset}`` of held-out passages (``passage``), for perplexity."""
    import datasets

    return {"test": datasets.Dataset.from_list(_records(num_examples, passage_words, seed))}
