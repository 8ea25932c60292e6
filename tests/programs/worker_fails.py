"""A two-worker MultiWorkerMirrored job in which one worker's input fails mid-epoch.

Worker 1's dataset raises at its 40th batch (a corrupt shard, say); worker 0's
is fine. Worker 1 must exit with that error although the execution dispatched
behind the failing one waits in an all-reduce that worker 0 never joins; the
launcher then stops the job.
"""

import json
import os

import keras
import tensorflow as tf

import tfdist

BATCH, FAIL_AT = 16, 40


def main() -> None:
    strategy = tfdist.make_strategy("multi_worker_mirrored", precision="float32")
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        def example(i):
            checks = [tf.debugging.assert_less(i, tf.constant(FAIL_AT * BATCH, tf.int64),
                                               message="corrupt record in shard 1")] if index == 1 else []
            with tf.control_dependencies(checks):
                return tf.fill([4], tf.cast(i % 7, tf.float32)), tf.zeros([1])

        return tf.data.Dataset.range(10**6).map(example).batch(BATCH)

    tfdist.fit(model, dataset_fn, batch_size=2 * BATCH, steps_per_epoch=200, epochs=1, steps_per_execution=5,
               verbose=0)
    print("trained", flush=True)


if __name__ == "__main__":
    main()
