"""What every tfdist command shares: a quiet, honest TensorFlow start-up and error reporting.

TensorFlow 2.21's C++ side prints, on every start, lines that are not addressed
to the user: absl's "All log messages before absl::InitializeLog() ..." notice,
the oneDNN notice and "Could not find cuda drivers" -- each twice, because two
of its shared libraries carry their own logging -- and, on a machine without an
NVIDIA driver, `E0000 ... failed call to cuInit` (TensorFlow 2.18 prints its
own variants, plus "Unable to register cuDNN/cuBLAS/cuFFT factory" errors that
every machine gets). The first ones are written at
library load, before any log level applies; TF_CPP_MIN_LOG_LEVEL is read once,
at the first log call during the import, and never again, so raising it to 3
"around the import" would hide every later C++ error of the run as well.

`quiet_tensorflow()` therefore keeps the level at 2 (errors shown) and, only
while TensorFlow loads and lists its devices, passes stderr through a separate
filter process that drops exactly those known lines (the cuInit one only when
no NVIDIA driver is loaded) and forwards every other line unchanged; being a
separate process, it still delivers what a crashing import wrote. A user who
sets TF_CPP_MIN_LOG_LEVEL, or TFDIST_TF_LOGS=1, gets TensorFlow's own output
untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, NoReturn, Optional

from tfdist.errors import UserError, one_paragraph

# A C++ log line's start: absl's format (TensorFlow 2.21) or TSL's own (TensorFlow 2.18), then the source path.
_LOG = r"^(?:[IWEF]\d{4} \S+ +\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] )(?:\S*/)?"
# Start-up lines TensorFlow prints on every run (regular expressions, one line each).
STARTUP_NOISE = (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    _LOG + r"port\.cc:\d+\] oneDNN custom operations are on\.",
    _LOG + r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
    _LOG + r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized",
    r"^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.$",
    # TensorFlow 2.18: its CUDA plugins register twice, on every machine (tensorflow/tensorflow#62075).
    _LOG + r"cuda_(?:fft|dnn|blas)\.cc:\d+\] Unable to register cu(?:FFT|DNN|BLAS) factory: Attempting to "
           r"register factory for plugin cu(?:FFT|DNN|BLAS) when one has already been registered$",
)
# Only noise when no NVIDIA driver is loaded: with one, a failing cuInit is a real error.
NO_DRIVER_NOISE = _LOG + r"cuda_(?:platform|driver)\.cc:\d+\] failed call to cuInit: "

_FILTER = r"""
import re, sys
patterns = [re.compile(p) for p in sys.argv[1:]]
out = sys.stdout.buffer
for raw in sys.stdin.buffer:
    line = raw.decode("utf-8", "replace").rstrip("\n")
    if not any(p.search(line) for p in patterns):
        out.write(raw)
        out.flush()
"""


def nvidia_driver_loaded() -> bool:
    """Whether the NVIDIA kernel driver is loaded (its /proc entry exists)."""
    return os.path.exists("/proc/driver/nvidia/version")


def quiet_tensorflow() -> None:
    """Imports TensorFlow without its start-up noise, unless the user asked for TensorFlow's own logs.

    Call it before anything imports TensorFlow. Honours a TF_CPP_MIN_LOG_LEVEL
    the user set (nothing is filtered then) and TFDIST_TF_LOGS=1 (TensorFlow's
    defaults, nothing filtered).
    """
    if os.environ.get("TFDIST_TF_LOGS", "") not in ("", "0") or "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        return
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"  # INFO and WARNING hidden; ERROR and FATAL shown.
    if "tensorflow" in sys.modules or not sys.executable:
        return
    patterns = list(STARTUP_NOISE) + ([] if nvidia_driver_loaded() else [NO_DRIVER_NOISE])
    with _filtered_stderr(patterns):
        import tensorflow as tf

        tf.config.list_physical_devices()  # Initialises the device platforms (the cuInit call).


class _filtered_stderr:
    """File descriptor 2 goes through a filter process that drops lines matching `patterns`."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns

    def __enter__(self) -> None:
        self.filter: Optional[subprocess.Popen] = None
        try:
            sys.stderr.flush()
            self.saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # No usable stderr: nothing to filter.
            return
        read, write = os.pipe()
        try:
            self.filter = subprocess.Popen([sys.executable, "-I", "-S", "-c", _FILTER, *self.patterns],
                                           stdin=read, stdout=self.saved, stderr=self.saved)
        except OSError:
            os.close(read)
            os.close(write)
            os.close(self.saved)
            return
        os.close(read)
        os.dup2(write, 2)
        os.close(write)

    def __exit__(self, *exc: object) -> None:
        if self.filter is None:
            return
        sys.stderr.flush()
        os.dup2(self.saved, 2)  # Closes the pipe's last write end: the filter drains it and exits.
        os.close(self.saved)
        try:
            self.filter.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.filter.kill()


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    print(f"{prog}: error: {one_paragraph(message)}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_reporting_user_errors(prog: str, fn: Callable[[], int | None]) -> int | None:
    """Runs `fn`; a `UserError` becomes one paragraph on stderr and exit code 2."""
    try:
        return fn()
    except UserError as e:
        fail(prog, str(e), e.exit_code)
