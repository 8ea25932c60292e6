"""What every tfdist command shares: quiet TensorFlow start-up and error reporting."""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn

from tfdist.errors import UserError, one_paragraph


def quiet_tensorflow() -> None:
    """Hides TensorFlow's C++ start-up chatter unless the user asked for it."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    print(f"{prog}: error: {one_paragraph(message)}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_reporting_user_errors(prog: str, fn: Callable[[], int | None]) -> int | None:
    """Runs `fn`; a `UserError` becomes one paragraph on stderr and exit code 2."""
    try:
        return fn()
    except UserError as e:
        fail(prog, str(e), e.exit_code)
