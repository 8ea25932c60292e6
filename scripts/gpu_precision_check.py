"""GPU check of tfdist's model under mixed_float16 against float32 (Keras 3, any backend).

Trains tfdist.mnist.model.build_cnn on the bundled split (8,000 train / 2,000 held-out
digits, read straight from the IDX files) with each precision policy and prints
one JSON line per policy: held-out accuracy, loss-scaling state, seconds.
Used where a GPU machine has no TensorFlow (KERAS_BACKEND=jax): it checks the
model's numerics under float16 with Keras' loss scaling, not tfdist's TF loop.

  KERAS_BACKEND=jax python scripts/gpu_precision_check.py --epochs=5
"""

import argparse
import gzip
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402

from tfdist.mnist.model import build_cnn  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tfdist", "data", "mnist")


def read_idx(path: str) -> np.ndarray:
    raw = gzip.open(path).read()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--policies", default="float32,mixed_float16,mixed_bfloat16")
    args = parser.parse_args()
    images = read_idx(os.path.join(DATA, "t10k-images-idx3-ubyte.gz"))[..., None]
    labels = read_idx(os.path.join(DATA, "t10k-labels-idx1-ubyte.gz")).astype(np.int32)
    held = np.arange(len(labels)) % 5 == 4
    x, y, xe, ye = images[~held], labels[~held], images[held], labels[held]
    for policy in args.policies.split(","):
        keras.mixed_precision.set_dtype_policy(policy)
        model = build_cnn(0)
        steps = args.epochs * (len(y) // 128)
        schedule = keras.optimizers.schedules.CosineDecay(3e-3, steps)
        model.compile(optimizer=keras.optimizers.Adam(schedule),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        start = time.time()
        model.fit(x[: len(y) // 128 * 128], y[: len(y) // 128 * 128], batch_size=128, epochs=args.epochs,
                  shuffle=True, verbose=0)
        seconds = time.time() - start
        loss, accuracy = model.evaluate(xe, ye, verbose=0)
        optimizer = model.optimizer
        print(json.dumps({
            "backend": keras.backend.backend(), "policy": policy, "eval_accuracy": round(float(accuracy), 4),
            "eval_loss": round(float(loss), 4), "train_seconds": round(seconds, 2),
            "loss_scale_optimizer": type(optimizer).__name__ == "LossScaleOptimizer",
            "final_loss_scale": float(optimizer.dynamic_scale.numpy()) if hasattr(optimizer, "dynamic_scale") else None,
            "logits_dtype": model.layers[-1].compute_dtype,
            "devices": [str(d) for d in __import__("jax").devices()] if keras.backend.backend() == "jax" else None,
        }), flush=True)


if __name__ == "__main__":
    main()
