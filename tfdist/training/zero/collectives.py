"""Reduce-scatter and all-gather of equal flat parts, inside a replica step, on every synchronous backend.

- Collective strategies (MirroredStrategy's default, MultiWorkerMirrored): the reduce-scatter is an
  all-to-all of the bucket as [N, S/N] rows plus a local sum of what arrives (half an all-reduce's traffic;
  TensorFlow's reduce-scatter op is NCCL-only), the all-gather a CollectiveGatherV2 of equal parts (no shape
  gather, no padding). Both through the strategy's own launchers (`tf_private`).
- Horovod: ``hvd.reducescatter`` and ``hvd.allgather`` (Horovod 0.28.1 with Gloo has both on CPU).
- Anything else (MirroredStrategy with ``reduce_to_one``, one replica): the all-reduce, of which a replica
  keeps its slice, and a sum in which each replica adds its own part and zeros elsewhere. Exact: a copy, or
  x + 0.
A backend that changes the gradients on their way (``--all_reduce_dtype=bfloat16``, Horovod's fp16
compression or Adasum) reduces them its own way (`Backend.finish_gradients`), then a replica keeps its slice.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tfdist.distribute.backend import Backend
from tfdist.training.zero import tf_private


def _horovod(backend: Backend) -> bool:
    return type(backend).__name__ == "HorovodBackend"


def plain_sum(backend: Backend) -> bool:
    """Whether the backend's gradient reduction is a plain sum in the gradients' dtype (else the gradients
    go through `Backend.finish_gradients` and are sliced)."""
    if backend.gradient_dtype not in ("float32", None):
        return False
    if _horovod(backend):
        return getattr(backend, "op", "sum") != "adasum" and \
            getattr(backend, "_compression", None) in (None, backend.hvd.Compression.none)
    return True


def _launcher(backend: Backend, replica: int) -> Optional[Any]:
    found = tf_private.launchers(backend.strategy) if not _horovod(backend) else None
    if not found:
        return None
    return found[replica - backend.worker_index * len(found)]


def path(backend: Backend) -> str:
    """Which collectives the backend's shards move by: "collective", "horovod", "all_reduce" or "none"."""
    if backend.num_replicas == 1:
        return "none"
    if _horovod(backend):
        return "horovod"
    return "collective" if tf_private.launchers(backend.strategy) else "all_reduce"


def reduce_scatter(backend: Backend, flat: tf.Tensor, replica: int, name: str) -> tf.Tensor:
    """The sum over the replicas of a [S] tensor (S a multiple of N), of which this replica gets its
    [S / N] slice."""
    n = backend.num_replicas
    way = path(backend)
    if way == "none":
        return flat
    if way == "horovod":
        return backend.hvd.reducescatter(flat, op=backend.hvd.Sum, name=name)
    if way == "collective":
        received = tf_private.all_to_all(tf.reshape(flat, [n, -1]), _launcher(backend, replica))
        return tf.reduce_sum(received, 0)
    width = flat.shape[0] // n
    summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, flat)
    return summed[replica * width:(replica + 1) * width]


def all_gather(backend: Backend, part: tf.Tensor, replica: int, name: str) -> tf.Tensor:
    """Every replica's [k] `part` concatenated in replica order: [N * k]."""
    n = backend.num_replicas
    way = path(backend)
    if way == "none":
        return part
    if way == "horovod":
        return backend.hvd.allgather(part, name=name)
    if way == "collective":
        return tf_private.all_gather(part, _launcher(backend, replica))
    width = part.shape[0]
    filled = tf.concat([tf.zeros([replica * width], part.dtype), part,
                        tf.zeros([(n - replica - 1) * width], part.dtype)], 0)
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, filled)


def all_sum(backend: Backend, tensors: list[tf.Tensor], replica: int, name: str) -> list[tf.Tensor]:
    """Small figures summed over the replicas (on collective strategies with tfdist's own instance keys,
    `tf_private`; else `Backend.all_sum`)."""
    if path(backend) == "collective":
        launcher = _launcher(backend, replica)
        return [tf_private.all_reduce(t, launcher) for t in tensors]
    return backend.all_sum(tensors, name)
