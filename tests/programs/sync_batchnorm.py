"""A two-task job (MultiWorkerMirrored workers, or Horovod ranks) of `fit(sync_batchnorm=True)`.

Each task fits tests/batchnorm_model.py's CNN (batch 8: 4 examples a task) with the option and writes its
weights, and each BatchNormalization layer's `synchronized` after fit, to OUT/task{N}.npz.

  python tests/programs/sync_batchnorm.py OUT [multi_worker_mirrored|horovod]
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tfdist  # noqa: E402
from tests import batchnorm_model as case  # noqa: E402
from tfdist.distribute import strategies  # noqa: E402


def main() -> None:
    out, name = sys.argv[1], sys.argv[2]
    strategy = tfdist.make_strategy(name, precision="float32")
    with strategy.scope():
        model = case.cnn()
    case.fit(tfdist.fit, model, sync_batchnorm=True)
    index = strategies.current_backend().worker_index
    np.savez(os.path.join(out, f"task{index}.npz"), *model.get_weights(),
             synchronized=np.array([layer.synchronized for layer in case.norms(model)]))


if __name__ == "__main__":
    main()
