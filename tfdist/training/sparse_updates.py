"""Row-sparse optimizer updates of `ShardedEmbedding` tables.

A lookup's gradient is an `IndexedSlices`: the rows the batch looked up. What
Keras 3's optimizers do with it:
- SGD without momentum scatters it into the table (sparse);
- Adagrad adds the squared rows into its accumulator (a scatter), then divides
  each row by the accumulator and subtracts it (sparse in effect, but written as
  whole-table reads);
- momentum SGD, Adam and the like decay every row's slots at every step, so
  their update is dense: whole-table reads and writes of the table and its slots.

While tfdist's training step is traced, `sparse_table_updates` replaces the
optimizer's ``update_step`` for the tables' shards only (every other variable
gets Keras' own update):
- ``sparse_updates="exact"`` (the layer's default): SGD without momentum and
  Adagrad update only the looked-up rows, computing exactly what Keras computes
  (Adagrad as Keras does with an `IndexedSlices`: each occurrence of a row
  adds its own squared gradient). Any other optimizer runs Keras' own dense
  update, and a table of `LARGE_TABLE_BYTES` or more gets a warning naming it.
- ``sparse_updates="lazy"``: SGD with momentum (Nesterov too) and Adam also
  update only the looked-up rows and their slots, with the rows' summed
  gradients: TensorFlow 1's LazyAdam rule. Rows not looked up keep their slots
  undecayed, so training differs from Keras'; it is a named choice, never a
  silent one. Other optimizers (and Adam's amsgrad) are refused before any step.

The same rules run on every backend, so a model trains the same on one device
and under parameter servers. Weight decay and EMA act on every variable as
Keras' own (dense) update does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import keras
import tensorflow as tf
from absl import logging

from tfdist.errors import UserError
from tfdist.layers.sharded_embedding import sharded_tables
from tfdist.training import keras_hooks

LARGE_TABLE_BYTES = 16 * 2**20
_warned: set = set()  # (id(optimizer), table name): warned once per process.


_SLOTS = {"adagrad": ("_accumulators",), "momentum": ("momentums",), "lazy_adam": ("_momentums", "_velocities")}


def _rule(optimizer: Any, mode: str) -> Optional[str]:
    """Which row-sparse rule `optimizer` gets for a table in `mode`, or None (Keras' dense update)."""
    kind = type(optimizer)
    if kind is keras.optimizers.SGD:
        if optimizer.momentum == 0:
            return "sgd"
        return "momentum" if mode == "lazy" else None
    if kind is keras.optimizers.Adagrad:
        return "adagrad"
    if kind is keras.optimizers.Adam and mode == "lazy" and not optimizer.amsgrad:
        return "lazy_adam"
    return None


def check(model: keras.Model) -> None:
    """Refuses, before any step, a "lazy" table whose optimizer has no lazy rule; warns of dense updates."""
    tables = sharded_tables(model)
    if not tables or getattr(model, "optimizer", None) is None:
        return
    from tfdist.training.custom_steps import overrides

    if overrides(model, "train_step"):
        lazy = [table.name for table in tables if table.sparse_updates == "lazy"]
        if lazy:
            raise UserError(
                f"ShardedEmbedding {', '.join(map(repr, lazy))}: sparse_updates='lazy' applies to tfdist's own "
                "training step; this model's custom train_step applies Keras' own (dense) update to the table. Use "
                "sparse_updates='exact', or train without the train_step override.")
        return
    optimizer = keras_hooks.optimizers(model.optimizer)[-1]
    for table in tables:
        rule = _rule(optimizer, table.sparse_updates)
        needed = ["_trainable_variables", "_get_variable_index", "update_step", *_SLOTS.get(rule, ())]
        missing = [name for name in needed if not hasattr(optimizer, name)]
        if rule is not None and missing:
            raise UserError(
                f"tfdist's row-sparse update of ShardedEmbedding {table.name!r} relies on Keras internals that this "
                f"Keras ({keras.__version__}) lacks: {', '.join(f'{type(optimizer).__name__}.{n}' for n in missing)}. "
                "Install a Keras 3 release tfdist supports (tested with 3.15.1).")
        if rule is None and table.sparse_updates == "lazy":
            raise UserError(
                f"ShardedEmbedding {table.name!r} asks for sparse_updates='lazy', which tfdist implements for "
                f"keras.optimizers.SGD (with or without momentum), Adagrad and Adam (without amsgrad); the model's "
                f"optimizer is {type(optimizer).__name__}. Use one of those, or sparse_updates='exact' (Keras' own "
                "update).")
        size = table.input_dim * table.output_dim * 4
        dense = rule is None or bool(getattr(optimizer, "weight_decay", None)) or bool(
            getattr(optimizer, "use_ema", False))
        key = (id(optimizer), table.name)
        if dense and size >= LARGE_TABLE_BYTES and key not in _warned:
            _warned.add(key)
            logging.warning(
                "ShardedEmbedding %r (%d x %d, %.0f MB): %s updates every row of the table (and its slots) at every "
                "step, as Keras does%s. For row-sparse updates use SGD without momentum or Adagrad (exact), or "
                "sparse_updates='lazy' with momentum SGD or Adam (docs/sharded-embeddings.md).", table.name,
                table.input_dim, table.output_dim, size / 2**20, type(optimizer).__name__,
                " (weight decay or EMA touch every row)" if rule is not None else "")


def warn_whole_table_reads(model: keras.Model) -> None:
    """Under parameter servers: warns once per `keras.layers.Embedding`, which reads its whole table per step."""
    for layer in model._flatten_layers(include_self=False):
        if not isinstance(layer, keras.layers.Embedding) or ("embedding", id(layer)) in _warned:
            continue
        _warned.add(("embedding", id(layer)))
        size = layer.input_dim * layer.output_dim * 4
        logging.warning(
            "keras.layers.Embedding %r (%d x %d, %.1f MB) reads its whole table from the parameter servers at every "
            "step. tfdist.layers.ShardedEmbedding takes the same arguments, splits the table over the ps tasks and "
            "moves only the rows a batch looks up.", layer.name, layer.input_dim, layer.output_dim, size / 2**20)


def _rows(gradient: tf.IndexedSlices, dtype: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """The distinct rows of `gradient` and each one's summed gradient."""
    rows, position = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(tf.cast(gradient.values, dtype), position, tf.size(rows))
    return rows, values


def _slot(optimizer: Any, name: str, variable: Any) -> Any:
    return getattr(optimizer, name)[optimizer._get_variable_index(variable)]


def _apply(optimizer: Any, rule: str, gradient: tf.IndexedSlices, variable: Any, learning_rate: Any) -> None:
    """One shard's update by `rule` (`_rule`), in the optimizer's update context (colocated with the shard)."""
    dtype = variable.dtype
    lr = tf.cast(learning_rate, dtype)
    if rule == "sgd":
        optimizer.assign_sub(variable, tf.IndexedSlices(tf.cast(gradient.values, dtype) * lr, gradient.indices,
                                                        gradient.dense_shape))
        return
    if rule == "adagrad":
        accumulator = _slot(optimizer, "_accumulators", variable)
        values = tf.cast(gradient.values, dtype)
        optimizer.assign_add(accumulator, tf.IndexedSlices(tf.square(values), gradient.indices, gradient.dense_shape))
        seen = tf.gather(keras_hooks._tf_variable(accumulator), gradient.indices)
        step = lr * values / tf.sqrt(seen + tf.cast(optimizer.epsilon, dtype))
        optimizer.assign_sub(variable, tf.IndexedSlices(step, gradient.indices, gradient.dense_shape))
        return
    rows, values = _rows(gradient, dtype)

    def scatter(target: Any, new_rows: tf.Tensor, old_rows: tf.Tensor) -> None:
        # An increment, not an overwrite: parameter-server workers updating one row at once lose nothing.
        optimizer.assign_add(target, tf.IndexedSlices(new_rows - old_rows, rows, gradient.dense_shape))

    def gather(target: Any) -> tf.Tensor:
        return tf.gather(keras_hooks._tf_variable(target), rows)

    if rule == "momentum":
        momentum = tf.cast(optimizer.momentum, dtype)
        m = _slot(optimizer, "momentums", variable)
        old_m = gather(m)
        new_m = old_m * momentum - values * lr
        scatter(m, new_m, old_m)
        step = new_m * momentum - values * lr if optimizer.nesterov else new_m
        optimizer.assign_add(variable, tf.IndexedSlices(step, rows, gradient.dense_shape))
        return
    # lazy_adam: Keras' Adam on the looked-up rows only (bias correction by the global step).
    t = tf.cast(optimizer.iterations + 1, dtype)
    beta_1, beta_2 = tf.cast(optimizer.beta_1, dtype), tf.cast(optimizer.beta_2, dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(beta_2, t)) / (1 - tf.pow(beta_1, t))
    m, v = _slot(optimizer, "_momentums", variable), _slot(optimizer, "_velocities", variable)
    old_m, old_v = gather(m), gather(v)
    new_m = old_m + (values - old_m) * (1 - beta_1)
    new_v = old_v + (tf.square(values) - old_v) * (1 - beta_2)
    scatter(m, new_m, old_m)
    scatter(v, new_v, old_v)
    step = new_m * alpha / (tf.sqrt(new_v) + tf.cast(optimizer.epsilon, dtype))
    optimizer.assign_sub(variable, tf.IndexedSlices(step, rows, gradient.dense_shape))


def _sparse_update_step(optimizer: Any, shards: dict) -> Callable:
    """The replacement of ``optimizer.update_step``: a row-sparse rule for shards, Keras' own otherwise."""
    def make(before: Any, key: tuple) -> Callable:
        keras_own = type(optimizer).update_step.__get__(optimizer) if before is keras_hooks._MISSING else before

        def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
            if keras_hooks._acting(key) and isinstance(gradient, tf.IndexedSlices):
                owner = optimizer._trainable_variables[optimizer._get_variable_index(variable)]
                table = shards.get(id(owner))
                rule = None if table is None else _rule(optimizer, table.sparse_updates)
                if rule is not None:
                    return _apply(optimizer, rule, gradient, variable, learning_rate)
            return keras_own(gradient, variable, learning_rate)

        return update_step

    return make


@contextlib.contextmanager
def sparse_table_updates(model: keras.Model) -> Iterator[None]:
    """While tfdist's step is traced: the tables' shards get the row-sparse rules above."""
    tables = sharded_tables(model)
    if not tables:
        yield
        return
    shards = {id(shard): table for table in tables for shard in table.shards}
    with contextlib.ExitStack() as stack:
        for opt in keras_hooks.optimizers(model.optimizer):
            if hasattr(opt, "_trainable_variables") and hasattr(type(opt), "update_step"):
                stack.enter_context(keras_hooks._replaced(opt, "update_step", _sparse_update_step(opt, shards),
                                                          this_thread=False))
        yield


__all__ = ["check", "sparse_table_updates", "warn_whole_table_reads", "LARGE_TABLE_BYTES"]
