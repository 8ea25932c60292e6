"""The rest of `Model.fit`'s arguments for `tfdist.fit`, resolved as Keras resolves them.

`prepare` runs first in `tfdist.fit`, before any input is checked, and turns
what Keras' ``fit`` takes beyond tfdist's core inputs into those inputs:

- ``validation_split``: the last fraction of the arrays (x, y, sample_weight),
  cut before any shuffling, becomes the validation data, as Keras' own
  `keras.src.trainers.data_adapters.array_slicing.train_validation_split`
  cuts it (only where ``validation_data`` is None; refused for anything but
  arrays, as Keras refuses it).
- ``class_weight``: Keras' own conversions into sample weights:
  ``data_adapter_utils.class_weight_to_sample_weights`` for arrays (the
  training part only, after the split) and ``tf_dataset_adapter.
  make_class_weight_map_fn`` for datasets, dataset functions and PyDatasets;
  refused with sample weights, several outputs, or a Python generator, as Keras refuses them.
- ``keras.utils.PyDataset`` and Python generators as ``x``: read into a
  `tf.data.Dataset` (`tf.data.Dataset.from_generator`, with the spec of the
  first batch) that goes down tfdist's dataset path. A finite PyDataset is
  read in batch order, or with ``shuffle=True`` (Keras' default) in a
  permutation of its batches seeded by ``(seed, epoch)``, the same on every
  topology; ``on_epoch_begin``/``on_epoch_end`` are called around each pass.
- ``shuffle`` for datasets: Keras' own warning that it is ignored.

`should_validate` is Keras' ``validation_freq`` rule; `check_backend` refuses
what a backend cannot honour; `plan_fields` names the arguments that change
what a step means (a resumed run must keep them).
"""

from __future__ import annotations

import dataclasses
import itertools
import types
import warnings
from typing import Any, Callable, Iterator, Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import UserError
from tfdist.training import columns, inputs

# Keras' words (keras/src/trainers/data_adapters/__init__.py get_data_adapter).
DATASET_SHUFFLE_WARNING = ("`shuffle=True` was passed, but will be ignored since the data `x` was provided as a "
                           "tf.data.Dataset. The Dataset is expected to already be shuffled (via "
                           "`.shuffle(buffer_size)`).")
INFINITE_PY_DATASET_SHUFFLE_WARNING = (
    "`shuffle=True` was passed, but will be ignored since the data `x` was provided as an infinite PyDataset. "
    "The PyDataset is expected to already be shuffled.")
GENERATOR_SHUFFLE_WARNING = ("`shuffle=True` was passed, but will be ignored since the data `x` was provided as a "
                             "generator. The generator is expected to yield already-shuffled data.")


@dataclasses.dataclass
class Prepared:
    """What `tfdist.fit` trains on once the extra arguments are applied."""

    x: Any
    y: Any
    sample_weight: Any
    validation_data: Any
    batch_size: Optional[int]
    examples: Optional[int] = None  # A finite PyDataset: the examples of one pass (its last batch may be short).
    one_pass: bool = False  # A generator read once: one epoch is trained (Keras' 'ran out of data').


def is_generator(x: Any) -> bool:
    return isinstance(x, types.GeneratorType)


def is_py_dataset(x: Any) -> bool:
    return isinstance(x, keras.utils.PyDataset)


def _kind(x: Any) -> str:
    if isinstance(x, tf.data.Dataset):
        return "dataset"
    if is_py_dataset(x):
        return "py_dataset"
    if is_generator(x):
        return "generator"
    if callable(x):
        return "dataset_fn"
    return "arrays"


