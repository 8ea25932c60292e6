"""The step-runner thread: executions dispatched by `Backend.dispatch` run in order on one daemon thread.

Also what that thread needs and what a task does at exit: the caller's tf.summary defaults carried
over to the thread (`_summary_state`, `_summaries_as`), and `wait_until_closed`, how a task learns
that the job's other tasks have exited.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import queue
import socket
import threading
import time
from typing import Any, Callable, Sequence


class Runner:
    """Runs submitted calls in order on one daemon thread; `submit` returns a `concurrent.futures.Future`.

    Unlike `concurrent.futures.ThreadPoolExecutor`, whose threads are joined at
    exit without a limit, `close` (also run at exit) waits a bounded time: a
    worker whose execution failed exits (so the job fails) even if the execution
    queued behind it waits in a collective whose partners will never come.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="tfdist-steps", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("This backend's runner was shut down; make a new strategy to train again.")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # Delivered to whoever fetches it.
                future.set_exception(e)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Ends the thread once the calls already submitted are done (or cancelled); True if it has ended.

        Waits up to `timeout_s` for it: a thread still inside TensorFlow while the
        interpreter shuts down aborts the process. One stuck longer (in a collective
        whose partners are gone) is left behind rather than hanging the caller; the
        exit hook then waits for it once more.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        atexit.unregister(self.close)
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def wait_until_closed(addresses: Sequence[str], timeout_s: float, poll_s: float = 0.1) -> list[str]:
    """Waits until no process listens at any of `addresses` ("host:port"); returns those still listening.

    A TensorFlow server listens until its process has exited, so this is how a
    task learns that the others have gone.
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(addresses)
    while waiting:
        still = []
        for address in waiting:
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                    still.append(address)
            except ConnectionRefusedError:
                pass  # Nothing listens there any more: that task has exited.
            except ValueError:
                pass  # Not a host:port address: nothing to wait for.
            except OSError:
                still.append(address)  # Unreachable or slow: keep asking until the deadline.
        waiting = still
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return waiting


_SUMMARY_FIELDS = ("writer", "step", "is_recording", "is_recording_distribution_strategy")


def _summary_state() -> dict:
    """This thread's tf.summary defaults (writer, step, recording condition)."""
    from tensorflow.python.ops import summary_ops_v2

    return {name: getattr(summary_ops_v2._summary_state, name, None) for name in _SUMMARY_FIELDS}


@contextlib.contextmanager
def _summaries_as(state: dict) -> Any:
    """Another thread's tf.summary defaults, in this thread for the duration."""
    from tensorflow.python.ops import summary_ops_v2

    previous = _summary_state()
    for name, value in state.items():
        setattr(summary_ops_v2._summary_state, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(summary_ops_v2._summary_state, name, value)
