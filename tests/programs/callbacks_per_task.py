"""A two-worker MultiWorkerMirrored job whose callbacks write files, as a Keras user writes them.

Each task names its files after its TF_CONFIG index, so the test can tell who wrote: only the
chief may run TensorBoard, ModelCheckpoint and CSVLogger, while BackupAndRestore restores on
every task (the chief alone writes the backup). The first fit is interrupted after epoch 0,
the second resumes from the backup on both workers.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


def setup() -> tuple:
    """The strategy, this task's index, a small compiled model and its data."""
    strategy = tfdist.make_strategy("multi_worker_mirrored", precision="float32")
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    return strategy, index, model, x, x.sum(axis=1, keepdims=True)


def main() -> None:
    out = sys.argv[1]
    strategy, index, model, x, y = setup()
    writers = [keras.callbacks.CSVLogger(f"{out}/task{index}.csv"),
               keras.callbacks.ModelCheckpoint(f"{out}/task{index}.keras"),
               keras.callbacks.TensorBoard(f"{out}/tb{index}")]
    backup = f"{out}/backup"
    try:
        tfdist.fit(model, x, y, batch_size=32, epochs=3, callbacks=[keras.callbacks.BackupAndRestore(backup),
                                                                    Interrupt()], verbose=0)
    except RuntimeError:
        pass
    # A barrier: worker 1 must not look for the backup before the chief has written it.
    strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    tfdist.fit(model, x, y, batch_size=32, epochs=3, verbose=0,
               callbacks=writers + [keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    print(f"restored epoch {model._initial_epoch}", flush=True)


if __name__ == "__main__":
    main()
