"""A peer tfdist is measured against: tf_keras ``model.fit`` under the strategy TF_CONFIG names.

What a team that needs multi-worker or parameter-server training with Keras
today falls back to: tf_keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``), written as
TensorFlow's "Multi-worker training with Keras" and "Parameter server training"
tutorials write it. Run under ``tfdist-launch``, which sets TF_CONFIG:

- workers only: ``tf.distribute.MultiWorkerMirroredStrategy``; every worker runs
  ``fit`` on the global batch, auto-sharded by data (each reads its share);
- a chief and ps tasks: ``ParameterServerStrategy``; workers and ps tasks run a
  ``tf.distribute.Server`` and wait; the chief runs ``fit`` with a
  ``DatasetCreator`` (each worker's steps take the global batch).

The model, data, batch, optimizer and steps per execution are tfdist-train's
(tfdist.mnist.model.build_cnn built in tf_keras, seed 0; the bundled digits,
whole batches; Adam at a constant rate: the peer rows pass
--lr_schedule=constant to both sides). The task that reports (the chief, or
worker 0) evaluates on the held-out digits after training (not timed) and
prints one line ``BENCH {json}`` with per-epoch training seconds.

  tfdist-launch --num_workers=2 -- python scripts/peer_tf_keras.py --epochs=4
  tfdist-launch --num_workers=2 --num_ps=1 -- python scripts/peer_tf_keras.py --epochs=4
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # Before TensorFlow is imported: tf.keras is tf_keras.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from benchlib import programs  # noqa: E402  (scripts/ is on sys.path: run as a file)
from tfdist.mnist import data, model  # noqa: E402


EpochTimer = programs.epoch_timer(keras)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=128, help="Global batch.")
    parser.add_argument("--steps_per_execution", type=int, default=10)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--lr_schedule", choices=("constant",), default="constant",
                        help="Constant only: tfdist's WarmupCosine is a Keras 3 schedule.")
    parser.add_argument("--precision", choices=("float32",), default="float32")
    return parser.parse_args(argv)


def strategy_from_tf_config() -> object:
    """The tutorials' strategy for this TF_CONFIG; ps and worker tasks of a ps job serve and never return."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = config.get("task", {})
    if "ps" in config.get("cluster", {}):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        if task["type"] in ("worker", "ps"):
            server = tf.distribute.Server(resolver.cluster_spec(), job_name=task["type"], task_index=task["index"],
                                          protocol=resolver.rpc_layer or "grpc", start=True)
            server.join()
        return tf.distribute.ParameterServerStrategy(resolver)
    if config:
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def main(argv=None) -> None:
    args = parse_args(argv)
    strategy = strategy_from_tf_config()
    digits = data.load_dataset("mnist")
    steps = digits.num_train // args.batch_size
    images, labels = digits.train_images[:steps * args.batch_size], digits.train_labels[:steps * args.batch_size]

    def dataset_fn(context: tf.distribute.InputContext = None) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(len(images), seed=0).repeat()
        return ds.batch(args.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    with strategy.scope():
        net = model.build_cnn(0, keras_module=keras)
        net.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                    steps_per_execution=args.steps_per_execution)
    timer = EpochTimer()
    if isinstance(strategy, tf.distribute.ParameterServerStrategy):
        train = keras.utils.experimental.DatasetCreator(dataset_fn)
    else:
        train = dataset_fn()
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        train = train.with_options(options)
    net.fit(train, epochs=args.epochs, steps_per_epoch=steps, callbacks=[timer], verbose=0)
    if isinstance(strategy, tf.distribute.ParameterServerStrategy):
        evaluator = model.build_cnn(0, keras_module=keras)  # On the chief, outside the strategy.
        evaluator.set_weights(net.get_weights())
        evaluator.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    else:
        evaluator = net  # Every MWMS worker evaluates: it is a collective.
    _, accuracy = evaluator.evaluate(digits.eval_images, digits.eval_labels, verbose=0, batch_size=500)
    if not programs.reports_here():
        return
    print("BENCH " + json.dumps({
        "epoch_train_seconds": timer.seconds, "steps_per_epoch": steps, "global_batch_size": args.batch_size,
        "steps_per_execution": args.steps_per_execution, "eval_accuracy": float(accuracy),
        "precision": args.precision, "strategy": type(strategy).__name__,
        "tensorflow_version": tf.__version__, "keras_version": keras.__version__}), flush=True)


if __name__ == "__main__":
    main()
