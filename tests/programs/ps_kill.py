"""Counts the steps a parameter-server job applies while the test kills a worker mid-execution.

Run as the chief's program under tfdist-launch (2 workers, 1 ps), with the run
directory and a marker path as arguments. The model's one weight gets gradient
1 per step (loss = the prediction on x = 1), so SGD with a learning rate of
2^-10 leaves it at exactly -steps * 2^-10: the weight counts the steps applied.
Worker 0's input sleeps per batch (no CPU). Worker 1's input gives two batches,
then writes the marker and stalls for good: its first execution has claimed two
of its steps and waits inside the third when the test, seeing the marker, kills
it. That moment is certain, not a race against a timer on a loaded machine. A
thread on the chief samples the on-ps step counter (the one the steps increment
and checkpoints hold) and reports whether it ever went down. Prints one line
with the counts.
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
SLEEP_US = 50_000  # Per batch on worker 0: an execution takes about 0.25 s.
STALLED_WORKER, BATCHES_BEFORE_STALL = 1, 2
FOREVER_US = 10 ** 12


def write_marker(path: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies([tf.io.write_file(path, "stalled")]):
        return tf.identity(path)


def make_dataset_fn(marker: str):
    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        x = tf.ones((8, 1))
        batches = tf.data.Dataset.from_tensors((x, tf.zeros_like(x))).repeat()
        try:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        except RuntimeError:  # Called off the workers (tfdist reads the batches' shapes): nothing stalls.
            worker = tf.constant(-1, tf.int64)
        stalled = tf.equal(worker, STALLED_WORKER)
        # take(-1) is everything: on the other workers the slow batches never end.
        head = batches.take(tf.where(stalled, tf.constant(BATCHES_BEFORE_STALL, tf.int64), -1))
        # Asked for its next batch, the stalled worker's input writes the marker (an empty dataset
        # whose one element's map writes it), then sleeps for good.
        mark = tf.data.Dataset.from_tensors(marker).map(write_marker)
        mark = mark.filter(lambda _: False).map(lambda _: (x, tf.zeros_like(x)))
        return head.apply(sleep_per_element(SLEEP_US)).concatenate(mark).concatenate(
            batches.apply(sleep_per_element(FOREVER_US)))

    return dataset_fn


def sample(counter: tf.Variable, seen: list, done: threading.Event) -> None:
    while not done.is_set():
        seen.append(int(counter.numpy()))
        time.sleep(0.02)


def main() -> None:
    workdir, marker = sys.argv[1:3]
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
        tfdist.fit(model, make_dataset_fn(marker), batch_size=8, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS,
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
