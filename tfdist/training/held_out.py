"""Held-out data (evaluate, predict, fit's validation) read into arrays, with Keras' batch size."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import UserError
from tfdist.training import columns, custom_steps, fit_args, inputs
from tfdist.training.sources import arrays_from, element_spec

KERAS_BATCH_SIZE = 32  # Keras' default for evaluate and predict.


# Inputs -------------------------------------------------------------------------------
def unpack(element: Any, validation: bool = False) -> tuple:
    """(x, y, sample_weight) as `keras.utils.unpack_x_y_sample_weight` reads it: a list is a tuple, a bare x has
    no y."""
    if isinstance(element, list):
        element = tuple(element)
    if not isinstance(element, tuple):
        return element, None, None
    if len(element) not in (1, 2, 3):
        raise UserError(f"validation_data must be (x_val,), (x_val, y_val) or (x_val, y_val, sample_weight_val), "
                        f"not a tuple of length {len(element)}." if validation else
                        f"The dataset yields tuples of {len(element)} values; yield x, (x, y) or "
                        "(x, y, sample_weight).")
    return tuple(element) + (None,) * (3 - len(element))


def _read_dataset(data: Any, steps: Optional[int], batch_size: Optional[int], what: str) -> tuple:
    """A finite dataset (or a dataset function's one-pipeline dataset) read into arrays; returns (x, y, w, batch)."""
    if callable(data) and not isinstance(data, tf.data.Dataset):
        try:
            data = data(tf.distribute.InputContext())  # One pipeline, one replica: the whole dataset.
        except Exception as e:  # The user's function: say where it failed, in one paragraph.
            raise UserError(f"The dataset function failed when called with an InputContext: "
                            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
        if not isinstance(data, tf.data.Dataset):
            raise UserError(f"The dataset function must return a tf.data.Dataset, not {type(data).__name__}.")
    if batch_size is not None:
        raise UserError(f"{what} is a dataset, whose batches are the batches; drop batch_size={batch_size} (as Keras "
                        "asks), or pass arrays.")
    if steps is not None:
        data = data.take(steps)
    elif int(data.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise UserError(f"{what} is an infinite dataset (.repeat()?); pass steps= (the number of batches to use) or "
                        "a finite dataset.")
    return _joined([tf.nest.map_structure(columns.leaf, element) for element in data], what)


def _python_batches(data: Any, steps: Optional[int], batch_size: Optional[int], what: str) -> tuple:
    """A generator's or PyDataset's batches read into arrays (at most `steps` of them); returns (x, y, w, batch)."""
    if batch_size is not None:
        raise UserError(f"{what} yields its own batches; drop batch_size={batch_size} (as Keras asks), or pass arrays.")
    if fit_args.is_py_dataset(data):
        count = fit_args._num_batches(data)
        if count is None and steps is None:
            raise UserError(f"{what} is an infinite PyDataset (no num_batches); pass steps= (the number of batches to "
                            "use), or give it a length.")
        indices = range(count if steps is None else steps if count is None else min(int(steps), count))
        return _joined([fit_args._standardize(data[i]) for i in indices], what)
    return _joined([fit_args._standardize(batch) for batch in itertools.islice(data, steps)], what)


def _joined(parts: list, what: str) -> tuple:
    if not parts:
        raise UserError(f"{what} yields no batches; pass a dataset holding at least one batch.")
    first = tf.nest.flatten(parts[0])[0]
    if columns.ndim(first) == 0:
        raise UserError(f"{what} yields scalars, not batches; batch it (dataset.batch(32)) first.")
    joined = tf.nest.map_structure(lambda *leaves: columns.concat(leaves), *parts)
    return (*unpack(joined, validation=what == "validation_data"), columns.rows(first))


def _batch_size(batch_size: Optional[int], steps: Optional[int], num_examples: int) -> int:
    if batch_size is None:  # Keras' array adapter: steps without a batch size spread the examples over them.
        batch_size = -(-num_examples // int(steps)) if steps else KERAS_BATCH_SIZE
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise UserError(f"batch_size={batch_size!r} must be a positive number of examples per batch (Keras' batch; "
                        "each replica evaluates whole batches).")
    return int(batch_size)


def _first(arrays: inputs.Arrays, count: int) -> inputs.Arrays:
    if count >= arrays.num_examples:
        return arrays
    return inputs.Arrays(*inputs.map_present(lambda a: columns.head(a, count), arrays.structure))


def held_out(model: keras.Model, x: Any, y: Any, sample_weight: Any, batch_size: Optional[int],
             steps: Optional[int], *, targets: bool) -> tuple[inputs.Arrays, int]:
    """The examples to evaluate (with targets) or predict, as arrays, and Keras' batch size."""
    if steps is not None and (isinstance(steps, bool) or int(steps) < 1):
        raise UserError(f"steps={steps!r} must be a positive number of batches, or None (all the data).")
    batch = None
    fit_args.refuse_distributed(x)
    python = fit_args.is_generator(x) or fit_args.is_py_dataset(x)
    if isinstance(x, tf.data.Dataset) or callable(x) or python:
        if y is not None or sample_weight is not None:
            raise UserError("x is a dataset, so y and sample_weight must come from it; drop y=/sample_weight=.")
        read = _python_batches if python else _read_dataset
        x, y, sample_weight, batch = read(x, steps, batch_size, "x")
        if not targets:
            y = sample_weight = None
        steps = None  # Already taken.
    if targets:
        arrays = arrays_from(model, x, y, sample_weight, "x/y")
    else:
        arrays = _predict_arrays(model, x)
    if batch is None:
        batch = _batch_size(batch_size, steps, arrays.num_examples)
    if steps is not None:
        arrays = _first(arrays, int(steps) * batch)
    if arrays.num_examples < 1:
        raise UserError("x holds no examples; pass at least one.")
    return arrays, batch


def _predict_arrays(model: keras.Model, x: Any) -> inputs.Arrays:
    x = inputs.to_numpy(x)
    if x is None:
        raise UserError("x is None; pass the inputs to predict (arrays, a dict of arrays, or a dataset).")
    leaves = tf.nest.flatten(x)
    for leaf in leaves:
        if columns.ndim(leaf) == 0:
            raise UserError("x holds a scalar; every input needs a leading example dimension.")
    if len({columns.rows(leaf) for leaf in leaves}) > 1:
        shown = ", ".join(str(columns.rows(leaf)) for leaf in leaves)
        raise UserError(f"The inputs of x disagree on the number of examples ({shown}); every array needs the same "
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
            raise UserError(f"predict: the keys of x ({', '.join(sorted(x))}) do not match the model's inputs. {fix}")
        given = [x[name] for name in names]
    else:
        given = tf.nest.flatten(x)
    if len(given) != len(wanted):
        raise UserError(f"predict: x holds {len(given)} array(s), but the model takes {len(wanted)}. {fix}")
    for array, tensor in zip(given, wanted):
        shape = tuple(tensor.shape)[1:]
        given_shape = tuple(array.shape)[1:]
        if columns.ndim(array) - 1 != len(shape) or any(
                w is not None and g is not None and w != g for w, g in zip(shape, given_shape)):
            raise UserError(f"predict: an array of shape {array.shape} was given for input {tensor.name}, which takes "
                            f"(examples, {', '.join('None' if d is None else str(d) for d in shape)}). {fix}")


def validation(model: keras.Model, validation_data: Any, source: Any, *, batch_size: Optional[int],
               steps: Optional[int]) -> Optional[tuple[inputs.Arrays, int]]:
    """fit's validation data as arrays, and the batch Keras' fit validates it in: a dataset's own batches (cut
    to `steps` already: `fit_args.limit_validation`), else ``validation_batch_size or batch_size`` (`batch_size`
    here), Keras' default 32, or the examples spread over `steps` batches; its first `steps` batches."""
    if validation_data is None:
        return None
    if not custom_steps.overrides(model, "test_step") and not custom_steps.has_call(model):
        raise UserError(f"{type(model).__name__} has neither call() nor test_step(), so validation_data (or "
                        "validation_split) cannot be evaluated: Keras' test_step calls the model. Drop the "
                        "validation, or give the model a test_step (or a call).")
    batch = None
    if isinstance(validation_data, tf.data.Dataset):
        element_spec(model, validation_data, "validation_data")
        if int(validation_data.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
            raise UserError("validation_data is an infinite dataset (.repeat()?); pass a finite one: every example "
                            "is evaluated exactly once.")
        *validation_data, batch = _read_dataset(validation_data, None, None, "validation_data")
        steps = None  # Already taken.
    vx, vy, vw = unpack(validation_data, validation=True)
    arrays = arrays_from(model, vx, vy, vw, "validation_data")
    if source.arrays is not None and tf.nest.map_structure(lambda a: a.shape[1:], arrays.x) != \
            tf.nest.map_structure(lambda a: a.shape[1:], source.arrays.x):
        raise UserError("validation_data's inputs do not have the shapes of the training inputs (apart from the "
                        "number of examples); pass (x_val, y_val) structured like x and y.")
    if batch is None:
        batch = _batch_size(batch_size, steps, arrays.num_examples)
    if steps is not None:
        arrays = _first(arrays, int(steps) * batch)
    return arrays, batch


def rows(x: Any) -> int:
    leaves = tf.nest.flatten(x)
    if not leaves or getattr(leaves[0], "shape", None) is None or not len(leaves[0].shape):
        raise UserError("x must be a batch: an array (or a structure of arrays) whose first dimension is its examples.")
    return int(leaves[0].shape[0])
