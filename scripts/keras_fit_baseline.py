"""The baseline tfdist is measured against: plain Keras 3 `model.fit`, no strategy.

Everything that decides a step's cost is set as tfdist-train sets it, so the
two are compared like with like: the same model (tfdist.mnist.model.build_cnn, seed
0), the same digits (the bundled ones by default; whole batches only; a tfds:NAME
train split as the same stream tfdist-train reads), the same batch, precision
and XLA setting, Adam with the same learning rate and schedule
(tfdist.mnist.batching.WarmupCosine: cosine decay to 0 over the run, or constant),
and the same ``steps_per_execution`` (tfdist's default is 10; Keras' is 1).
With --num_cpu_replicas=N it trains under ``tf.distribute.MirroredStrategy``
over N logical CPU devices, as Keras' distributed-training guide writes it
(the benchmark's ``peer_mirrored`` row). Prints one JSON line with per-epoch training seconds (evaluation excluded),
the held-out accuracy and the versions.

  python scripts/keras_fit_baseline.py --epochs=4 --batch_size=128 --steps_per_execution=10
  python scripts/keras_fit_baseline.py --num_cpu_replicas=2 --steps_per_execution=1
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from benchlib import programs  # noqa: E402  (scripts/ is on sys.path: run as a file)
from tfdist.mnist import batching, data, model  # noqa: E402


EpochTimer = programs.epoch_timer(keras)  # scripts/ps_embedding.py imports it from here.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--steps_per_execution", type=int, default=10, help="As tfdist-train's default (10).")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="As tfdist-train's default.")
    parser.add_argument("--lr_schedule", choices=("cosine", "constant"), default="cosine")
    parser.add_argument("--jit_compile", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--data_dir", default=None, help="tensorflow-datasets data directory (tfds:NAME).")
    parser.add_argument("--num_cpu_replicas", type=int, default=0,
                        help="N >= 2: MirroredStrategy over N logical CPU devices (global batch --batch_size).")
    args = parser.parse_args()
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    if args.num_cpu_replicas > 1:
        (cpu,) = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()]
                                                   * args.num_cpu_replicas)
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.num_cpu_replicas)])
    keras.mixed_precision.set_dtype_policy(args.precision)
    digits = data.load_dataset(args.dataset, data_dir=args.data_dir)
    steps = digits.num_train // args.batch_size
    n = steps * args.batch_size  # Whole batches only, as tfdist trains.
    schedule = batching.WarmupCosine(args.learning_rate, 0, steps * args.epochs if args.lr_schedule == "cosine"
                                     else 0)
    with strategy.scope():
        net = model.build_cnn(0)
        net.compile(optimizer=keras.optimizers.Adam(schedule),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                    steps_per_execution=args.steps_per_execution,
                    jit_compile={"auto": "auto", "true": True, "false": False}[args.jit_compile])
    timer = EpochTimer()
    if digits.train_stream is not None:  # tfds:NAME: the same stream of whole batches tfdist-train reads.
        stream = digits.train_stream.dataset_fn(args.batch_size, seed=0)(tf.distribute.InputContext())
        net.fit(stream.repeat(), steps_per_epoch=steps, epochs=args.epochs, callbacks=[timer], verbose=0)
    else:
        net.fit(digits.train_images[:n], digits.train_labels[:n], batch_size=args.batch_size, epochs=args.epochs,
                shuffle=True, callbacks=[timer], verbose=0)
    _, accuracy = net.evaluate(digits.eval_images, digits.eval_labels, verbose=0)

    print(json.dumps({"epoch_train_seconds": timer.seconds, "steps_per_epoch": steps,
                      "global_batch_size": args.batch_size, "steps_per_execution": args.steps_per_execution,
                      "replicas": int(strategy.num_replicas_in_sync), "eval_accuracy": float(accuracy), "precision": args.precision,
                      "tensorflow_version": tf.__version__, "keras_version": keras.__version__}))


if __name__ == "__main__":
    main()