def check_arguments(*, shuffle: Any, class_weight: Any, validation_split: Any, validation_freq: Any,
                    initial_epoch: Any) -> None:
    """Refuses values Keras' fit would refuse or tfdist cannot read, before anything else."""
    if shuffle == "batch":
        raise UserError("shuffle='batch' (Keras' shuffling in batch-sized chunks, for HDF5 arrays) is not supported "
                        "by tfdist.fit, which permutes whole examples with a seed; pass shuffle=True or False.")
    if not isinstance(shuffle, (bool, np.bool_)):
        raise UserError(f"shuffle={shuffle!r} must be True or False.")
    if class_weight is not None and not isinstance(class_weight, dict):
        raise UserError(f"class_weight must be a dict mapping class indices to weights, not "
                        f"{type(class_weight).__name__}.")
    if not isinstance(validation_split, (int, float)) or not 0.0 <= float(validation_split) < 1.0:
        raise UserError(f"validation_split={validation_split!r} must be a float in [0, 1): the fraction of the "
                        "arrays kept for validation.")
    if isinstance(validation_freq, bool) or not (
            (isinstance(validation_freq, int) and validation_freq >= 1) or
            (isinstance(validation_freq, (list, tuple)) and all(isinstance(e, int) for e in validation_freq))):
        raise UserError(f"validation_freq={validation_freq!r} must be a positive int (validate every N epochs) or "
                        "a list of the (1-based) epochs to validate after, as in Keras.")
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, (int, np.integer)) or initial_epoch < 0:
        raise UserError(f"initial_epoch={initial_epoch!r} must be an int of 0 or more (the epoch to start at).")


def should_validate(epoch: int, validation_freq: Any) -> bool:
    """Keras' rule (`Trainer._should_eval`): validate after 0-based `epoch` if its 1-based number is due."""
    epoch = epoch + 1
    if isinstance(validation_freq, int):
        return epoch % validation_freq == 0
    return epoch in validation_freq


def plan_fields(*, shuffle: bool, class_weight: Optional[dict], validation_split: float) -> dict:
    """The arguments that change what a step trains on; only non-defaults, so older run dirs still resume."""
    fields: dict = {}
    if not shuffle:
        fields["shuffle"] = False
    if class_weight:
        fields["class_weight"] = {str(k): float(v) for k, v in sorted(class_weight.items())}
    if validation_split:
        fields["validation_split"] = float(validation_split)
    return fields


def check_backend(backend: Any, kind: str, shuffle: bool) -> None:
    """Refuses what the backend cannot honour (before any step)."""
    if not shuffle and kind == "arrays" and not backend.sharded_input:
        raise UserError(
            "shuffle=False cannot be honoured under parameter servers: workers take steps as they become free, so "
            "no step has a fixed place in the input order, and each worker reads the arrays in a random order of "
            "its own. Drop shuffle=False (or train with a synchronous strategy to train in input order).")


# Arrays -------------------------------------------------------------------------------
def split_arrays(x: Any, y: Any, sample_weight: Any, validation_split: float) -> tuple:
    """Keras' split: ``((x, y, sample_weight), (x_val, y_val, sample_weight_val))``, the last part held out."""
    from keras.src.trainers.data_adapters import array_slicing

    try:
        return array_slicing.train_validation_split((x, y, sample_weight), validation_split=validation_split)
    except ValueError as e:
        raise UserError(f"validation_split={validation_split}: {' '.join(str(e).split())}") from None


def _no_sample_weight_with_class_weight() -> UserError:
    return UserError("class_weight and sample_weight were both given; Keras refuses them together (its class "
                     "weights become the sample weights). Fold the class weights into sample_weight "
                     "(sample_weight * weight of each example's class), or pass only one of them.")


def _single_output_only() -> UserError:
    return UserError("class_weight is only supported for models with a single output (as in Keras): y holds "
                     "several targets. Pass per-output sample weights (sample_weight={output: weights}) instead.")


