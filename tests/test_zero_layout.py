"""tfdist.training.zero.layout: equal flat shards of buckets of variables (FSDP's flat parameters)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.training.zero import layout


def variables(*shapes, dtype="float32"):
    return [keras.Variable(np.zeros(s, dtype)) for s in shapes]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_each_replica_owns_an_equal_slice_and_the_padding_is_under_n(replicas):
    found = layout.plan(variables((100,), (10,), (60,), (3, 13), (5,)), replicas)
    (bucket,) = found
    assert bucket.total == 214 and bucket.padded % replicas == 0 and bucket.padded - bucket.total < replicas
    covered = np.zeros(bucket.padded, int)
    for r in range(replicas):
        pieces = bucket.pieces(r)
        assert sum(p.length for p in pieces) <= bucket.shard
        for p in pieces:  # Where each piece sits in the flat bucket.
            begin = sum(bucket.sizes[:bucket.indices.index(p.index)]) + p.start
            assert begin == r * bucket.shard + p.offset
            covered[begin:begin + p.length] += 1
    assert covered[:bucket.total].tolist() == [1] * bucket.total and not covered[bucket.total:].any()


def test_a_variable_spans_replicas_and_owned_parts_are_the_flat_slices():
    """Two replicas of 107 elements each: the 60-element variable is cut between them."""
    found = layout.plan(variables((100,), (10,), (60,), (3, 13), (5,)), 2)
    (bucket,) = found
    assert [(p.index, p.start, p.offset, p.length) for p in bucket.pieces(1)] == \
        [(1, 7, 0, 3), (2, 0, 3, 60), (3, 0, 63, 39), (4, 0, 102, 5)]
    values = [tf.reshape(tf.range(k, k + int(np.prod(s)), dtype=tf.float32), s)
              for k, s in zip((0, 1000, 2000, 3000, 4000), [(100,), (10,), (60,), (3, 13), (5,)])]
    flat = bucket.flatten(values)
    assert flat.shape == (214,)
    for r in range(2):
        np.testing.assert_array_equal(bucket.owned_part(r, values), flat[r * 107:(r + 1) * 107])
    for piece, value in zip(bucket.split(flat), values):
        np.testing.assert_array_equal(piece, tf.reshape(value, [-1]))
    np.testing.assert_array_equal(bucket.mask(1, lambda i: i == 2), [0] * 3 + [1] * 60 + [0] * 44)


def test_buckets_are_runs_of_one_dtype_within_the_limit():
    mixed = variables((10,), (10,), (30,)) + variables((4,), dtype="float16") + variables((8,))
    found = layout.plan(mixed, 3, limit=100)
    assert [b.indices for b in found] == [(0, 1), (2,), (3,), (4,)]  # 80 bytes; 120 alone; a dtype change.
    assert [b.dtype for b in found] == [tf.float32, tf.float32, tf.float16, tf.float32]
    assert [b.padded for b in found] == [21, 30, 6, 9]
