"""Run under horovodrun by tests/test_steps.py: Horovod ranks train as Keras does on one device.

Each rank trains two models with `tfdist.fit` on the Horovod backend (a
`compute_loss` override returning a plain mean; a reduction="sum" loss with
weight and activity regularisers and grad_accum_steps=2) and the same models
with Keras' own `fit` on one device, on the same global batches, and writes the
largest weight difference and how far training moved the weights to OUT_DIR.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist


class MeanComputeLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred - y))


def build(cls, loss, lr, **dense):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0),
                                **dense)(inputs)
    model = cls(inputs, keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))(hidden))
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
    return model


CASES = {
    "compute_loss_mean": (lambda: build(MeanComputeLoss, "mse", 0.1), 1),
    "sum_accumulated": (lambda: build(keras.Model, keras.losses.MeanSquaredError(reduction="sum"), 0.002,
                                      kernel_regularizer=keras.regularizers.L2(0.5),
                                      activity_regularizer=keras.regularizers.L2(0.5)), 2),
}


def main(out_dir: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
    strategy = tfdist.make_strategy("horovod", precision="float32")
    report = {}
    for name, (make, accum) in CASES.items():
        reference = make()
        start = reference.get_weights()
        reference.fit(dataset, epochs=1, shuffle=False, verbose=0)
        with strategy.scope():
            model = make()
        tfdist.fit(model, dataset, epochs=1, grad_accum_steps=accum, verbose=0)
        report[name] = {
            "max_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights())),
            "moved": max(float(np.max(np.abs(a - b))) for a, b in zip(reference.get_weights(), start)),
        }
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
