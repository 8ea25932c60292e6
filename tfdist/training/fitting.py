"""`tfdist.fit`: train any compiled Keras 3 model under the strategy `tfdist.make_strategy` built.

It takes what `Model.fit` takes (arrays, dicts/lists of arrays, sample
weights, a `tf.data.Dataset`, or a dataset function of a
`tf.distribute.InputContext`), trains with tfdist's loop (`tfdist.training.steps`,
`tfdist.training.loop`) and returns a `keras.callbacks.History` with Keras' own keys.
Bad input raises `tfdist.UserError` (a `ValueError`) with one paragraph naming
the problem and the fix, before any training step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import warnings
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.training import columns, custom_steps, epochs as epochs_lib, fit_args, inputs, steps as steps_lib
from tfdist.distribute import strategies
from tfdist.distribute.backend import Backend, tf_variable
from tfdist.errors import UserError
from tfdist.training.loop import (BATCH_HOOKS, TEST_BATCH_HOOKS, UNBOUNDED, Controller, LoopPlan, LoopResult,
                                  Preempted, has_batch_hooks)

PLAN_FILE = "plan.json"


def _fail(message: str) -> UserError:
    return UserError(message)


# Inputs -------------------------------------------------------------------------
def _input_names(model: keras.Model) -> Optional[list[str]]:
    names = getattr(model, "input_names", None)
    if names:
        return list(names)
    try:
        return [t.name for t in tf.nest.flatten(model.inputs)]
    except (AttributeError, ValueError):
        return None


def arrays_from(model: keras.Model, x: Any, y: Any, sample_weight: Any, what: str) -> inputs.Arrays:
    """Checks and converts array inputs; `what` names them in errors ('x' or 'validation_data')."""
    x, y, sample_weight = inputs.to_numpy(x), inputs.to_numpy(y), inputs.to_numpy(sample_weight)
    if y is None and sample_weight is not None:
        raise _fail(f"{what} has sample weights but no targets; the weights weigh a compiled loss against y. Pass "
                    "y, or fold the weights into the loss your model adds (add_loss).")
    if isinstance(x, dict):
        names = _input_names(model)
        if names and set(x) != set(names):
            raise _fail(
                f"The keys of {what} ({', '.join(sorted(x))}) do not match the model's inputs "
                f"({', '.join(sorted(names))}); use one key per keras.Input, named as the Input's name.")
    lengths = {}
    for label, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if value is None:
            continue
        for i, leaf in enumerate(tf.nest.flatten(value)):
            if columns.ndim(leaf) == 0:
                raise _fail(f"{what}: {label} holds a scalar; every input needs a leading example dimension.")
            lengths[f"{label}[{i}]" if len(tf.nest.flatten(value)) > 1 else label] = columns.rows(leaf)
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise _fail(f"The inputs of {what} disagree on the number of examples ({shown}); every array needs the "
                    "same first dimension.")
    return inputs.Arrays(x, y, sample_weight)


def _split_validation(validation_data: Any) -> tuple:
    """(x, y, sample_weight) as Keras' `unpack_x_y_sample_weight` reads it: a list is a tuple, a bare x has no y."""
    if isinstance(validation_data, list):
        validation_data = tuple(validation_data)
    if not isinstance(validation_data, tuple):
        return validation_data, None, None
    if len(validation_data) in (1, 2, 3):
        return tuple(validation_data) + (None,) * (3 - len(validation_data))
    raise _fail(f"validation_data must be (x_val,), (x_val, y_val) or (x_val, y_val, sample_weight_val), not a "
                f"tuple of length {len(validation_data)}.")


