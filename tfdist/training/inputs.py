"""Input pipelines for the training loop: arrays, datasets and dataset functions.

The loop consumes *per-replica batches* from a `tf.distribute` dataset
function (``dataset_fn(InputContext) -> tf.data.Dataset``). This module turns
what a user hands to `tfdist.fit` into such functions.

Array inputs train in an order that does not depend on the topology: the
examples of global step ``s`` are a function of ``(seed, epoch, s)`` alone.
Each epoch is one stateless permutation of the training set
(`tf.random.experimental.index_shuffle` seeded by ``(seed, epoch)``), sliced
into global batches; global batch ``s`` is split into contiguous per-replica
pieces in replica order (and each replica's piece into micro-batches in
order). One process with 1, 2 or 4 replicas, several workers or several
Horovod ranks therefore train on the same examples at every step, and a run
resumed on another topology continues the same trajectory. The arrays are
held once per pipeline and gathered by index, not sliced element by element.

Evaluation pipelines pad every pipeline's share with weight-0 examples up to
whole batches, so every held-out example counts exactly once and every batch
has the same static shape (as TPUs need).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.training import columns

DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class Arrays:
    """A nested structure (x, y, sample_weight) of arrays sharing their first dimension."""

    x: Any
    y: Any = None
    sample_weight: Any = None

    @property
    def structure(self) -> tuple:
        return (self.x, self.y, self.sample_weight)

    @property
    def num_examples(self) -> int:
        return columns.rows(columns.first(self.x))

    @property
    def composite(self) -> bool:
        """Whether a leaf is a SparseTensor or RaggedTensor (gathered per replica, not sliced from one batch)."""
        return any(columns.is_composite(a) for a in tf.nest.flatten(self.structure) if a is not None)


def options() -> tf.data.Options:
    opts = tf.data.Options()
    # Sharding is explicit (by input context); tf.distribute must not shard again.
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    opts.deterministic = True
    return opts


def _replicas_here(ctx: tf.distribute.InputContext) -> int:
    return max(1, ctx.num_replicas_in_sync // ctx.num_input_pipelines)


def to_numpy(value: Any) -> Any:
    """Arrays of every leaf; lists become tuples, as Keras' adapters make them (`x=[x1, x2]`: two inputs).

    A list of plain numbers stays one array.
    """
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    if isinstance(value, list) and all(isinstance(v, (int, float, bool, np.number)) for v in value):
        return np.asarray(value)
    if isinstance(value, (list, tuple)):
        return tuple(to_numpy(v) for v in value)
    return columns.leaf(value)  # A SparseTensor or RaggedTensor stays one (tfdist.training.columns).


def absent_marked(x: Any) -> Any:
    """`x` with each None leaf (an optional input, ``keras.Input(optional=True)``, given none) held as an
    ``(examples, 0)`` bool array, which the pipelines split, pad and gather as any input (tf.distribute cannot pad
    a None in a partial batch); `absent_as_none` turns it back into None where the model is called."""
    leaves = tf.nest.flatten(x)
    if all(leaf is not None for leaf in leaves):
        return x
    n = columns.rows(columns.first(x))
    return tf.nest.map_structure(lambda a: np.zeros((n, 0), bool) if a is None else a, x)


def absent_marked_dataset(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """A dataset of replica batches whose x holds None (an optional input given none, `tf.NoneTensorSpec`) with
    `absent_marked`'s marks there instead (tf.distribute cannot pad a None in a partial batch); any other dataset
    as it is. Never unbatched after: tf.data's ``unbatch()`` crashes on a zero-size tensor."""
    spec = dataset.element_spec
    x_spec = spec[0] if isinstance(spec, tuple) else spec
    if not any(isinstance(leaf, columns.NoneTensorSpec) for leaf in tf.nest.flatten(x_spec)):
        return dataset

    def mark(x: Any) -> Any:
        n = columns.batch_rows(columns.first(x))
        return tf.nest.map_structure(lambda a: tf.zeros([n, 0], tf.bool) if a is None else a, x)

    if isinstance(spec, tuple):
        return dataset.map(lambda *element: (mark(element[0]), *element[1:]))
    return dataset.map(mark)


