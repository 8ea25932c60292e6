"""Held-out data (evaluate, predict, fit's validation) read into arrays, with Keras' batch size."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import UserError, error_text
from tfdist.training import columns, custom_steps, fit_args, inputs
from tfdist.training.sources import (arrays_from, check_dict_keys, dict_keys, element_spec, given_for_inputs,
                                     keras_takes_rank, model_inputs)

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
                            f"{type(e).__name__}: {error_text(e)}") from None
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
    return _joined([inputs.map_present(columns.leaf, element) for element in data], what)


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
    first = columns.first(parts[0])
    if first is None or columns.ndim(first) == 0:
        raise UserError(f"{what} yields scalars, not batches; batch it (dataset.batch(32)) first.")
    for part in parts:  # Joined, the rows of batches unequal within would be miscounted.
        columns.same_rows(part, f"a batch of {what}")
    try:
        joined = tf.nest.map_structure(lambda *leaves: _concat(leaves, what), *parts)
    except UserError:
        raise
    except (ValueError, TypeError) as e:
        raise UserError(f"{what} yields batches of different structures ({error_text(e)}); yield every batch as "
                        "the same structure (x, y, sample_weight).") from None
    return (*unpack(joined, validation=what == "validation_data"), columns.rows(first))


def _concat(leaves: tuple, what: str) -> Any:
    """One input's batches joined; refused where their shapes differ beyond the examples (held-out data is read
    into one array per input, then re-batched), or where some batches hold None there and others an array."""
    if any(leaf is None for leaf in leaves) and not all(leaf is None for leaf in leaves):
        raise UserError(f"{what} yields None for an input in some batches and an array in others; yield one or "
                        "the other in every batch.")
    dense = [leaf for leaf in leaves if leaf is not None and not columns.is_composite(leaf)]
    shapes = list(dict.fromkeys(tuple(np.shape(leaf))[1:] for leaf in dense))  # In order of appearance.
    if len(shapes) > 1:
        raise UserError(f"{what} yields batches whose shapes differ beyond the first dimension (examples of shapes "
                        f"{shapes[0]} and {shapes[1]}): tfdist reads held-out batches into one array per input "
                        "before the first step and cannot join them (Keras' own evaluate and predict take each batch "
                        "as it comes). Pad them to one shape, or evaluate them in groups of one shape.")
    return columns.concat(leaves)


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
    if columns.first(x) is None:
        raise UserError("x is None; pass the inputs to predict (arrays, a dict of arrays, or a dataset).")
    leaves = columns.present(x)
    for leaf in leaves:
        if columns.ndim(leaf) == 0:
            raise UserError("x holds a scalar; every input needs a leading example dimension.")
    if len({columns.rows(leaf) for leaf in leaves}) > 1:
        shown = ", ".join(str(columns.rows(leaf)) for leaf in leaves)
        raise UserError(f"The inputs of x disagree on the number of examples ({shown}); every array needs the same "
                        "first dimension.")
    _check_structure(model, x)
    return inputs.Arrays(inputs.absent_marked(_keras_rank(model, x)))


def _keras_rank(model: keras.Model, x: Any) -> Any:
    """`x` with each array's rank as the model's call makes it (`Functional._adjust_input_rank`): a last dimension of 1
    added where the Input has one more, dropped where it has one fewer. The same values the model computes on, with
    the shapes its output spec is read for."""
    wanted, given = model_inputs(model), given_for_inputs(model, x)
    if wanted is None or given is None:
        return x

    def adjust(array: Any, tensor: Any) -> Any:
        if array is None or columns.is_composite(array):
            return array
        rank, shape = np.ndim(array), tuple(tensor.shape)
        if rank == len(shape) - 1 and shape[-1] == 1:
            return np.expand_dims(array, -1)
        if rank == len(shape) + 1 and np.shape(array)[-1] == 1:
            return np.squeeze(array, -1)
        return array

    adjusted = [adjust(a, t) for a, t in zip(given, wanted)]
    found = dict_keys(model) if isinstance(x, dict) else None
    if found is not None:
        return {**x, **dict(zip(found[0], adjusted))}
    return tf.nest.pack_sequence_as(x, adjusted)


def _describe(tensors: list) -> str:
    return ", ".join(f"{t.name} {tuple(t.shape)}" for t in tensors)


def _optional(tensor: Any) -> bool:
    """Whether a model input is a ``keras.Input(optional=True)``, which takes None."""
    history = getattr(tensor, "_keras_history", None)
    return bool(getattr(history[0], "optional", False)) if history else False


def _check_structure(model: keras.Model, x: Any) -> None:
    """Refuses inputs that do not match the model's `keras.Input`s (number, keys, shapes) as Keras matches them
    (`sources.given_for_inputs`: a rank one less or more where Keras adds or drops a last dimension of 1; None
    for an optional input), before any step."""
    wanted = model_inputs(model)
    if wanted is None:  # A subclassed model: its call decides (`_output_spec` reports a failure).
        return
    fix = (f"The model takes {len(wanted)} input(s): {_describe(wanted)}. Pass x as "
           + ("one array" if len(wanted) == 1 else "a list in that order, or a dict keyed by those names")
           + " with one row per example.")
    if isinstance(x, dict):
        try:
            check_dict_keys(model, x, "x")
        except UserError as e:  # Keyed by the model's own dict keys: its message says which; else by Input name.
            raise UserError(f"predict: {e}" if dict_keys(model)[1] else
                            f"predict: the keys of x ({', '.join(sorted(x))}) do not match the model's inputs. {fix}"
                            ) from None
    given = given_for_inputs(model, x)
    if given is None:
        raise UserError(f"predict: x holds {len(tf.nest.flatten(x))} array(s), but the model takes {len(wanted)}. "
                        f"{fix}")
    for array, tensor in zip(given, wanted):
        if array is None:
            if not _optional(tensor):
                raise UserError(f"predict: x holds None for input {tensor.name}, which is not optional (only a "
                                f"keras.Input(optional=True) takes None). {fix}")
            continue
        shape = tuple(tensor.shape)
        given_shape = tuple(array.shape)
        if not keras_takes_rank(columns.ndim(array), shape, given_shape[-1] if given_shape else None) or (
                len(given_shape) == len(shape) and any(
                    w is not None and g is not None and w != g for w, g in zip(shape[1:], given_shape[1:]))):
            raise UserError(f"predict: an array of shape {array.shape} was given for input {tensor.name}, which takes "
                            f"(examples, {', '.join('None' if d is None else str(d) for d in shape[1:])}). {fix}")


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
    leaf = columns.first(x)
    if leaf is None or getattr(leaf, "shape", None) is None or not len(leaf.shape):
        raise UserError("x must be a batch: an array (or a structure of arrays) whose first dimension is its examples.")
    return int(leaf.shape[0])
