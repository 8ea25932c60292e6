"""The model and data of tests/test_sync_batchnorm.py, shared with tests/programs/sync_batchnorm.py (which must
not import a test module: tests/conftest.py sets the devices up before a multi-worker strategy could)."""

import keras
import numpy as np

from tfdist.training import sync_batchnorm

RNG = np.random.default_rng(0)
X = RNG.normal(size=(80, 6, 6, 1)).astype("float32")
Y = RNG.integers(0, 3, size=80)
TRAIN, VALID = slice(0, 64), slice(64, 80)


def cnn(user_synchronized=False):
    """A small CNN whose BatchNormalization layers sit at top level and inside a nested model (momentum 0.5,
    so the moving statistics move visibly in 8 steps)."""
    init = keras.initializers.GlorotUniform
    block = keras.Sequential([keras.layers.Dense(8, kernel_initializer=init(2)),
                              keras.layers.BatchNormalization(momentum=0.5, synchronized=user_synchronized),
                              keras.layers.ReLU()], name="block")
    model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3, kernel_initializer=init(0)),
                              keras.layers.BatchNormalization(momentum=0.5), keras.layers.ReLU(),
                              keras.layers.Flatten(), block, keras.layers.Dense(3, kernel_initializer=init(1))])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def fit(fit_fn, model, **arguments):
    """8 steps of batch 8, in order, validating on 16 held-out examples."""
    return fit_fn(model, X[TRAIN], Y[TRAIN], batch_size=8, epochs=1, shuffle=False,
                  validation_data=(X[VALID], Y[VALID]), verbose=0, **arguments).history


def keras_fit(model, *args, **kwargs):
    return model.fit(*args, **kwargs)


def norms(model):
    return sync_batchnorm.batch_norm_layers(model)
