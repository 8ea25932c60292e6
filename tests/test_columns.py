"""Sparse, ragged and text inputs (tfdist.training.columns) through fit, evaluate and predict, against Keras on one
device: SGD/Adagrad, float32, 1e-5, on 2 replicas; a batch whose parts differ in rows refused before any step."""

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


# Text inputs ------------------------------------------------------------------------------------------------------
WORDS = ["a", "b", "c", "d"]


def string_model():
    """A StringLookup on a string input (as a FeatureSpace or keras.io's structured-data models feed it)."""
    text = keras.Input((), dtype="string", name="text")
    encoded = keras.layers.StringLookup(vocabulary=WORDS, output_mode="one_hot")(text)
    out = keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(0))(encoded)
    model = keras.Model(text, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def string_data(rows=14):
    rng = np.random.default_rng(3)
    words = rng.choice(WORDS + ["unknown"], rows)
    return np.array(list(words), dtype=object), rng.random((rows, 2)).astype(np.float32)


def test_string_arrays_and_datasets_train_evaluate_and_predict_as_keras_on_two_replicas():
    """An object array of Python strings (what Keras' array adapter takes as tf.string) and a dataset of string
    batches (the FeatureSpace test's form, read into memory for evaluate and predict): the weights, the loss and
    the predictions equal Keras' own on one device. The arrays were refused ("Invalid dtype: object") where
    tfdist named their dtype for Keras, and predict of the dataset failed alike."""
    x, y = string_data()
    reference = string_model()
    reference.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = string_model()
    tfdist.fit(model, x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, validation_data=(x[:6], y[:6]))
    assert_same(model, reference)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    np.testing.assert_allclose(tfdist.evaluate(model, x, y, batch_size=4, verbose=0),
                               reference.evaluate(x, y, batch_size=4, verbose=0), atol=1e-5)
    np.testing.assert_allclose(tfdist.evaluate(model, dataset, verbose=0), reference.evaluate(dataset, verbose=0),
                               atol=1e-5)
    expected = reference.predict(x, verbose=0)
    np.testing.assert_allclose(tfdist.predict(model, x, verbose=0), expected, atol=1e-5)
    np.testing.assert_allclose(tfdist.predict(model, dataset.map(lambda a, b: a), verbose=0), expected, atol=1e-5)
    np.testing.assert_allclose(tfdist.predict_on_batch(model, x), expected, atol=1e-5)


@pytest.mark.parametrize("form", ["bytes objects", "str", "bytes", "a generator"])
def test_text_in_every_numpy_form_is_taken_as_tf_string(form):
    """Object arrays of bytes, NumPy str ('U') and bytes ('S') arrays, and a generator of string batches train,
    evaluate and predict as the object array of str does under Keras' own fit (whose fit, evaluate and predict name
    no dtype for the other forms, while its train_on_batch and predict_on_batch take them as tf.string)."""
    x, y = string_data()
    reference = string_model()
    reference.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    given = {"bytes objects": np.array([w.encode() for w in x], dtype=object), "str": x.astype(str),
             "bytes": x.astype(bytes), "a generator": x}[form]
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = string_model()
    if form == "a generator":
        tfdist.fit(model, ((x[i:i + 7], y[i:i + 7]) for i in (0, 7)), verbose=0, shuffle=False)
    else:
        tfdist.fit(model, given, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    assert_same(model, reference)
    np.testing.assert_allclose(tfdist.evaluate(model, given, y, verbose=0), reference.evaluate(x, y, verbose=0),
                               atol=1e-5)
    np.testing.assert_allclose(tfdist.predict(model, given, verbose=0), reference.predict(x, verbose=0), atol=1e-5)
    assert columns.tf_dtype(columns.leaf(given)) == tf.string


# Unequal rows -----------------------------------------------------------------------------------------------------
class Pairs(keras.Model):
    """Its layer changes the batch dimension: each row of 4 becomes two rows of 2 (as an unbatched audio clip
    becomes a spectrogram's frames), so its targets have twice x's rows."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, kernel_initializer="ones")

    def call(self, x):
        return self.dense(keras.ops.reshape(x, (-1, 2)))


class SumOfOutputs(keras.losses.Loss):
    """run_layer_test's loss: the outputs' sum, whatever y holds."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.sum(y_pred)


class StepCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(batch)


@pytest.mark.parametrize("form", ["generator", "dataset", "validation", "evaluate"])
def test_a_batch_whose_inputs_and_targets_differ_in_rows_is_refused_before_any_step(form):
    """Keras' run_layer_test (MelSpectrogram: x 16000 rows, y 80) fits such a batch whole on one device; tfdist
    splits batches by rows, so it refuses it in one paragraph naming the parts and their rows, and nothing ran.
    It gathered past y's end inside its input pipeline ("indices[80] = 80 is not in [0, 80)"), or, the other way
    round, trained on rows of y that belong to no example."""
    x, y = np.ones((6, 4), np.float32), np.zeros((12, 1), np.float32)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = Pairs()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SumOfOutputs())
    counter = StepCounter()

    def batches():
        while True:
            yield x, y

    with pytest.raises(tfdist.UserError) as refused:
        if form == "generator":
            tfdist.fit(model, batches(), steps_per_epoch=1, verbose=0, callbacks=[counter])
        elif form == "dataset":
            tfdist.fit(model, tf.data.Dataset.from_tensors((x, y)), verbose=0, callbacks=[counter])
        elif form == "validation":  # Training rows of 2 features: one output row each.
            tfdist.fit(model, x[:, :2], y[:6], batch_size=2, verbose=0, callbacks=[counter],
                       validation_data=(b for b in [(x, y)]))
        else:
            # As many rows of x as of y in all (18), not in each batch.
            tfdist.evaluate(model, (b for b in [(x, y), (np.ones((12, 4), np.float32), y[:6])]), verbose=0)
    text = str(refused.value)
    assert "x has 6 rows and y 12: every input, target and sample weight of a batch needs the same number of " \
           "rows" in text and "splits each batch by rows among the replicas" in text, text
    assert "\n" not in text
    assert counter.calls == [] and not model.built and int(model.optimizer.iterations) == 0
    if form == "generator":  # Keras' own fit takes the batch whole.
        reference = Pairs()
        reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=SumOfOutputs())
        reference.fit(batches(), steps_per_epoch=1, verbose=0)
        assert int(reference.optimizer.iterations) == 1


def test_the_rows_of_a_batch_are_named_part_by_part():
    st = tf.sparse.from_dense(np.ones((3, 2), np.float32))
    assert columns.same_rows((np.ones((3, 2)), st, None)) is not None
    assert columns.same_rows(tf.TensorSpec((None, 5))) is not None  # Unknown rows: nothing to compare.
    with pytest.raises(tfdist.UserError, match=r"In a batch, x\[0\] has 3 rows, x\[1\] 2 and sample_weight 3:"):
        columns.same_rows(([np.ones(3), np.ones((2, 1))], None, np.ones(3)))
    with pytest.raises(tfdist.UserError, match="x has 4 rows and y 3"):
        columns.same_rows((tf.TensorSpec((4, 1)), tf.TensorSpec((3,))))
