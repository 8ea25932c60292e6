"""`tfdist.predict` and `predict_on_batch`: Keras' `Model.predict` under any tfdist backend, every row once,
in input order.

Each replica predicts its rows and returns them with their positions in the input; an execution returns every
local replica's rows (on a multi-worker job every replica's, all-gathered), one step at a time, and the host
writes them at their positions into the result, as Keras appends each batch's outputs. The compiled execution
is kept per model and backend, as Keras keeps `model.predict_function` (dropped when the model is compiled
again): batches have an unknown first dimension, so it is traced once per input signature, whatever the batch
size or number of examples (TPUs: once per batch size, their shapes static).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError, error_text
from tfdist.training import checks, columns, custom_steps, evaluating, inputs, preparing
from tfdist.training.callbacks import PREDICT_BATCH_HOOKS
from tfdist.training.held_out import held_out, rows
from tfdist.training.plan import compiled_execution

# The most output bytes a compiled call returns (at least one step's): a step's rows are held twice on the device
# (the TensorArray, its concatenation), so an execution's are fetched in parts of this size, the callbacks still
# called once an execution. Keras' own predict holds one batch's.
_CALL_BYTES = 64 << 20
# Dtypes TensorFlow's collective all-gather takes; other outputs (bool, small ints) travel as int32.
_GATHERABLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)


# predict -------------------------------------------------------------------------------------
def predict_arrays_fn(arrays: inputs.Arrays, *, per_replica_batch: int, steps: int,
                      keras_batch: Optional[int] = None, static_shapes: bool = True) -> inputs.DatasetFn:
    """Per-replica batches ``(x, positions)`` in `inputs.eval_arrays_fn`'s layout, always padded.

    ``positions`` are the examples' indices in the input; padding rows (whose
    inputs repeat the last example) have positions past the end, so their
    predictions are dropped on the host. With `keras_batch` step s is Keras'
    batch s split as evenly as can be over the replicas
    (`inputs.eval_arrays_fn`); padding rows then have position -1. Without
    `static_shapes` the batches' first dimension is unknown to the compiled
    function (one trace for every batch size).
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
                start = (step * replicas + first_replica + local) * per_replica_batch
                positions = start + tf.range(_rows(num - start, per_replica_batch, static_shapes), dtype=tf.int64)
            else:
                start = step * keras_batch
                mine = inputs.split_range(start, tf.clip_by_value(num - start, 0, keras_batch), replicas,
                                          first_replica + local)
                padding = _rows(tf.size(mine, tf.int64), per_replica_batch, static_shapes) - tf.size(mine, tf.int64)
                positions = tf.concat([mine, -tf.ones([padding], tf.int64)], 0)
            if not static_shapes:
                positions = tf.compat.v1.placeholder_with_default(positions, [None])
            indices = tf.clip_by_value(positions, 0, num - 1)
            return tf.nest.map_structure(lambda t: columns.gather(t, indices), x), positions

        ds = tf.data.Dataset.range(steps * here).map(replica_batch)
        return ds.prefetch(tf.data.AUTOTUNE).with_options(inputs.options())

    return dataset_fn


def _rows(examples: tf.Tensor, per_replica_batch: int, static_shapes: bool) -> tf.Tensor:
    """The rows of a replica's batch holding `examples` of the input (compiled): the whole batch where shapes
    are static, else the examples and no padding, one discarded row where it has none (layers that need a row).
    A short last batch padded to the whole batch on every replica took the activations of replicas x
    `batch_size` rows: a 1-example predict of an EfficientNetB0 grew the process by 1.1 GB (Keras' by 64 MB)."""
    examples = tf.clip_by_value(tf.cast(examples, tf.int64), 0, per_replica_batch)
    return tf.constant(per_replica_batch, tf.int64) if static_shapes else tf.maximum(examples, 1)


class _Predictor:
    """One model's compiled predict executions under one backend (`_Steps`), and its output specs by input
    signature; `composite` is the one-task call for ragged and sparse outputs (`_predict_composite`).

    The compiled functions hold the steps they run, and the steps hold nothing that holds them: no reference
    cycle, so the graphs go with the model's cache entry at once. (Bound to the predictor itself they made one,
    and a dropped model's graphs, 2 replicas' of an EfficientNetB0 about 100 MB, waited for a second full
    garbage collection.)"""

    def __init__(self, model: keras.Model, backend: Backend):
        steps = _Steps(model, backend)
        self._model, self.backend, self.gather = steps.model, backend, steps.gather
        self.specs: dict[Any, Any] = {}
        self.function = backend.compile(steps.run)
        self.step_function = backend.compile(steps.one_step)
        self.composite = tf.function(steps.call, reduce_retracing=True)

    def output_spec(self, arrays: inputs.Arrays, batch: int) -> Any:
        """The model's output spec for inputs like `arrays` (in batches of `batch`), kept by input signature."""
        key = str(tf.nest.map_structure(lambda a: (type(a).__name__, tuple(a.shape[1:]), str(a.dtype)), arrays.x))
        if key not in self.specs:
            self.specs[key] = _output_spec(self._model(), arrays, batch)
        return self.specs[key]


