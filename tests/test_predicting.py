"""tfdist.training.predicting: `tfdist.predict` per call as Keras' `Model.predict` on 2 CPU replicas.

Traced once per model and input signature (Keras keeps `model.predict_function`, traced again only after
`compile`), whatever the batch size or number of examples; peak memory within 1.5x Keras' own predict for a
large output and for a conv net's activations (a short batch unpadded, one Keras batch split over CPU replicas,
one step a compiled call, the compiled functions gone with the model); boolean outputs; a `Sequential` without
an `Input`. Results against Keras' own `predict` on one device with the same weights (the wider predict
contract: tests/test_evaluating.py).
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import keras
import numpy as np

import tfdist
from tests.conftest import REPO, subprocess_env


def mirrored2():
    return tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", all_reduce="reduce_to_one")


def data(num=37, features=5):
    return np.random.default_rng(0).normal(size=(num, features)).astype("float32")


class Count(keras.layers.Layer):
    """Counts the Python calls of its `call`: each trace of a function that runs the model (one a replica)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, x):
        self.calls += 1
        return x


def test_predict_traces_once_per_model_and_input_signature():
    """As Keras' predict (one trace, whatever the batch size or number of examples; again after compile): a
    character LSTM's sampling callback predicts one example a call."""
    def build():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((5,))
        return keras.Model(inputs, Count()(keras.layers.Dense(3)(inputs)))

    strategy = mirrored2()
    with strategy.scope():
        model = build()
    twin = build()
    twin.set_weights(model.get_weights())
    counter, x = model.layers[-1], data()

    def predict_as_keras(batch, rows):
        np.testing.assert_allclose(tfdist.predict(model, x[:rows], batch_size=batch, verbose=0),
                                   twin.predict(x[:rows], batch_size=batch, verbose=0), atol=1e-5)

    predict_as_keras(8, 37)
    traced = counter.calls
    for _ in range(4):
        predict_as_keras(8, 37)
    assert counter.calls == traced  # Each call retraced (2 more calls of the layer a predict, one a replica).
    for batch, rows in ((16, 37), (3, 37), (8, 1), (8, 20), (32, 5)):
        predict_as_keras(batch, rows)
    assert counter.calls == traced
    with strategy.scope():
        model.compile(loss="mse")  # Keras' compile drops model.predict_function.
    predict_as_keras(8, 37)
    assert counter.calls > traced


