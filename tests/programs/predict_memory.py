"""Peak memory of one predict call with a large output: Keras' own `Model.predict` on one device, or
`tfdist.predict` on 2 CPU replicas (tests/test_predicting.py runs each in a process of its own).

Usage: predict_memory.py keras|tfdist. Prints ``PEAK_MB <n>``: how far the process' resident memory rose
above what it held just before the call (its high-water mark reset there, where Linux allows).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import tfdist  # noqa: E402

NUM, BATCH, FRAMES, BINS = 96, 32, 512, 1024  # Outputs of 2 MiB an example, 192 MiB in all.


def build() -> keras.Model:
    """A spectrogram-sized output from a small input."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((16,))
    frames = keras.layers.Reshape((FRAMES, 16))(keras.layers.Dense(FRAMES * 16)(inputs))
    return keras.Model(inputs, keras.layers.Dense(BINS)(frames))


def memory_mb() -> tuple:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def main() -> None:
    x = np.random.default_rng(0).normal(size=(NUM, 16)).astype("float32")
    if sys.argv[1] == "keras":
        model = build()
        call = lambda: model.predict(x, batch_size=BATCH, verbose=0)  # noqa: E731
    else:
        strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
        with strategy.scope():
            model = build()
        call = lambda: tfdist.predict(model, x, batch_size=BATCH, verbose=0)  # noqa: E731
    before = memory_mb()[0]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Resets the high-water mark to the resident memory now.
    except OSError:
        pass
    predicted = call()
    assert predicted.shape == (NUM, FRAMES, BINS), predicted.shape
    print(f"PEAK_MB {memory_mb()[1] - before:.0f}", flush=True)


if __name__ == "__main__":
    main()
