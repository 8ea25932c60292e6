"""A program that builds its own tf.distribute.MultiWorkerMirroredStrategy and trains through tfdist.

Every task runs it (tfdist-launch --num_workers=2 sets TF_CONFIG). The strategy is the program's, built as a
tf.distribute program builds it, not by tfdist.make_strategy; the model is built under it and trained by
`tfdist.fit` (no strategy= argument: tfdist takes the model's) and then by `tfdist.train_on_batch` calls.
Each task writes its weights, the train_on_batch results and the backend tfdist used to OUT/<task>.npz.
`tfdist.is_chief()` and `tfdist.task_path()` answer worker 0 is the chief (no chief task) before tfdist has seen
the strategy (from TF_CONFIG), inside its scope and after training (from the adopted strategy); a wrong answer
ends the task with an error.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist

FIT_BATCH, ON_BATCH = 16, (7, 10)  # train_on_batch rows: 7 does not divide over the 2 workers.


def data() -> tuple:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(48 + sum(ON_BATCH), 5)).astype("float32")
    return x, rng.integers(0, 3, len(x)).astype("int32")


def build() -> keras.Model:
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def batches(x: np.ndarray, y: np.ndarray) -> list:
    """The train_on_batch batches, after fit's 48 examples."""
    edges = np.cumsum((48,) + ON_BATCH)
    return [(x[a:b], y[a:b]) for a, b in zip(edges[:-1], edges[1:])]


def check_task(index: int, when: str) -> None:
    """worker 0 is the chief and keeps the path; worker 1 names its own copy."""
    expected = (index == 0, "out/w.weights.h5" if index == 0 else f"out/w.task{index}.weights.h5")
    got = (tfdist.is_chief(), tfdist.task_path("out/w.weights.h5"))
    if got != expected:
        raise AssertionError(f"{when}: is_chief/task_path gave {got}, expected {expected}")


def main() -> None:
    out = sys.argv[1]
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # The program's own, from TF_CONFIG.
    check_task(index, "before any tfdist call")
    with strategy.scope():
        model = build()
        check_task(index, "inside the strategy's scope")
    x, y = data()
    tfdist.fit(model, x[:48], y[:48], batch_size=FIT_BATCH, shuffle=False, verbose=0)
    (xa, ya), (xb, yb) = batches(x, y)
    first = tfdist.train_on_batch(model, xa, ya, return_dict=True)
    second = tfdist.train_on_batch(model, xb, yb)
    check_task(index, "after training")
    from tfdist.distribute import adopting

    spec = json.loads(os.environ["TF_CONFIG"])["task"]
    np.savez(os.path.join(out, f"{spec['type']}{spec['index']}.npz"), first_names=np.asarray(sorted(first)),
             first=np.asarray([first[k] for k in sorted(first)]), second=np.asarray(second),
             backend=np.asarray([b.name for b in adopting._ADOPTED if b.strategy is strategy]),
             workers=np.asarray(adopting.known_backend(strategy).num_workers),
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    print(f"[{spec['type']}:{spec['index']}] trained under the program's own strategy", flush=True)


if __name__ == "__main__":
    main()
