"""Bucket layout of equal flat shards: which elements of which variables each replica owns.

A bucket is the flat concatenation of a run of trainable variables of one dtype (in model order, at most
`BUCKET_BYTES`; a larger variable alone), padded at its end with zeros to a multiple of the replica count N
(fewer than N elements). Replica r owns elements ``[r * S / N, (r + 1) * S / N)`` of a bucket of S padded
elements, as FSDP's flat parameters and DeepSpeed's partitions: every replica holds exactly 1/N, a variable
may span two or more replicas, and the layout depends on N, never on what a replica holds. A `Piece` is where
one variable's elements meet one replica's shard; everything that moves between the model's variables and
the shards goes through them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

BUCKET_BYTES = 32 << 20  # The most one bucket's reduce-scatter and all-gather move (one larger variable alone).


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + length)`` of variable `index` (flattened), at `offset` in a replica's shard."""
    index: int
    start: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A run of variables flattened together: their indices, element counts, dtype and padded size."""
    indices: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: tf.DType
    replicas: int

    @property
    def total(self) -> int:
        """The variables' elements, without the padding."""
        return sum(self.sizes)

    @property
    def shard(self) -> int:
        """The elements each replica owns (the padded size over N)."""
        return -(-self.total // self.replicas) if self.total else 0

    @property
    def padded(self) -> int:
        return self.shard * self.replicas

    def pieces(self, replica: int) -> list[Piece]:
        """The parts of variables replica `replica` owns in this bucket, in shard order."""
        low, high = replica * self.shard, (replica + 1) * self.shard
        found, begin = [], 0
        for index, size in zip(self.indices, self.sizes):
            a, b = max(low, begin), min(high, begin + size)
            if a < b:
                found.append(Piece(index, a - begin, a - low, b - a))
            begin += size
        return found

    def flatten(self, tensors: Sequence[Any]) -> tf.Tensor:
        """The bucket's flat [padded] tensor from one tensor per variable (None: zeros), padding zeros."""
        flat = [tf.zeros([size], self.dtype) if t is None else tf.reshape(tf.cast(t, self.dtype), [-1])
                for t, size in zip(tensors, self.sizes)]
        if self.padded > self.total:
            flat.append(tf.zeros([self.padded - self.total], self.dtype))
        return tf.concat(flat, 0) if len(flat) > 1 else flat[0]

    def split(self, flat: tf.Tensor) -> list[tf.Tensor]:
        """One flat tensor per variable from a whole [padded] bucket (the padding dropped)."""
        return tf.split(flat[:self.total], list(self.sizes)) if len(self.sizes) > 1 else [flat[:self.total]]

    def owned_part(self, replica: int, tensors: Sequence[Any]) -> tf.Tensor:
        """Replica `replica`'s [shard] slice of the bucket made from one tensor per variable, without
        concatenating the whole bucket (only the owned elements are copied)."""
        by_index = dict(zip(self.indices, tensors))
        parts = [tf.reshape(by_index[p.index], [-1])[p.start:p.start + p.length] for p in self.pieces(replica)]
        filled = sum(p.length for p in self.pieces(replica))
        if filled < self.shard:
            parts.append(tf.zeros([self.shard - filled], self.dtype))
        return tf.concat(parts, 0) if len(parts) > 1 else parts[0]

    def mask(self, replica: int, chosen: Any) -> np.ndarray:
        """A [shard] float vector: 1 on the elements of variables for which ``chosen(index)`` is true."""
        out = np.zeros([self.shard], np.float32)
        for p in self.pieces(replica):
            if chosen(p.index):
                out[p.offset:p.offset + p.length] = 1.0
        return out


def plan(variables: Sequence[Any], replicas: int, limit: int = 0) -> list[Bucket]:
    """The buckets of `variables` on `replicas` replicas: runs in order, of one dtype, at most `limit` bytes
    (`BUCKET_BYTES`; one larger variable alone)."""
    limit = limit or BUCKET_BYTES
    groups: list[list[int]] = []
    held = 0
    for i, v in enumerate(variables):
        size = variable_bytes(v)
        if not groups or held + size > limit or variables[groups[-1][0]].dtype != v.dtype:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    return [Bucket(tuple(g), tuple(variable_size(variables[i]) for i in g), tf.as_dtype(variables[g[0]].dtype),
                   replicas) for g in groups]


def variable_size(variable: Any) -> int:
    return int(np.prod(variable.shape))


def variable_bytes(variable: Any) -> int:
    return variable_size(variable) * tf.as_dtype(variable.dtype).size
