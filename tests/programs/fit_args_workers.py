"""A two-worker MultiWorkerMirrored job using Model.fit's extra arguments, as a Keras user writes them.

Each task trains the same small model on arrays with class_weight, validation_split,
validation_freq, initial_epoch and shuffle=False, then on a PyDataset, and saves its weights
and History to OUT/task{index}.npz for the test to compare with Keras' own fit on one device.
"""

import json
import os
import sys

import keras
import numpy as np

import tfdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.test_fit_args import CLASS_WEIGHT, X, Y, Batches, model_fn  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    strategy = tfdist.make_strategy("multi_worker_mirrored", precision="float32")
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        arrays, py_dataset = model_fn(), model_fn()
    history = tfdist.fit(arrays, X, Y, batch_size=32, epochs=4, initial_epoch=1, shuffle=False,
                         class_weight=CLASS_WEIGHT, validation_split=0.25, validation_freq=2, verbose=0)
    tfdist.fit(py_dataset, Batches(), epochs=2, shuffle=False, verbose=0)
    np.savez(f"{out}/task{index}.npz", *arrays.get_weights(), *py_dataset.get_weights(),
             history=json.dumps(history.history))


if __name__ == "__main__":
    main()
