"""Document processing for the ``mq_hellaswag`` and ``mq_winogrande`` lm-eval tasks.

The functions compute what lm-eval's ``hellaswag`` and ``winogrande`` tasks compute; the
test suite checks, document by document, that the requests built from our tasks equal the
ones built from lm-eval's own definitions on the same data.
"""

from __future__ import annotations

import re

_BRACKETED = re.compile(r"\[.*?\]")
_WINOGRANDE_ANSWER_INDEX = {"1": 0, "2": 1}


def _clean_hellaswag_text(text: str) -> str:
    """Drop the WikiHow markup of HellaSwag: ``[title]`` becomes a sentence break, other tags go."""
    text = text.strip().replace(" [title]", ". ")
    text = _BRACKETED.sub("", text)
    return text.replace("  ", " ")


def hellaswag_process_docs(dataset):
    """Add ``query`` (activity label and context), cleaned ``choices`` and the integer ``gold``.

    Args:
        dataset: a ``datasets.Dataset`` with HellaSwag's fields.

    Returns:
        The mapped dataset.
    """

    def process(doc):
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _clean_hellaswag_text(doc["activity_label"] + ": " + context),
            "choices": [_clean_hellaswag_text(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(process)


def winogrande_doc_to_text(doc) -> int:
    """Index of the correct context (option 1 or 2) for partial scoring.

    Args:
        doc: a WinoGrande document.

    Returns:
        0 or 1.
    """
    return _WINOGRANDE_ANSWER_INDEX[doc["answer"]]


def winogrande_doc_to_target(doc) -> str:
    """The sentence after the blank, stripped: the continuation scored under each context.

    Args:
        doc: a WinoGrande document.

    Returns:
        The continuation text.
    """
    blank = doc["sentence"].index("_")
    return doc["sentence"][blank + 1:].strip()


def winogrande_doc_to_choice(doc) -> list[str]:
    """The sentence up to the blank, completed by each of the two options.

    Args:
        doc: a WinoGrande document.

    Returns:
        The two contexts.
    """
    blank = doc["sentence"].index("_")
    prefix = doc["sentence"][:blank]
    return [prefix + doc["option1"], prefix + doc["option2"]]
