"""A program's own files on a multi-task job: `tfdist.is_chief()` and `tfdist.task_path(path)`.

Every worker runs the whole script, so a file the script writes at top level
(keras.io's MixUp example saves ``initial_weights.weights.h5``) is written by
every worker at once: on one machine or a shared filesystem the writes collide
(h5py's lock fails). Write it from the chief only (``if tfdist.is_chief():``), or
give each task its own copy (``tfdist.task_path(name)``).

Both answer from the job's strategy: the one in scope, else the last `tfdist.make_strategy`'s, else the
program's own tf.distribute strategy tfdist last trained with (`adopting`), else the cluster TF_CONFIG (or a
SLURM step) describes: a program that builds its own ``MultiWorkerMirroredStrategy()`` may ask before any
tfdist call. The chief is the task of type chief, or worker 0 in a cluster without one.
"""

from __future__ import annotations

import os
from typing import Any, Union

import tensorflow as tf

from tfdist.distribute import adopting, cluster as cluster_lib, strategies
from tfdist.distribute.backend import Backend


def _task() -> Union[Backend, cluster_lib.ClusterInfo]:
    """What knows this process's task (``is_chief``, ``worker_index``): a backend, or the cluster's description."""
    if tf.distribute.has_strategy():  # Inside a strategy's scope: that strategy's task.
        scoped: Any = tf.distribute.get_strategy()
        known = adopting.known_backend(scoped)
        if known is not None:
            return known
        if isinstance(scoped, tf.distribute.MultiWorkerMirroredStrategy):
            return adopting.cluster_of(scoped)
    if strategies._CURRENT:  # The last make_strategy's.
        return strategies.current_backend()
    if adopting._ADOPTED:
        return adopting._ADOPTED[-1]
    info = cluster_lib.resolve()
    if info.is_multi_worker:  # No tfdist backend yet (a program that built its own strategy): TF_CONFIG's task.
        return info
    return strategies.current_backend()


def is_chief() -> bool:
    """Whether this process is the job's chief (task 0, Horovod's rank 0; True in a one-process job).

    Uses the job's strategy (the module's docstring says which), else the task TF_CONFIG names.
    """
    return _task().is_chief


def task_path(path: str) -> str:
    """`path` itself on the chief; on another task, the same name with the task in it, before the first dot.

    ``task_path("initial_weights.weights.h5")`` is ``initial_weights.weights.h5`` on the chief
    and ``initial_weights.task1.weights.h5`` on task 1 (Keras' ``.weights.h5`` and ``.keras``
    suffixes survive), so each task writes and reads its own file.
    """
    task = _task()
    if task.is_chief:
        return path
    folder, name = os.path.split(os.fspath(path))
    stem, dot, suffix = name.partition(".")
    return os.path.join(folder, f"{stem}.task{task.worker_index}{dot}{suffix}")
