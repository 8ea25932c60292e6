"""A two-worker job (MultiWorkerMirrored) of a model compiled with a custom metric whose ``result()`` returns
its own state variable (tests/custom_metric.py): evaluate, fit with a progress display on the chief and
validation, evaluate again. Each task writes its logs and weights to OUT/task{N}.npz.

  python tests/programs/custom_metric.py OUT
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tfdist  # noqa: E402
from tests import custom_metric  # noqa: E402
from tfdist.distribute import strategies  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    strategy = tfdist.make_strategy("multi_worker_mirrored", precision="float32")
    with strategy.scope():
        model = custom_metric.model_fn()
    # verbose=1: the chief shows progress (computing the logs more often than worker 1 does).
    logs = custom_metric.keras_run(model, tfdist.fit, tfdist.evaluate, verbose=1, steps_per_execution=2)
    index = strategies.current_backend().worker_index
    np.savez(os.path.join(out, f"task{index}.npz"), *model.get_weights(), logs=json.dumps(logs))


if __name__ == "__main__":
    main()