class _Source:
    """What the training data is: arrays, a dataset of global batches, or a dataset function."""

    def __init__(self, kind: str, *, batch_size: Optional[int], num_examples: int, steps_per_epoch: Optional[int],
                 arrays: Optional[inputs.Arrays] = None, dataset: Optional[tf.data.Dataset] = None,
                 function: Any = None, spec: Any = None, model: Optional[keras.Model] = None,
                 partial: bool = False, finite: bool = False, streamed: bool = False):
        self.partial = partial  # A dataset whose last global batch of a pass is short.
        self.kind, self.batch_size, self.num_examples = kind, batch_size, num_examples
        self.steps_per_epoch, self.arrays, self.dataset, self.function = steps_per_epoch, arrays, dataset, function
        self.spec, self.model = spec, model
        self.shuffle = True  # Arrays: a seeded permutation each epoch (False: input order; fit_args).
        self.finite = finite  # A dataset of known length, read a pass at a time.
        self.streamed = streamed  # A dataset of unknown length read as it comes (`LoopPlan.streamed`).

    def sparse_inputs(self) -> bool:
        """Whether a SparseTensor input (scipy sparse ones are held as such: `columns.leaf`) feeds the model."""
        leaves = tf.nest.flatten(self.arrays.structure) if self.arrays is not None else tf.nest.flatten(self.spec)
        return any(isinstance(leaf, (tf.SparseTensor, tf.SparseTensorSpec)) for leaf in leaves)

    def pass_batches(self) -> Optional[int]:
        """Batches of one pass over the data where it is finite and its length known, else None."""
        if self.kind == "arrays" or (self.kind == "dataset" and self.finite):
            return -(-self.num_examples // int(self.batch_size))
        return None

    def example(self, size: int) -> tuple:
        if self.arrays is not None:
            return inputs.map_present(lambda a: columns.head(a, size), self.arrays.structure)
        element = tuple(self.spec) + (None,) * (3 - len(self.spec))
        return inputs.map_present(lambda s: keras.KerasTensor((size, *s.shape[1:]), s.dtype.name), element)

    def check_batches(self, plan: LoopPlan) -> None:
        if self.kind != "dataset_fn":
            return
        for leaf in tf.nest.flatten(self.spec[0]):
            size = leaf.shape[0] if leaf.shape.rank else None
            if size is not None and size != plan.per_replica_batch:
                raise _fail(
                    f"The dataset function returns batches of {size} examples, but batch_size={plan.global_batch} "
                    f"over {plan_replicas(plan)} replica(s) means {plan.per_replica_batch} per replica; batch it "
                    "with input_context.get_per_replica_batch_size(batch_size).")

    def dataset_fn(self, plan: LoopPlan, backend: Backend, first: int) -> inputs.DatasetFn:
        if self.kind == "arrays":
            if not backend.sharded_input:
                return inputs.random_order_arrays_fn(self.arrays, per_replica_batch=plan.per_replica_batch)
            return inputs.train_arrays_fn(self.arrays, per_replica_batch=plan.per_replica_batch,
                                          global_batch=plan.global_batch,
                                          steps_per_epoch=plan.steps_per_pass(), seed=plan.seed, start_step=first,
                                          total_steps=plan.total_steps, partial_last=plan.partial_last,
                                          shuffle=self.shuffle)
        if self.kind == "dataset" and self.streamed:
            return inputs.global_batches_fn(self.dataset, per_replica_batch=plan.per_replica_batch,
                                            global_batch=plan.global_batch, start_step=first, partial_last=True,
                                            stream=True)
        if self.kind == "dataset":
            return inputs.global_batches_fn(self.dataset, per_replica_batch=plan.per_replica_batch,
                                            global_batch=plan.global_batch,
                                            start_step=first if backend.sharded_input else 0,
                                            partial_last=plan.partial_last, whole_batches=not self.partial)
        return inputs.resumed_fn(self.function, start_step=first, sharded=backend.sharded_input)


def _check_rank(model: keras.Model, spec: Any, what: str) -> None:
    """A dataset yielding single examples instead of batches is recognised by its rank."""
    try:
        wanted = [len(t.shape) for t in tf.nest.flatten(model.inputs)]
    except (AttributeError, ValueError):
        return
    given = [leaf.shape.rank for leaf in tf.nest.flatten(spec)]
    if len(wanted) == len(given) and all(g is not None and g == w - 1 for g, w in zip(given, wanted)):
        raise _fail(f"{what} yields single examples (shape {tf.nest.flatten(spec)[0].shape}), not batches; batch "
                    "it (dataset.batch(...)) before passing it to tfdist.fit.")


def _element_spec(model: keras.Model, dataset: tf.data.Dataset, what: str) -> tuple:
    spec = dataset.element_spec
    if custom_steps.overrides(model, "train_step"):  # The user's step takes whatever the dataset yields.
        return spec if isinstance(spec, tuple) else (spec,)
    if not isinstance(spec, tuple):  # x alone (a model whose loss needs no targets: add_loss, an endpoint).
        spec = (spec,)
    if len(spec) not in (1, 2, 3):
        raise _fail(f"{what} must yield x, (x, y) or (x, y, sample_weight) batches, not {spec}.")
    _check_rank(model, spec[0], what)
    return spec


def _first_batch_size(dataset: tf.data.Dataset) -> int:
    for element in dataset.take(1):
        return int(tf.shape(tf.nest.flatten(element)[0])[0])
    raise _fail("The training dataset is empty.")


COUNT_LIMIT = 1_000_000  # Batches of a dataset of unknown length counted before it is refused (maybe endless).


def _count_examples(dataset: tf.data.Dataset) -> int:
    """The examples of one pass of a dataset of unknown length (filter(), from_generator()), read once; refused
    past COUNT_LIMIT batches (it may be endless). A count, not a time: every worker decides alike."""
    logging.info("The training dataset's length is unknown: reading one pass to count its examples (Keras reads it "
                 "to its end as its first epoch).")
    sizes = dataset.take(COUNT_LIMIT + 1).map(lambda *e: columns.batch_rows(tf.nest.flatten(e)[0]))
    examples, batches, shown = 0, 0, time.time()
    for size in sizes:
        examples, batches = examples + int(size), batches + 1
        if time.time() - shown > 30:
            logging.info("Counting the training dataset: %d batches so far (pass steps_per_epoch= to skip this).",
                         batches)
            shown = time.time()
    if batches > COUNT_LIMIT:
        raise _fail(f"The training dataset's length is unknown and one pass holds more than {COUNT_LIMIT} batches "
                    "(it may be endless: from_generator(), repeat() after filter(), ...); pass steps_per_epoch= "
                    "(steps in an epoch), or give it its length with "
                    "dataset.apply(tf.data.experimental.assert_cardinality(batches)).")
    if batches == 0:
        raise _fail("The training dataset is empty.")
    return examples


def _dataset_examples(dataset: tf.data.Dataset, static: Optional[int]) -> int:
    """The examples in one pass over a dataset of batches (Keras trains each pass as an epoch).

    From the number of batches and the batch size, or, where the batches have no
    static size (``dataset.batch(b)``), by reading one pass and adding its batch sizes.
    """
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise _fail("The training dataset is infinite (it repeats); pass steps_per_epoch= (steps in an epoch), "
                    "as Keras' fit asks.")
    if cardinality == tf.data.UNKNOWN_CARDINALITY:  # As Keras reads it to its end: one pass, counted.
        return _count_examples(dataset)
    if cardinality == 0:
        raise _fail("The training dataset is empty.")
    if static is not None:
        return cardinality * static
    sizes = dataset.map(lambda *e: tf.shape(tf.nest.flatten(e)[0], out_type=tf.int64)[0])
    return int(sizes.reduce(tf.constant(0, tf.int64), lambda total, n: total + n))  # One pass, read once.


def _source(model: keras.Model, backend: Backend, x: Any, y: Any, sample_weight: Any, batch_size: Any,
            steps_per_epoch: Optional[int], examples: Optional[int] = None, stream: bool = False) -> _Source:
    """``examples``: the examples of one pass over `x`, where the caller knows them (a PyDataset). ``stream``:
    a dataset of unknown length is read as it comes, its epochs ending where it ends (`can_stream`)."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise _fail("x is a tf.data.Dataset, so y and sample_weight must come from it; drop y=/sample_weight=.")
        if not backend.sharded_input:
            raise _fail("Under parameter servers pass a dataset function (input_context -> per-replica batches) "
                        "or arrays; a tf.data.Dataset object cannot be sent to the workers.")
        spec = _element_spec(model, x, "The training dataset")
        static = tf.nest.flatten(spec[0])[0].shape[0]
        if batch_size is None:
            batch_size = static if static is not None else _first_batch_size(x)
        cardinality = int(x.cardinality())
        if stream and examples is None and cardinality == tf.data.UNKNOWN_CARDINALITY:
            if static is not None and int(batch_size) != static:
                raise _fail(f"x is a dataset of unknown length, read as it comes: each of its batches (of {static}) "
                            f"is a step, so batch_size={batch_size} cannot re-cut them; drop batch_size= or "
                            "batch the dataset with it.")
            return _Source("dataset", batch_size=batch_size, steps_per_epoch=steps_per_epoch, dataset=x,
                           num_examples=(steps_per_epoch or 1) * int(batch_size), spec=spec, model=model,
                           streamed=True)
        if steps_per_epoch is not None and (examples is None and cardinality < 0):
            # Infinite, or of a length unknown without reading it: as many whole global batches as the epochs
            # take, the dataset repeated as needed (one that ends restarts, where Keras would end the epoch).
            return _Source("dataset", batch_size=batch_size, num_examples=steps_per_epoch * int(batch_size),
                           steps_per_epoch=steps_per_epoch, dataset=x, spec=spec, model=model)
        examples = examples if examples is not None else _dataset_examples(x, static)
        return _Source("dataset", batch_size=batch_size, num_examples=examples,
                       steps_per_epoch=steps_per_epoch or -(-examples // int(batch_size)),  # The last one short.
                       dataset=x, spec=spec, model=model, partial=examples % int(batch_size) != 0, finite=True)
    if callable(x):
        if batch_size is None or steps_per_epoch is None:
            raise _fail("With a dataset function, pass batch_size= (the global batch) and steps_per_epoch=.")
        if y is not None or sample_weight is not None:
            raise _fail("x is a dataset function, so y and sample_weight must come from it; drop y=/sample_weight=.")
        replicas = backend.num_replicas
        context = tf.distribute.InputContext(max(1, backend.num_workers) if backend.sharded_input else 1,
                                             backend.worker_index if backend.sharded_input else 0, replicas)
        try:
            probe = x(context)
        except Exception as e:  # The user's function: say where it failed, in one paragraph.
            raise _fail(f"The dataset function failed when called with an InputContext: "
                        f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
        if not isinstance(probe, tf.data.Dataset):
            raise _fail(f"The dataset function must return a tf.data.Dataset, not {type(probe).__name__}.")
        spec = _element_spec(model, probe, "The dataset function's dataset")
        return _Source("dataset_fn", batch_size=batch_size, num_examples=steps_per_epoch * int(batch_size),
                       steps_per_epoch=steps_per_epoch, function=x, spec=spec, model=model)
    if batch_size is None:
        batch_size = 32  # Keras' default for arrays: the global batch, over all replicas.
    arrays = arrays_from(model, x, y, sample_weight, "x/y")
    return _Source("arrays", batch_size=batch_size, num_examples=arrays.num_examples,
                   steps_per_epoch=steps_per_epoch, arrays=arrays)


def _check_composite(source: _Source, backend: Backend, grad_accum_steps: int) -> None:
    """Sparse and ragged inputs: not on a TPU (one static shape) nor cut into micro-batches."""
    leaves = tf.nest.flatten(source.arrays.structure) if source.arrays is not None else \
        tf.nest.flatten(source.spec) if source.spec is not None else []
    if not any(isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor, tf.SparseTensorSpec, tf.RaggedTensorSpec))
               for leaf in leaves):
        return
    if backend.device_kind == "tpu":
        raise _fail("The inputs hold a SparseTensor or RaggedTensor, and a TPU compiles one static shape for every "
                    "batch; pad them to dense arrays (tf.sparse.to_dense, RaggedTensor.to_tensor) for a TPU.")
    if grad_accum_steps > 1:
        raise _fail(f"The inputs hold a SparseTensor or RaggedTensor, which tfdist does not cut into "
                    f"grad_accum_steps={grad_accum_steps} micro-batches; use grad_accum_steps=1 (or dense inputs).")


def _validation(model: keras.Model, validation_data: Any, source: _Source) -> Optional[inputs.Arrays]:
    if validation_data is None:
        return None
    if not custom_steps.overrides(model, "test_step") and not custom_steps.has_call(model):
        raise _fail(f"{type(model).__name__} has neither call() nor test_step(), so validation_data (or "
                    "validation_split) cannot be evaluated: Keras' test_step calls the model. Drop the validation, or "
                    "give the model a test_step (or a call).")
    if isinstance(validation_data, tf.data.Dataset):
        _element_spec(model, validation_data, "validation_data")
        if int(validation_data.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
            raise _fail("validation_data is an infinite dataset (.repeat()?); pass a finite one: every example "
                        "is evaluated exactly once.")
        try:
            validation_data = inputs.to_arrays(validation_data)  # Read once: evaluation is exact over arrays.
        except ValueError as e:
            raise _fail(f"validation_data: {e}.") from None
    vx, vy, vw = _split_validation(validation_data)
    validation = arrays_from(model, vx, vy, vw, "validation_data")
    if source.arrays is not None and tf.nest.map_structure(lambda a: a.shape[1:], validation.x) != \
            tf.nest.map_structure(lambda a: a.shape[1:], source.arrays.x):
        raise _fail("validation_data's inputs do not have the shapes of the training inputs (apart from the "
                    "number of examples); pass (x_val, y_val) structured like x and y.")
    return validation


# Strategy and model ---------------------------------------------------------------
def _backend(strategy: Any) -> Backend:
    if strategy is not None:
        backend = strategies.backend_of(strategy)
        if backend is None:
            raise _fail("The strategy passed to tfdist.fit was not made by tfdist.make_strategy; build it with "
                        "tfdist.make_strategy(name, ...) so tfdist knows its topology.")
        return backend
    return strategies.current_backend()


def _check_scope(model: keras.Model, backend: Backend) -> None:
    extended = getattr(backend.strategy, "extended", None)
    if backend.strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        strategy_default = True
    else:
        strategy_default = False
    for variable in list(model.weights) + _optimizer_variables(model):  # None for an uncompiled model.
        value = tf_variable(variable)
        if strategy_default or extended is None:
            if isinstance(value, tf.distribute.DistributedValues):
                raise _fail(f"The model's variable {variable.path} belongs to another tf.distribute strategy; build "
                            "and compile the model under the scope of the strategy you train with.")
            continue
        if not extended.variable_created_in_scope(value):
            raise _fail(
                f"The model was not built under the strategy's scope (variable {variable.path} is not "
                f"{type(backend.strategy).__name__}'s). Build and compile it inside `with strategy.scope():` "
                "with the strategy from tfdist.make_strategy.")


def _why_even(backend: Backend, source: _Source) -> str:
    """Why this run needs a global batch the replicas (and micro-batches) divide, or "" if it does not."""
    if backend.device_kind == "tpu":
        return "a TPU compiles one batch shape for every replica"
    if not backend.sharded_input:
        return "parameter-server workers each train whole per-replica batches"
    if source.kind == "dataset_fn":
        return "the dataset function batches per replica (input_context.get_per_replica_batch_size)"
    return ""


def _check_short_custom_step(model: keras.Model, backend: Backend, plan: LoopPlan, examples: int) -> None:
    """A custom step on a replica with no example would average over nothing (NaN logs and layer state)."""
    if plan.global_batch < backend.num_replicas and custom_steps.overrides(model, "train_step"):
        raise _fail(
            f"batch_size={plan.global_batch} is smaller than the number of replicas ({backend.num_replicas}), so a "
            f"replica would run {type(model).__name__}.train_step() on no example at every step (its means, "
            "trackers and BatchNormalization statistics would become NaN). Use a batch_size of at least "
            f"{backend.num_replicas}.")
    left = examples % plan.global_batch
    if plan.partial_last and custom_steps.overrides(model, "train_step") and 0 < left < backend.num_replicas:
        raise _fail(
            f"The last batch of each epoch holds {left} example(s), fewer than the {backend.num_replicas} replicas, "
            f"so a replica would run {type(model).__name__}.train_step() on no example (its means, trackers and "
            "BatchNormalization statistics would become NaN). Use a batch_size that leaves at least one example "
            "per replica in the last batch (or none), or pass steps_per_epoch= (whole batches).")


def _optimizer_variables(model: keras.Model) -> list:
    """The variables of every optimizer the model holds (a custom step's several included)."""
    return [v for opt in custom_steps.optimizers_of(model) for v in opt.variables]


def _build(model: keras.Model, backend: Backend, example: tuple) -> None:
    """Creates all model, metric and optimizer state, under the strategy's scope."""
    x, y, sample_weight = example
    if (custom_steps.overrides(model, "train_step") or custom_steps.overrides(model, "test_step")) and \
            not custom_steps.has_call(model):
        return  # Nothing to call: its parts are built, and its step is traced before any step (custom_steps.probe).
    with backend.scope():
        try:
            model._symbolic_build(data_batch=(x, y, sample_weight))
        except (ValueError, TypeError) as e:
            raise _fail(f"The model cannot take these inputs: {' '.join(str(e).split())[:400]}") from None


# Plan -----------------------------------------------------------------------------
def _plan(backend: Backend, *, num_train: int, batch_size: int, epochs: int, grad_accum_steps: int,
          steps_per_execution: Optional[int], steps_per_epoch: Optional[int], seed: int,
          max_steps: Optional[int], extra: dict, pass_batches: Optional[int] = None,
          partial_dataset: bool = False, why_even: str = "", keras_execution: int = 1,
          streamed: bool = False, drop_remainder: bool = False, row_layers: bool = False) -> LoopPlan:
    """The run's numbers; `why_even` (if any) is why this input needs a batch the replicas divide.

    `pass_batches`: the batches of one pass over the data where they are known (arrays, a dataset of known
    length): a `steps_per_epoch` below them gives Keras' continuing epochs (epochs.py), `keras_execution`
    (compile's steps_per_execution) batches an execution. `streamed`: a stream (`_stream_plan`).
    `drop_remainder`: a pass over arrays is its whole global batches only (tfdist-train's plan; on a TPU with
    steps_per_epoch, which compiles one shape).
    """
    replicas = backend.num_replicas
    for name, value in (("steps_per_epoch", steps_per_epoch), ("max_steps", max_steps),
                        ("steps_per_execution", steps_per_execution)):
        if value is not None and value < 1:
            raise _fail(f"{name}={value} must be 1 or more.")
    limit = keras.config.max_steps_per_epoch()  # Keras' global cap (keras.config.set_max_steps_per_epoch).
    if limit and (steps_per_epoch is None or steps_per_epoch > limit):
        logging.warning("Limiting steps_per_epoch to %d (keras.config.max_steps_per_epoch).", limit)
        steps_per_epoch = limit
    if streamed:
        if steps_per_execution is None and row_layers and not backend.sum_rows_each_step(2):
            steps_per_execution = 1  # An Embedding's rows vary with the batch: a collective takes one shape a call.
        return _stream_plan(backend, batch_size=batch_size, epochs=epochs, grad_accum_steps=grad_accum_steps,
                            steps_per_execution=steps_per_execution, steps_per_epoch=steps_per_epoch, seed=seed,
                            max_steps=max_steps, extra=extra)
    unit = replicas * grad_accum_steps
    uneven = bool(batch_size % unit)  # Split as evenly as can be at every step (some parts one example short).
    if uneven and why_even:
        lower, upper = (batch_size // unit) * unit, (batch_size // unit + 1) * unit
        raise _fail(f"batch_size={batch_size} does not divide evenly across {replicas} replica(s) x "
                    f"{grad_accum_steps} accumulation step(s), and {why_even}; use a multiple of {unit}, e.g. "
                    + (f"{lower} or {upper}." if lower else f"{upper}."))
    whole = num_train // batch_size
    partial_last = partial_dataset
    drop_remainder = drop_remainder or (backend.device_kind == "tpu" and steps_per_epoch is not None)
    if drop_remainder and pass_batches is not None and not partial_dataset:
        pass_batches = whole
    if pass_batches is not None and steps_per_epoch is not None and steps_per_epoch >= pass_batches:
        # As Keras: every batch, the last one short if it is; past them it warns the input ran out of data.
        if steps_per_epoch > pass_batches:
            logging.warning("steps_per_epoch=%d is more than the %d batches of the input: your input ran out of "
                            "data, so each epoch trains those %d batches (as Keras does).", steps_per_epoch,
                            pass_batches, pass_batches)
        steps_per_epoch = None
    # As Keras: every example once a pass, the last batch holding what is left. Parameter-server workers read
    # without epochs (each in its own random order), in whole batches.
    pass_partial = bool(num_train % batch_size) and backend.sharded_input and not drop_remainder
    epoch_steps: tuple = ()
    pass_steps = 0
    if steps_per_epoch is None:
        partial_last = pass_partial
        steps_per_epoch = -(-num_train // batch_size) if partial_last else whole
        if steps_per_epoch < 1:
            raise _fail(f"batch_size={batch_size} is larger than the training set ({num_train} examples).")
    elif pass_batches is not None:  # Below a pass: Keras' epochs go on where the last one stopped.
        partial_last = pass_partial
        pass_steps = pass_batches if partial_last else whole
        if pass_steps < 1:
            raise _fail(f"batch_size={batch_size} is larger than the training set ({num_train} examples).")
        epoch_steps = epochs_lib.keras_epoch_steps(steps_per_epoch, pass_steps, epochs, keras_execution)
        if min(epoch_steps) < steps_per_epoch:
            logging.warning("steps_per_epoch=%d with %d batches a pass: each epoch goes on where the last stopped, "
                            "and one that reaches the end of the data ends there (your input ran out of data), as "
                            "in Keras' fit: epochs of %s steps.", steps_per_epoch, pass_steps,
                            ", ".join(map(str, epoch_steps[:6])) + (", ..." if len(epoch_steps) > 6 else ""))
        if pass_steps == steps_per_epoch:
            pass_steps = 0  # A pass an epoch.
        if set(epoch_steps) == {steps_per_epoch}:
            epoch_steps = ()  # Epochs alike: steps_per_epoch each (passes may still span several).
    if partial_last and backend.device_kind == "tpu":
        raise _fail(f"The training set ({num_train} examples) does not divide into global batches of "
                    f"{batch_size}, and a TPU compiles one shape: its last, partial batch cannot be trained as "
                    "Keras trains it. Use a batch_size that divides the training set, pass steps_per_epoch= "
                    "(whole batches), or batch a dataset with drop_remainder=True.")
    total = sum(epoch_steps) if epoch_steps else steps_per_epoch * epochs
    if max_steps is not None:
        total = min(total, max_steps)
    partial_last = partial_last or uneven  # Parts of differing sizes, each carrying the step's global count.
    per_replica = -(-batch_size // replicas)  # The largest share.
    return LoopPlan(
        global_batch=batch_size, per_replica_batch=per_replica, micro_batch=-(-per_replica // grad_accum_steps),
        num_replicas=replicas,
        grad_accum_steps=grad_accum_steps, steps_per_epoch=steps_per_epoch, epochs=epochs, total_steps=total,
        steps_per_execution=steps_per_execution or default_steps_per_execution(backend), seed=seed,
        extra=tuple(sorted(extra.items())), partial_last=partial_last, epoch_steps=epoch_steps,
        pass_steps=pass_steps,
    )


def can_stream(backend: Backend, model: keras.Model) -> bool:
    """Whether a dataset of unknown length (a generator's) can be read as it comes, its epochs ending where it
    ends: one process drives every replica (a multi-worker job's workers would each have to learn it), the
    batch shapes may vary (not a TPU), the input is sharded (not parameter servers), and the model has no custom
    train_step (whose step on a replica with no example, a short batch's, tfdist refuses before training)."""
    return backend.single_controller and backend.device_kind != "tpu" and backend.sharded_input and \
        not backend.asynchronous and not custom_steps.overrides(model, "train_step")


def _stream_plan(backend: Backend, *, batch_size: int, epochs: int, grad_accum_steps: int,
                 steps_per_execution: Optional[int], steps_per_epoch: Optional[int], seed: int,
                 max_steps: Optional[int], extra: dict) -> LoopPlan:
    """A stream's numbers (`_plan` checked them): each of its batches a step (any size, carrying its example
    count), an epoch `steps_per_epoch` steps or until the data ends (`UNBOUNDED` when not given)."""
    per_epoch = steps_per_epoch or UNBOUNDED
    total = per_epoch * epochs if max_steps is None else min(per_epoch * epochs, max_steps)
    per_replica = -(-batch_size // backend.num_replicas)
    return LoopPlan(
        global_batch=batch_size, per_replica_batch=per_replica, micro_batch=-(-per_replica // grad_accum_steps),
        num_replicas=backend.num_replicas, grad_accum_steps=grad_accum_steps, steps_per_epoch=per_epoch,
        epochs=epochs, total_steps=total,
        steps_per_execution=steps_per_execution or default_steps_per_execution(backend), seed=seed,
        extra=tuple(sorted(extra.items())), partial_last=True, streamed=True)


def _compiled_execution(model: keras.Model) -> int:
    """compile(steps_per_execution=): the batches an epoch's executions take in Keras (epochs.py)."""
    compiled = getattr(model, "steps_per_execution", 1)
    return compiled if isinstance(compiled, int) and not isinstance(compiled, bool) and compiled > 1 else 1


def default_steps_per_execution(backend: Backend) -> int:
    """Steps per compiled execution when nothing asks for a number: 100 on TPUs (round trips cost most), else 10."""
    return 100 if backend.device_kind == "tpu" else 10


def resolve_steps_per_execution(given: Optional[int], model: keras.Model, callbacks: Any, backend: Backend,
                                hooks: Sequence[str], sparse_inputs: bool = False) -> Optional[int]:
    """Steps per execution: tfdist's argument; else `compile(steps_per_execution=)` where the model was compiled
    with more than 1; else 1 where a callback has per-batch `hooks` (Keras calls them after every
    `steps_per_execution` batches, and compile's default is 1), or where sparse inputs' gradients can reach the
    optimizer row-sparse only one step an execution (`Backend.sum_rows_each_step`); else tfdist's default.
    """
    if given is not None:
        return given
    if _compiled_execution(model) > 1:
        return _compiled_execution(model)
    if has_batch_hooks(list(callbacks or []), hooks):
        return 1
    if sparse_inputs and backend.sum_rows_each_step(1) and not backend.sum_rows_each_step(2):
        return 1
    return default_steps_per_execution(backend)


def check_resume(path: str, plan: LoopPlan) -> None:
    """Refuses to resume a run whose resolved plan differs, naming each field."""
    saved_path = os.path.join(path, PLAN_FILE)
    if not tf.io.gfile.exists(saved_path):
        return
    try:
        with tf.io.gfile.GFile(saved_path) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"Cannot resume the run in --workdir={path}: its {PLAN_FILE} is damaged ({e}). Start a "
                        "new run with a new --workdir.") from None
    now = plan.resume_fields()
    changed = [f"{k} (was {saved.get(k)!r}, now {now.get(k)!r})" for k in sorted(set(saved) | set(now))
               if k != "num_replicas" and saved.get(k) != now.get(k)]
    if changed:
        raise UserError(
            f"Cannot resume the run in --workdir={path}: {'; '.join(changed)} changed what a training step "
            "means. Restore the old setting, or start a new run with a new --workdir.")
    if saved.get("num_replicas") not in (None, plan_replicas(plan)):
        logging.info("Resuming on another topology (%s replica(s) before, %s now); the plan is unchanged, so "
                     "training continues the same trajectory.", saved.get("num_replicas"), plan_replicas(plan))


def plan_replicas(plan: LoopPlan) -> int:
    """The replica count a plan was made for."""
    return plan.num_replicas


# The public function ---------------------------------------------------------------
def _releasing_the_runner(fit_fn: Any) -> Any:
    """Each fit call ends its backend's step-runner thread on the way out, whether it returns or raises."""
    @functools.wraps(fit_fn)
    def fit_and_release(*args: Any, **kwargs: Any) -> Any:
        finished = False
        try:
            history = fit_fn(*args, **kwargs)
            finished = True
            return history
        except Preempted:
            finished = True  # Every task stopped together and saved.
            raise
        finally:
            backend = strategies.backend_of(kwargs["strategy"]) if kwargs.get("strategy") is not None \
                else strategies.current_backend()
            if backend is not None:
                backend.release_runner(finished=finished)
    return fit_and_release


def naming_bad_ids(fn: Any) -> Any:
    """A step that failed `ShardedEmbedding`'s id check raises its one-paragraph `UserError` instead."""
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except tf.errors.InvalidArgumentError as e:
            from tfdist.layers.sharded_embedding import id_error

            clear = id_error(e)
            if clear is None:
                raise
            raise clear from None
    return checked


@naming_bad_ids
@_releasing_the_runner
def fit(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: Optional[int] = None,
    epochs: int = 1,
    validation_data: Any = None,
    sample_weight: Any = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
    workdir: Any = None,
    strategy: Any = None,
    steps_per_epoch: Optional[int] = None,
    steps_per_execution: Optional[int] = None,
    grad_accum_steps: int = 1,
    seed: int = 0,
    max_steps: Optional[int] = None,
    checkpoint_every_steps: int = 0,
    checkpoint_every_secs: float = 0.0,
    keep_checkpoints: int = 3,
    resume: Optional[bool] = None,
    verbose: int = 1,
    step_counter: Optional[tf.Variable] = None,
    jit_compile: Any = "auto",
    summary_every_steps: int = 0,
    profile_steps: Optional[tuple[int, int]] = None,
    export: Sequence[str] = ("keras",),
    plan_extra: Optional[dict] = None,
    shuffle: Any = True,
    class_weight: Optional[dict] = None,
    validation_split: float = 0.0,
    validation_freq: Any = 1,
    initial_epoch: int = 0,
    validation_steps: Optional[int] = None,
    validation_batch_size: Optional[int] = None,
    drop_remainder: bool = False,
    _report: Optional[dict] = None,
) -> keras.callbacks.History:
    """Trains `model` (built and compiled under the strategy's scope); returns its History.

    See the README's "Use it from Python" section for every argument.
    """
    from tfdist.training import export as export_lib, workdir as workdir_lib

    start = time.time()
    export = export_lib.parse_export_formats(",".join(export)) if export else ()
    backend = _backend(strategy)
    steps_lib.check_model(model, _fail)
    steps_lib.check_custom_steps(model, backend, grad_accum_steps=grad_accum_steps, error=_fail)
    if epochs < 1:
        raise _fail(f"epochs={epochs} must be 1 or more.")
    if keras.config.max_epochs() and keras.config.max_epochs() < epochs:  # Keras' global cap, as its fit reads it.
        logging.warning("Limiting epochs to %d (keras.config.max_epochs).", keras.config.max_epochs())
        epochs = keras.config.max_epochs()
    if grad_accum_steps < 1:
        raise _fail(f"grad_accum_steps={grad_accum_steps} must be 1 or more.")
    if not checkpoint_every_secs >= 0:
        raise _fail(f"checkpoint_every_secs={checkpoint_every_secs} must be 0 (off) or more.")
    fit_args.check_arguments(shuffle=shuffle, class_weight=class_weight, validation_split=validation_split,
                             validation_freq=validation_freq, initial_epoch=initial_epoch)
    keras_validation_batch = validation_batch_size or batch_size  # What Keras' validation batches (or None).
    validation_data = fit_args.limit_validation(validation_data, validation_steps)
    validation_was_dataset = isinstance(validation_data, tf.data.Dataset)  # Cut to validation_steps already.
    if validation_was_dataset and validation_batch_size is None and \
            has_batch_hooks(list(callbacks or []), TEST_BATCH_HOOKS):  # Read only where per-batch hooks need it.
        keras_validation_batch = _first_batch_size(validation_data)  # Keras validates the dataset's own batches.
    if validation_batch_size is not None and (isinstance(validation_batch_size, bool) or
                                              not isinstance(validation_batch_size, int) or validation_batch_size < 1):
        raise _fail(f"validation_batch_size={validation_batch_size!r} must be a positive number of examples.")
    streamable = can_stream(backend, model)
    given = fit_args.prepare(x, y, sample_weight, validation_data=validation_data, batch_size=batch_size,
                             steps_per_epoch=steps_per_epoch, shuffle=shuffle, class_weight=class_weight,
                             validation_split=validation_split, seed=seed, epochs=epochs, stream=streamable)
    x, y, sample_weight, validation_data, batch_size = (given.x, given.y, given.sample_weight,
                                                        given.validation_data, given.batch_size)
    if given.one_pass and epochs > initial_epoch + 1:
        warnings.warn(f"x is a Python generator without steps_per_epoch: its one pass is epoch {initial_epoch + 1}, "
                      f"and your input ran out of data, so epochs {initial_epoch + 2}-{epochs} are not trained (Keras "
                      "runs them without data). Pass steps_per_epoch= with a generator that does not end, or a "
                      "keras.utils.PyDataset (read once an epoch).", stacklevel=3)
        epochs = initial_epoch + 1
    if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or steps_per_epoch < 1):
        raise _fail(f"steps_per_epoch={steps_per_epoch!r} must be 1 or more (steps in an epoch), or None.")
    source = _source(model, backend, x, y, sample_weight, batch_size, steps_per_epoch, examples=given.examples,
                     stream=streamable and (steps_per_epoch is not None or given.one_pass))
    source.shuffle = bool(shuffle)
    _check_composite(source, backend, grad_accum_steps)
    fit_args.check_backend(backend, source.kind, source.shuffle)
    batch_size = source.batch_size
    if batch_size is None or int(batch_size) < 1:
        raise _fail(f"batch_size={batch_size!r} must be a positive global batch size (examples per optimizer step "
                    "over all replicas).")
    validation = _validation(model, validation_data, source)
    if validation is not None and validation_steps is not None and not validation_was_dataset:
        # Keras evaluates the first validation_steps batches of validation_batch_size (or batch_size).
        per_step = keras_validation_batch or -(-validation.num_examples // int(validation_steps))  # Keras' rule.
        validation = inputs.Arrays(*inputs.map_present(
            lambda a: columns.head(a, int(validation_steps) * per_step), validation.structure))
    _check_scope(model, backend)
    plan = _plan(backend, num_train=source.num_examples, batch_size=int(batch_size), epochs=epochs,
                 grad_accum_steps=grad_accum_steps,
                 steps_per_execution=resolve_steps_per_execution(steps_per_execution, model, callbacks, backend,
                                                                 BATCH_HOOKS, source.sparse_inputs()),
                 steps_per_epoch=source.steps_per_epoch, seed=seed, max_steps=max_steps,
                 extra={"data": source.kind, "num_train": source.num_examples, **(plan_extra or {}),
                        **fit_args.plan_fields(shuffle=source.shuffle, class_weight=class_weight,
                                               validation_split=validation_split)},
                 pass_batches=source.pass_batches() if backend.sharded_input else None,  # PS: no passes.
                 partial_dataset=source.partial, streamed=source.streamed, drop_remainder=drop_remainder,
                 row_layers=source.streamed and any(isinstance(layer, keras.layers.Embedding)
                                                    for layer in model._flatten_layers()),
                 why_even=_why_even(backend, source), keras_execution=_compiled_execution(model))
    source.check_batches(plan)
    _check_short_custom_step(model, backend, plan, source.num_examples)
    _build(model, backend, source.example(plan.micro_batch))
    steps_lib.check_metrics(model, _fail)  # Compiled metrics have variables only once built.

    with backend.scope():
        if step_counter is None:
            step_counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_step",
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    backend.report_placement(list(model.variables) + _optimizer_variables(model) + [step_counter])
    checkpoint = workdir_lib.training_checkpoint(model, step_counter)  # Seed generators' state included.
    if workdir is not None:
        export_lib.check_exportable(model, export)  # Before any step: a failed export would come after training.
    owned = not isinstance(workdir, workdir_lib.RunDir)
    rundir = workdir if not owned else (workdir_lib.RunDir(workdir, is_chief=backend.is_chief) if workdir else None)
    if rundir is not None:
        workdir = rundir.path
    start_step = 0
    manager = None
    with rundir if (rundir is not None and owned) else contextlib.nullcontext():
        if rundir is not None:
            rundir.acquire()
            latest = rundir.readable_checkpoint()  # Skips damaged ones with a log line; none whole: UserError.
            if latest is not None and resume is False:
                raise UserError(f"--workdir={workdir} already holds checkpoint {os.path.basename(latest)} and "
                                "resuming is off (--noresume / resume=False); tfdist never overwrites a run. Pick a "
                                "new --workdir, or drop --noresume to continue this run.")
            if latest is None and resume:
                raise UserError(f"--resume was given but {rundir.join('checkpoints')} holds no checkpoint; drop "
                                "--resume (resume=True) to start a new run.")
            if latest is not None:
                check_resume(workdir, plan)
                if plan.streamed and plan.known_steps_per_epoch() is not None:
                    raise UserError(
                        f"Cannot resume the run in --workdir={workdir}: its input is a dataset of unknown length "
                        "read as a stream with steps_per_epoch, and where its passes ended (its epochs can end "
                        "early) was not recorded, so the data cannot be continued exactly. Give the dataset its "
                        "length (dataset.apply(tf.data.experimental.assert_cardinality(batches))), or start a new "
                        "--workdir.")
                try:
                    workdir_lib.restore_checkpoint(checkpoint, latest)
                except (AssertionError, ValueError, tf.errors.OpError) as e:
                    raise UserError(
                        f"Cannot resume from {latest}: it does not hold this model and optimizer "
                        f"({' '.join(str(e).split())[:200]}). Was the model changed? Use a new workdir, or the "
                        "model the checkpoint was written by.") from None
                with backend.scope():
                    workdir_lib.sync_table_replicas(checkpoint)
                start_step = int(step_counter.numpy())
                logging.info("Resuming from checkpoint %s at step %d.", latest, start_step)
            manager = tf.train.CheckpointManager(checkpoint, rundir.checkpoint_dir, max_to_keep=keep_checkpoints,
                                                 checkpoint_name="ckpt")
            rundir.write_text(PLAN_FILE, json.dumps({**plan.resume_fields(), "num_replicas": backend.num_replicas},
                                                    indent=2, sort_keys=True) + "\n")
            rundir.record_membership(start_step, backend.num_workers, backend.num_replicas)
        precision = keras.mixed_precision.dtype_policy().name
        step_functions = steps_lib.StepFunctions(
            model, backend, grad_accum_steps=grad_accum_steps, step_counter=step_counter,
            jit_compile=_resolve_jit(jit_compile, backend, model), partial_last=plan.partial_last,
            row_sparse=backend.sum_rows_each_step(plan.steps_per_execution), streamed=plan.streamed,
            train_example=custom_steps.keras_data(inputs.drop_none(source.example(plan.micro_batch))),
            eval_example=custom_steps.keras_data(inputs.drop_none(validation.structure)) if validation else None)
        # After the step functions: a custom step's optimizers are built when its step is first traced.
        backend.broadcast_initial_state(list(model.variables) + _optimizer_variables(model))
        result = _run(model, backend, plan, source, validation, step_functions, checkpoint, manager, rundir,
                      step_counter, start_step, callbacks, checkpoint_every_steps, verbose, precision,
                      summary_every_steps, profile_steps, initial_epoch=int(initial_epoch),
                      validation_freq=validation_freq, checkpoint_every_secs=float(checkpoint_every_secs),
                      validation_batch_size=validation_batch_size,
                      hook_batch=keras_validation_batch or 32)  # Keras' default batch.
        if rundir is not None and not result.diverged:  # Chief only; staged and renamed into place.
            _export(rundir, model, export, result, manager)
    if _report is not None:
        _report.update(plan=plan, result=result, backend=backend, precision=precision, rundir=rundir,
                       wall_seconds=time.time() - start)
    return result.history


def _export(rundir: Any, model: keras.Model, export: Sequence[str], result: LoopResult, manager: Any) -> None:
    """Writes the exports; one that fails raises `ExportError` with the History on it (checkpoints are kept)."""
    from tfdist.training import export as export_lib, workdir as workdir_lib

    for name, write in (("keras", rundir.export_model), ("saved_model", rundir.export_saved_model)):
        if name not in export:
            continue
        try:
            write(model)
        except Exception as e:  # noqa: BLE001 - any failure: keep the History, say what failed.
            cause = str(e) if isinstance(e, workdir_lib.WriteError) else \
                f"{type(e).__name__}: {export_lib.first_sentence(e)}"
            latest = manager.latest_checkpoint if manager is not None else None
            kept = (f"checkpoint {os.path.basename(latest)} in {os.path.dirname(latest)} holds the trained model"
                    if latest else "no checkpoint was written")
            raise export_lib.ExportError(
                f"Training finished at step {result.steps} and {kept}, but the {name} export failed: {cause} The "
                "History is on model.history and on this error's .history. Fix the cause and rerun the same call "
                "(it resumes at the last checkpoint and exports again), or pass export=() to skip the export.",
                history=result.history) from e


def _local_replicas(backend: Backend) -> int:
    try:
        return len(backend.strategy.extended.worker_devices) or 1
    except (AttributeError, RuntimeError):  # The default strategy has none: one device.
        return 1


def _resolve_jit(jit_compile: Any, backend: Backend, model: keras.Model) -> bool:
    """XLA for the step: "auto" is what Keras' own ``fit`` would use, where tfdist can run it; refused clearly.

    "auto" takes the model's ``jit_compile``: the value given to ``compile`` or, for
    ``compile(jit_compile="auto")``, Keras' resolution of it (keras/src/trainers/trainer.py
    ``_resolve_auto_jit_compile``: off on CPU-only machines, off for a model built under a
    tf.distribute scope, off unless ``model_supports_jit``: every layer ``supports_jit``, op
    determinism off). tfdist then keeps it off where it cannot run XLA: several replicas in
    one process, Horovod, loss scaling, multi-worker CPU collectives, and TPUs (TPUStrategy
    compiles every step with XLA itself). ``True`` is refused in those cases, and for a model
    Keras would not compile (Keras warns and proceeds without XLA).
    """
    from keras.src.trainers.trainer import model_supports_jit
    from tensorflow.python.framework.config import is_op_determinism_enabled  # What Keras reads.

    if jit_compile not in ("auto", True, False):
        raise _fail(f"jit_compile={jit_compile!r} must be 'auto', True or False.")
    loss_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    single = _local_replicas(backend) == 1 and backend.name != "horovod"
    # XLA-compiled cross-worker collectives on CPU abort the process (SIGABRT, double free; TF 2.21).
    cpu_workers = backend.device_kind == "cpu" and backend.num_workers > 1 and not backend.asynchronous
    supported = model_supports_jit(model)
    if jit_compile == "auto":
        return bool(model.jit_compile) and supported and single and not loss_scaled and not cpu_workers \
            and backend.device_kind != "tpu"
    if jit_compile and not single:
        raise _fail(
            f"XLA (jit_compile) is supported here with one replica per process; this {backend.name} backend has "
            f"{_local_replicas(backend)} local replica(s){' (Horovod ops are not XLA ops)' if backend.name == 'horovod' else ''}"
            ". Use --jit_compile=auto/false, or one process per device (multi_worker_mirrored).")
    if jit_compile and cpu_workers:
        raise _fail(
            f"XLA (jit_compile=True) on a multi-worker CPU job ({backend.num_workers} workers) is refused: TensorFlow "
            "aborts the workers (SIGABRT, double free) in XLA-compiled collectives on CPUs. Use jit_compile='auto' "
            "or False on CPUs (XLA is also slower there), or XLA on GPU workers.")
    if jit_compile and loss_scaled and backend.num_replicas > 1:
        raise _fail("XLA (jit_compile) with loss scaling (mixed_float16) across several replicas hits an upstream "
                    "Keras bug (keras-team/keras#21366); use --precision=mixed_bfloat16 (no loss scaling), or "
                    "--jit_compile=false.")
    if jit_compile and not supported:
        layers = [f"{layer.name} ({type(layer).__name__})" for layer in model._flatten_layers()
                  if not layer.supports_jit]
        why = (f"layer(s) {', '.join(layers)} do not support XLA (supports_jit=False)" if layers else
               "TensorFlow op determinism is enabled (tf.config.experimental.enable_op_determinism), which XLA "
               "does not support" if is_op_determinism_enabled() else
               "Keras does not support XLA for it on this platform")
        raise _fail(f"jit_compile=True, but the model cannot be compiled with XLA: {why}. Keras' fit would warn "
                    "and train without XLA; pass jit_compile='auto' or False to tfdist.fit.")
    return bool(jit_compile)


# Keras callbacks that write files: on a multi-worker job only the chief runs them, so workers
# never race on shared storage. BackupAndRestore also reads: every task restores, the chief writes.
FILE_WRITERS = (keras.callbacks.TensorBoard, keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger)


class _RestoreOnly(keras.callbacks.Callback):
    """A `BackupAndRestore` on a non-chief task: it restores at the start and writes nothing."""

    def __init__(self, callback: keras.callbacks.Callback):
        super().__init__()
        self.callback = callback

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        self.callback.set_params(params)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.callback.on_train_begin(logs)


def callbacks_for_task(callbacks: list, backend: Backend) -> list:
    """The user's callbacks this task runs: all on the chief; on other workers none that write files."""
    if backend.is_chief:
        return callbacks
    kept = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            kept.append(_RestoreOnly(callback))
        elif not isinstance(callback, FILE_WRITERS):
            kept.append(callback)
    return kept


def _run(model, backend, plan, source, validation, step_functions, checkpoint, manager, rundir, step_counter,
         start_step, callbacks, checkpoint_every_steps, verbose, precision, summary_every_steps,
         profile_steps, initial_epoch: int = 0, validation_freq: Any = 1,
         checkpoint_every_secs: float = 0.0, validation_batch_size: Optional[int] = None,
         hook_batch: int = 32) -> LoopResult:
    replicas = backend.num_replicas
    from tfdist.training import evaluating, loop

    test_hooks = loop.has_batch_hooks(list(callbacks or []), loop.TEST_BATCH_HOOKS) and \
        (replicas == 1 or evaluating.keras_batch_steps(model, backend, callbacks, loop.TEST_BATCH_HOOKS))
    train_fn = lambda first: iter(backend.distribute_dataset(source.dataset_fn(plan, backend, first)))  # noqa: E731
    eval_fn, eval_steps, eval_examples = None, 0, None
    if validation is not None:
        # Keras validates in batches of batch_size; a custom test_step's trackers (means of batch means)
        # depend on that partition, so each replica takes whole Keras batches (as tfdist.evaluate does).
        # Built-in metrics do not depend on it: larger batches are faster.
        eval_batch = plan.global_batch if step_functions.custom_test else max(plan.per_replica_batch, 64)
        eval_batch = validation_batch_size or eval_batch  # Keras' validation batch, whole on each replica.
        eval_steps = inputs.eval_steps(validation.num_examples, eval_batch, replicas)
        keras_batch = None
        if test_hooks:  # Keras' validation batches, each split over the replicas: the hooks come per batch.
            keras_batch = hook_batch
            eval_batch, eval_steps = -(-keras_batch // replicas), -(-validation.num_examples // keras_batch)
        eval_dataset = backend.distribute_eval_dataset(inputs.eval_arrays_fn(
            validation, per_replica_batch=eval_batch, steps=eval_steps,
            static_shapes=backend.device_kind == "tpu", keras_batch=keras_batch))
        eval_fn = lambda: iter(eval_dataset)  # noqa: E731
        eval_examples = validation.num_examples
    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        callbacks_for_task(list(callbacks or []), backend) + [history], add_history=False, add_progbar=False,
        model=model,
        verbose=0, epochs=plan.epochs, steps=plan.known_steps_per_epoch())

    def save(step: int) -> Optional[str]:
        if manager is None or not (backend.is_chief or backend.all_tasks_save):
            return None
        # Saves come after every dispatched execution has finished, so the steps applied (the counter the
        # steps increment) are the steps counted. Fewer: a step was cut short with a killed worker (see the
        # README); the checkpoint records the count the run goes on from. Never assigned backwards.
        applied = step_functions.device_step_count = int(step_counter.numpy())
        if applied != step:
            logging.warning("%d step(s) applied to the variables against %d counted; the checkpoint records %d.",
                            applied, step, max(applied, step))
        if applied < step:
            step_counter.assign(step)
        path = rundir.save_checkpoint(manager, step)  # A failed write: WriteError, the last good one kept.
        if backend.is_chief:
            logging.info("Saved checkpoint %s at step %d.", path, step)
        return path if backend.is_chief else None

    controller = Controller(
        steps=step_functions, backend=backend, plan=plan, train_iterator_fn=train_fn, eval_iterator_fn=eval_fn,
        eval_steps=eval_steps, eval_examples=eval_examples, checkpoint=checkpoint, manager=manager, save_fn=save,
        callbacks=callback_list, history=history,
        loss_scaling=isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer),
        checkpoint_every_steps=checkpoint_every_steps, checkpoint_every_secs=checkpoint_every_secs,
        progress=bool(verbose), error=_fail,
        summary_every_steps=summary_every_steps,
        profile=(profile_steps, rundir.join("tensorboard")) if profile_steps and rundir is not None
        and backend.is_chief else None,
        batch_hooks=has_batch_hooks(list(callbacks or [])), precision=precision,
        initial_epoch=initial_epoch, validation_freq=validation_freq,
    )
    controller.writer = rundir.summary_writer() if rundir is not None else None
    if test_hooks:
        controller.test_batch_hooks = resolve_steps_per_execution(None, model, callbacks, backend,
                                                                  loop.TEST_BATCH_HOOKS)
    result = controller.run(start_step)
    if controller.writer is not None:
        controller.writer.flush()
    result.device_step_count = getattr(step_functions, "device_step_count", None)
    return result
