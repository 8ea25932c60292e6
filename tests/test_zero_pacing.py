"""tfdist.training.zero.pacing: a bucket's gradient is made after the reduce-scatter of the bucket SLACK places
later (control edges in the step's graph), never where the edge would close a cycle; the values are unchanged."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.training.zero import layout, pacing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Var:
    def __init__(self, shape):
        self.shape, self.dtype = tf.TensorShape(shape), tf.float32


def _buckets(count):
    return layout.plan([_Var([4, 4]) for _ in range(count)], replicas=1, limit=64)  # 64 bytes: one each.


def _step(slack, tie=False, cast=False, leak=False, stateful=False):
    """A stand-in backward pass: four weight gradients made from one chain of activation gradients, each
    bucket 'reduced' by a sum under its own name scope; with `tie`, bucket 1's reduction also reads bucket 0's
    gradient; with `leak`, bucket 1's gradient also feeds the activation chain (as BatchNormalization's beta's
    does)."""
    record = {}

    @tf.function
    def step(x):
        grads, upstream = [], x
        for k in reversed(range(4)):  # The last layer's gradient first, as a backward pass makes them.
            upstream = tf.tanh(upstream)
            g = tf.matmul(upstream, upstream, transpose_a=True)
            grads.insert(0, tf.cast(tf.cast(g, tf.float16), tf.float32) if cast else g)
            if leak and k == 1:
                upstream = upstream - g  # The earlier layers' backward pass reads this gradient.
            if stateful and k == 1:  # Made by a stateful op (TensorFlow runs those in the order made).
                grads[0] = tf.identity(tf.random.uniform([4, 4]))
        reduced, scopes = [None] * 4, [None] * 4
        for k in reversed(range(4)):
            with tf.name_scope(f"rs_{k}") as scopes[k]:
                reduced[k] = tf.reduce_sum(grads[k])
        if tie:
            reduced[1] = reduced[1] + tf.reduce_sum(grads[0])
        pacing.pace(grads, reduced, _buckets(4), scopes, slack=slack)
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


def test_a_gradient_the_backward_pass_reads_on_is_not_held():
    """BatchNormalization's beta: its gradient is also the activation gradient the earlier layers' backward
    pass (and a synchronized statistic's collective) reads; holding it would hold the backward pass, and with
    the step's collectives ordered as made, close a cycle."""
    plain, _ = _step(slack=0, leak=True)
    values, record = _step(slack=1, leak=True)
    assert list(record["grads"][1].op.control_inputs) == []
    assert record["reduced"][1].op in record["grads"][0].op.control_inputs
    assert record["reduced"][3].op in record["grads"][2].op.control_inputs
    np.testing.assert_array_equal(values.numpy(), plain.numpy())


def test_a_gradient_a_stateful_op_makes_is_not_held():
    _, record = _step(slack=1, stateful=True)
    assert list(record["grads"][1].op.control_inputs) == []
    assert record["grads"][1].op.inputs[0].op.type == "RandomUniform"
    assert record["reduced"][3].op in record["grads"][2].op.control_inputs


def test_nothing_is_held_back_when_executing_eagerly():
    g = [tf.ones([2, 2]), tf.ones([2, 2])]
    pacing.pace(g, [tf.reduce_sum(t) for t in g], _buckets(2), ["", ""], slack=1)  # Eager: no graph to edit.


@pytest.mark.parametrize("stage,accum", [(1, 1), (2, 2), (1, 2)])
def test_a_sharded_step_of_many_buckets_is_paced_and_trains_as_keras(monkeypatch, stage, accum):
    """Each of the test model's six variables a bucket of its own (the default 32 MB holds them all in one):
    every bucket but the last waits for the next one's reduce-scatter, per replica and micro-batch (stage 1's
    accumulated sums are not held), and 2 replicas end with Keras' weights."""
    from tests.test_zero import OPTIMIZERS, close, sharded_fit
    from tests.zero_model import keras_weights

    monkeypatch.setattr(layout, "BUCKET_BYTES", 64)
    real, edges = pacing.pace, []

    def spy(grads, reduced, buckets, scopes, slack=None):
        real(grads, reduced, buckets, scopes, slack)
        edges.append(sum(reduced[k + 1].op in grads[i].op.control_inputs
                         for k in range(len(buckets) - 1) for i in buckets[k].indices))
        assert len(buckets) == 6
    monkeypatch.setattr(pacing, "pace", spy)
    net, result = sharded_fit(2, OPTIMIZERS["sgd_momentum"], stage, grad_accum_steps=accum)
    assert result.steps == 20
    close(net.get_weights(), keras_weights(OPTIMIZERS["sgd_momentum"]), 1e-5)  # SGD: a gradient scale shows.
    if accum > 1 and stage == 1:
        assert edges == []
    else:
        assert edges and set(edges) == {5} and len(edges) % (2 * accum) == 0  # Each replica, each micro-batch.


def synchronized_batchnorm_run(out: str, stage: int, accum: int) -> None:
    """One fit of a Dense, synchronized BatchNormalization, Dense model on 2 collective replicas, a bucket a
    variable; its weights to `out` (.npz)."""
    import keras

    from tests.zero_model import BATCH, data
    from tfdist.training.fitting import train

    layout.BUCKET_BYTES = 64
    x, y = data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    keras.utils.set_random_seed(1)
    with strategy.scope():
        net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(3)])
        net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    result = train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=strategy, zero_stage=stage,
                   grad_accum_steps=accum, export=())
    assert result.steps == 20
    np.savez(out, *net.get_weights())


@pytest.mark.parametrize("accum", [1, 2])
def test_synchronized_batchnorm_on_collective_replicas_is_paced_without_a_cycle(tmp_path, accum):
    """Its beta's gradient is the activation gradient its statistics' all-reduce reads, and the step's
    collectives run in the order they are made: holding that gradient for a later reduce-scatter closed a
    cycle ("457 nodes in a cycle") before only gradients that feed their own reduction alone were held. Stages
    1 and 2 equal unsharded (1e-6). Each fit in a fresh process (a new collective strategy in the same process
    counts TensorFlow's instance keys from 100 again: tests/test_zero.py)."""
    from tests.conftest import subprocess_env
    from tests.test_zero import close

    weights = {}
    for stage in (0, 1, 2) if accum == 1 else (0, 2):
        out = str(tmp_path / f"stage{stage}.npz")
        code = ("import tests.conftest; from tests.test_zero_pacing import synchronized_batchnorm_run; "
                f"synchronized_batchnorm_run({out!r}, {stage}, {accum})")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                cwd=REPO, env=subprocess_env())
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        with np.load(out) as saved:
            weights[stage] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    for stage, values in weights.items():
        close(values, weights[0], 1e-6)
