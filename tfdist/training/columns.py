"""One input leaf of any kind Keras takes: a dense array (text held as objects of UTF-8 bytes, as TensorFlow reads
`tf.string`), a `tf.SparseTensor` (or scipy sparse matrix) or a `tf.RaggedTensor`, each with its examples along the
first dimension.

The input pipelines (`tfdist.training.inputs`) and the readers of fit, evaluate and predict hold every leaf
through these few operations, so a sparse or ragged input is split, shuffled, padded and gathered by example
exactly as a dense one: the same examples at every step on every topology.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.none_tensor import NoneTensorSpec  # tf.NoneTensorSpec only from TF 2.19.

from tfdist.errors import UserError

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
    array = np.asarray(value)
    return tf.constant(array).numpy() if is_text(array) else array


def is_text(array: np.ndarray) -> bool:
    """Whether a NumPy array holds text: str ('U') or bytes ('S') items, or objects that are all str or bytes (as
    Keras' array adapter takes a column of Python strings)."""
    if array.dtype.kind in ("U", "S"):
        return True
    return array.dtype == object and array.size > 0 and all(isinstance(item, (str, bytes)) for item in array.flat)


def tf_dtype(value: Any) -> tf.DType:
    """A leaf's dtype as TensorFlow and Keras name it: `tf.string` for text, which NumPy holds as objects, str or
    bytes (Keras' ``standardize_dtype`` names none of them)."""
    return value.dtype if isinstance(value.dtype, tf.DType) else tf.as_dtype(value.dtype)


def is_text_dtype(dtype: Any) -> bool:
    """Whether a NumPy dtype is one text is held in (objects, str, bytes): `tf.string` to TensorFlow."""
    return isinstance(dtype, np.dtype) and dtype.kind in ("O", "U", "S")


def symbolic(value: Any) -> Any:
    """A leaf as Keras' symbolic build reads it (``KerasTensor(v.shape, standardize_dtype(v.dtype))``): text as a
    `tf.string` tensor, every other leaf as it is."""
    return tf.constant(value) if isinstance(value, np.ndarray) and is_text_dtype(value.dtype) else value


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
    return tf.TensorSpec((batch_dim, *value.shape[1:]), tf_dtype(value))


def common_spec(leaves: Sequence[Any]) -> Any:
    """The tf.data spec of one input's batches: each dimension they agree on kept, the others None (as Keras'
    `data_adapter_utils.get_keras_tensor_spec` merges them); `tf.NoneTensorSpec` for an optional input's None."""
    if leaves[0] is None:
        return NoneTensorSpec()
    if is_composite(leaves[0]):
        return spec(leaves[0])
    dims = [d[0] if len(set(d)) == 1 else None for d in zip(*(np.shape(leaf) for leaf in leaves))]
    return tf.TensorSpec((None, *dims[1:]), tf_dtype(leaves[0]))


def known_rows(value: Any) -> Optional[int]:
    """The number of examples of a batch leaf (an array, a tensor or a tf.data spec), None where unknown."""
    if isinstance(value, tf.SparseTensor):
        return int(value.dense_shape[0])
    if isinstance(value, tf.RaggedTensor):
        return int(value.nrows())
    shape = tf.TensorShape(value.shape if hasattr(value, "shape") else np.shape(value))
    return shape[0] if shape.rank else None


UNEQUAL_ROWS = ("every input, target and sample weight of a batch needs the same number of rows (one per example), "
                "because tfdist splits each batch by rows among the replicas (Keras' one-device fit takes such a "
                "batch whole: a layer that changes the batch dimension, given an unbatched input). Give every part "
                "of a batch one row per example: batch the input (x[None] for one example) and give y its rows.")


def same_rows(batch: Any, what: str = "a batch") -> Any:
    """The batch ``(x, y, sample_weight)`` (or x alone; arrays, tensors or specs); refused where its leaves differ in
    their number of rows, naming each part and its rows, before any step (**unequal rows**: `UNEQUAL_ROWS`)."""
    parts = tuple(batch) if isinstance(batch, tuple) else (batch,)
    counts: dict[str, int] = {}
    for name, part in zip(("x", "y", "sample_weight"), parts):
        leaves = tf.nest.flatten(part)
        for i, leaf in enumerate(leaves):
            rows_here = None if leaf is None or isinstance(leaf, NoneTensorSpec) else known_rows(leaf)
            if rows_here is not None:
                counts[f"{name}[{i}]" if len(leaves) > 1 else name] = int(rows_here)
    if len(set(counts.values())) > 1:
        (first, count), *others = counts.items()
        parts_rows = [f"{first} has {count} rows"] + [f"{label} {n}" for label, n in others]
        listed = ", ".join(parts_rows[:-1]) + " and " + parts_rows[-1]
        raise UserError(f"In {what}, {listed}: {UNEQUAL_ROWS}")
    return batch


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