class _Steps:
    """What a predict execution runs: each step's rows and their positions, as every local replica (on a
    multi-worker job, every replica: `gather`) predicted them, in one TensorArray an output. Holds the model
    weakly (the cache the predictor lives in is keyed by the model)."""

    def __init__(self, model: keras.Model, backend: Backend):
        self.model = weakref.ref(model)
        self.backend = backend
        self.gather = backend.sharded_input and backend.num_workers > 1  # Each process runs some replicas.

    def call(self, x: Any) -> Any:
        return self.model()(inputs.absent_as_none(x), training=False)

    def run(self, iterator: Any, num_steps: tf.Tensor, dtypes: tuple) -> list[list[tf.Tensor]]:
        """`num_steps` steps: each leaf's rows (the outputs', then the positions), in one part."""
        arrays = [tf.TensorArray(dtype, size=tf.cast(num_steps, tf.int32), infer_shape=False)
                  for dtype in (*dtypes, tf.int64)]
        for step in tf.range(tf.cast(num_steps, tf.int32)):
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)  # One step's collectives at a time.
            values = self.backend.run_eval(self._replica_step, (next(iterator),))
            arrays = [array.write(step, tf.concat(self._local_rows(value), 0)) for array, value in zip(arrays, values)]
        return [[array.concat()] for array in arrays]

    def one_step(self, iterator: Any) -> list[list[tf.Tensor]]:
        """One step: each leaf's rows as each local replica holds them (no copy: large outputs)."""
        values = self.backend.run_eval(self._replica_step, (next(iterator),))
        return [list(self._local_rows(value)) for value in values]

    def _local_rows(self, value: Any) -> tuple:
        if isinstance(value, tf.distribute.DistributedValues):
            values = self.backend.strategy.experimental_local_results(value)
        else:
            values = (value,)
        return tuple(values[:1]) if self.gather else tuple(values)  # Gathered: each local replica holds all.

    def _replica_step(self, element: tuple) -> list[tf.Tensor]:
        x, positions = element
        values = [*tf.nest.flatten(self.model()(inputs.absent_as_none(x), training=False)), positions]
        if self.gather:
            values = [self._all_gather(value, f"tfdist_predict_{j}") for j, value in enumerate(values)]
        return values

    def _all_gather(self, value: tf.Tensor, name: str) -> tf.Tensor:
        with tf.device(self._replica_device()):  # tf.distribute gathers to the tensor's device: it needs one.
            sent = tf.identity(value if value.dtype in _GATHERABLE else tf.cast(value, tf.int32))
        gathered = self.backend.all_gather(sent, name)
        if gathered is None:  # This backend's reductions do not gather; its replica context does.
            gathered = tf.distribute.get_replica_context().all_gather(sent, axis=0)
        return tf.cast(gathered, value.dtype)

    def _replica_device(self) -> str:
        try:
            index = self.backend.replica_index()
        except (ValueError, AttributeError):  # One trace for every replica (TPUs), or no replica context.
            return ""
        return dict(self.backend.local_replicas()).get(index, "")


@dataclasses.dataclass
class _Compiled:
    """A model's predictors by backend, and the compile they were made after (`model._compile_config`)."""

    compile_config: Any
    predictors: dict[int, _Predictor] = dataclasses.field(default_factory=dict)


_PREDICTORS: "weakref.WeakKeyDictionary[keras.Model, _Compiled]" = weakref.WeakKeyDictionary()


def _predictor(model: keras.Model, backend: Backend) -> _Predictor:
    """The model's predictor under `backend`: made once, again after the model is compiled again (as Keras
    drops `model.predict_function` in `compile`)."""
    config = getattr(model, "_compile_config", None)
    compiled = _PREDICTORS.get(model)
    if compiled is None or compiled.compile_config is not config:
        compiled = _PREDICTORS[model] = _Compiled(config)
    if id(backend) not in compiled.predictors:  # The predictor holds the backend: its id stays its own.
        compiled.predictors[id(backend)] = _Predictor(model, backend)
    return compiled.predictors[id(backend)]