def is_absent(value: Any) -> bool:
    """Whether a leaf is `absent_marked`'s mark (array, tensor or KerasTensor)."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or columns.is_composite(value):
        return False
    shape = tf.TensorShape(shape)
    if shape.rank != 2 or shape[1] != 0:
        return False
    try:
        return tf.as_dtype(dtype) == tf.bool
    except TypeError:
        return False


def absent_as_none(x: Any) -> Any:
    """`x` as the model takes it: each `absent_marked` mark None again."""
    if x is None:
        return None
    return tf.nest.map_structure(lambda a: None if is_absent(a) else a, x)


def map_present(fn: Callable[[Any], Any], structure: Any) -> Any:
    """`tf.nest.map_structure` that leaves None leaves (no targets, no weights) as None."""
    return tf.nest.map_structure(lambda a: None if a is None else fn(a), structure)


def _constants(arrays: Arrays) -> tuple:
    return map_present(columns.constant, arrays.structure)


def _gather(tensors: tuple, indices: tf.Tensor) -> tuple:
    return map_present(lambda t: columns.gather(t, indices), tensors)


def drop_none(element: tuple) -> tuple:
    """``(x, y, sample_weight)`` without its None entries: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``."""
    x, y, sample_weight = element
    if sample_weight is None:
        return (x, y) if y is not None else (x,)
    return (x, y, sample_weight)


def split_range(start: Any, n: Any, parts: int, index: Any) -> tf.Tensor:
    """Positions of part `index` of `n` examples from `start` split as evenly as can be (compiled)."""
    start, n, index = (tf.cast(v, tf.int64) for v in (start, n, index))
    return tf.range(start + index * n // parts, start + (index + 1) * n // parts)


def train_arrays_fn(
    arrays: Arrays,
    *,
    per_replica_batch: int,
    steps_per_epoch: int,
    seed: int,
    start_step: int = 0,
    total_steps: Optional[int] = None,
    partial_last: bool = False,
    shuffle: bool = True,
    global_batch: Optional[int] = None,
) -> DatasetFn:
    """Per-replica training batches in the topology-independent order (module docstring).

    Without `shuffle` every epoch takes the examples in input order (`tfdist.fit(shuffle=False)`).

    `start_step` skips the steps an interrupted run already trained, so a
    resumed run sees exactly the data the uninterrupted run would have. With
    `partial_last` the last step of each epoch takes the examples left over
    (as Keras' last batch), split evenly over the replicas, and every element
    ends with the step's global example count (`with_global_count`). A
    `global_batch` the replicas do not divide (given with `partial_last`) is
    split as evenly as it can be at every step: some replicas take one example
    fewer, or none.
    """
    num = arrays.num_examples
    given = global_batch

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        here = _replicas_here(ctx)
        replicas = ctx.num_replicas_in_sync
        global_batch = given or per_replica_batch * replicas
        first_replica = ctx.input_pipeline_id * here
        tensors = _constants(arrays)
        logging.info("Input pipeline %d of %d: replicas %d-%d of %d, per-replica batch %d, global batch %d, "
                     "order seeded by %d (the same on every topology).", ctx.input_pipeline_id,
                     ctx.num_input_pipelines, first_replica, first_replica + here - 1, ctx.num_replicas_in_sync,
                     per_replica_batch, global_batch, seed)

        def step_batches(step: tf.Tensor) -> tf.data.Dataset:
            epoch = step // steps_per_epoch
            start = (step % steps_per_epoch) * global_batch

            def order(positions: tf.Tensor) -> tf.Tensor:
                if not shuffle:
                    return positions
                # Elementwise; one extra position, dropped, as the op rejects an empty vector (a replica
                # whose share of a batch smaller than the replica count is empty).
                padded = tf.concat([positions, tf.zeros([1], tf.int64)], 0)
                return tf.random.experimental.index_shuffle(
                    padded, seed=tf.stack([tf.constant(seed, tf.int64), epoch]), max_index=num - 1)[:-1]

            if not partial_last and arrays.composite:  # Sparse/ragged rows: gathered replica by replica.
                def composite_batch(local: tf.Tensor) -> tuple:
                    offset = start + (first_replica + local) * per_replica_batch
                    return drop_none(_gather(tensors, order(offset + tf.range(per_replica_batch, dtype=tf.int64))))

                return tf.data.Dataset.range(here).map(composite_batch)
            if not partial_last:
                offset = start + first_replica * per_replica_batch
                indices = order(offset + tf.range(here * per_replica_batch, dtype=tf.int64))
                batch = _gather(tensors, tf.reshape(indices, [here, per_replica_batch]))
                return tf.data.Dataset.from_tensor_slices(drop_none(batch))
            n = tf.minimum(tf.constant(global_batch, tf.int64), num - start)

            def replica_batch(local: tf.Tensor) -> tuple:
                indices = order(split_range(start, n, replicas, first_replica + local))
                return drop_none(_gather(tensors, indices)) + (tf.cast(n, tf.float32),)

            return tf.data.Dataset.range(here).map(replica_batch)

        end = total_steps if total_steps is not None else np.iinfo(np.int64).max
        ds = tf.data.Dataset.range(start_step, end).flat_map(step_batches)
        return ds.prefetch(tf.data.AUTOTUNE).with_options(options())

    return dataset_fn


def random_order_arrays_fn(arrays: Arrays, *, per_replica_batch: int) -> DatasetFn:
    """Every pipeline reads all the arrays in a random order of its own, forever.

    For parameter-server workers, which take steps as they become free, so no
    fixed assignment of steps to workers exists.
    """

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        num = arrays.num_examples
        tensors = _constants(arrays)
        logging.info("Input pipeline %d: all %d training examples, per-replica batch %d, in a random order of its "
                     "own (steps go to whichever worker is free).", ctx.input_pipeline_id, num, per_replica_batch)
        ds = tf.data.Dataset.range(num).shuffle(num, reshuffle_each_iteration=True).repeat()
        ds = ds.batch(per_replica_batch, drop_remainder=True).map(lambda i: drop_none(_gather(tensors, i)))
        return ds.prefetch(tf.data.AUTOTUNE).with_options(options())

    return dataset_fn


def eval_steps(num_examples: int, per_replica_batch: int, num_replicas: int) -> int:
    return max(1, -(-num_examples // (per_replica_batch * num_replicas)))


def _padded_weight(weight: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """A sample weight ([n] per example, or [n, T] per timestep) with the padding rows zeroed."""
    weight = tf.cast(weight, tf.float32)
    return weight * tf.reshape(mask, tf.concat([[-1], tf.ones([tf.rank(weight) - 1], tf.int32)], 0))


def eval_arrays_fn(arrays: Arrays, *, per_replica_batch: int, steps: int, static_shapes: bool = False,
                   keras_batch: Optional[int] = None) -> DatasetFn:
    """Per-replica eval batches ``(x, y, mask)``, ``(x, y, sample_weight, mask)`` or ``(x, mask)``: every example once.

    Replica r of step s takes positions ``(s * R + r) * b ...``. Positions past
    the end are dropped, so the last batches are smaller (some may be empty):
    a masked loss, a mean over each batch's unmasked entries, then sees the
    batches Keras sees where the short one fits one replica. With `keras_batch`
    step s is Keras' batch s instead, its examples split as evenly as can be over
    the replicas (some may take none): per-batch callback hooks then come once per
    Keras batch. With `static_shapes` (TPUs) the positions past the end are
    padding instead and `mask` (one value per example, shape ``[b]``) is 0 there. The user's sample weights keep their
    structure and shape (per example ``[b]`` or per timestep ``[b, T]``, one per
    output or one for all), with the padding rows zeroed; without them the
    element has no weight, so the step passes ``sample_weight=None`` as Keras does.
    """
    num = arrays.num_examples

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        here = _replicas_here(ctx)
        replicas = ctx.num_replicas_in_sync
        first_replica = ctx.input_pipeline_id * here
        x, y, sample_weight = _constants(arrays)

        def replica_batch(slot: tf.Tensor) -> tuple:
            step, local = slot // here, slot % here
            replica = first_replica + local
            positions = (step * replicas + replica) * per_replica_batch + tf.range(per_replica_batch,
                                                                                   dtype=tf.int64)
            if static_shapes:
                indices = tf.minimum(positions, num - 1)
                mask = tf.cast(positions < num, tf.float32)
            elif keras_batch is None:
                indices = tf.boolean_mask(positions, positions < num)
                mask = tf.ones(tf.shape(indices), tf.float32)
            else:  # Keras' batch `step`, split as evenly as can be.
                start = step * keras_batch
                indices = split_range(start, tf.clip_by_value(num - start, 0, keras_batch), replicas, replica)
                mask = tf.ones(tf.shape(indices), tf.float32)
            bx, by = _gather((x, y), indices)
            weight = map_present(lambda w: _padded_weight(columns.gather(w, indices), mask), sample_weight)
            return drop_none((bx, by, weight)) + (mask,)

        ds = tf.data.Dataset.range(steps * here).map(replica_batch)
        return ds.prefetch(tf.data.AUTOTUNE).with_options(options())

    return dataset_fn


def global_batches_fn(dataset: tf.data.Dataset, *, per_replica_batch: int, start_step: int = 0,
                      partial_last: bool = False, global_batch: Optional[int] = None,
                      whole_batches: bool = False, stream: bool = False) -> DatasetFn:
    """Per-replica batches cut from a dataset of global batches, the same way on every topology.

    Every pipeline reads the whole dataset (repeated), re-cuts it into global
    batches of ``per_replica_batch x replicas`` and keeps its replicas' slices
    of each, in replica order, so the examples of a step do not depend on the
    topology (for a deterministic dataset). `start_step` global batches are skipped.
    With `partial_last` each pass over the dataset is one epoch whose last batch
    holds what is left (as Keras' fit trains it), split evenly over the replicas,
    and every element ends with the step's global example count; so does every
    element where the replicas do not divide `global_batch` (each global batch
    then split as evenly as it can be). With `whole_batches` (a split the replicas do not divide, but no pass
    ending short: `steps_per_epoch` given) the dataset is read as one stream of whole global batches, as without
    `partial_last`, so no step depends on where a pass ends. With `stream` (a dataset of unknown length,
    `fitting`) each of the dataset's own batches is a step, split as evenly as can be, carrying its example
    count, and the dataset is read once, `start_step` batches skipped: the loop ends an epoch where it ends.
    """
    given = global_batch

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        here = _replicas_here(ctx)
        first = ctx.input_pipeline_id * here
        replicas = ctx.num_replicas_in_sync
        global_batch = given or per_replica_batch * replicas

        def mine(*element: Any) -> tf.data.Dataset:
            if any(columns.is_composite(t) for t in tf.nest.flatten(element)):  # Sparse/ragged: by row.
                def replica_rows(local: tf.Tensor) -> tuple:
                    start = (first + local) * per_replica_batch
                    rows = tf.range(start, start + per_replica_batch)
                    return tuple(map_present(lambda t: columns.gather(t, rows), element))

                return tf.data.Dataset.range(here).map(replica_rows)

            def cut(t: tf.Tensor) -> tf.Tensor:
                part = t[first * per_replica_batch:(first + here) * per_replica_batch]
                return tf.reshape(part, tf.concat([[here, per_replica_batch], tf.shape(t)[1:]], 0))

            return tf.data.Dataset.from_tensor_slices(tuple(map_present(cut, element)))

        def mine_split(*element: Any) -> tf.data.Dataset:
            n = columns.batch_rows(columns.first(element))

            def replica_batch(local: tf.Tensor) -> tuple:
                rows = split_range(0, n, replicas, first + local)
                return tuple(map_present(lambda t: columns.gather(t, rows), element)) + (tf.cast(n, tf.float32),)

            return tf.data.Dataset.range(here).map(replica_batch)

        if stream:  # The dataset's own batches, each a step, until it ends (no repeat): Keras' epochs of a stream.
            ds = dataset.skip(start_step).flat_map(mine_split)
        elif partial_last and whole_batches:
            ds = dataset.repeat().unbatch().batch(global_batch, drop_remainder=True).skip(start_step)
            ds = ds.flat_map(mine_split)
        elif partial_last:
            ds = dataset.unbatch().batch(global_batch).repeat().skip(start_step).flat_map(mine_split)
        else:
            ds = dataset.repeat().unbatch().batch(global_batch, drop_remainder=True).skip(start_step).flat_map(mine)
        # An optional input's None marked in the replicas' batches: not before, as tf.data's unbatch() crashes on
        # a zero-size tensor.
        return absent_marked_dataset(ds).prefetch(tf.data.AUTOTUNE).with_options(options())

    return dataset_fn


def resumed_fn(dataset_fn: DatasetFn, *, start_step: int, sharded: bool = True) -> DatasetFn:
    """A user's dataset function, repeated, with the batches of `start_step` steps skipped."""

    def wrapped(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        ds = dataset_fn(ctx).repeat()
        if sharded and start_step:
            ds = ds.skip(start_step * _replicas_here(ctx))
        return ds

    return wrapped
