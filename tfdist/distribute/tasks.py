"""A program's own files on a multi-task job: `tfdist.is_chief()` and `tfdist.task_path(path)`.

Every worker runs the whole script, so a file the script writes at top level
(keras.io's MixUp example saves ``initial_weights.weights.h5``) is written by
every worker at once: on one machine or a shared filesystem the writes collide
(h5py's lock fails). Write it from the chief only (``if tfdist.is_chief():``), or
give each task its own copy (``tfdist.task_path(name)``).
"""

from __future__ import annotations

import os

from tfdist.distribute import strategies


def is_chief() -> bool:
    """Whether this process is the job's chief (task 0, Horovod's rank 0; True in a one-process job).

    Uses the strategy of the last `tfdist.make_strategy` call.
    """
    return strategies.current_backend().is_chief


def task_path(path: str) -> str:
    """`path` itself on the chief; on another task, the same name with the task in it, before the first dot.

    ``task_path("initial_weights.weights.h5")`` is ``initial_weights.weights.h5`` on the chief
    and ``initial_weights.task1.weights.h5`` on task 1 (Keras' ``.weights.h5`` and ``.keras``
    suffixes survive), so each task writes and reads its own file.
    """
    backend = strategies.current_backend()
    if backend.is_chief:
        return path
    folder, name = os.path.split(os.fspath(path))
    stem, dot, suffix = name.partition(".")
    return os.path.join(folder, f"{stem}.task{backend.worker_index}{dot}{suffix}")
