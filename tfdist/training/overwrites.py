"""Trainable variables Keras overwrites with their gradient (``Variable.overwrite_with_gradient``: float8
training's scales and amax histories, which a float8 layer's custom gradient computes from the batch).

Keras' optimizer assigns such a "gradient" to its variable instead of stepping, and over the micro-batches of
its own gradient accumulation keeps the largest (``BaseOptimizer._overwrite_variables_directly_with_gradients``).
A global batch split over replicas (or over tfdist's micro-batches) is one batch on one device: the amax of the
whole is the largest of its parts', and the scale (computed from the history before this batch) is the same in
every part. So these values are combined by their maximum, never summed as gradients are; then Keras' own
optimizer assigns them as on one device. Every such value is at least 0 (an amax, a positive scale), so the
zeros a replica with no example of a short batch gives (`steps`) never win, as Keras' accumulator starts at 0.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tfdist.errors import UserError


def is_overwritten(variable: Any) -> bool:
    """Whether Keras overwrites `variable` with its gradient."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def indices(variables: Sequence[Any]) -> set[int]:
    """The positions of `variables` that Keras overwrites with their gradient."""
    return {i for i, v in enumerate(variables) if is_overwritten(v)}


def accumulate(total: list, micro: list, which: set[int], add: Callable[[Any, Any], Any]) -> list:
    """`total` and one more micro-batch's gradients: `add`ed, or the larger where `which`."""
    return [tf.maximum(a, b) if i in which and a is not None and b is not None else add(a, b)
            for i, (a, b) in enumerate(zip(total, micro))]


def set_aside(grads: list, which: set[int]) -> tuple[list, dict]:
    """`grads` without the overwritten ones (None in their place, so no sum takes them), and those apart."""
    kept = {i: grads[i] for i in which if grads[i] is not None}
    return [None if i in kept else g for i, g in enumerate(grads)], kept


def put_back(backend: Any, grads: list, kept: dict) -> list:
    """The summed `grads` with each value set aside put back as its largest over the replicas (inside a replica
    step; a replica of an asynchronous parameter-server worker keeps its own, as it applies its own update)."""
    grads = list(grads)
    if backend.num_replicas > 1 and not backend.asynchronous:
        kept = _largest(backend, kept)
    for i, value in kept.items():
        grads[i] = value
    return grads


def _largest(backend: Any, values: dict) -> dict:
    """Each of `values` (position: tensor) as its element-wise largest over the replicas: one all-gather per
    dtype of all of them flattened together."""
    by_dtype: dict = {}
    for i, value in values.items():
        by_dtype.setdefault(tf.convert_to_tensor(value).dtype, []).append(i)
    largest = {}
    for dtype, positions in by_dtype.items():
        parts = [tf.reshape(tf.convert_to_tensor(values[i]), [-1]) for i in positions]
        sent = tf.concat(parts, 0)[None]
        gathered = backend.all_gather(sent, f"tfdist_overwrite_{dtype.name}")
        if gathered is None:  # This backend's reductions do not gather; its replica context does.
            gathered = tf.distribute.get_replica_context().all_gather(sent, axis=0)
        pieces = tf.split(tf.reduce_max(gathered, axis=0), [int(p.shape[0]) for p in parts])
        for i, piece in zip(positions, pieces):
            largest[i] = tf.reshape(piece, tf.shape(values[i]))
    return largest


def custom_step_refusal(backend: Any, optimizer: Any, variables: Optional[list]) -> Optional[UserError]:
    """Why a custom train_step's ``optimizer.apply`` on `variables` (None: the optimizer's own) cannot run
    here, or None: on more than one synchronous replica, a variable Keras overwrites with its "gradient". A
    custom step's loss is its replica's own examples' mean, weighed only after the backward pass, so a float8
    layer's amax of the output gradient would be of that loss's, not of the global batch's."""
    if backend.num_replicas == 1 or backend.asynchronous:
        return None
    for variable in variables if variables is not None else getattr(optimizer, "_trainable_variables", ()):
        if is_overwritten(variable):
            return UserError(
                f"The custom train_step calls {type(optimizer).__name__}.apply on {variable.path}, which Keras "
                "overwrites with its gradient (a float8 layer's scales and amax histories, computed from the "
                "output gradient of the step's loss). On several replicas each replica's loss is its own "
                "examples' mean, weighed only after the backward pass, so that amax would not be the global "
                "batch's. Train the float8 model with Keras' own train_step (tfdist.fit without a custom one), "
                "or on one replica.")
    return None