def class_weighted(y: Any, sample_weight: Any, class_weight: dict) -> np.ndarray:
    """Keras' sample weights for `class_weight` (the weight of each example's class; 1 where none is given)."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    if sample_weight is not None:
        raise _no_sample_weight_with_class_weight()
    if y is None:
        raise UserError("class_weight was given without y: it weights each example by its target's class, so it "
                        "needs targets (pass y, or drop class_weight).")
    if tf.nest.is_nested(y):
        raise _single_output_only()
    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


# Datasets -----------------------------------------------------------------------------
def _class_weight_map(class_weight: dict) -> Callable:
    from keras.src.trainers.data_adapters.tf_dataset_adapter import make_class_weight_map_fn

    return make_class_weight_map_fn(class_weight)


def weighted_dataset(dataset: tf.data.Dataset, class_weight: dict) -> tf.data.Dataset:
    """The dataset with Keras' class-weight map applied (refused clearly where Keras refuses)."""
    spec = dataset.element_spec
    if isinstance(spec, tuple) and len(spec) == 3:
        raise _no_sample_weight_with_class_weight()
    if isinstance(spec, tuple) and len(spec) == 2 and tf.nest.is_nested(spec[1]):
        raise _single_output_only()
    return dataset.map(_class_weight_map(class_weight))


def weighted_dataset_fn(function: Callable, class_weight: dict) -> Callable:
    def weighted(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = function(ctx)
        return weighted_dataset(dataset, class_weight) if isinstance(dataset, tf.data.Dataset) else dataset

    return weighted


def _standardize(batch: Any) -> tuple:
    """A PyDataset's or generator's batch as a tuple of arrays, as Keras' adapters read it."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        batch = (batch,)
    return columns.same_rows(inputs.to_numpy(batch), "a batch the generator (or PyDataset) yields")


def _spec(batch: tuple, batch_dim: Optional[int]) -> Any:
    """The batch's tf.data spec (None, an optional input given none: `tf.NoneTensorSpec`)."""
    return tf.nest.map_structure(lambda a: columns.NoneTensorSpec() if a is None else columns.spec(a, batch_dim), batch)


def _batch_size(batch: tuple) -> int:
    return columns.rows(columns.first(batch))


def _num_batches(data: keras.utils.PyDataset) -> Optional[int]:
    try:
        return data.num_batches
    except NotImplementedError:
        return None


def py_dataset_to_dataset(data: keras.utils.PyDataset, *, shuffle: bool, seed: int) -> tf.data.Dataset:
    """A PyDataset as a dataset of its batches, one pass per iteration of the dataset.

    Each pass (epoch ``e`` of the PyDataset) reads its batches in order, or in the
    permutation seeded by ``(seed, e)`` with `shuffle`; every pipeline reads the same
    passes, so the order does not depend on the topology. The batch dimension is
    static when the last batch is as large as the first.
    """
    count = _num_batches(data)
    if count is not None and count < 1:
        raise UserError("The PyDataset is empty (num_batches is 0); it must yield at least one batch.")
    first = _standardize(data[0])
    size = _batch_size(first)
    if count is not None and count > 1 and _batch_size(_standardize(data[count - 1])) != size:
        size = None  # A partial last batch: the dataset's batches have no fixed size.
    passes = itertools.count()

    def batches() -> Iterator[tuple]:
        epoch = next(passes)
        data.on_epoch_begin()
        order: Any = range(count) if count is not None else itertools.count()
        if shuffle and count is not None:
            order = np.random.default_rng([int(seed) & 0xFFFFFFFF, epoch]).permutation(count)
        for index in order:
            yield _standardize(data[int(index)])
        data.on_epoch_end()

    dataset = tf.data.Dataset.from_generator(batches, output_signature=_spec(first, size))
    if count is not None:
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(count))
    return dataset


SPEC_BATCHES = 2  # Batches a generator's spec is read from (Keras' data_adapter_utils.NUM_BATCHES_FOR_TENSOR_SPEC).


def _merged_spec(batches: list) -> Any:  # Dimensions the batches differ in: None (`columns.common_spec`).
    return tf.nest.map_structure(lambda *leaves: columns.common_spec(leaves), *batches)


