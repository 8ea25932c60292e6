"""Stopping on a signal: SIGTERM/SIGINT become a flag the loop (and, through a variable every step reads, every
worker) sees between executions; training then saves a checkpoint and raises `Preempted`."""

from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import tensorflow as tf
from absl import logging


class Preempted(Exception):
    """Raised after a SIGTERM/SIGINT stopped training and a checkpoint was saved."""

    def __init__(self, step: int, checkpoint: Optional[str]):
        saved = (f"checkpoint {checkpoint} was saved. Run the same command with the same --workdir to resume "
                 "from it.") if checkpoint else "the chief saved the checkpoint (if the run has a workdir)."
        super().__init__(f"Training was stopped by a signal at step {step}; {saved}")
        self.step = step
        self.checkpoint = checkpoint


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag the loop checks between executions.

    With a `flag` variable (multi-worker jobs) the request is also written
    there, where the running execution's next step reads it: the request then
    travels with that execution's reduction to every worker.
    """

    def __init__(self, flag: Optional[tf.Variable] = None) -> None:
        self.requested = False
        self.flag = flag
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # Not the main thread: leave signals alone.
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # Second signal: stop now.
            raise KeyboardInterrupt
        logging.warning("Received signal %d: saving a checkpoint and stopping.", signum)
        self.requested = True
        if self.flag is not None:
            with tf.init_scope():  # Runs now, even if the signal lands while a function is being traced.
                self.flag.assign(1.0)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def host_variable(value: float, name: str) -> tf.Variable:
    """A float32 variable on this host, outside any distribution strategy.

    Strategy scopes are per thread, so it is created on a thread of its own:
    even inside a caller's ``strategy.scope()`` it is a plain variable, not a
    mirrored one whose creation would be a collective.
    """
    made: list = []

    def create() -> None:
        try:
            with tf.device("/CPU:0"):
                made.append(tf.Variable(value, trainable=False, name=name))
        except Exception as e:  # Re-raised in the caller's thread.
            made.append(e)

    creator = threading.Thread(target=create)
    creator.start()
    creator.join()
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]
