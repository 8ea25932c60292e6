"""`tfdist.predict` and `predict_on_batch`: Keras' `Model.predict` under any tfdist backend, every row once,
in input order (each replica writes its rows into a zero buffer; the buffers are sum-reduced)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import checks, columns, custom_steps, evaluating, inputs, preparing
from tfdist.training.callbacks import PREDICT_BATCH_HOOKS
from tfdist.training.held_out import held_out, rows
from tfdist.training.steps import execution


# predict -------------------------------------------------------------------------------------
def predict_arrays_fn(arrays: inputs.Arrays, *, per_replica_batch: int, steps: int,
                      keras_batch: Optional[int] = None) -> inputs.DatasetFn:
    """Per-replica batches ``(x, positions)`` in `inputs.eval_arrays_fn`'s layout, always padded (static shapes).

    ``positions`` are the examples' indices in the input; padding rows (whose
    inputs repeat the last example) have positions past the end, so their
    predictions land past the last row and are cut off on the host. With
    `keras_batch` step s is Keras' batch s split as evenly as can be over the
    replicas (`inputs.eval_arrays_fn`); padding rows then have position -1 (the
    predictor's spare row).
    """
    num = arrays.num_examples

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        here = max(1, ctx.num_replicas_in_sync // ctx.num_input_pipelines)
        replicas = ctx.num_replicas_in_sync
        first_replica = ctx.input_pipeline_id * here
        x = tf.nest.map_structure(columns.constant, arrays.x)

        def replica_batch(slot: tf.Tensor) -> tuple:
            step, local = slot // here, slot % here
            if keras_batch is None:
                positions = (step * replicas + first_replica + local) * per_replica_batch + tf.range(
                    per_replica_batch, dtype=tf.int64)
            else:
                start = step * keras_batch
                mine = inputs.split_range(start, tf.clip_by_value(num - start, 0, keras_batch), replicas,
                                          first_replica + local)
                positions = tf.concat([mine, -tf.ones([per_replica_batch - tf.size(mine)], tf.int64)], 0)
            indices = tf.clip_by_value(positions, 0, num - 1)
            return tf.nest.map_structure(lambda t: columns.gather(t, indices), x), positions

        ds = tf.data.Dataset.range(steps * here).map(replica_batch)
        return ds.prefetch(tf.data.AUTOTUNE).with_options(inputs.options())

    return dataset_fn


class _Predictor:
    """The compiled predict execution: each replica scatters its rows into a zero window, summed across replicas."""

    def __init__(self, model: keras.Model, backend: Backend, specs: list, window: int):
        self.model, self.backend, self.specs, self.window = model, backend, specs, window
        self.execution = execution(backend, self._step, zeros=self._buffers, reduce=self._reduce)

    def _buffers(self) -> Any:
        return self.backend.run_eval(self._zeros, ())

    def _step(self, element: tuple, buffers: Any, offset: tf.Tensor) -> Any:
        return self.backend.run_eval(self._replica_step, (element, buffers, offset))

    def _reduce(self, buffers: Any) -> list[tf.Tensor]:
        return [self.backend.reduce_eval(b) for b in buffers]

    def _zeros(self) -> list[tf.Tensor]:  # One spare row past the window: padding rows (position -1) land there.
        return [tf.zeros((self.window + 1, *shape), dtype) for shape, dtype in self.specs]

    def _replica_step(self, element: tuple, buffers: list, offset: tf.Tensor) -> list[tf.Tensor]:
        x, positions = element
        outputs = tf.nest.flatten(self.model(x, training=False))
        # Within the window (the execution's steps cover it), or the spare row.
        rows = tf.reshape(tf.where(positions >= 0, positions - offset, self.window), [-1, 1])
        return [tf.tensor_scatter_nd_add(buffer, rows, tf.cast(output, buffer.dtype))
                for buffer, output in zip(buffers, outputs)]


def _output_spec(model: keras.Model, arrays: inputs.Arrays, batch: int) -> Any:
    example = tf.nest.map_structure(
        lambda a: keras.KerasTensor((batch, *a.shape[1:]), a.dtype.name, sparse=isinstance(a, tf.SparseTensor),
                                    ragged=isinstance(a, tf.RaggedTensor)), arrays.x)
    try:
        return model.compute_output_spec(example)
    except Exception as e:  # The model's own call on these inputs: one paragraph naming the fix.
        raise UserError(f"predict: the model cannot take x ({' '.join(str(e).split())[:300]}). Pass x structured as "
                        "the model's inputs (one array, a list, or a dict keyed by input name), one row per "
                        "example.") from None


def _build_for_predict(model: keras.Model, backend: Backend, arrays: inputs.Arrays) -> None:
    if model.built:
        return
    with backend.scope():  # The variables are the strategy's.
        model(inputs.map_present(lambda a: columns.head(a, 1), arrays.x), training=False)


@preparing.naming_bad_ids
def predict(
    model: keras.Model,
    x: Any,
    *,
    batch_size: Optional[int] = None,
    verbose: Any = "auto",
    steps: Optional[int] = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
    strategy: Any = None,
    steps_per_execution: Optional[int] = None,
) -> Any:
    """Keras' `Model.predict`: every example's prediction once, in input order, on every task.

    Returns a numpy array, or the model's output structure (dict, list) of them.
    """
    backend = preparing.backend_for(strategy)
    if custom_steps.overrides(model, "predict_step"):
        raise UserError(f"{type(model).__name__} overrides predict_step(); tfdist.predict gathers the outputs of "
                        "model(x) from every replica, and cannot run a custom predict_step yet. Apply its extra logic "
                        "to the returned predictions (e.g. np.argmax(tfdist.predict(model, x), -1)).")
    arrays, batch = held_out(model, x, None, None, batch_size, steps, targets=False)
    per_execution = evaluating.per_execution_steps(steps_per_execution, backend, model, callbacks, PREDICT_BATCH_HOOKS)
    checks.check_scope(model, backend)
    spec = _output_spec(model, arrays, batch)
    _build_for_predict(model, backend, arrays)
    replicas = evaluating.evaluating_replicas(backend)
    split = evaluating.keras_batch_steps(model, backend, callbacks, PREDICT_BATCH_HOOKS)
    num, rows_per_step = arrays.num_examples, batch if split else batch * replicas
    num_steps = evaluating.num_steps(num, batch, backend, split)
    leaves = tf.nest.flatten(spec)
    # Ragged inputs give ragged outputs (their spec may not say so); sparse ones dense outputs, as a rule.
    if any(isinstance(a, tf.RaggedTensor) for a in tf.nest.flatten(arrays.x)) or \
            any(getattr(leaf, "ragged", False) or getattr(leaf, "sparse", False) for leaf in leaves):
        return _predict_composite(model, backend, arrays, batch, spec, callbacks, verbose)
    specs = [(tuple(leaf.shape)[1:], tf.as_dtype(leaf.dtype)) for leaf in leaves]
    if any(d is None for shape, _ in specs for d in shape):
        raise UserError(f"predict: the model's outputs have no fixed shape for these inputs ({[s for s, _ in specs]} "
                        "per example); tfdist.predict gathers fixed-shape rows. Pad the inputs to a fixed shape.")
    predictor = _Predictor(model, backend, specs, window=per_execution * rows_per_step)
    iterator = iter(backend.distribute_eval_dataset(predict_arrays_fn(
        arrays, per_replica_batch=-(-batch // replicas) if split else batch, steps=num_steps,
        keras_batch=batch if split else None)))
    callback_list = evaluating.callback_list(model, backend, callbacks, verbose, num_steps)
    callback_list.on_predict_begin()
    parts: list[list[np.ndarray]] = []
    for first, count in evaluating.executions(num_steps, per_execution):
        callback_list.on_predict_batch_begin(first)
        offset = first * rows_per_step
        with backend.scope():
            window = predictor.execution(iterator, tf.constant(count, tf.int64), tf.constant(offset, tf.int64))
        real = min(num - offset, count * rows_per_step)
        kept = [np.asarray(w)[:real] for w in window]
        parts.append(kept)
        callback_list.on_predict_batch_end(first + per_execution - 1,
                                           {"outputs": tf.nest.pack_sequence_as(spec, kept)})
    callback_list.on_predict_end()
    backend.leave_last()
    joined = [np.concatenate([p[i] for p in parts]) for i in range(len(leaves))]
    return tf.nest.pack_sequence_as(spec, joined)


def _predict_composite(model: keras.Model, backend: Backend, arrays: inputs.Arrays, batch: int, spec: Any,
                       callbacks: Any, verbose: Any) -> Any:
    """Ragged or sparse outputs (no fixed-shape row window holds them): Keras' batches in order, each a call of
    the model on this task (the strategy's variables read as they are), joined as Keras joins them."""
    num = arrays.num_examples
    num_steps = -(-num // batch)
    callback_list = evaluating.callback_list(model, backend, callbacks, verbose, num_steps)
    callback_list.on_predict_begin()
    parts = []
    call = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
    for step in range(num_steps):
        callback_list.on_predict_batch_begin(step)
        x = inputs.map_present(lambda a: columns.rows_range(a, step * batch, min(num, (step + 1) * batch)), arrays.x)
        with backend.scope():
            outputs = tf.nest.map_structure(columns.leaf, call(x))
        parts.append(tf.nest.flatten(outputs))
        callback_list.on_predict_batch_end(step, {"outputs": outputs})
    callback_list.on_predict_end()
    backend.leave_last()
    return tf.nest.pack_sequence_as(spec, [columns.concat([p[i] for p in parts]) for i in range(len(parts[0]))])


def predict_on_batch(model: keras.Model, x: Any, *, strategy: Any = None) -> Any:
    """Keras' `Model.predict_on_batch`: the predictions of the one batch `x`, a row per example (Keras' own,
    under a strategy, returns every replica's rows)."""
    return predict(model, x, batch_size=rows(x), verbose=0, strategy=strategy)