def generator_to_dataset(generator: Iterator) -> tuple[tf.data.Dataset, int]:
    """A Python generator's batches as a dataset (read once, on from the first), and the first batch's size; its
    spec read from its first batches, as Keras reads it (`_merged_spec`)."""
    peeked = [_standardize(batch) for batch in itertools.islice(generator, SPEC_BATCHES)]
    if not peeked:
        raise UserError("The generator passed as x is exhausted: it yielded no batch.")
    chained = itertools.chain(peeked, (_standardize(batch) for batch in generator))
    dataset = tf.data.Dataset.from_generator(lambda: chained, output_signature=_merged_spec(peeked))
    return dataset, _batch_size(peeked[0])


def generator_pass(generator: Iterator, what: str = "The generator passed as x") -> tuple[tf.data.Dataset, int]:
    """A finite generator's one pass read into memory, as a dataset of its batches (its length now known), to be
    re-cut into global batches: refused where the batches' shapes differ beyond their examples."""
    batches = [_standardize(batch) for batch in generator]
    if not batches:
        raise UserError(f"{what} is exhausted: it yielded no batch.")
    spec, first = _merged_spec(batches), _spec(batches[0], None)
    if spec != first:
        raise UserError(f"{what} yields batches whose shapes differ beyond the first dimension (first "
                        f"{[getattr(s, 'shape', None) for s in tf.nest.flatten(first)]}, all "
                        f"{[getattr(s, 'shape', None) for s in tf.nest.flatten(spec)]}): tfdist reads it into memory "
                        "here and re-cuts it into global batches of one shape (Keras takes each batch as it comes). "
                        "Pad the batches to one shape.")
    size = _batch_size(batches[0])
    dataset = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=first)
    return dataset.apply(tf.data.experimental.assert_cardinality(len(batches))), size


def _refuse_y(what: str, y: Any, sample_weight: Any) -> None:
    for name, value, holds in (("y", y, "the targets"), ("sample_weight", sample_weight, "the sample weights")):
        if value is not None:
            raise UserError(f"x is a {what}, so {name} must not be passed; {holds} come from the {what}'s batches "
                            "((x, y) or (x, y, sample_weight)), as in Keras.")


