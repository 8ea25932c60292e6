"""Counts what concurrent parameter-server workers apply: every update must land exactly once.

The model's one weight gets gradient 1 per step (loss = the prediction on x = 1),
so plain SGD leaves it at -lr * steps; a layer counts its calls in a
non-trainable variable with Keras' read-modify-write `assign(count + 1)`, as
BatchNormalization updates its moving statistics. Prints the three counts.
"""

import keras
import numpy as np
import tensorflow as tf

import tfdist

STEPS_PER_EPOCH, EPOCHS, LR = 100, 3, 1e-3


class CallCounter(keras.layers.Layer):
    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, inputs, training=None):
        if training:
            self.calls.assign(self.calls + 1.0)
        return inputs


def main() -> None:
    strategy = tfdist.make_strategy("auto", precision="float32")
    with strategy.scope():
        inputs = keras.Input((1,))
        outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(CallCounter()(inputs))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=lambda y, p: tf.reduce_mean(p, axis=-1))
    x = np.ones((64 * STEPS_PER_EPOCH, 1), "float32")
    try:  # Sharding the optimizer state is refused here, before any step (tests/test_zero.py).
        tfdist.fit(model, x, np.zeros_like(x), batch_size=64, epochs=EPOCHS, verbose=0, zero_stage=1)
    except tfdist.UserError as e:
        print(f"refused: {e}", flush=True)
    tfdist.fit(model, x, np.zeros_like(x), batch_size=64, epochs=EPOCHS, verbose=0)
    kernel = float(model.layers[2].get_weights()[0][0, 0])
    calls = float(model.layers[1].calls.numpy())
    print(f"applied={round(-kernel / LR)} iterations={int(model.optimizer.iterations.numpy())} calls={calls:.0f} "
          f"expected={STEPS_PER_EPOCH * EPOCHS}", flush=True)


if __name__ == "__main__":
    main()
