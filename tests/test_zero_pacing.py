"""tfdist.training.zero.pacing: a bucket's gradient is made after the reduce-scatter of the bucket SLACK places
later (control edges in the step's graph), never where the edge would close a cycle; the values are unchanged."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist.training.zero import layout, pacing


class _Var:
    def __init__(self, shape):
        self.shape, self.dtype = tf.TensorShape(shape), tf.float32


def _buckets(count):
    return layout.plan([_Var([4, 4]) for _ in range(count)], replicas=1, limit=64)  # 64 bytes: one each.


def _step(slack, tie=False, cast=False):
    """A stand-in backward pass: four weight gradients made from one chain of activation gradients, each
    bucket 'reduced' by a sum; with `tie`, bucket 1's reduction also reads bucket 0's gradient."""
    record = {}

    @tf.function
    def step(x):
        grads, upstream = [], x
        for k in range(4):
            upstream = tf.tanh(upstream)  # The activation gradient chain (never held back).
            g = tf.matmul(upstream, upstream, transpose_a=True)
            grads.append(tf.cast(tf.cast(g, tf.float16), tf.float32) if cast else g)
        reduced = [tf.reduce_sum(g) for g in grads]
        if tie:
            reduced[1] = reduced[1] + tf.reduce_sum(grads[0])
        pacing.pace(grads, reduced, _buckets(4), slack=slack)
        record.update(grads=grads, reduced=reduced)
        return tf.stack(reduced)
    return step(tf.reshape(tf.range(16, dtype=tf.float32) / 16.0, [4, 4])), record


def test_each_buckets_gradient_waits_for_the_reduce_scatter_slack_buckets_later():
    plain, _ = _step(slack=0)
    for slack in (1, 2):
        paced, record = _step(slack=slack)
        grads, reduced = record["grads"], record["reduced"]
        for k in range(4):
            expected = [reduced[k + slack].op] if k + slack < 4 else []
            assert list(grads[k].op.control_inputs) == expected, (slack, k)
        np.testing.assert_array_equal(paced.numpy(), plain.numpy())  # Runs (no cycle), same values.


def test_the_ops_a_cast_gradient_is_made_from_wait_too():
    _, record = _step(slack=1, cast=True)
    cast = record["grads"][0].op
    assert cast.type == "Cast" and record["reduced"][1].op in cast.control_inputs
    inner = cast.inputs[0].op  # The float16 cast, then the matmul that makes the buffer.
    assert record["reduced"][1].op in inner.control_inputs
    assert record["reduced"][1].op in inner.inputs[0].op.control_inputs


def test_no_edge_where_the_later_reduction_already_reads_the_gradient():
    values, record = _step(slack=1, tie=True)
    assert list(record["grads"][0].op.control_inputs) == []  # The edge would close a cycle: left out.
    assert record["reduced"][2].op in record["grads"][1].op.control_inputs
    assert np.isfinite(values.numpy()).all()


def test_nothing_is_held_back_when_executing_eagerly():
    g = [tf.ones([2, 2]), tf.ones([2, 2])]
    pacing.pace(g, [tf.reduce_sum(t) for t in g], _buckets(2), slack=1)  # Eager tensors: no graph to edit.


@pytest.mark.parametrize("stage,accum", [(1, 1), (2, 2), (1, 2)])
def test_a_sharded_step_of_many_buckets_is_paced_and_trains_as_keras(monkeypatch, stage, accum):
    """Each of the test model's six variables a bucket of its own (the default 32 MB holds them all in one):
    every bucket but the last waits for the next one's reduce-scatter, per replica and micro-batch (stage 1's
    accumulated sums are not held), and 2 replicas end with Keras' weights."""
    from tests.test_zero import OPTIMIZERS, close, sharded_fit
    from tests.zero_model import keras_weights

    monkeypatch.setattr(layout, "BUCKET_BYTES", 64)
    real, edges = pacing.pace, []

    def spy(grads, reduced, buckets, slack=None):
        real(grads, reduced, buckets, slack)
        edges.append(sum(reduced[k + 1].op in grads[i].op.control_inputs
                         for k in range(len(buckets) - 1) for i in buckets[k].indices))
        assert len(buckets) == 6
    monkeypatch.setattr(pacing, "pace", spy)
    net, result = sharded_fit(2, OPTIMIZERS["adam"], stage, grad_accum_steps=accum)
    assert result.steps == 20
    close(net.get_weights(), keras_weights(OPTIMIZERS["adam"]), 1e-5)
    if accum > 1 and stage == 1:
        assert edges == []
    else:
        assert edges and set(edges) == {5} and len(edges) % (2 * accum) == 0  # Each replica, each micro-batch.