def _cannot_take(e: Exception) -> UserError:
    return UserError(f"predict: the model cannot take x ({error_text(e)}). Pass x structured as "
                     "the model's inputs (one array, a list, or a dict keyed by input name), one row per example.")


def _output_spec(model: keras.Model, arrays: inputs.Arrays, batch: int) -> Any:
    example = tf.nest.map_structure(
        lambda a: keras.KerasTensor((batch, *a.shape[1:]), columns.tf_dtype(a).name,
                                    sparse=isinstance(a, tf.SparseTensor), ragged=isinstance(a, tf.RaggedTensor)),
        arrays.x)
    example = inputs.absent_as_none(example)
    # A symbolic call, as predict calls the model: it converts the inputs to the model's input dtypes (an int64
    # batch into a float32 Input gives float32 outputs, where `model.compute_output_spec` says int64), and takes an
    # optional input's None (Keras' own compute_output_spec compares every input's shape).
    try:
        return keras.src.backend.compute_output_spec(lambda x: model(x, training=False), example)
    except Exception as e:  # The model's own call on these inputs: one paragraph naming the fix.
        if any(leaf is None for leaf in tf.nest.flatten(example)):
            raise _cannot_take(e) from None
        try:
            return model.compute_output_spec(example)
        except Exception:
            raise _cannot_take(e) from None


