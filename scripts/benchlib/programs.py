"""What the benchmark's programs share: an epoch timer for either Keras, and which task reports.

Imported by the scripts beside benchlib/ (run as files, so scripts/ is on
sys.path); it imports no Keras itself, so tf_keras programs and Keras 3 ones
each pass their own.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def epoch_timer(keras: Any) -> type:
    """A callback class of `keras` (Keras 3 or tf_keras): each epoch's seconds and its loss.

    Keras calls on_epoch_end after an epoch's validation; the programs pass no
    validation data to fit (they evaluate afterwards), so the seconds are training only.
    """

    class EpochTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds, self.last_loss = [], None

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)
            self.last_loss = (logs or {}).get("loss")

    return EpochTimer


def reports_here() -> bool:
    """Whether this task prints the figures: the chief, or worker 0 where there is none (or no TF_CONFIG)."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = config.get("task", {})
    if "chief" in config.get("cluster", {}):
        return task.get("type") == "chief"
    return task.get("type", "worker") == "worker" and int(task.get("index", 0)) == 0
