"""`tfdist.evaluate` and `tfdist.predict`: Keras' `Model.evaluate` / `Model.predict` under any tfdist backend.

Both take what `tfdist.fit` takes (arrays, dicts/lists of arrays, a
`tf.data.Dataset`, a dataset function) and what Keras' methods take
(``batch_size`` default 32, ``steps``, ``verbose``, ``callbacks``;
``sample_weight`` and ``return_dict`` for `evaluate`).

Batches. ``batch_size`` is Keras' batch: every replica evaluates whole Keras
batches, replica ``r`` of step ``s`` taking batch ``s * R + r``
(`inputs.eval_arrays_fn`), so a step covers ``batch_size x R`` examples and the
results equal Keras' on one device with the same ``batch_size``, losses that
depend on the batch (masked ones) included. Every example counts exactly once:
the last batches are smaller, or padded and masked where static shapes are
needed (TPUs; `predict` always pads).

`evaluate` runs `StepFunctions.eval_chunk` (the loss and metrics the model
compiled, reduced across replicas and workers as a flat vector of metric-state
sums), ``steps_per_execution`` steps per compiled execution, and returns what
Keras returns: a scalar, a list in ``model.metrics_names`` order, or a dict.
The model's metric variables are left untouched (the step accumulates metric
*deltas* in a `StatelessScope`; Keras' own evaluate would leave them holding
the evaluation's state).

`predict` runs the model in a compiled execution of its own (`_Predictor`):
each replica writes its rows, at their example positions, into a zero buffer
covering the execution's examples, and the buffers are sum-reduced across
replicas and workers (adding zeros is exact), so every task receives every
prediction once, in input order.

A parameter-server job evaluates and predicts inline on the chief, as
`tfdist.fit` validates there: the chief reads the variables from the
parameter servers and runs every batch itself, in order (the workers take
steps as they become free, with no fixed share of the examples).
Multi-worker jobs (MultiWorkerMirrored, Horovod) must call these functions on
every task with the same arguments, as they call `tfdist.fit`.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import columns, custom_steps, fit_args, fitting, inputs, loop, steps as steps_lib

KERAS_BATCH_SIZE = 32  # Keras' default for evaluate and predict.


def _fail(message: str) -> UserError:
    return UserError(message)


# Inputs -------------------------------------------------------------------------------
def _unpack(element: Any) -> tuple:
    """(x, y, sample_weight) as `keras.utils.unpack_x_y_sample_weight` reads a dataset element."""
    if isinstance(element, list):
        element = tuple(element)
    if not isinstance(element, tuple):
        return element, None, None
    if len(element) not in (1, 2, 3):
        raise _fail(f"The dataset yields tuples of {len(element)} values; yield x, (x, y) or (x, y, sample_weight).")
    return tuple(element) + (None,) * (3 - len(element))


def _read_dataset(data: Any, steps: Optional[int], batch_size: Optional[int], what: str) -> tuple:
    """A finite dataset (or a dataset function's one-pipeline dataset) read into arrays; returns (x, y, w, batch)."""
    if callable(data) and not isinstance(data, tf.data.Dataset):
        try:
            data = data(tf.distribute.InputContext())  # One pipeline, one replica: the whole dataset.
        except Exception as e:  # The user's function: say where it failed, in one paragraph.
            raise _fail(f"The dataset function failed when called with an InputContext: "
                        f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
        if not isinstance(data, tf.data.Dataset):
            raise _fail(f"The dataset function must return a tf.data.Dataset, not {type(data).__name__}.")
    if batch_size is not None:
        raise _fail(f"{what} is a dataset, whose batches are the batches; drop batch_size={batch_size} (as Keras "
                    "asks), or pass arrays.")
    if steps is not None:
        data = data.take(steps)
    elif int(data.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise _fail(f"{what} is an infinite dataset (.repeat()?); pass steps= (the number of batches to use) or "
                    "a finite dataset.")
    return _joined([tf.nest.map_structure(columns.leaf, element) for element in data], what)


def _python_batches(data: Any, steps: Optional[int], batch_size: Optional[int], what: str) -> tuple:
    """A generator's or PyDataset's batches read into arrays (at most `steps` of them); returns (x, y, w, batch)."""
    if batch_size is not None:
        raise _fail(f"{what} yields its own batches; drop batch_size={batch_size} (as Keras asks), or pass arrays.")
    if fit_args.is_py_dataset(data):
        count = fit_args._num_batches(data)
        if count is None and steps is None:
            raise _fail(f"{what} is an infinite PyDataset (no num_batches); pass steps= (the number of batches to "
                        "use), or give it a length.")
        indices = range(count if steps is None else steps if count is None else min(int(steps), count))
        return _joined([fit_args._standardize(data[i]) for i in indices], what)
    return _joined([fit_args._standardize(batch) for batch in itertools.islice(data, steps)], what)


def _joined(parts: list, what: str) -> tuple:
    if not parts:
        raise _fail(f"{what} yields no batches; pass a dataset holding at least one batch.")
    first = tf.nest.flatten(parts[0])[0]
    if columns.ndim(first) == 0:
        raise _fail(f"{what} yields scalars, not batches; batch it (dataset.batch(32)) first.")
    joined = tf.nest.map_structure(lambda *leaves: columns.concat(leaves), *parts)
    return (*_unpack(joined), columns.rows(first))


def _batch_size(batch_size: Optional[int], steps: Optional[int], num_examples: int) -> int:
    if batch_size is None:  # Keras' array adapter: steps without a batch size spread the examples over them.
        batch_size = -(-num_examples // int(steps)) if steps else KERAS_BATCH_SIZE
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise _fail(f"batch_size={batch_size!r} must be a positive number of examples per batch (Keras' batch; "
                    "each replica evaluates whole batches).")
    return int(batch_size)


def _first(arrays: inputs.Arrays, count: int) -> inputs.Arrays:
    if count >= arrays.num_examples:
        return arrays
    return inputs.Arrays(*inputs.map_present(lambda a: columns.head(a, count), arrays.structure))


def _held_out(model: keras.Model, x: Any, y: Any, sample_weight: Any, batch_size: Optional[int],
              steps: Optional[int], *, targets: bool) -> tuple[inputs.Arrays, int]:
    """The examples to evaluate (with targets) or predict, as arrays, and Keras' batch size."""
    if steps is not None and (isinstance(steps, bool) or int(steps) < 1):
        raise _fail(f"steps={steps!r} must be a positive number of batches, or None (all the data).")
    batch = None
    fit_args.refuse_distributed(x)
    python = fit_args.is_generator(x) or fit_args.is_py_dataset(x)
    if isinstance(x, tf.data.Dataset) or callable(x) or python:
        if y is not None or sample_weight is not None:
            raise _fail("x is a dataset, so y and sample_weight must come from it; drop y=/sample_weight=.")
        read = _python_batches if python else _read_dataset
        x, y, sample_weight, batch = read(x, steps, batch_size, "x")
        if not targets:
            y = sample_weight = None
        steps = None  # Already taken.
    if targets:
        arrays = fitting.arrays_from(model, x, y, sample_weight, "x/y")
    else:
        arrays = _predict_arrays(model, x)
    if batch is None:
        batch = _batch_size(batch_size, steps, arrays.num_examples)
    if steps is not None:
        arrays = _first(arrays, int(steps) * batch)
    if arrays.num_examples < 1:
        raise _fail("x holds no examples; pass at least one.")
    return arrays, batch


def _predict_arrays(model: keras.Model, x: Any) -> inputs.Arrays:
    x = inputs.to_numpy(x)
    if x is None:
        raise _fail("x is None; pass the inputs to predict (arrays, a dict of arrays, or a dataset).")
    leaves = tf.nest.flatten(x)
    for leaf in leaves:
        if columns.ndim(leaf) == 0:
            raise _fail("x holds a scalar; every input needs a leading example dimension.")
    if len({columns.rows(leaf) for leaf in leaves}) > 1:
        shown = ", ".join(str(columns.rows(leaf)) for leaf in leaves)
        raise _fail(f"The inputs of x disagree on the number of examples ({shown}); every array needs the same "
                    "first dimension.")
    _check_structure(model, x)
    return inputs.Arrays(x)


def _model_inputs(model: keras.Model) -> Optional[list]:
    try:
        found = tf.nest.flatten(model.inputs)
    except (AttributeError, ValueError):
        return None
    return found or None


def _describe(tensors: list) -> str:
    return ", ".join(f"{t.name} {tuple(t.shape)}" for t in tensors)


def _check_structure(model: keras.Model, x: Any) -> None:
    """Refuses inputs that do not match the model's `keras.Input`s (number, names, shapes), before any step."""
    wanted = _model_inputs(model)
    if wanted is None:  # A subclassed model: its call decides (`_output_spec` reports a failure).
        return
    fix = (f"The model takes {len(wanted)} input(s): {_describe(wanted)}. Pass x as "
           + ("one array" if len(wanted) == 1 else "a list in that order, or a dict keyed by those names")
           + " with one row per example.")
    if isinstance(x, dict):
        names = [t.name for t in wanted]
        if set(x) != set(names):
            raise _fail(f"predict: the keys of x ({', '.join(sorted(x))}) do not match the model's inputs. {fix}")
        given = [x[name] for name in names]
    else:
        given = tf.nest.flatten(x)
    if len(given) != len(wanted):
        raise _fail(f"predict: x holds {len(given)} array(s), but the model takes {len(wanted)}. {fix}")
    for array, tensor in zip(given, wanted):
        shape = tuple(tensor.shape)[1:]
        given_shape = tuple(array.shape)[1:]
        if columns.ndim(array) - 1 != len(shape) or any(
                w is not None and g is not None and w != g for w, g in zip(shape, given_shape)):
            raise _fail(f"predict: an array of shape {array.shape} was given for input {tensor.name}, which takes "
                        f"(examples, {', '.join('None' if d is None else str(d) for d in shape)}). {fix}")


# The backend and the model ----------------------------------------------------------------
def _replicas(backend: Backend) -> int:
    """Replicas that evaluate: all of them, or the chief alone on a parameter-server job."""
    return backend.num_replicas if backend.sharded_input else 1


def _num_steps(num_examples: int, batch: int, backend: Backend) -> int:
    return inputs.eval_steps(num_examples, batch, _replicas(backend))


def _steps_per_execution(value: Optional[int], backend: Backend, model: keras.Model, callbacks: Any,
                         hooks: Sequence[str]) -> int:
    value = fitting.resolve_steps_per_execution(value, model, callbacks, backend, hooks)
    if isinstance(value, bool) or int(value) < 1:
        raise _fail(f"steps_per_execution={value!r} must be 1 or more.")
    return int(value)


def _check_evaluable(model: keras.Model, backend: Backend) -> None:
    if not getattr(model, "compiled", False):
        raise _fail("The model is not compiled, so it has no loss or metrics to evaluate; call model.compile(loss="
                    "..., metrics=[...]) under the strategy's scope before tfdist.evaluate (as Keras' evaluate "
                    "needs).")
    if custom_steps.overrides(model, "test_step") and backend.device_kind == "tpu":
        raise _fail(f"{type(model).__name__} overrides test_step(); on a TPU every batch has one shape, so the last "
                    "batch would reach the custom step with padding rows it cannot tell from examples. Evaluate "
                    "with a test set that divides into batches, or move the logic into compute_loss() and "
                    "compiled metrics, which tfdist masks.")


def _callback_list(model: keras.Model, backend: Backend, callbacks: Optional[Sequence[Any]], verbose: Any,
                   num_steps: int) -> keras.callbacks.CallbackList:
    if isinstance(callbacks, keras.callbacks.CallbackList):
        raise _fail("callbacks must be a list of keras.callbacks.Callback, not a CallbackList.")
    own = fitting.callbacks_for_task(list(callbacks or []), backend)  # File writers on the chief only.
    return keras.callbacks.CallbackList(own, add_progbar=verbose != 0 and backend.is_chief, verbose=verbose,
                                        epochs=1, steps=num_steps, model=model)


def keras_batch_steps(model: keras.Model, backend: Backend, callbacks: Any, hooks: Sequence[str]) -> bool:
    """Whether each step is one Keras batch split over the replicas (instead of one whole batch per replica):
    where a callback has per-batch `hooks`, so they come once per Keras batch, as in Keras. Not for a custom
    test_step (its trackers average whole batches' means), a TPU (one shape) or parameter servers (the chief
    evaluates alone)."""
    return (_replicas(backend) > 1 and backend.device_kind != "tpu" and not custom_steps.overrides(model, "test_step")
            and loop.has_batch_hooks(list(callbacks or []), hooks))


def _executions(num_steps: int, per_execution: int) -> list[tuple[int, int]]:
    """(first step, steps) of each compiled execution."""
    return [(first, min(per_execution, num_steps - first)) for first in range(0, num_steps, per_execution)]


# evaluate ------------------------------------------------------------------------------------
@fitting.naming_bad_ids
def evaluate(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: Optional[int] = None,
    verbose: Any = "auto",
    sample_weight: Any = None,
    steps: Optional[int] = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
    return_dict: bool = False,
    strategy: Any = None,
    steps_per_execution: Optional[int] = None,
) -> Union[float, list, dict]:
    """Keras' `Model.evaluate` of `model` (built and compiled under the strategy's scope) on every backend.

    Returns the loss (a float) when the model has no other metric, else a list in
    ``model.metrics_names`` order, or a dict with ``return_dict=True``.
    """
    backend = fitting._backend(strategy)
    _check_evaluable(model, backend)
    arrays, batch = _held_out(model, x, y, sample_weight, batch_size, steps, targets=True)
    per_execution = _steps_per_execution(steps_per_execution, backend, model, callbacks, loop.TEST_BATCH_HOOKS)
    fitting._check_scope(model, backend)
    fitting._build(model, backend, inputs.map_present(lambda a: columns.head(a, batch), arrays.structure))
    steps_lib.check_metrics(model, _fail)
    custom = custom_steps.overrides(model, "test_step")  # Each replica's step gets whole Keras batches.
    split = keras_batch_steps(model, backend, callbacks, loop.TEST_BATCH_HOOKS)
    num_steps = -(-arrays.num_examples // batch) if split else _num_steps(arrays.num_examples, batch, backend)
    functions = steps_lib.StepFunctions(
        model, backend, grad_accum_steps=1, step_counter=None, training=False,
        eval_example=custom_steps.keras_data(inputs.drop_none(arrays.structure)) if custom else None)
    layout = functions.eval_layout
    dataset = backend.distribute_eval_dataset(inputs.eval_arrays_fn(
        arrays, per_replica_batch=batch, steps=num_steps, static_shapes=backend.device_kind == "tpu",
        keras_batch=batch if split else None))
    iterator = iter(dataset)
    callback_list = _callback_list(model, backend, callbacks, verbose, num_steps)
    callback_list.on_test_begin()
    totals = functions.reset_metrics(layout)  # Keras' evaluate begins with reset_metrics.
    logs: dict = {}
    for first, count in _executions(num_steps, per_execution):
        callback_list.on_test_batch_begin(first)
        with backend.scope():
            totals = layout.combine(totals, backend.execute(functions.eval_chunk, iterator,
                                                            tf.constant(count, tf.int64)))
        logs = layout.results(totals)
        callback_list.on_test_batch_end(first + per_execution - 1, logs)
    counted = int(round(float(totals[0])))
    if counted != arrays.num_examples:
        raise RuntimeError(f"Evaluation counted {counted} examples, expected {arrays.num_examples}.")
    functions.store_metrics(totals, layout)
    callback_list.on_test_end(logs)
    backend.leave_last()  # As after fit: the coordination-service leader exits after the other tasks.
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


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
        self.chunk = backend.compile(self._chunk)

    def _zeros(self) -> list[tf.Tensor]:  # One spare row past the window: padding rows (position -1) land there.
        return [tf.zeros((self.window + 1, *shape), dtype) for shape, dtype in self.specs]

    def _replica_step(self, element: tuple, buffers: list, offset: tf.Tensor) -> list[tf.Tensor]:
        x, positions = element
        outputs = tf.nest.flatten(self.model(x, training=False))
        # Within the window (the execution's steps cover it), or the spare row.
        rows = tf.reshape(tf.where(positions >= 0, positions - offset, self.window), [-1, 1])
        return [tf.tensor_scatter_nd_add(buffer, rows, tf.cast(output, buffer.dtype))
                for buffer, output in zip(buffers, outputs)]

    def _chunk(self, iterator: Any, num_steps: tf.Tensor, offset: tf.Tensor) -> list[tf.Tensor]:
        backend = self.backend
        buffers = backend.run_eval(self._zeros, ())
        for _ in tf.range(num_steps):
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            buffers = backend.run_eval(self._replica_step, (next(iterator), buffers, offset))
        return [backend.reduce_eval(b) for b in buffers]


def _output_spec(model: keras.Model, arrays: inputs.Arrays, batch: int) -> Any:
    example = tf.nest.map_structure(
        lambda a: keras.KerasTensor((batch, *a.shape[1:]), a.dtype.name, sparse=isinstance(a, tf.SparseTensor),
                                    ragged=isinstance(a, tf.RaggedTensor)), arrays.x)
    try:
        return model.compute_output_spec(example)
    except Exception as e:  # The model's own call on these inputs: one paragraph naming the fix.
        raise _fail(f"predict: the model cannot take x ({' '.join(str(e).split())[:300]}). Pass x structured as "
                    "the model's inputs (one array, a list, or a dict keyed by input name), one row per "
                    "example.") from None


def _build_for_predict(model: keras.Model, backend: Backend, arrays: inputs.Arrays) -> None:
    if model.built:
        return
    with backend.scope():  # The variables are the strategy's.
        model(inputs.map_present(lambda a: columns.head(a, 1), arrays.x), training=False)


@fitting.naming_bad_ids
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
    backend = fitting._backend(strategy)
    if custom_steps.overrides(model, "predict_step"):
        raise _fail(f"{type(model).__name__} overrides predict_step(); tfdist.predict gathers the outputs of "
                    "model(x) from every replica, and cannot run a custom predict_step yet. Apply its extra logic "
                    "to the returned predictions (e.g. np.argmax(tfdist.predict(model, x), -1)).")
    arrays, batch = _held_out(model, x, None, None, batch_size, steps, targets=False)
    per_execution = _steps_per_execution(steps_per_execution, backend, model, callbacks, loop.PREDICT_BATCH_HOOKS)
    fitting._check_scope(model, backend)
    spec = _output_spec(model, arrays, batch)
    _build_for_predict(model, backend, arrays)
    replicas = _replicas(backend)
    split = keras_batch_steps(model, backend, callbacks, loop.PREDICT_BATCH_HOOKS)
    num, rows_per_step = arrays.num_examples, batch if split else batch * replicas
    num_steps = -(-num // batch) if split else _num_steps(num, batch, backend)
    leaves = tf.nest.flatten(spec)
    # Ragged inputs give ragged outputs (their spec may not say so); sparse ones dense outputs, as a rule.
    if any(isinstance(a, tf.RaggedTensor) for a in tf.nest.flatten(arrays.x)) or \
            any(getattr(leaf, "ragged", False) or getattr(leaf, "sparse", False) for leaf in leaves):
        return _predict_composite(model, backend, arrays, batch, spec, callbacks, verbose)
    specs = [(tuple(leaf.shape)[1:], tf.as_dtype(leaf.dtype)) for leaf in leaves]
    if any(d is None for shape, _ in specs for d in shape):
        raise _fail(f"predict: the model's outputs have no fixed shape for these inputs ({[s for s, _ in specs]} "
                    "per example); tfdist.predict gathers fixed-shape rows. Pad the inputs to a fixed shape.")
    predictor = _Predictor(model, backend, specs, window=per_execution * rows_per_step)
    iterator = iter(backend.distribute_eval_dataset(predict_arrays_fn(
        arrays, per_replica_batch=-(-batch // replicas) if split else batch, steps=num_steps,
        keras_batch=batch if split else None)))
    callback_list = _callback_list(model, backend, callbacks, verbose, num_steps)
    callback_list.on_predict_begin()
    parts: list[list[np.ndarray]] = []
    for first, count in _executions(num_steps, per_execution):
        callback_list.on_predict_batch_begin(first)
        offset = first * rows_per_step
        with backend.scope():
            window = predictor.chunk(iterator, tf.constant(count, tf.int64), tf.constant(offset, tf.int64))
        real = min(num - offset, count * rows_per_step)
        rows = [np.asarray(w)[:real] for w in window]
        parts.append(rows)
        callback_list.on_predict_batch_end(first + per_execution - 1,
                                           {"outputs": tf.nest.pack_sequence_as(spec, rows)})
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
    callback_list = _callback_list(model, backend, callbacks, verbose, num_steps)
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


def _rows(x: Any) -> int:
    leaves = tf.nest.flatten(x)
    if not leaves or getattr(leaves[0], "shape", None) is None or not len(leaves[0].shape):
        raise _fail("x must be a batch: an array (or a structure of arrays) whose first dimension is its examples.")
    return int(leaves[0].shape[0])


def test_on_batch(model: keras.Model, x: Any, y: Any = None, sample_weight: Any = None, *,
                  return_dict: bool = False, strategy: Any = None) -> Union[float, list, dict]:
    """Keras' `Model.test_on_batch`: `evaluate` of the one batch `x` (its metrics reset first, as Keras')."""
    return evaluate(model, x, y, sample_weight=sample_weight, batch_size=_rows(x), verbose=0,
                    return_dict=return_dict, strategy=strategy)


def predict_on_batch(model: keras.Model, x: Any, *, strategy: Any = None) -> Any:
    """Keras' `Model.predict_on_batch`: the predictions of the one batch `x`, a row per example (Keras' own,
    under a strategy, returns every replica's rows)."""
    return predict(model, x, batch_size=_rows(x), verbose=0, strategy=strategy)
