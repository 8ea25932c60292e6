"""Non-trainable state a forward pass writes (BatchNormalization statistics, seed generators): recorded,
written back, and which of it replicas average."""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf
from keras.src.backend.common.stateless_scope import StatelessScope

from tfdist.distribute.backend import tf_variable


class RecordingScope(StatelessScope):
    """A `StatelessScope` that remembers which variables the forward pass updated."""

    def __init__(self, state_mapping: list):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.updated: dict[int, Any] = {}

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        self.updated[id(update[0])] = update[0]


def where_present(empty: tf.Tensor, grad: Any) -> Any:
    """A gradient, or zeros where the part held no example (its mean loss is 0/0)."""
    if grad is None or isinstance(grad, tf.IndexedSlices):  # No rows gathered: nothing to zero.
        return grad
    return tf.where(empty, tf.zeros_like(grad), grad)


def global_statistics(model: keras.Model) -> set:
    """Ids of the moving statistics of `BatchNormalization(synchronized=True)` layers: an empty part computes
    them from the global batch too, so it writes them like every other part."""
    return {id(tf_variable(v)) for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "synchronized", False)
            for v in (layer.moving_mean, layer.moving_variance)}


def write_state(scope: RecordingScope, before: dict, atomic: bool, keep: Optional[tf.Tensor] = None,
                global_state: frozenset = frozenset()) -> None:
    """Writes the forward pass's non-trainable state updates back to the variables.

    Synchronous replicas assign them, as Keras' own step would. Under asynchronous
    workers (``atomic``) a layer's moving average (BatchNormalization:
    ``m <- m * momentum + mean * (1 - momentum)``) is written back as
    ``m += new - old``: concurrent workers each add their own contribution, as
    with the optimizer's slots, instead of overwriting each other's (with 2
    parameter-server workers many updates were lost, and the lagging statistics
    cost 3-6 points of validation accuracy after 3 epochs). Integer counters
    (seed generators) are incremented the same way.
    """
    for key, variable in scope.updated.items():
        target = tf_variable(variable)
        new = tf.cast(scope.get_current_value(variable), target.dtype)
        old = before.get(key)
        if keep is not None and old is not None and id(target) not in global_state:  # An empty part: its
            # own statistics are 0/0, keep the state (a synchronized layer's are the global batch's).
            new = tf.where(keep, tf.cast(old, target.dtype), new)
        if atomic and old is not None and (target.dtype.is_floating or target.dtype in (tf.int32, tf.int64)):
            target.assign_add(new - old)
        else:  # Synchronous, or state the forward pass did not declare: written as Keras would.
            target.assign(new)


def synced_state(model: keras.Model, updated: Any) -> list:
    """The state replicas must agree on: replica-local float variables the forward pass updates.

    ``updated`` holds the ids of the variables a traced forward pass wrote
    (BatchNormalization's moving statistics); a frozen layer's weights are not
    among them, so they are never all-reduced.
    """
    found = []
    for variable in model.non_trainable_variables:
        value = tf_variable(variable)
        if id(variable) in updated and value.dtype.is_floating and \
                getattr(value, "aggregation", None) == tf.VariableAggregation.NONE:
            found.append(variable)
    return found
