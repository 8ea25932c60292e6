"""`ShardedEmbedding`: `keras.layers.Embedding` whose table is split into row shards.

Under `ParameterServerStrategy` the shards are spread over the ps tasks
(created one after another, so round-robin from wherever the strategy's
placement stands; with as many shards as ps tasks, one each) and a lookup is
`tf.nn.embedding_lookup` over them: each ps gathers the rows a batch needs
from its shards, and only those rows, and their gradients (`IndexedSlices`),
cross the network. Keras' `Embedding` reads the whole table at every step.

Rows are split the way TensorFlow's "div" partitioning splits them: shard i
of n holds rows [offset_i, offset_i + size_i), the first `input_dim % n`
shards one row more than the others.

The number of shards: `num_shards` if given; under a parameter-server
strategy made by `tfdist.make_strategy`, its `ps_shards` (``--ps_shards``) or,
by default, the number of ps tasks; otherwise 1. Whatever the count, the layer
computes what `keras.layers.Embedding` computes with the same table.

In a `model.keras` file (`save_own_variables`) the table is one
`[input_dim, output_dim]` array, so a model trained on 3 shards loads into a
layer of any shard count, in a process without a cluster. tfdist's training
checkpoints hold each table (and each optimizer slot of it) as one logical
variable saved in slices (`tfdist.training.workdir`), so a run resumes exactly
on another shard count. How the optimizer updates the rows under parameter
servers (``sparse_updates``) is in `tfdist.training.sparse_updates`.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import get_stateless_scope, in_stateless_scope

from tfdist.errors import UserError

SPARSE_UPDATES = ("exact", "lazy")
ID_ERROR = "tfdist.layers.ShardedEmbedding"  # Starts the message of the in-graph id check.


def row_split(rows: int, shards: int) -> list[int]:
    """Rows per shard, TensorFlow's "div" partitioning: the first `rows % shards` hold one more."""
    return [rows // shards + (1 if i < rows % shards else 0) for i in range(shards)]


def _check_count(name: str, shards: Any, rows: int, where: str) -> int:
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or not 1 <= shards <= rows:
        raise UserError(
            f"{name}: {where}={shards!r} cannot split a table of {rows} rows; give a whole number from 1 to {rows} "
            "(each shard holds at least one row).")
    return int(shards)


def _default_shards(name: str, rows: int) -> int:
    """`ps_shards` of tfdist's parameter-server strategy, else its number of ps tasks; 1 elsewhere."""
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return 1
    given = getattr(strategy, "_tfdist_ps_shards", None)
    if given is not None:
        return _check_count(name, given, rows, "--ps_shards")
    num_ps = getattr(strategy.extended, "_num_ps", None) or 1
    return min(num_ps, rows)


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedEmbedding(keras.layers.Layer):
    """`keras.layers.Embedding(input_dim, output_dim, ...)` with its table in `num_shards` row shards.

    Args (those of `keras.layers.Embedding`, and):
      embeddings_initializer: as Keras'; with one shard the layer starts from
        the table `keras.layers.Embedding` would draw, with several each shard
        draws its own rows (the same distribution, another draw). `weights`
        sets the whole table.
      num_shards: how many row shards (1 to `input_dim`); by default tfdist's
        ``ps_shards`` under a parameter-server strategy (else its ps task
        count), and 1 under any other strategy.
      sparse_updates: how the optimizer updates the table under parameter
        servers. ``"exact"`` (default): only the looked-up rows (and their
        slots) are written where that is exactly Keras' update (SGD without
        momentum, Adagrad); other optimizers run Keras' own dense update (with a
        warning on a large table). ``"lazy"``: SGD with momentum and Adam also
        update only the looked-up rows and their slots; rows not looked up keep
        their slots undecayed, which differs from Keras (TensorFlow 1's
        LazyAdam rule).
    """

    def __init__(self, input_dim: int, output_dim: int, embeddings_initializer: Any = "uniform",
                 embeddings_regularizer: Any = None, embeddings_constraint: Any = None, mask_zero: bool = False,
                 weights: Optional[Any] = None, num_shards: Optional[int] = None, sparse_updates: str = "exact",
                 **kwargs: Any):
        for unsupported in ("lora_rank", "lora_alpha", "input_length"):
            if kwargs.pop(unsupported, None) is not None:
                raise UserError(f"ShardedEmbedding does not take {unsupported}= (keras.layers.Embedding's LoRA and "
                                "input_length are not supported); leave it out.")
        super().__init__(**kwargs)
        for label, value in (("input_dim", input_dim), ("output_dim", output_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise UserError(f"ShardedEmbedding {self.name}: {label}={value!r}; give a positive whole number.")
        if num_shards is not None:
            _check_count(f"ShardedEmbedding {self.name}", num_shards, int(input_dim), "num_shards")
        if sparse_updates not in SPARSE_UPDATES:
            raise UserError(f"ShardedEmbedding {self.name}: sparse_updates={sparse_updates!r}; give one of "
                            f"{', '.join(map(repr, SPARSE_UPDATES))} (see tfdist's docs/sharded-embeddings.md).")
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero
        self.autocast = False
        self.num_shards = num_shards
        self.sparse_updates = sparse_updates
        self._initial_weights = weights
        self.shards: list = []

    # Variables -------------------------------------------------------------
    def build(self, input_shape: Any = None) -> None:
        if self.built:
            return
        count = self.num_shards or _default_shards(f"ShardedEmbedding {self.name}", self.input_dim)
        self.shards = []
        for index, rows in enumerate(row_split(self.input_dim, count)):
            self.shards.append(self.add_weight(
                shape=(rows, self.output_dim), initializer=self.embeddings_initializer,
                name=f"embeddings_shard_{index}" if count > 1 else "embeddings",
                regularizer=self.embeddings_regularizer, constraint=self.embeddings_constraint, trainable=True))
        self.built = True
        if self._initial_weights is not None:
            self.set_weights(self._split(np.asarray(self._initial_weights[0] if isinstance(
                self._initial_weights, (list, tuple)) else self._initial_weights)))
            self._initial_weights = None

    def _split(self, table: np.ndarray) -> list[np.ndarray]:
        if table.shape != (self.input_dim, self.output_dim):
            raise UserError(f"ShardedEmbedding {self.name}: a table of shape {tuple(table.shape)} cannot be loaded "
                            f"into this layer, whose table is ({self.input_dim}, {self.output_dim}).")
        offsets = np.cumsum([0] + row_split(self.input_dim, len(self.shards)))
        return [table[offsets[i]:offsets[i + 1]] for i in range(len(self.shards))]

    @property
    def embeddings(self) -> tf.Tensor:
        """The whole table, as one tensor (reads every shard: for inspection, not for a training step)."""
        return tf.concat([tf.convert_to_tensor(s) for s in self.shards], axis=0)

    def table(self) -> np.ndarray:
        """The whole table as a NumPy array."""
        return np.concatenate([np.asarray(s) for s in self.shards], axis=0)

    # Computation -----------------------------------------------------------
    def _shard_values(self) -> list:
        """What a lookup reads: each shard's TensorFlow variable (a gather on the ps), or its value in a
        stateless call (`model.stateless_call`) that maps it."""
        scope = get_stateless_scope() if in_stateless_scope() else None
        values = []
        for shard in self.shards:
            mapped = scope.get_current_value(shard) if scope is not None else None
            values.append(mapped if mapped is not None else shard._value)
        return values

    def call(self, inputs: Any) -> tf.Tensor:
        ids = tf.convert_to_tensor(inputs)
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        checked = self._check_ids(ids)
        with tf.control_dependencies([checked]):
            ids = tf.identity(ids)
        outputs = tf.nn.embedding_lookup(self._shard_values(), ids)
        return tf.cast(outputs, self.compute_dtype)

    def _check_ids(self, ids: tf.Tensor) -> tf.Operation:
        """Ids outside 0..input_dim-1 fail the step with one message naming the layer and the ids' range."""
        flat = tf.reshape(ids, [-1])
        ok = tf.logical_and(tf.reduce_all(flat >= 0), tf.reduce_all(flat < self.input_dim))
        top = self.input_dim - 1
        return tf.debugging.Assert(ok, [
            f"{ID_ERROR} {self.name!r} (input_dim={self.input_dim}) got ids outside 0..{top}: this batch's ids range "
            "from", tf.reduce_min(flat), "to", tf.reduce_max(flat),
            f". Keras' Embedding would fail the same way on a CPU and return zeros on a GPU; map the ids into 0..{top} "
            "(e.g. with keras.layers.IntegerLookup or keras.layers.Hashing) or raise input_dim."], summarize=3)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if not self.mask_zero:
            return None
        return keras.ops.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape: Sequence[Any]) -> tuple:
        return (*input_shape, self.output_dim)

    # Saving ------------------------------------------------------------------
    def save_own_variables(self, store: Any) -> None:
        """The whole table as one array (`model.keras`): it loads into a layer of any shard count."""
        store["0"] = self.table()

    def load_own_variables(self, store: Any) -> None:
        if len(store.keys()) != 1:
            raise UserError(f"ShardedEmbedding {self.name}: the saved layer holds {len(store.keys())} arrays; a "
                            "ShardedEmbedding saves its table as one.")
        for shard, rows in zip(self.shards, self._split(np.asarray(store["0"]))):
            shard.assign(rows)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update({
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "embeddings_regularizer": keras.regularizers.serialize(self.embeddings_regularizer),
            "embeddings_constraint": keras.constraints.serialize(self.embeddings_constraint),
            "mask_zero": self.mask_zero,
            "num_shards": self.num_shards,
            "sparse_updates": self.sparse_updates,
        })
        return config


def sharded_tables(model: Any) -> list[ShardedEmbedding]:
    """The model's ShardedEmbedding layers (each once)."""
    return [layer for layer in model._flatten_layers(include_self=False) if isinstance(layer, ShardedEmbedding)]


def id_error(error: BaseException) -> Optional[UserError]:
    """The one-paragraph `UserError` for a step that failed the in-graph id check (`_check_ids`), else None."""
    text = getattr(error, "message", None) or str(error)
    start = text.find(ID_ERROR)
    if start < 0:
        return None
    parts = re.findall(r"\[([^\[\]]*)\]", text[text.rfind("[", 0, start):])
    if len(parts) < 5:
        return UserError(" ".join(text[start:].split()).replace("\\'", "'"))
    head, low, _, high, tail = (p.strip() for p in parts[:5])
    return UserError(f"{head} {low} to {high}{tail}".replace("\\'", "'"))
