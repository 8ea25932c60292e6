"""Validation in tfdist.fit (tfdist.training.steps, inputs.eval_arrays_fn) equals Keras' own `model.evaluate`.

Masked sequence models (``Embedding(mask_zero=True)``), per-timestep ``[n, T]``
and per-example sample weights, several outputs; on one device and on 2
mirrored replicas, with the last batch smaller or padded to a static shape
(the TPU path, forced here). Keras divides a masked loss by the unmasked
entries of each batch, so the reference evaluates with tfdist's per-replica
eval batch (64 here, as `fit(batch_size=64)` validates).
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.training import inputs

T, VOCAB, CLASSES = 6, 12, 3
MIRRORED = {"all_reduce": "reduce_to_one"}  # See tests/test_fitting.py.
STRATEGIES = {"default": ("default", {}), "mirrored2": ("mirrored", {"num_cpu_replicas": 2, **MIRRORED})}


def sequences(n, seed):
    """Token ids padded with 0 after a random length (1..T), per-timestep tags and per-example labels."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, T + 1, n)
    x = np.where(np.arange(T)[None, :] < lengths[:, None], rng.randint(1, VOCAB, (n, T)), 0).astype("int32")
    tags = rng.randint(0, CLASSES, (n, T)).astype("int32")
    labels = rng.randint(0, 2, n).astype("int32")
    return x, tags, labels, rng.uniform(0.1, 2.0, (n, T)).astype("float32"), rng.uniform(0.1, 2.0, n).astype("float32")


def sequence_model(kind):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((T,), dtype="int32"), keras.layers.Embedding(VOCAB, 8, mask_zero=True)]
    if kind == "lstm":
        layers += [keras.layers.LSTM(8, return_sequences=True), keras.layers.Dense(CLASSES)]
    elif kind == "gru":
        layers += [keras.layers.GRU(8, return_sequences=True), keras.layers.Dense(CLASSES)]
    else:
        layers += [keras.layers.TimeDistributed(keras.layers.Dense(CLASSES))]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")])
    return model


