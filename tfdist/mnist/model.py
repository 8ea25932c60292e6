"""The Keras 3 CNN that tfdist trains, and the weights fingerprint.

It imports only Keras and NumPy (no TensorFlow), so the same definition can be
checked under Keras' other backends (scripts/gpu_precision_check.py). The model
takes uint8 images (rescaled inside the model, in the compute dtype
of the current mixed-precision policy) and returns float32 logits: the last
layer always computes in float32 so the softmax and the loss stay accurate
under mixed precision.
"""

from __future__ import annotations

import hashlib
from typing import Any

import keras
import numpy as np

IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


def build_cnn(seed: int = 0, keras_module: Any = None) -> keras.Model:
    """A small CNN: two conv/pool blocks and a dense head (about 0.2M weights).

    `keras_module`: the Keras to build it in (default Keras 3); the benchmark's peer
    programs pass tf_keras, so both frameworks train the same network, seeded alike.
    """
    k = keras_module or keras
    init = lambda i: k.initializers.GlorotUniform(seed=seed * 100 + i)  # noqa: E731
    inputs = k.Input(IMAGE_SHAPE, dtype="uint8", name="image")
    x = k.layers.Rescaling(1.0 / 255)(inputs)
    x = k.layers.Conv2D(32, 3, activation="relu", kernel_initializer=init(1))(x)
    x = k.layers.MaxPooling2D()(x)
    x = k.layers.Conv2D(64, 3, activation="relu", kernel_initializer=init(2))(x)
    x = k.layers.MaxPooling2D()(x)
    x = k.layers.Flatten()(x)
    x = k.layers.Dense(128, activation="relu", kernel_initializer=init(3))(x)
    logits = k.layers.Dense(NUM_CLASSES, dtype="float32", kernel_initializer=init(4), name="logits")(x)
    return k.Model(inputs, logits, name="tfdist_cnn")


def fingerprint(arrays: list[np.ndarray]) -> str:
    """A short hash of weight values; equal on every replica of a correct run."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(str(array.dtype).encode() + str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]
