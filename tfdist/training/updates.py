"""The optimizer update of a training step: the gradients all-reduced once (`Backend.finish_gradients`), then
the user's own Keras optimizer applied to the sums, with Keras' own cross-replica sum turned off while it is
traced (`tfdist.training.keras_hooks`), so its clipping and a loss scale's finite check see global gradients.
(A custom ``train_step`` calls its optimizers itself: `tfdist.training.custom_steps.GlobalGradients`.)"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import keras
import tensorflow as tf

from tfdist.distribute.backend import Backend
from tfdist.training import keras_hooks, overwrites, sparse_updates


def apply(model: keras.Model, backend: Backend, grads: list, step_counter: tf.Variable, *, data: Any,
          row_sparse: bool, streamed: bool, zero: Any = None, present: Sequence[int] = (),
          reduced: bool = False, fresh: bool = True) -> tf.Tensor:
    """All-reduces one replica step's `grads` and applies them to the model's trainable variables (counting
    the step); returns 1.0 where the summed gradients are non-finite (alike on every replica), else 0.0.

    ``zero``: a sharded optimizer state (`tfdist.training.zero`) reduce-scatters them and applies its slices;
    `present`: the variables with a gradient; ``reduced``: `grads` are already this replica's summed slices;
    ``fresh``: `grads` are one backward pass's own (not sums of micro-batches: `zero.pacing`).
    """
    if zero is not None:  # Reduce-scattered (`reduced`: a micro-batch at a time already) and applied by shards.
        return _apply_sharded(zero, backend, grads if reduced else zero.reduce(grads, fresh=fresh), step_counter,
                              present=present)
    leaves = tf.nest.flatten(data)
    sparse = any(isinstance(t, tf.SparseTensor) for t in leaves)
    if any(isinstance(t, tf.RaggedTensor) for t in leaves) or (sparse and not row_sparse) or \
            (streamed and not row_sparse):  # A stream's batches vary in size within an execution.
        # A ragged input's gathers, a sparse input's kernel gradient (Keras' embedding_lookup_sparse):
        # each replica its own count of rows, which a collective all-reduce cannot take from step to step
        # of one execution. Summed dense it is one device's gradient.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    # Else a sparse input's kernel gradient (each replica's own unique rows) is summed as unique rows: it
    # reaches the optimizer row-sparse, one device's gradient.
    optimizer, variables = model.optimizer, model.trainable_variables
    grads, overwritten = overwrites.set_aside(grads, overwrites.indices(variables))  # Float8's scales: the max.
    grads = overwrites.put_back(backend, backend.finish_gradients(grads, distinct_rows=sparse and row_sparse),
                                overwritten)
    # Whether this step's all-reduced gradients are non-finite: the same on every replica (the loop's
    # divergence guard counts steps).
    nonfinite = 1.0 - tf.cast(all_finite(grads), tf.float32)
    with optimizer_hooks(model, backend):  # Entered while this is traced, left before it returns.
        # The update and the step count (parameter servers: only a step no earlier run claimed).
        backend.apply_step(lambda ready: optimizer.apply(ready, variables), step_counter, ready=grads,
                           variables=variables)
    return nonfinite


def _apply_sharded(zero: Any, backend: Backend, grads: list, step_counter: tf.Variable, *,
                   present: Sequence[int]) -> tf.Tensor:
    """The sharded update of this replica's slices of the summed gradients (`zero.reduce`)."""
    finite = []
    backend.apply_step(lambda _: finite.append(zero.apply(grads, present)), step_counter)
    return 1.0 - tf.cast(finite[0], tf.float32)


@contextlib.contextmanager
def optimizer_hooks(model: keras.Model, backend: Backend) -> Iterator[None]:
    """What tfdist changes in Keras' optimizer while a step is traced (`keras_hooks`, `sparse_updates`)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(keras_hooks.no_gradient_sum(model.optimizer))
        stack.enter_context(sparse_updates.sparse_table_updates(model))
        if backend.asynchronous:
            stack.enter_context(keras_hooks.atomic_iterations(model.optimizer))
        yield


def all_finite(grads: list) -> tf.Tensor:
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])
