"""Training data of every kind (arrays, a dataset, a dataset function, a stream) adapted to one `Source`."""

from __future__ import annotations

import time
from typing import Any, Optional

import keras
import tensorflow as tf
from absl import logging

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError, error_text
from tfdist.training import columns, custom_steps, inputs
from tfdist.training.plan import LoopPlan


# Inputs -------------------------------------------------------------------------
def _input_names(model: keras.Model) -> Optional[list[str]]:
    names = getattr(model, "input_names", None)
    if names:
        return list(names)
    try:
        return [t.name for t in tf.nest.flatten(model.inputs)]
    except (AttributeError, ValueError):
        return None


def dict_keys(model: keras.Model) -> Optional[tuple[list[str], bool]]:
    """The keys a dict `x` is matched by, as Keras' functional models match them (`Functional._standardize_inputs`),
    and whether they must be all of x's keys: a model built with a dict (``keras.Model(inputs={...})``) takes its
    own keys, exactly; any other takes its `keras.Input` names, and x may hold more keys (Keras takes the named
    ones). None where the model's call alone decides (a subclassed model)."""
    built_with = getattr(model, "_inputs_struct", None)
    if isinstance(built_with, dict):
        return sorted(built_with), True
    names = _input_names(model)
    return (names, False) if names else None


def check_dict_keys(model: keras.Model, x: Any, what: str) -> None:
    """Refuses a dict `x` whose keys the model does not match to its inputs (`dict_keys`), before any step."""
    found = dict_keys(model) if isinstance(x, dict) else None
    if found is None:
        return
    keys, exact = found
    if set(keys) <= set(x) and (not exact or set(x) == set(keys)):
        return
    if exact:
        raise UserError(f"The keys of {what} ({', '.join(sorted(x))}) do not match the model's inputs: it was built "
                        f"with a dict of inputs keyed {', '.join(keys)} (keras.Model(inputs={{...}})), so x is a dict "
                        "with those keys, as Keras matches them.")
    raise UserError(f"The keys of {what} ({', '.join(sorted(x))}) do not match the model's inputs "
                    f"({', '.join(sorted(keys))}); use one key per keras.Input, named as the Input's name.")


def arrays_from(model: keras.Model, x: Any, y: Any, sample_weight: Any, what: str) -> inputs.Arrays:
    """Checks and converts array inputs; `what` names them in errors ('x' or 'validation_data'). A None in x is an
    optional input (``keras.Input(optional=True)``) given none, as Keras takes it; the model's build refuses it
    for any other input."""
    x, y, sample_weight = inputs.to_numpy(x), inputs.to_numpy(y), inputs.to_numpy(sample_weight)
    if y is None and sample_weight is not None:
        raise UserError(f"{what} has sample weights but no targets; the weights weigh a compiled loss against y. Pass "
                        "y, or fold the weights into the loss your model adds (add_loss).")
    if x is not None:
        check_required_given(model, x, what)
    if columns.first(x) is None:
        raise UserError(f"{what}: x holds no array (None alone); pass the model's inputs, one row per example.")
    check_dict_keys(model, x, what)
    lengths = {}
    for label, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        leaves = tf.nest.flatten(value)
        for i, leaf in enumerate(leaves):
            if leaf is None:
                continue
            if columns.ndim(leaf) == 0:
                raise UserError(f"{what}: {label} holds a scalar; every input needs a leading example dimension.")
            lengths[f"{label}[{i}]" if len(leaves) > 1 else label] = columns.rows(leaf)
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise UserError(f"The inputs of {what} disagree on the number of examples ({shown}); every array needs the "
                        "same first dimension.")
    return inputs.Arrays(inputs.absent_marked(x), y, sample_weight)