def _build_for_predict(model: keras.Model, backend: Backend, arrays: inputs.Arrays) -> None:
    """Builds the model as Keras' first call would (its variables the strategy's). Before its output spec: an
    unbuilt `Sequential` without an `Input` has no spec until then."""
    if model.built:
        return
    try:
        with backend.scope():
            model(inputs.absent_as_none(inputs.map_present(lambda a: columns.head(a, 1), arrays.x)), training=False)
    except Exception as e:  # The model's own call on these inputs.
        raise _cannot_take(e) from None


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
    backend = preparing.backend_for(strategy, model)
    if custom_steps.overrides(model, "predict_step"):
        raise UserError(f"{type(model).__name__} overrides predict_step(); tfdist.predict gathers the outputs of "
                        "model(x) from every replica, and cannot run a custom predict_step yet. Apply its extra logic "
                        "to the returned predictions (e.g. np.argmax(tfdist.predict(model, x), -1)).")
    arrays, batch = held_out(model, x, None, None, batch_size, steps, targets=False)
    per_execution = evaluating.per_execution_steps(steps_per_execution, backend, model, callbacks, PREDICT_BATCH_HOOKS)
    checks.check_scope(model, backend)
    _build_for_predict(model, backend, arrays)
    predictor = _predictor(model, backend)
    spec = predictor.output_spec(arrays, batch)
    leaves = tf.nest.flatten(spec)
    # Ragged inputs give ragged outputs (their spec may not say so); sparse ones dense outputs, as a rule.
    if any(isinstance(a, tf.RaggedTensor) for a in tf.nest.flatten(arrays.x)) or \
            any(getattr(leaf, "ragged", False) or getattr(leaf, "sparse", False) for leaf in leaves):
        return _predict_composite(model, backend, predictor, arrays, batch, spec, callbacks, verbose)
    specs = [(tuple(leaf.shape)[1:], tf.as_dtype(leaf.dtype)) for leaf in leaves]
    if any(d is None for shape, _ in specs for d in shape):
        raise UserError(f"predict: the model's outputs have no fixed shape for these inputs ({[s for s, _ in specs]} "
                        "per example); tfdist.predict gathers fixed-shape rows. Pad the inputs to a fixed shape.")
    replicas = evaluating.evaluating_replicas(backend)
    split = _splits_batches(model, backend, callbacks)
    num, rows_per_step = arrays.num_examples, batch if split else batch * replicas
    num_steps = evaluating.num_steps(num, batch, backend, split)
    iterator = iter(backend.distribute_eval_dataset(predict_arrays_fn(
        arrays, per_replica_batch=-(-batch // replicas) if split else batch, steps=num_steps,
        keras_batch=batch if split else None, static_shapes=backend.device_kind == "tpu" or predictor.gather)))
    results = [np.empty((num, *shape), dtype.as_numpy_dtype) for shape, dtype in specs]
    dtypes = tuple(dtype.name for _, dtype in specs)
    callback_list = evaluating.callback_list(model, backend, callbacks, verbose, num_steps)
    row_bytes = sum(int(np.prod(shape)) * dtype.size for shape, dtype in specs)
    per_call = _steps_per_call(steps_per_execution, model, backend, rows_per_step * row_bytes)
    callback_list.on_predict_begin()
    written = 0
    for first, count in evaluating.executions(num_steps, per_execution):
        callback_list.on_predict_batch_begin(first)
        for _, part in evaluating.executions(count, per_call):
            with backend.scope():
                values = predictor.step_function(iterator) if per_call == 1 else \
                    predictor.function(iterator, tf.constant(part, tf.int64), dtypes)
            written += _place(results, values, num)
        offset = first * rows_per_step
        kept = [result[offset:offset + count * rows_per_step] for result in results]
        callback_list.on_predict_batch_end(first + per_execution - 1,
                                           {"outputs": tf.nest.pack_sequence_as(spec, kept)})
    if written != num:
        raise RuntimeError(f"predict wrote {written} rows, expected {num}.")
    callback_list.on_predict_end()
    backend.leave_last()
    return tf.nest.pack_sequence_as(spec, results)


def _splits_batches(model: keras.Model, backend: Backend, callbacks: Any) -> bool:
    """Whether each step is one Keras batch split over the replicas (else a whole batch a replica): where a
    callback has per-batch hooks (they come once a Keras batch, as in Keras), and where several replicas share
    this process' memory (CPU devices), as Keras' predict under a strategy. There whole batches held replicas x
    the activations of Keras' one batch: twice Keras' peak for an EfficientNetB0 on 2 CPU replicas. A GPU
    replica holds what Keras' one device holds, in half the steps. Never on a TPU (one shape)."""
    if evaluating.keras_batch_steps(model, backend, callbacks, PREDICT_BATCH_HOOKS):
        return True
    return evaluating.evaluating_replicas(backend) > 1 and backend.device_kind == "cpu" and \
        len(backend.local_replicas()) > 1


def _steps_per_call(asked: Optional[int], model: keras.Model, backend: Backend, step_bytes: int) -> int:
    """Steps one compiled call runs. One where nobody asked for more (tfdist's `steps_per_execution` or
    compile's), as Keras' predict: a loop of steps in one call holds the model's graph again in its body (40 MB
    more for an EfficientNetB0 on 2 replicas), where a Python loop of one-step calls costs little next to a
    large model's step (a 2-layer MLP's 313 steps: about 0.2 s more). Else the steps asked (TPUs: tfdist's
    default too, round trips costing most), in parts of at most `_CALL_BYTES` of output."""
    if asked is None and compiled_execution(model) == 1 and backend.device_kind != "tpu":
        return 1
    return max(1, _CALL_BYTES // max(1, step_bytes))


def _place(results: list[np.ndarray], values: list[list[tf.Tensor]], num: int) -> int:
    """Writes a call's rows at their positions: `values` holds each output's parts, then the positions' parts;
    padding rows (positions outside the input) are dropped. Returns the rows written."""
    written = 0
    for part, positions in enumerate(values[-1]):
        positions = np.asarray(positions)
        kept = (positions >= 0) & (positions < num)
        everything = bool(kept.all())
        for result, parts in zip(results, values[:-1]):
            rows = np.asarray(parts[part])
            result[positions if everything else positions[kept]] = rows if everything else rows[kept]
        written += int(kept.sum())
    return written


def _predict_composite(model: keras.Model, backend: Backend, predictor: _Predictor, arrays: inputs.Arrays,
                       batch: int, spec: Any, callbacks: Any, verbose: Any) -> Any:
    """Ragged or sparse outputs (no fixed-shape rows): Keras' batches in order, each a call of the model on this
    task (the strategy's variables read as they are), joined as Keras joins them."""
    num = arrays.num_examples
    num_steps = -(-num // batch)
    callback_list = evaluating.callback_list(model, backend, callbacks, verbose, num_steps)
    callback_list.on_predict_begin()
    parts = []
    for step in range(num_steps):
        callback_list.on_predict_batch_begin(step)
        x = inputs.map_present(lambda a: columns.rows_range(a, step * batch, min(num, (step + 1) * batch)), arrays.x)
        with backend.scope():
            outputs = tf.nest.map_structure(columns.leaf, predictor.composite(x))
        parts.append(tf.nest.flatten(outputs))
        callback_list.on_predict_batch_end(step, {"outputs": outputs})
    callback_list.on_predict_end()
    backend.leave_last()
    return tf.nest.pack_sequence_as(spec, [columns.concat([p[i] for p in parts]) for i in range(len(parts[0]))])


def predict_on_batch(model: keras.Model, x: Any, *, strategy: Any = None) -> Any:
    """Keras' `Model.predict_on_batch`: the predictions of the one batch `x`, a row per example (Keras' own,
    under a strategy, returns every replica's rows)."""
    return predict(model, x, batch_size=rows(x), verbose=0, strategy=strategy)
