"""The model, data and Keras reference that tests/test_zero.py and tests/programs/zero_job.py share.

Kept apart from the tests: a job's processes import it, and must not configure TensorFlow's devices as the
test modules' conftest does (collective ops are set up at a program's start)."""

import keras
import numpy as np

BATCH, EXAMPLES = 12, 240  # 20 steps an epoch; 6 and 4 examples a replica on 2 and 3 workers.


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(EXAMPLES, 8)).astype("float32"), rng.normal(size=(EXAMPLES, 3)).astype("float32")


def model(optimizer=None):
    """Six variables of different sizes (128, 16, 192, 12, 36 and 3 floats), so their owners differ."""
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                            keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(3)])
    default = keras.optimizers.AdamW(0.01, weight_decay=0.05, global_clipnorm=1.0) if optimizer is None else None
    net.compile(optimizer=optimizer() if optimizer else default, loss="mse")
    return net


def keras_weights(optimizer=None, steps=20):
    """Keras' own fit on one device: the first `steps` batches, in order."""
    x, y = data()
    reference = model(optimizer)
    reference.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    return reference.get_weights()