class Source:
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
        return inputs.map_present(lambda s: None if isinstance(s, columns.NoneTensorSpec) else
                                  keras.KerasTensor((size, *s.shape[1:]), s.dtype.name), element)

    def check_batches(self, plan: LoopPlan) -> None:
        if self.kind != "dataset_fn":
            return
        for leaf in columns.present(self.spec[0]):
            size = leaf.shape[0] if leaf.shape.rank else None
            if size is not None and size != plan.per_replica_batch:
                raise UserError(
                    f"The dataset function returns batches of {size} examples, but batch_size={plan.global_batch} "
                    f"over {plan.num_replicas} replica(s) means {plan.per_replica_batch} per replica; batch it "
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


def optional_input(tensor: Any) -> bool:
    """Whether a model input is a ``keras.Input(optional=True)``, which takes None."""
    history = getattr(tensor, "_keras_history", None)
    return bool(getattr(history[0], "optional", False)) if history else False


def check_required_given(model: keras.Model, x: Any, what: str) -> None:
    """Refuses None given for a `keras.Input` that is not optional, before any step, in the words of Keras' own
    error (functional.py: "The input '...' is not optional, but None was passed")."""
    given = given_for_inputs(model, x)
    if given is None:
        return
    for array, tensor in zip(given, model_inputs(model)):
        if array is None and not optional_input(tensor):
            raise UserError(f"{what}: The input '{tensor.name}' is not optional, but None was passed. Please provide "
                            "a valid tensor. (Only a keras.Input(optional=True) takes None: pass an array with one "
                            "row per example for it, as Keras' own fit requires.)")


def model_inputs(model: keras.Model) -> Optional[list]:
    try:
        return list(tf.nest.flatten(model.inputs)) or None
    except (AttributeError, ValueError):
        return None


def given_for_inputs(model: keras.Model, x: Any) -> Optional[list]:
    """The leaves of `x` (arrays or specs) in the order of the model's `keras.Input`s, matched as Keras matches
    them (a dict by `dict_keys`, else in order); None where the model has no Inputs or x does not match them."""
    wanted = model_inputs(model)
    if wanted is None:
        return None
    found = dict_keys(model) if isinstance(x, dict) else None
    if found is not None:
        keys = found[0]
        if not set(keys) <= set(x):
            return None
        given = [x[k] for k in keys]
    else:
        given = tf.nest.flatten(x)
    return given if len(given) == len(wanted) else None


def keras_takes_rank(rank: int, shape: tuple, given_last: Any) -> bool:
    """Whether Keras' functional model takes a batch of `rank` for an Input of `shape` (batch dimension included):
    the same rank, or one less where the Input's last dimension is 1 (Keras adds it), or one more where the
    batch's is (Keras drops it) (`Functional._adjust_input_rank`)."""
    return rank == len(shape) or (rank == len(shape) - 1 and shape[-1] == 1) or \
        (rank == len(shape) + 1 and given_last == 1)


def _check_rank(model: keras.Model, spec: Any, what: str) -> None:
    """A dataset yielding single examples instead of batches is recognised by its rank. Keras takes every
    dataset's elements as batches, so one that Keras takes (a batch of 1-D features for an Input of shape
    ``(1,)``, which Keras expands) is a dataset of batches here too."""
    wanted, given = model_inputs(model), given_for_inputs(model, spec)
    if wanted is None or given is None:
        return
    pairs = [(leaf, tuple(t.shape)) for leaf, t in zip(given, wanted) if not isinstance(leaf, columns.NoneTensorSpec)]
    ranks = [(leaf.shape.rank, shape, leaf.shape[-1] if leaf.shape.rank else None) for leaf, shape in pairs]
    if ranks and all(r is not None and r == len(shape) - 1 for r, shape, _ in ranks) and \
            not all(keras_takes_rank(*entry) for entry in ranks):
        raise UserError(f"{what} yields single examples (shape {pairs[0][0].shape}), not batches; batch "
                        "it (dataset.batch(...)) before passing it to tfdist.fit.")


def element_spec(model: keras.Model, dataset: tf.data.Dataset, what: str) -> tuple:
    spec = dataset.element_spec
    if custom_steps.overrides(model, "train_step"):  # The user's step takes whatever the dataset yields.
        return spec if isinstance(spec, tuple) else (spec,)
    if not isinstance(spec, tuple):  # x alone (a model whose loss needs no targets: add_loss, an endpoint).
        spec = (spec,)
    if len(spec) not in (1, 2, 3):
        raise UserError(f"{what} must yield x, (x, y) or (x, y, sample_weight) batches, not {spec}.")
    _check_rank(model, spec[0], what)
    return columns.same_rows(spec, f"the batches of {what[0].lower()}{what[1:]}")


def first_batch_size(dataset: tf.data.Dataset) -> int:
    for element in dataset.take(1):
        return int(columns.batch_rows(columns.first(element)))
    raise UserError("The training dataset is empty.")


COUNT_LIMIT = 1_000_000  # Batches of a dataset of unknown length counted before it is refused (maybe endless).


def _count_examples(dataset: tf.data.Dataset) -> tuple[int, int]:
    """(The examples, the largest batch) of one pass of a dataset of unknown length (filter(), from_generator()),
    read once; refused past COUNT_LIMIT batches (it may be endless). A count, not a time: every worker decides
    alike."""
    logging.info("The training dataset's length is unknown: reading one pass to count its examples (Keras reads it "
                 "to its end as its first epoch).")
    sizes = dataset.take(COUNT_LIMIT + 1).map(lambda *e: columns.batch_rows(columns.first(e)))
    examples, batches, largest, shown = 0, 0, 0, time.time()
    for size in sizes:
        examples, batches, largest = examples + int(size), batches + 1, max(largest, int(size))
        if time.time() - shown > 30:
            logging.info("Counting the training dataset: %d batches so far (pass steps_per_epoch= to skip this).",
                         batches)
            shown = time.time()
    if batches > COUNT_LIMIT:
        raise UserError(f"The training dataset's length is unknown and one pass holds more than {COUNT_LIMIT} batches "
                        "(it may be endless: from_generator(), repeat() after filter(), ...); pass steps_per_epoch= "
                        "(steps in an epoch), or give it its length with "
                        "dataset.apply(tf.data.experimental.assert_cardinality(batches)).")
    if batches == 0:
        raise UserError("The training dataset is empty.")
    return examples, largest


def _dataset_examples(dataset: tf.data.Dataset, static: Optional[int]) -> tuple[int, Optional[int]]:
    """(The examples in one pass over a dataset of batches (Keras trains each pass as an epoch), its largest batch
    where the batches have no static size, else None).

    From the number of batches and the batch size, or, where the batches have no
    static size (``dataset.batch(b)``), by reading one pass and adding its batch sizes.
    """
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise UserError("The training dataset is infinite (it repeats); pass steps_per_epoch= (steps in an epoch), "
                        "as Keras' fit asks.")
    if cardinality == tf.data.UNKNOWN_CARDINALITY:  # As Keras reads it to its end: one pass, counted.
        return _count_examples(dataset)
    if cardinality == 0:
        raise UserError("The training dataset is empty.")
    if static is not None:
        return cardinality * static, None
    sizes = dataset.map(lambda *e: tf.cast(columns.batch_rows(columns.first(e)), tf.int64))
    zero = tf.constant(0, tf.int64)
    total, largest = sizes.reduce((zero, zero), lambda seen, n: (seen[0] + n, tf.maximum(seen[1], n)))  # One pass.
    return int(total), int(largest)


def adapt(model: keras.Model, backend: Backend, x: Any, y: Any, sample_weight: Any, batch_size: Any,
          steps_per_epoch: Optional[int], examples: Optional[int] = None, stream: bool = False) -> Source:
    """``examples``: the examples of one pass over `x`, where the caller knows them (a PyDataset). ``stream``:
    a dataset of unknown length is read as it comes, its epochs ending where it ends (`can_stream`)."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise UserError("x is a tf.data.Dataset, so y and sample_weight must come from it; drop y=/sample_weight=.")
        if not backend.sharded_input:
            raise UserError("Under parameter servers pass a dataset function (input_context -> per-replica batches) "
                            "or arrays; a tf.data.Dataset object cannot be sent to the workers.")
        spec = element_spec(model, x, "The training dataset")
        static = columns.first(spec[0]).shape[0]
        given_batch = batch_size
        if batch_size is None:
            batch_size = static if static is not None else first_batch_size(x)
        cardinality = int(x.cardinality())
        if stream and examples is None and cardinality == tf.data.UNKNOWN_CARDINALITY:
            if static is not None and int(batch_size) != static:
                raise UserError(f"x is a dataset of unknown length, read as it comes: each of its batches (of {static}) "
                                f"is a step, so batch_size={batch_size} cannot re-cut them; drop batch_size= or "
                                "batch the dataset with it.")
            return Source("dataset", batch_size=batch_size, steps_per_epoch=steps_per_epoch, dataset=x,
                          num_examples=(steps_per_epoch or 1) * int(batch_size), spec=spec, model=model,
                          streamed=True)
        if steps_per_epoch is not None and (examples is None and cardinality < 0):
            # Infinite, or of a length unknown without reading it: as many whole global batches as the epochs
            # take, the dataset repeated as needed (one that ends restarts, where Keras would end the epoch).
            return Source("dataset", batch_size=batch_size, num_examples=steps_per_epoch * int(batch_size),
                          steps_per_epoch=steps_per_epoch, dataset=x, spec=spec, model=model)
        if examples is None:
            examples, largest = _dataset_examples(x, static)
            # The largest batch of the pass, not the first one met: the same in every process whatever the order.
            batch_size = largest if given_batch is None and largest else batch_size
        return Source("dataset", batch_size=batch_size, num_examples=examples,
                      steps_per_epoch=steps_per_epoch or -(-examples // int(batch_size)),  # The last one short.
                      dataset=x, spec=spec, model=model, partial=examples % int(batch_size) != 0, finite=True)
    if callable(x):
        if batch_size is None or steps_per_epoch is None:
            raise UserError("With a dataset function, pass batch_size= (the global batch) and steps_per_epoch=.")
        if y is not None or sample_weight is not None:
            raise UserError("x is a dataset function, so y and sample_weight must come from it; drop y=/sample_weight=.")
        replicas = backend.num_replicas
        context = tf.distribute.InputContext(max(1, backend.num_workers) if backend.sharded_input else 1,
                                             backend.worker_index if backend.sharded_input else 0, replicas)
        try:
            probe = x(context)
        except Exception as e:  # The user's function: say where it failed, in one paragraph.
            raise UserError(f"The dataset function failed when called with an InputContext: "
                            f"{type(e).__name__}: {error_text(e)}") from None
        if not isinstance(probe, tf.data.Dataset):
            raise UserError(f"The dataset function must return a tf.data.Dataset, not {type(probe).__name__}.")
        spec = element_spec(model, probe, "The dataset function's dataset")
        return Source("dataset_fn", batch_size=batch_size, num_examples=steps_per_epoch * int(batch_size),
                      steps_per_epoch=steps_per_epoch, function=x, spec=spec, model=model)
    if batch_size is None:
        batch_size = 32  # Keras' default for arrays: the global batch, over all replicas.
    arrays = arrays_from(model, x, y, sample_weight, "x/y")
    return Source("arrays", batch_size=batch_size, num_examples=arrays.num_examples,
                  steps_per_epoch=steps_per_epoch, arrays=arrays)


def can_stream(backend: Backend, model: keras.Model) -> bool:
    """Whether a dataset of unknown length (a generator's) can be read as it comes, its epochs ending where it
    ends: one process drives every replica (a multi-worker job's workers would each have to learn it), the
    batch shapes may vary (not a TPU), the input is sharded (not parameter servers), and the model has no custom
    train_step (whose step on a replica with no example, a short batch's, tfdist refuses before training)."""
    return backend.single_controller and backend.device_kind != "tpu" and backend.sharded_input and \
        not backend.asynchronous and not custom_steps.overrides(model, "train_step")
