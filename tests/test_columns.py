"""Sparse and ragged inputs (tfdist.training.columns) through fit, evaluate and predict, against Keras on one
device: SGD/Adagrad, float32, 1e-5, on 2 replicas."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.training import columns

MIRRORED = {"all_reduce": "reduce_to_one"}


def sparse_batches(seed=0, count=4, rows=6):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        dense = (rng.random((rows, 5)) > 0.6) * rng.random((rows, 5))
        yield tf.sparse.from_dense(tf.constant(dense, tf.float32)), tf.constant(rng.random((rows, 3)), tf.float32)


def sparse_model():
    model = keras.Sequential([keras.Input((5,), sparse=True),
                              keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(0))])
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse", metrics=["mae"])
    return model


def assert_same(a, b):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, atol=1e-5)


def test_rows_of_a_sparse_tensor_are_gathered_as_dense_rows():
    dense = np.array([[0, 1, 0], [2, 0, 0], [0, 0, 0], [3, 0, 4]], np.float32)
    st = columns.leaf(tf.sparse.from_dense(dense))
    for rows in ([3, 0, 3], [2], [1, 2, 0, 3]):
        got = tf.sparse.to_dense(columns.gather(st, tf.constant(rows, tf.int64)))
        np.testing.assert_array_equal(got.numpy(), dense[rows])
    np.testing.assert_array_equal(tf.sparse.to_dense(columns.rows_range(st, 1, 4)).numpy(), dense[1:4])
    assert columns.rows(st) == 4 and columns.ndim(st) == 2


@pytest.mark.parametrize("uneven", [False, True])
def test_sparse_batches_train_evaluate_and_predict_as_keras_on_two_replicas(uneven):
    """A generator of SparseTensor batches (Keras' trainer_test form) and a whole SparseTensor x with a batch
    the replicas do not divide: Adagrad's accumulators and the weights equal Keras' own on one device, the
    kernel's gradient reaching the optimizer row-sparse (each replica's rows gathered and merged)."""
    reference = sparse_model()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = sparse_model()
    if not uneven:
        reference.fit(sparse_batches(), verbose=0, shuffle=False)
        updates, assign_sub = [], model.optimizer.assign_sub

        def recorded(variable, value):  # As Keras' test_fit_sparse: the update reaches the optimizer row-sparse.
            updates.append(type(value).__name__)
            return assign_sub(variable, value)

        model.optimizer.assign_sub = recorded
        try:
            tfdist.fit(model, sparse_batches(), verbose=0, shuffle=False)
        finally:
            del model.optimizer.assign_sub
        assert "IndexedSlices" in updates, updates
    else:
        parts = list(sparse_batches(count=3, rows=7))
        x, y = tf.sparse.concat(0, [p[0] for p in parts]), tf.concat([p[1] for p in parts], 0)
        reference.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
        tfdist.fit(model, x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
    assert_same(model, reference)
    np.testing.assert_allclose(tfdist.evaluate(model, sparse_batches(1), verbose=0),
                               reference.evaluate(sparse_batches(1), verbose=0), atol=1e-5)
    np.testing.assert_allclose(tfdist.predict(model, sparse_batches(2), verbose=0),
                               reference.predict(sparse_batches(2), verbose=0), atol=1e-5)


class RaggedSum(keras.layers.Layer):
    """Per example: its tokens' embeddings summed, and the embedded tokens themselves (a ragged output)."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(10, 2), initializer=keras.initializers.GlorotUniform(1))

    def call(self, tokens):
        embedded = tf.ragged.map_flat_values(tf.gather, self.table, tokens)
        return tf.reduce_sum(embedded, axis=1)


def ragged_model():
    inputs = keras.Input((None,), dtype="int64", ragged=True)
    model = keras.Model(inputs, RaggedSum()(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_ragged_inputs_train_and_predict_as_keras_on_two_replicas():
    tokens = tf.ragged.constant([[1, 2], [3], [4, 5, 6], [7], [8, 9], [1, 1, 1], [2]], dtype=tf.int64)
    y = np.arange(14, dtype=np.float32).reshape(7, 2) / 10

    reference = ragged_model()
    reference.fit(tokens, y, batch_size=3, epochs=2, verbose=0, shuffle=False)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = ragged_model()
    tfdist.fit(model, tokens, y, batch_size=3, epochs=2, verbose=0, shuffle=False)
    assert_same(model, reference)
    np.testing.assert_allclose(tfdist.predict(model, tokens, verbose=0), reference.predict(tokens, verbose=0),
                               atol=1e-5)


def test_a_ragged_dataset_evaluates_as_keras_and_sparse_inputs_refuse_micro_batches():
    tokens = tf.ragged.constant([[1, 2], [3], [4, 5, 6], [7], [8, 9]], dtype=tf.int64)
    y = np.arange(10, dtype=np.float32).reshape(5, 2) / 10
    dataset = tf.data.Dataset.from_tensor_slices((tokens, y)).batch(2)

    reference = ragged_model()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = ragged_model()
    np.testing.assert_allclose(tfdist.evaluate(model, dataset, verbose=0), reference.evaluate(dataset, verbose=0),
                               atol=1e-6)
    with pytest.raises(tfdist.UserError, match=r"The inputs hold a SparseTensor or RaggedTensor, which tfdist does "
                                               r"not cut into grad_accum_steps=2 micro-batches"):
        tfdist.fit(model, tokens, y, batch_size=4, grad_accum_steps=2, verbose=0)


def test_sparse_inputs_under_a_collective_all_reduce_keep_one_shape_an_execution():
    """MirroredStrategy's default (collective) all-reduce takes one shape an execution: row-sparse gradients
    one step an execution (the default there), summed dense in executions of several steps; both as Keras.
    In a process of its own: collectives of two strategies in one process share instance keys (see
    test_fitting.MIRRORED), so this would break the next collective test run in the same process."""
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env

    result = subprocess.run([sys.executable, "-c", COLLECTIVE_PROGRAM], capture_output=True, text=True,
                            timeout=300, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0 and "ok 2" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]


COLLECTIVE_PROGRAM = """
import tfdist
from tests.test_columns import assert_same, sparse_batches, sparse_model
strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
for number, steps_per_execution in enumerate((None, 3), 1):
    reference = sparse_model()
    reference.fit(sparse_batches(count=6), verbose=0, shuffle=False)
    with strategy.scope():
        model = sparse_model()
    tfdist.fit(model, sparse_batches(count=6), verbose=0, shuffle=False, steps_per_execution=steps_per_execution)
    assert_same(model, reference)
    print("ok", number)
"""
