"""Run by tests/test_workdir.py, alone or under tfdist-launch: a small model with random layers
(Dropout, GaussianNoise, neither given a seed) trained with tfdist.fit in a workdir.

Usage: dropout_resume.py STRATEGY WORKDIR MAX_STEPS OUT_DIR (MAX_STEPS 0: no limit). Each task
writes OUT_DIR/task<I>.npz with its final weights and the values of every seed generator's state
on each of its replicas, and prints one line `seeds [...]`.
"""

import json
import os
import sys

import keras
import numpy as np

import tfdist
from tfdist.distribute.backend import tf_variable

STEPS_PER_EPOCH, EPOCHS, BATCH = 8, 2, 32


def main() -> None:
    strategy_name, workdir, max_steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    strategy = tfdist.make_strategy(strategy_name, precision="float32")
    keras.utils.set_random_seed(5)  # The same initial weights and seeds in every run of this program.
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.5),
            keras.layers.Dense(16), keras.layers.GaussianNoise(0.3), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.randn(STEPS_PER_EPOCH * BATCH, 8).astype("float32")
    y = x[:, :1] * 2.0 - x[:, 1:2]
    tfdist.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, max_steps=max_steps or None, workdir=workdir,
               steps_per_execution=2, checkpoint_every_steps=2, verbose=0, export=())
    states = [[np.asarray(v) for v in strategy.experimental_local_results(tf_variable(s))]
              for s in [layer.seed_generator.state for layer in model.layers if hasattr(layer, "seed_generator")]]
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"task{task}.npz"), seeds=np.array(states),
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    print("seeds", np.array(states).tolist(), flush=True)


if __name__ == "__main__":
    main()