def two_output_model():
    """A masked per-timestep output and a per-example output (the mask consumed by the pooling)."""
    keras.utils.set_random_seed(2)
    tokens = keras.Input((T,), dtype="int32", name="tokens")
    hidden = keras.layers.LSTM(8, return_sequences=True)(keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens))
    tags = keras.layers.Dense(CLASSES, name="tags")(hidden)
    label = keras.layers.Dense(2, name="label")(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(tokens, {"tags": tags, "label": label})
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss={"tags": loss, "label": loss},
                  loss_weights={"tags": 1.0, "label": 0.5},
                  metrics={"tags": ["accuracy"], "label": ["accuracy"]},
                  weighted_metrics={"tags": [keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")],
                                    "label": [keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")]})
    return model


@pytest.fixture(params=[False, True], ids=["dynamic", "static-shapes"])
def static_shapes(request, monkeypatch):
    """Forces the padded, static-shape eval batches (TPUs) where asked."""
    original = inputs.eval_arrays_fn
    monkeypatch.setattr(inputs, "eval_arrays_fn", functools.partial(original, static_shapes=request.param))
    return request.param


def assert_validation_equals_keras(build, train, validation, strategy_name, validation_weights=None):
    """tfdist.fit (one step) then its val_* logs against Keras' evaluate of the same weights, on one device."""
    name, options = STRATEGIES[strategy_name]
    strategy = tfdist.make_strategy(name, precision="float32", **options)
    with strategy.scope():
        model = build()
    x, y, *weights = train
    history = tfdist.fit(model, x, y, sample_weight=weights[0] if weights else None, batch_size=64, max_steps=1,
                         verbose=0, validation_data=validation).history
    reference = build()
    reference.set_weights(model.get_weights())
    vx, vy = validation[:2]
    expected = reference.evaluate(vx, vy, sample_weight=validation_weights, batch_size=64, verbose=0,
                                  return_dict=True)
    got = {key[4:]: values[-1] for key, values in history.items() if key.startswith("val_")}
    assert set(got) == set(expected), (got, expected)
    for key, value in expected.items():
        tolerance = 1e-5 if key.endswith("loss") else 1e-6
        assert got[key] == pytest.approx(value, abs=tolerance), (key, got, expected)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_masked_lstm_with_per_timestep_weights_validates_as_keras(strategy_name, static_shapes):
    x, tags, _, timestep_weights, _ = sequences(256, 0)
    vx, vtags, _, vweights, _ = sequences(150, 1)  # 150 = 64 + 64 + 22: the last batch is partial.
    assert_validation_equals_keras(lambda: sequence_model("lstm"), (x, tags, timestep_weights),
                                   (vx, vtags, vweights), strategy_name, validation_weights=vweights)


@pytest.mark.parametrize("kind, strategy_name", [("gru", "default"), ("time_distributed", "mirrored2")])
def test_masked_per_timestep_models_validate_as_keras(kind, strategy_name, static_shapes):
    x, tags, *_ = sequences(256, 0)
    vx, vtags, *_ = sequences(150, 1)
    assert_validation_equals_keras(lambda: sequence_model(kind), (x, tags), (vx, vtags), strategy_name)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_two_outputs_with_per_example_and_per_timestep_weights_validate_as_keras(strategy_name, static_shapes):
    x, tags, labels, timestep_weights, example_weights = sequences(256, 0)
    vx, vtags, vlabels, vtimestep, vexample = sequences(150, 1)
    weights = {"tags": vtimestep, "label": vexample}
    assert_validation_equals_keras(
        two_output_model, ({"tokens": x}, {"tags": tags, "label": labels},
                           {"tags": timestep_weights, "label": example_weights}),
        ({"tokens": vx}, {"tags": vtags, "label": vlabels}, weights), strategy_name, validation_weights=weights)


def test_eval_batches_keep_the_shape_of_each_sample_weight_and_zero_the_padding():
    x, tags, labels, timestep_weights, example_weights = sequences(70, 3)
    arrays = inputs.Arrays(x, {"tags": tags, "label": labels}, {"tags": timestep_weights, "label": example_weights})
    batches = list(inputs.eval_arrays_fn(arrays, per_replica_batch=64, steps=2, static_shapes=True)(
        tf.distribute.InputContext()))
    _, _, weight, mask = batches[1]  # Positions 64..127: 6 real examples, 58 padding rows.
    assert weight["tags"].shape == (64, T) and weight["label"].shape == (64,)
    np.testing.assert_array_equal(mask.numpy(), np.arange(64) < 6)
    np.testing.assert_array_equal(weight["tags"].numpy()[:6], timestep_weights[64:])
    np.testing.assert_array_equal(weight["label"].numpy()[:6], example_weights[64:])
    assert not weight["tags"].numpy()[6:].any() and not weight["label"].numpy()[6:].any()
    unweighted = list(inputs.eval_arrays_fn(inputs.Arrays(x, tags), per_replica_batch=64, steps=2)(
        tf.distribute.InputContext()))
    assert [len(b) for b in unweighted] == [3, 3]  # (x, y, mask): no weight, so Keras sees sample_weight=None.


def test_a_masked_model_with_per_timestep_weights_trains_as_keras_fit():
    x, tags, _, timestep_weights, _ = sequences(128, 4)
    dataset = tf.data.Dataset.from_tensor_slices((x, tags, timestep_weights)).batch(32, drop_remainder=True)
    reference = sequence_model("lstm")
    start = reference.get_weights()
    reference.fit(dataset, epochs=1, verbose=0)
    strategy = tfdist.make_strategy("default", precision="float32")
    with strategy.scope():
        model = sequence_model("lstm")
    tfdist.fit(model, dataset, epochs=1, verbose=0)
    assert model.optimizer.iterations.numpy() == 4
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(start, reference.get_weights())) > 1e-2


def per_sequence_loss(y_true, y_pred):
    """A loss of one value per example over a [n, T, C] output (a mean over steps and classes)."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=(1, 2))


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_a_loss_of_one_value_per_example_on_a_sequence_output_validates_as_keras(strategy_name):
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(128, 5, 3)).astype("float32"), rng.normal(size=(128, 5, 3)).astype("float32")
    vx, vy = rng.normal(size=(150, 5, 3)).astype("float32"), rng.normal(size=(150, 5, 3)).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(
            3, kernel_initializer=keras.initializers.GlorotUniform(0))])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=per_sequence_loss, metrics=["mae"])
        return model

    assert_validation_equals_keras(build, (x, y), (vx, vy), strategy_name)
