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
