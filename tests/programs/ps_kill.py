"""Counts the steps a parameter-server job applies while the test kills a worker mid-execution.

Run as the chief's program under tfdist-launch (2 workers, 1 ps). The model's
one weight gets gradient 1 per step (loss = the prediction on x = 1), so SGD
with a learning rate of 2^-10 leaves it at exactly -steps * 2^-10: the weight
counts the steps applied. A slow input (a sleep per batch, no CPU) keeps every
execution of STEPS_PER_EXECUTION steps in flight for seconds, so a kill lands
mid-execution. A thread on the chief samples the on-ps step counter (the one
the steps increment and checkpoints hold) and reports whether it ever went
down. Prints one line with the counts.
"""

import sys
import threading
import time

import keras
from absl import logging
import numpy as np
import tensorflow as tf
from tensorflow.python.data.experimental.ops.testing import sleep as sleep_per_element  # A SleepDataset.

import tfdist

STEPS_PER_EPOCH, EPOCHS, STEPS_PER_EXECUTION, LR = 20, 2, 5, 2.0 ** -10
SLEEP_US = 150_000  # Per batch: an execution takes about 0.75 s.


def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
    x = tf.ones((8, 1))
    return tf.data.Dataset.from_tensors((x, tf.zeros_like(x))).repeat().apply(sleep_per_element(SLEEP_US))


def sample(counter: tf.Variable, seen: list, done: threading.Event) -> None:
    while not done.is_set():
        seen.append(int(counter.numpy()))
        time.sleep(0.02)


def main() -> None:
    workdir = sys.argv[1]
    logging.set_verbosity(logging.INFO)  # tfdist's progress lines ("epoch 1: step 5/20"), which the test waits for.
    strategy = tfdist.make_strategy("auto", precision="float32")
    with strategy.scope():
        inputs = keras.Input((1,))
        outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=lambda y, p: tf.reduce_mean(p, axis=-1))
        counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_step",
                              aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    seen: list = []
    done = threading.Event()
    sampler = threading.Thread(target=sample, args=(counter, seen, done), daemon=True)
    sampler.start()
    try:
        tfdist.fit(model, dataset_fn, batch_size=8, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS,
                   steps_per_execution=STEPS_PER_EXECUTION, checkpoint_every_steps=STEPS_PER_EXECUTION * 2,
                   workdir=workdir, step_counter=counter, export=(), verbose=1)
    finally:
        done.set()
        sampler.join()
    seen.append(int(counter.numpy()))
    drops = sum(1 for a, b in zip(seen, seen[1:]) if b < a)
    kernel = float(model.layers[1].get_weights()[0][0, 0])
    print(f"applied={round(-kernel / LR)} counter={seen[-1]} iterations={int(model.optimizer.iterations.numpy())} "
          f"expected={STEPS_PER_EPOCH * EPOCHS} drops={drops} samples={len(seen)}", flush=True)


if __name__ == "__main__":
    main()
