"""The baseline tfdist is measured against: plain Keras 3 `model.fit`, no strategy.

Same model (tfdist.mnist.model.build_cnn), same bundled digits, same batch and
precision; Keras defaults otherwise. Prints one JSON line with per-epoch
training seconds (evaluation excluded) and the held-out accuracy.

  python scripts/keras_fit_baseline.py --epochs=4 --batch_size=128 --precision=mixed_bfloat16
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from tfdist.mnist import data, model  # noqa: E402


class EpochTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--precision", default="float32")
    args = parser.parse_args()
    keras.mixed_precision.set_dtype_policy(args.precision)
    digits = data.load_dataset("mnist")
    net = model.build_cnn(0)
    net.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    timer = EpochTimer()
    steps = digits.num_train // args.batch_size
    n = steps * args.batch_size  # Whole batches only, as tfdist trains.
    net.fit(digits.train_images[:n], digits.train_labels[:n], batch_size=args.batch_size, epochs=args.epochs,
            shuffle=True, callbacks=[timer], verbose=0)
    _, accuracy = net.evaluate(digits.eval_images, digits.eval_labels, verbose=0)
    print(json.dumps({"epoch_train_seconds": timer.seconds, "steps_per_epoch": steps,
                      "global_batch_size": args.batch_size, "eval_accuracy": float(accuracy)}))


if __name__ == "__main__":
    main()
