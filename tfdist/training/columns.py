"""One input leaf of any kind Keras takes: a dense array, a `tf.SparseTensor` (or scipy sparse matrix) or a
`tf.RaggedTensor`, each with its examples along the first dimension.

The input pipelines (`tfdist.training.inputs`) and the readers of fit, evaluate and predict hold every leaf
through these few operations, so a sparse or ragged input is split, shuffled, padded and gathered by example
exactly as a dense one: the same examples at every step on every topology.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.none_tensor import NoneTensorSpec  # tf.NoneTensorSpec only from TF 2.19.

COMPOSITE = (tf.SparseTensor, tf.RaggedTensor)


def is_composite(value: Any) -> bool:
    return isinstance(value, COMPOSITE)


def leaf(value: Any) -> Any:
    """A leaf as the pipelines hold it: sparse and ragged tensors as they are (scipy sparse as a SparseTensor,
    in canonical order), everything else a NumPy array."""
    if isinstance(value, tf.SparseTensor):
        return tf.sparse.reorder(value)
    if isinstance(value, tf.RaggedTensor):
        return value
    if hasattr(value, "tocoo") and hasattr(value, "nnz"):  # scipy.sparse, as Keras' adapters convert it.
        coo = value.tocoo()
        indices = np.stack([coo.row, coo.col], axis=1).astype(np.int64)
        return tf.sparse.reorder(tf.SparseTensor(indices, coo.data, coo.shape))
    return np.asarray(value)


def present(structure: Any) -> list:
    """The leaves of a structure (or of a dataset's element spec) that hold data: not the None of an optional
    input given none (``keras.Input(optional=True)``; tf.data's `NoneTensorSpec`), of absent targets or weights."""
    return [leaf for leaf in tf.nest.flatten(structure) if leaf is not None and not isinstance(leaf, NoneTensorSpec)]


def first(structure: Any) -> Any:
    """The first leaf holding data (its first dimension is the examples); None where there is none."""
    leaves = present(structure)
    return leaves[0] if leaves else None


def rows(value: Any) -> int:
    """The number of examples."""
    if isinstance(value, tf.SparseTensor):
        return int(value.dense_shape[0])
    if isinstance(value, tf.RaggedTensor):
        return int(value.nrows())
    return int(len(value))


def batch_rows(value: Any) -> tf.Tensor:
    """The number of examples of a batch (compiled), as int64."""
    if isinstance(value, tf.SparseTensor):
        return value.dense_shape[0]
    if isinstance(value, tf.RaggedTensor):
        return tf.cast(value.nrows(), tf.int64)
    return tf.shape(value, out_type=tf.int64)[0]


def spec(value: Any, batch_dim: Any = None) -> tf.TypeSpec:
    """The tf.data spec of a batch leaf, its first dimension `batch_dim` (None: any)."""
    if isinstance(value, tf.SparseTensor):
        return tf.SparseTensorSpec((batch_dim, *value.shape[1:]), value.dtype)
    if isinstance(value, tf.RaggedTensor):
        return tf.RaggedTensorSpec((batch_dim, *value.shape[1:]), value.dtype, value.ragged_rank,
                                   value.row_splits.dtype)
    return tf.TensorSpec((batch_dim, *value.shape[1:]), tf.as_dtype(value.dtype))


def common_spec(leaves: Sequence[Any]) -> Any:
    """The tf.data spec of one input's batches: each dimension they agree on kept, the others None (as Keras'
    `data_adapter_utils.get_keras_tensor_spec` merges them); `tf.NoneTensorSpec` for an optional input's None."""
    if leaves[0] is None:
        return NoneTensorSpec()
    if is_composite(leaves[0]):
        return spec(leaves[0])
    dims = [d[0] if len(set(d)) == 1 else None for d in zip(*(np.shape(leaf) for leaf in leaves))]
    return tf.TensorSpec((None, *dims[1:]), tf.as_dtype(leaves[0].dtype))


def ndim(value: Any) -> int:
    if is_composite(value):
        return int(value.shape.rank)
    return int(np.ndim(value))


def head(value: Any, count: int) -> Any:
    """The first `count` examples."""
    if isinstance(value, tf.SparseTensor):
        shape = value.dense_shape.numpy()
        return tf.sparse.slice(value, [0] * len(shape), [min(count, int(shape[0])), *shape[1:]])
    return value[:count]


def rows_range(value: Any, start: int, stop: int) -> Any:
    """Examples `start` to `stop` (eager)."""
    if isinstance(value, tf.SparseTensor):
        shape = value.dense_shape.numpy()
        return tf.sparse.slice(value, [start] + [0] * (len(shape) - 1), [stop - start, *shape[1:]])
    return value[start:stop]


def concat(parts: Sequence[Any]) -> Any:
    """Examples of several batches, in order (None where every batch has None: an optional input given none)."""
    if all(part is None for part in parts):
        return None
    if isinstance(parts[0], tf.SparseTensor):
        return tf.sparse.concat(0, list(parts), expand_nonconcat_dims=True)
    if isinstance(parts[0], tf.RaggedTensor):
        return tf.concat(list(parts), 0)
    return np.concatenate(parts)


def constant(value: Any) -> Any:
    """The leaf as a tensor the pipelines gather from."""
    return value if is_composite(value) else tf.constant(value)


def gather(value: Any, indices: tf.Tensor) -> Any:
    """The examples at `indices` (compiled): `tf.gather`, by row for a SparseTensor in canonical order."""
    if isinstance(value, tf.SparseTensor):
        return _sparse_rows(value, indices)
    return tf.gather(value, indices)


def _sparse_rows(value: tf.SparseTensor, indices: tf.Tensor) -> tf.SparseTensor:
    wanted = tf.reshape(tf.cast(indices, tf.int64), [-1])
    first = value.indices[:, 0]  # Sorted: the tensor is in canonical (row-major) order.
    entries = tf.ragged.range(tf.searchsorted(first, wanted, side="left"),
                              tf.searchsorted(first, wanted, side="right"))
    ids = entries.flat_values
    new_indices = tf.concat([entries.value_rowids()[:, None], tf.gather(value.indices[:, 1:], ids)], 1)
    shape = tf.concat([tf.shape(wanted, out_type=tf.int64), value.dense_shape[1:]], 0)
    result = tf.SparseTensor(new_indices, tf.gather(value.values, ids), shape)
    result.set_shape(tf.TensorShape([None]).concatenate(value.shape[1:]))
    return result