def _peak_mb(which):
    program = os.path.join(REPO, "tests", "programs", "predict_memory.py")
    result = subprocess.run([sys.executable, program, which], capture_output=True, text=True, timeout=300,
                            cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return float(result.stdout.split("PEAK_MB")[-1])


def test_predict_peak_memory_is_within_one_and_a_half_times_keras_for_a_large_output():
    """A spectrogram-sized output (2 MiB an example, 192 MiB in all): each process' resident memory above what
    it held before the one call (the output buffer of every example for each replica took 14x Keras')."""
    with ThreadPoolExecutor(2) as pool:
        keras_mb, tfdist_mb = pool.map(_peak_mb, ["keras", "tfdist"])
    assert keras_mb > 192  # Keras holds the whole output at least.
    assert tfdist_mb <= 1.5 * keras_mb, (tfdist_mb, keras_mb)


def test_boolean_outputs_are_predicted_as_keras():
    def build():
        keras.utils.set_random_seed(4)
        inputs = keras.Input((5,))
        values = keras.layers.Dense(3)(inputs)
        return keras.Model(inputs, {"values": values, "positive": keras.ops.greater(values, 0.0)})

    with mirrored2().scope():
        model = build()
    twin = build()
    twin.set_weights(model.get_weights())
    x = data()
    got, expected = tfdist.predict(model, x, batch_size=8, verbose=0), twin.predict(x, batch_size=8, verbose=0)
    assert got["positive"].dtype == expected["positive"].dtype == bool
    np.testing.assert_array_equal(got["positive"], expected["positive"])
    np.testing.assert_allclose(got["values"], expected["values"], atol=1e-5)


def test_a_sequential_without_an_input_is_built_and_predicted_as_keras():
    """Keras builds it at its first call; its output spec before that passes `training` to layers whose call
    does not take it (Reshape, Flatten)."""
    def build():
        keras.utils.set_random_seed(6)
        return keras.Sequential([keras.layers.Reshape((5, 1)), keras.layers.Flatten(), keras.layers.Dense(2)])

    with mirrored2().scope():
        model = build()
    x = data()
    got = tfdist.predict(model, x, batch_size=8, verbose=0)
    twin = build()
    twin.build((None, 5))
    twin.set_weights(model.get_weights())
    np.testing.assert_allclose(got, twin.predict(x, batch_size=8, verbose=0), atol=1e-5)


def conv_net():
    """Activations (1 MiB an example) far above its weights: a predict's tensor peak is its batches' rows."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((64, 64, 3))
    hidden = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    hidden = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(hidden)))


def tensor_peak_mb(call):
    """`call()` and the most tensor memory TensorFlow's CPU allocator (every replica's) held above the start."""
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    result = call()
    return result, (tf.config.experimental.get_memory_info("CPU:0")["peak"] - start) / 2**20


def test_a_first_predict_holds_the_activations_of_one_keras_batch_as_keras():
    """Keras' EfficientNetB0 saving test predicts one example: every replica ran a whole padded batch (64 rows
    for 1, 64 MB of tensors here against Keras' 1 MB; the process grew 800 MB), and with whole batches each
    replica held a Keras batch's activations (1.7x Keras' peak)."""
    with mirrored2().scope():
        model = conv_net()
    twin = conv_net()
    twin.set_weights(model.get_weights())
    for num in (1, 64):
        x = np.random.default_rng(num).normal(size=(num, 64, 64, 3)).astype("float32")
        expected, keras_mb = tensor_peak_mb(lambda: twin.predict(x, batch_size=32, verbose=0))
        got, tfdist_mb = tensor_peak_mb(lambda: tfdist.predict(model, x, batch_size=32, verbose=0))
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert tfdist_mb <= 1.5 * keras_mb + 4, (num, tfdist_mb, keras_mb)  # + 4: a padding row, small buffers.


def test_a_default_predict_runs_one_step_a_call_and_steps_per_execution_in_one():
    """As Keras' predict (compile's steps_per_execution=1): a loop of steps in one compiled call holds the model's
    graph again in its body (40 MB for an EfficientNetB0 on 2 replicas). Asked for, steps run in one call."""
    from tfdist.training import predicting

    with mirrored2().scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    twin = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    twin.set_weights(model.get_weights())
    x = data()
    tfdist.predict(model, x, batch_size=4, verbose=0)  # 10 steps.
    predictor = next(iter(predicting._PREDICTORS[model].predictors.values()))
    assert predictor.function.experimental_get_tracing_count() == 0
    assert predictor.step_function.experimental_get_tracing_count() == 1
    got = tfdist.predict(model, x, batch_size=4, verbose=0, steps_per_execution=3)
    assert predictor.function.experimental_get_tracing_count() == 1
    np.testing.assert_allclose(got, twin.predict(x, batch_size=4, verbose=0), atol=1e-5)


def test_a_dropped_models_compiled_predict_goes_with_it():
    """Keras' predict_function goes with its model; tfdist's predictor (2 replicas' graphs: about 100 MB for an
    EfficientNetB0) was in a reference cycle of its own and outlived the model until a second full collection."""
    import gc
    import weakref

    from tfdist.training import predicting

    with mirrored2().scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    tfdist.predict(model, data(), batch_size=8, verbose=0)
    predictor = weakref.ref(next(iter(predicting._PREDICTORS[model].predictors.values())))
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None
    assert predictor() is None
