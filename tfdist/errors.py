"""User-facing errors.

`UserError` is what tfdist raises for anything the user can fix: a bad flag, a
missing dataset, a malformed TF_CONFIG. Entry points print its message as one
paragraph and exit non-zero without a traceback; every other exception is a bug
(or an environment failure) and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem the user can fix; its message names the problem and the fix."""

    exit_code: int = 2


def one_paragraph(text: str) -> str:
    """Collapses whitespace so a message prints as a single paragraph."""
    return " ".join(str(text).split())


MESSAGE_LIMIT = 4000  # Characters of a quoted error kept whole; past it, its head and its end (`error_text`).


def error_text(error: BaseException) -> str:
    """An error's message (Keras', TensorFlow's, the user's) as one paragraph, quoted whole: the part naming the
    bad key or shape is often at its end. Only a pathological one past `MESSAGE_LIMIT` is cut, in its middle."""
    text = one_paragraph(str(error))
    if len(text) <= MESSAGE_LIMIT:
        return text
    tail = MESSAGE_LIMIT // 2
    return f"{text[:MESSAGE_LIMIT - tail]} [... {len(text) - MESSAGE_LIMIT} characters ...] {text[-tail:]}"
