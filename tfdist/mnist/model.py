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

import keras
import numpy as np

IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


def build_cnn(seed: int = 0) -> keras.Model:
    """A small CNN: two conv/pool blocks and a dense head (about 0.2M weights)."""
    init = lambda i: keras.initializers.GlorotUniform(seed=seed * 100 + i)  # noqa: E731
    inputs = keras.Input(IMAGE_SHAPE, dtype="uint8", name="image")
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    x = keras.layers.Conv2D(32, 3, activation="relu", kernel_initializer=init(1))(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu", kernel_initializer=init(2))(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(128, activation="relu", kernel_initializer=init(3))(x)
    logits = keras.layers.Dense(NUM_CLASSES, dtype="float32", kernel_initializer=init(4), name="logits")(x)
    return keras.Model(inputs, logits, name="tfdist_cnn")


def fingerprint(arrays: list[np.ndarray]) -> str:
    """A short hash of weight values; equal on every replica of a correct run."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(str(array.dtype).encode() + str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]
