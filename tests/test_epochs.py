"""tfdist.training.epochs: Keras' epochs when steps_per_epoch is below one pass over the data."""

import itertools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.epoch_iterator import EpochIterator

import tfdist
from tests.test_fitting import MIRRORED, _Hooks, assert_same_calls
from tfdist.training.epochs import epoch_of, epoch_start, keras_epoch_steps


def keras_batches_per_epoch(examples, batch_size, steps_per_epoch, execution, epochs):
    """The batches Keras' own EpochIterator hands each epoch."""
    iterator = EpochIterator(x=np.zeros((examples, 1), "float32"), batch_size=batch_size,
                             steps_per_epoch=steps_per_epoch, steps_per_execution=execution, shuffle=False)
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Your input ran out of data".
        for _ in range(epochs):
            count = 0
            with iterator.catch_stop_iteration():
                for _, _, data in iterator:
                    count += len(data)
            counts.append(count)
    return tuple(counts)


def test_epoch_steps_are_keras_epoch_iterators():
    for examples, batch, spe, execution, epochs in itertools.product(
            [10, 23, 40], [4, 8], [1, 2, 3, 5, 7, 11], [1, 2, 3], [1, 4]):
        assert keras_epoch_steps(spe, -(-examples // batch), epochs, execution) == \
            keras_batches_per_epoch(examples, batch, spe, execution, epochs), (examples, batch, spe, execution)
    lengths = keras_epoch_steps(9, 10, 4)
    assert lengths == (9, 1, 9, 1)
    assert [epoch_start(lengths, e) for e in range(5)] == [0, 9, 10, 19, 20]
    assert [epoch_of(lengths, s) for s in (0, 8, 9, 10, 18, 19)] == [0, 0, 1, 2, 2, 3]


def model_fn():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh", kernel_initializer=
                                                                    keras.initializers.GlorotUniform(1)),
                              keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(2))])
    return model


def compiled(model, execution):
    model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=execution,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("form", ["arrays", "dataset"])
@pytest.mark.parametrize("spe,execution", [(3, 1), (4, 3)], ids=["spe3", "spe4-exec3"])
def test_epochs_below_a_pass_continue_the_data_as_keras(form, spe, execution):
    """steps_per_epoch below the batches of a pass (21 examples in batches of 4: 6 batches, the last short):
    each epoch goes on where the last stopped and the one where the data runs out ends early; with
    compile(steps_per_execution=3) and steps_per_epoch=4 an epoch trains two whole executions. Hooks, logs and
    weights as Keras' own fit on one device, on 2 replicas (input order: shuffle=False)."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(21, 6)).astype("float32"), rng.integers(0, 3, size=21)

    def data():
        if form == "arrays":
            return {"x": x, "y": y, "batch_size": 4, "shuffle": False}
        return {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(4)}

    reference = compiled(model_fn(), execution)
    expected = _Hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = reference.fit(**data(), epochs=5, steps_per_epoch=spe, verbose=0, callbacks=[expected])
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = compiled(model_fn(), execution)
    seen = _Hooks()
    got = tfdist.fit(model, **data(), epochs=5, steps_per_epoch=spe, verbose=0, callbacks=[seen])
    assert_same_calls(seen.calls, expected.calls)
    np.testing.assert_allclose(got.history["loss"], history.history["loss"], atol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
