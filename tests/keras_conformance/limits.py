"""Each test's time and memory limits in the conformance run: a watchdog thread and a signal to the main thread.

Past a limit, the test fails with ConformanceLimit (raised in the main thread by SIGUSR1); if the test does not
end within GRACE_S after that, the run's results are written and the process exits with status EXIT_KILLED.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Optional

TEST_TIMEOUT_S = float(os.environ.get("KERAS_CONFORMANCE_TEST_TIMEOUT_S", "90"))  # 30 s seen on a busy CI
# Growth of the RSS in a test: a runaway (an endless generator read into memory) stops soon, sound tests pass
# (Keras' layer tests of RNN layers fitted on 2 replicas grow it about 320 MB; under Keras on one device 50-120 MB).
TEST_MEMORY_MB = float(os.environ.get("KERAS_CONFORMANCE_TEST_MEMORY_MB", "500"))
GRACE_S = 20.0
EXIT_KILLED = 70


class ConformanceLimit(BaseException):
    """A test went past the run's time or memory limit (BaseException: no `except Exception` in the way)."""


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class Watchdog:
    """Stops a test that runs too long or grows the process too much (an infinite generator read into memory)."""

    def __init__(self, on_growth: Callable[[int], None], on_stuck: Callable[[str], None]) -> None:
        self.on_growth, self.on_stuck = on_growth, on_stuck  # Each sample's growth; a test that did not stop.
        self.reason: Optional[str] = None
        self.done = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.reason, self.done = None, threading.Event()
        signal.signal(signal.SIGUSR1, self._raise)
        self.thread = threading.Thread(target=self._watch, args=(self.done, threading.main_thread().ident),
                                       daemon=True, name="keras_conformance_watchdog")
        self.thread.start()

    def stop(self) -> None:
        self.done.set()

    def _raise(self, signum: int, frame: Any) -> None:
        if self.reason is not None and not self.done.is_set():
            raise ConformanceLimit(self.reason)

    def _watch(self, done: threading.Event, main: int) -> None:
        start, rss0 = time.time(), _rss_mb()
        while not done.wait(0.5):
            grown = _rss_mb() - rss0
            self.on_growth(int(grown))
            if time.time() - start > TEST_TIMEOUT_S:
                self.reason = f"keras_conformance: the test ran past {TEST_TIMEOUT_S:.0f} s"
            elif grown > TEST_MEMORY_MB:
                self.reason = (f"keras_conformance: the process grew by {grown:.0f} MB in the test "
                               f"(limit {TEST_MEMORY_MB:.0f})")
            else:
                continue
            signal.pthread_kill(main, signal.SIGUSR1)
            if done.wait(GRACE_S):
                return
            self.on_stuck(self.reason)  # The main thread is stuck in TensorFlow: give up on the run.
            os._exit(EXIT_KILLED)