def limit_validation(data: Any, steps: Optional[int]) -> Any:
    """`validation_steps` for a dataset, PyDataset or generator: its first `steps` batches, as Keras evaluates
    them (an endless one included); a generator without it is read once. Arrays are cut in `held_out.validation`."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1):
        raise UserError(f"validation_steps={steps!r} must be a positive number of batches, or None (all of "
                        "validation_data).")
    if data is None or steps is None:
        return generator_pass(data, "validation_data")[0] if is_generator(data) else data
    if isinstance(data, tf.data.Dataset):
        return data.take(int(steps))
    if is_generator(data) or is_py_dataset(data):
        count = _num_batches(data) if is_py_dataset(data) else None
        read = (data[i] for i in range(min(int(steps), count) if count is not None else int(steps))) \
            if is_py_dataset(data) else itertools.islice(data, int(steps))
        return generator_pass(read, "validation_data")[0]
    return data


def refuse_distributed(x: Any) -> None:
    """A dataset a strategy already distributed (`strategy.distribute_datasets_from_function`) is refused."""
    if isinstance(x, tf.distribute.DistributedDataset):
        raise UserError("x is a tf.distribute DistributedDataset (from strategy.experimental_distribute_dataset or "
                        "distribute_datasets_from_function); tfdist distributes the input itself, the same way on "
                        "every backend. Pass the tf.data.Dataset of global batches, or the dataset function "
                        "(input_context -> per-replica batches) itself.")


# The entry point ----------------------------------------------------------------------
def prepare(x: Any, y: Any, sample_weight: Any, *, validation_data: Any, batch_size: Optional[int],
            steps_per_epoch: Optional[int], shuffle: bool, class_weight: Optional[dict], validation_split: float,
            seed: int, epochs: int = 1, stream: bool = False) -> Prepared:
    """Applies validation_split, class_weight and shuffle and converts PyDatasets and generators (module doc).

    ``stream``: a generator without steps_per_epoch is read as it comes (its one pass an epoch that ends where it
    does, an endless one included), not into memory first."""
    refuse_distributed(x)
    kind = _kind(x)
    if validation_split and validation_data is None and kind != "arrays":
        what = {"dataset": "a tf.data.Dataset", "dataset_fn": "a dataset function", "py_dataset": "a PyDataset",
                "generator": "a Python generator"}[kind]
        raise UserError(f"validation_split is only supported for arrays (as in Keras), and x is {what}; pass "
                        "validation_data= instead (e.g. dataset.take(n) for validation and dataset.skip(n) for "
                        "training).")
    if class_weight is not None and not class_weight:
        class_weight = None
    if is_py_dataset(validation_data):
        if _num_batches(validation_data) is None:
            raise UserError("validation_data is an infinite PyDataset; pass a finite one (num_batches/__len__): "
                            "every example is evaluated exactly once.")
        validation_data = py_dataset_to_dataset(validation_data, shuffle=False, seed=seed)
    if kind == "arrays":
        x, y, sample_weight = inputs.to_numpy(x), inputs.to_numpy(y), inputs.to_numpy(sample_weight)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_arrays(x, y, sample_weight, float(validation_split))
            if all(v is None for v in tf.nest.flatten(validation_data[2:], expand_composites=False)):
                validation_data = validation_data[:2]
        if class_weight is not None:
            sample_weight = class_weighted(y, sample_weight, class_weight)
        return Prepared(x, y, sample_weight, validation_data, batch_size)
    if kind == "dataset":
        if shuffle:
            warnings.warn(DATASET_SHUFFLE_WARNING, stacklevel=7)  # The caller of tfdist.fit.
        if class_weight is not None and y is None and sample_weight is None:
            x = weighted_dataset(x, class_weight)
        return Prepared(x, y, sample_weight, validation_data, batch_size)
    if kind == "dataset_fn":
        if class_weight is not None:
            x = weighted_dataset_fn(x, class_weight)
        return Prepared(x, y, sample_weight, validation_data, batch_size)
    if kind == "py_dataset":
        _refuse_y("PyDataset", y, sample_weight)
        finite = _num_batches(x) is not None
        if not finite and steps_per_epoch is None:
            raise UserError("x is an infinite PyDataset (its num_batches is None): pass steps_per_epoch= (steps in "
                            "an epoch), as Keras' fit needs to end an epoch, or give it a length.")
        if shuffle and not finite:
            warnings.warn(INFINITE_PY_DATASET_SHUFFLE_WARNING, stacklevel=7)  # The caller of tfdist.fit.
        dataset = py_dataset_to_dataset(x, shuffle=bool(shuffle), seed=seed)
        if class_weight is not None:
            dataset = weighted_dataset(dataset, class_weight)
        examples = None
        if finite:  # Read from the PyDataset itself: reading the dataset would start a pass (on_epoch_begin).
            count, first = _num_batches(x), _batch_size(_standardize(x[0]))
            examples = (count - 1) * first + _batch_size(_standardize(x[count - 1]))
            batch_size = batch_size or first
        return Prepared(dataset, None, None, validation_data, batch_size, examples)
    _refuse_y("Python generator", y, sample_weight)
    if class_weight is not None:
        raise UserError("class_weight is not supported for a Python generator as x (as in Keras); yield "
                        "(x, y, sample_weight) batches with the class weights, or use a keras.utils.PyDataset.")
    if shuffle:
        warnings.warn(GENERATOR_SHUFFLE_WARNING, stacklevel=7)  # The caller of tfdist.fit.
    dataset, first_size = generator_pass(x) if steps_per_epoch is None and not stream else generator_to_dataset(x)
    if stream and batch_size is not None and batch_size != first_size:
        raise UserError(f"x is a Python generator, read as it comes: each batch it yields is a step, so "
                        f"batch_size={batch_size} cannot re-cut its batches (the first holds {first_size} "
                        "examples); drop batch_size= (a generator's batches are the batches, as in Keras).")
    return Prepared(dataset, None, None, validation_data, batch_size or first_size,
                    one_pass=steps_per_epoch is None)
