"""Two MultiWorkerMirrored workers, and what a script does on each once `tfdist.fit` has returned.

`python after_fit.py load OUT [slow]`: a chief-only `ModelCheckpoint(save_best_only=True)` writes the best
epoch's weights to OUT, and every worker's next line loads them (with `slow`, the chief's save takes 3 s more:
a loaded machine). Each worker prints a fingerprint of what it loaded.

`python after_fit.py raise INDEX`: after fit, the task with TF_CONFIG index INDEX raises, and the other goes on
to `tfdist.evaluate` (collectives that wait for the failed task). It prints when its fit returned.

`python after_fit.py callback 0`: the chief's (chief-only) callback raises in on_train_end, while worker 1 waits
for it at the end of fit.
"""

import hashlib
import json
import os
import sys
import time

import keras
import numpy as np

import tfdist


class SlowCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ModelCheckpoint (so the chief's only) whose save comes 3 s late."""

    def on_epoch_end(self, epoch, logs=None):
        time.sleep(3)
        super().on_epoch_end(epoch, logs)


class BrokenCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ModelCheckpoint (so the chief's only) that fails at the end of training."""

    def on_train_end(self, logs=None):
        raise RuntimeError("the chief's callback broke")


def main() -> None:
    mode, arg = sys.argv[1], sys.argv[2]
    strategy = tfdist.make_strategy("multi_worker_mirrored", precision="float32")
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    callbacks = []
    if mode == "load":
        path = os.path.join(arg, "best.weights.h5")
        kind = SlowCheckpoint if sys.argv[3:] == ["slow"] else keras.callbacks.ModelCheckpoint
        callbacks = [kind(path, monitor="loss", save_best_only=True, save_weights_only=True)]
    elif mode == "callback":
        callbacks = [BrokenCheckpoint(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"unused-{os.getpid()}.keras"),
                                      save_freq=10**6)]
    tfdist.fit(model, x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    print(f"fit returned at {time.time():.3f}", flush=True)
    if mode == "load":
        model.load_weights(path)
        digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]
        print(f"loaded {digest}", flush=True)
        return
    if index == int(arg):
        raise RuntimeError(f"task {index} broke after fit")
    print("evaluated", tfdist.evaluate(model, x, y, verbose=0), flush=True)


if __name__ == "__main__":
    main()
