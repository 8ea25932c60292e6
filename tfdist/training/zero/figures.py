"""What Keras computes over whole variables or the whole gradient, made exact over flat shards.

Each replica computes per-variable partial sums over its shard (a segment sum by the variable each element
belongs to; the padding is segment V), the replicas add them in one small all-reduce, and Keras' own formula
runs on the totals: the loss scale's finite check, ``global_clipnorm``'s norm, ``clipnorm``'s per-variable
norms, LAMB's per-variable trust ratio.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist.training.zero.layout import Bucket


def segments(bucket: Bucket, replica: int, count: int) -> np.ndarray:
    """The variable index of each element of a replica's shard (`count` for the padding)."""
    out = np.full([bucket.shard], count, np.int32)
    for p in bucket.pieces(replica):
        out[p.offset:p.offset + p.length] = p.index
    return out


def square_sums(values: list[tf.Tensor], segs: list[np.ndarray], count: int) -> tf.Tensor:
    """Per-variable sums of squares over shards: a [count + 1] vector (the last entry: the padding)."""
    total = tf.zeros([count + 1], tf.float32)
    for value, seg in zip(values, segs):
        total += tf.math.unsorted_segment_sum(tf.square(tf.cast(value, tf.float32)), seg, count + 1)
    return total


def nonfinite(values: list[tf.Tensor]) -> tf.Tensor:
    """How many elements of `values` are not finite (a float32 scalar)."""
    counts = [tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(v)), tf.float32)) for v in values]
    return tf.add_n(counts) if counts else tf.constant(0.0)


def clipping(optimizer: Any, sums: Optional[tf.Tensor], segs: list[np.ndarray],
             present: list[int]) -> Optional[Callable[[list], list]]:
    """The clone's ``_clip_gradients`` where Keras' needs whole variables: ``clipnorm`` (each variable's
    norm) or ``global_clipnorm`` (the whole gradient's); `sums`: the all-reduced per-variable square sums."""
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        def clip_each(grads: list) -> list:
            out = []
            for g, seg in zip(grads, segs):
                l2sum = tf.gather(tf.cast(sums, g.dtype), seg)
                pred = l2sum > 0
                l2norm = tf.where(pred, tf.sqrt(tf.where(pred, l2sum, tf.ones_like(l2sum))), l2sum)
                out.append(tf.convert_to_tensor(g * optimizer.clipnorm) / tf.maximum(l2norm, optimizer.clipnorm))
            return out
        return clip_each
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        norm = tf.sqrt(tf.reduce_sum(tf.gather(sums, present)))
        clip_norm = optimizer.global_clipnorm

        def clip_all(grads: list) -> list:
            use_norm = tf.cast(norm, grads[0].dtype) if grads else norm
            scale = clip_norm * keras.ops.minimum(1.0 / use_norm, 1.0 / clip_norm) + (use_norm - use_norm)
            return [g * scale for g in grads]
        return clip_all
    return None


def lamb_update_step(optimizer: Any, segs: list[np.ndarray], count: int,
                     all_sum: Callable[[tf.Tensor, int], tf.Tensor]) -> Callable:
    """Keras' Lamb.update_step on a flat shard: the trust ratio ``|w| / |update|`` of each element's own
    variable, from per-variable partial sums all-reduced (`all_sum(partial, shard index)`)."""
    from keras import ops

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> None:
        index = optimizer._get_variable_index(variable)
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        local_step = ops.cast(optimizer.iterations + 1, variable.dtype)
        beta_1_power = ops.power(ops.cast(optimizer.beta_1, variable.dtype), local_step)
        beta_2_power = ops.power(ops.cast(optimizer.beta_2, variable.dtype), local_step)
        m, v = optimizer._momentums[index], optimizer._velocities[index]
        optimizer.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - optimizer.beta_1))
        optimizer.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - optimizer.beta_2))
        m_t_hat = ops.divide(m, (1.0 - beta_1_power))
        v_sqrt = ops.add(ops.sqrt(ops.divide(v, (1.0 - beta_2_power))), optimizer.epsilon)
        update = ops.divide(m_t_hat, v_sqrt)
        seg = segs[index]
        partial = tf.concat([tf.math.unsorted_segment_sum(ops.power(variable, 2), seg, count + 1),
                             tf.math.unsorted_segment_sum(ops.power(update, 2), seg, count + 1)], 0)
        totals = all_sum(partial, index)
        w_norm = tf.gather(ops.sqrt(totals[:count + 1]), seg)
        g_norm = tf.gather(ops.sqrt(totals[count + 1:]), seg)
        ratio = ops.where(ops.greater(w_norm, 0), ops.where(ops.greater(g_norm, 0), (w_norm / g_norm), 1.0), 1.0)
        optimizer.assign_sub(variable, ratio * lr * update)
    return update_step
