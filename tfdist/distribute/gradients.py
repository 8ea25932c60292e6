"""How gradients travel between replicas, apart from the all-reduce itself.

`compress`/`decompress`: the dtype they travel in (`Backend.gradient_dtype`). `unique_rows`/`sum_rows`:
row-sparse (`IndexedSlices`) gradients summed across replicas as unique rows, where each replica's
number of rows differs (a sparse input's kernel gradient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

if TYPE_CHECKING:
    from tfdist.distribute.backend import Backend


def compress(grads: list[Any], dtype: str) -> list[Any]:
    """Gradients as they travel: cast to `dtype` ("bfloat16" halves the bytes; "float32": unchanged)."""
    if dtype == "float32":
        return grads

    def cast(g: Any) -> Any:
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(g.values, dtype), g.indices, g.dense_shape)
        return tf.cast(g, dtype) if g.dtype.is_floating else g

    return [cast(g) for g in grads]


def decompress(grads: list[Any], like: list[Any]) -> list[Any]:
    """Casts all-reduced gradients back to the dtypes of `like`."""
    def cast(g: Any, ref: Any) -> Any:
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(g.values, ref.dtype), g.indices, g.dense_shape)
        return tf.cast(g, ref.dtype)

    return [cast(g, r) for g, r in zip(grads, like)]


def unique_rows(grad: tf.IndexedSlices) -> tf.IndexedSlices:
    """Each row once, its occurrences summed (as one device's sparse-input kernel gradient holds them)."""
    rows, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.size(rows))
    return tf.IndexedSlices(values, rows, grad.dense_shape)


def sum_rows(grad: tf.IndexedSlices, context: Any, backend: "Backend") -> tf.IndexedSlices:
    """The sum over every replica of row gradients whose number of rows differs by replica, as unique rows.

    Each replica places its rows, padded to the largest count, in its own slot of a zero buffer, and the
    buffers are summed across the replicas (of one shape on every member; counts first, the same way): every
    replica's rows, on every replica, then merged. The same rows and values everywhere: one device's gradient
    of the global batch. Parameter-server workers apply their own. The shapes vary by step: where the
    all-reduce cannot take that within an execution (`Backend.varying_shapes`), only one-step executions use it.
    """
    if context is None or backend.num_replicas == 1 or backend.asynchronous:
        return unique_rows(grad)
    replicas, me = backend.num_replicas, tf.cast(context.replica_id_in_sync_group, tf.int64)

    def gathered(rows: tf.Tensor, slot: tf.Tensor) -> tf.Tensor:  # [replicas * slot, ...]: each replica's rows.
        inner = tf.shape(rows, out_type=tf.int64)[1:]
        padded = tf.concat([rows, tf.zeros(tf.concat([[slot - tf.shape(rows, out_type=tf.int64)[0]], inner], 0),
                                           rows.dtype)], 0)
        placed = tf.concat([tf.zeros(tf.concat([[me * slot], inner], 0), rows.dtype), padded,
                            tf.zeros(tf.concat([[(replicas - 1 - me) * slot], inner], 0), rows.dtype)], 0)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, placed)

    count = tf.shape(grad.indices, out_type=tf.int64)[0]
    counts = gathered(tf.reshape(count, [1]), tf.constant(1, tf.int64))
    largest = tf.reduce_max(counts)
    indices = gathered(tf.cast(grad.indices, tf.int64) + 1, largest) - 1  # Padding: -1.
    values = gathered(grad.values, largest)
    real = indices >= 0
    return unique_rows(tf.IndexedSlices(tf.boolean_mask(values, real), tf.boolean_mask(indices, real),
                                        grad.dense_shape))
