"""A peer tfdist is measured against: horovod.tensorflow.keras with tf_keras, run by ``horovodrun``.

Written as Horovod's own Keras example (examples/tensorflow2/tensorflow2_keras_mnist.py)
writes it: ``hvd.init()``, ``hvd.DistributedOptimizer``,
``BroadcastGlobalVariablesCallback(0)`` and ``MetricAverageCallback``, each rank
reading its shard of the data. Horovod's Keras layer is Keras 2 only, so this is
tf_keras (``TF_USE_LEGACY_KERAS=1``), in an environment with Horovod (the
TensorFlow 2.18 lane), with the one workaround Horovod needs there
(`import_horovod_keras`). Like against like with tfdist-train: the same CNN
(tfdist.mnist.model.build_cnn in tf_keras, seed 0), bundled digits, global batch
(--batch_size, split evenly over the ranks), Adam at the rate given (not scaled
by the rank count as the example does: tfdist-train does not scale it either)
and steps per execution. Rank 0 prints one line ``BENCH {json}``.

  horovodrun -np 2 -H localhost:2 --gloo python scripts/peer_horovod_keras.py --epochs=4
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # Before TensorFlow is imported: tf.keras is tf_keras.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from benchlib import programs  # noqa: E402  (scripts/ is on sys.path: run as a file)
from tfdist.mnist import data, model  # noqa: E402


def import_horovod_keras():
    """horovod.tensorflow.keras, its Keras backend pointed at tf_keras.

    Horovod 0.28.1 reads `from keras import backend` on TensorFlow >= 2.6, which
    since TensorFlow 2.16 is Keras 3's backend (no `constant`; its callbacks fail:
    horovod/horovod#4290). A tf_keras user has to alias `keras` to tf_keras while
    Horovod is imported; this does that, and puts Keras 3 back.
    """
    keras3 = sys.modules.get("keras")
    sys.modules["keras"] = keras
    try:
        import horovod.tensorflow.keras as hvd
    finally:
        if keras3 is not None:
            sys.modules["keras"] = keras3
    return hvd


hvd = import_horovod_keras()


EpochTimer = programs.epoch_timer(keras)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=128, help="Global batch, split over the ranks.")
    parser.add_argument("--steps_per_execution", type=int, default=10)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--lr_schedule", choices=("constant",), default="constant")
    parser.add_argument("--precision", choices=("float32",), default="float32")
    args = parser.parse_args()
    hvd.init()
    if args.batch_size % hvd.size():
        raise SystemExit(f"--batch_size={args.batch_size} must divide over {hvd.size()} ranks.")
    digits = data.load_dataset("mnist")
    steps = digits.num_train // args.batch_size
    n = steps * args.batch_size
    train = (tf.data.Dataset.from_tensor_slices((digits.train_images[:n], digits.train_labels[:n]))
             .shard(hvd.size(), hvd.rank()).shuffle(n, seed=0).repeat()
             .batch(args.batch_size // hvd.size(), drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    net = model.build_cnn(0, keras_module=keras)
    net.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(args.learning_rate)),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                steps_per_execution=args.steps_per_execution)
    timer = EpochTimer()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), timer]
    net.fit(train, epochs=args.epochs, steps_per_epoch=steps, callbacks=callbacks, verbose=0)
    _, accuracy = net.evaluate(digits.eval_images, digits.eval_labels, verbose=0, batch_size=500)
    if hvd.rank() == 0:
        print("BENCH " + json.dumps({
            "epoch_train_seconds": timer.seconds, "steps_per_epoch": steps, "global_batch_size": args.batch_size,
            "steps_per_execution": args.steps_per_execution, "eval_accuracy": float(accuracy), "ranks": hvd.size(),
            "precision": args.precision, "tensorflow_version": tf.__version__,
            "keras_version": keras.__version__}), flush=True)


if __name__ == "__main__":
    main()
