"""One task of a job whose user optimizer is built before a sharded fit, for tests/test_zero_handover.py.

  python tests/programs/zero_handover_job.py OUT STAGE [STRATEGY]

Sets the model and its Adam state to Keras' 10 steps (computed in this process on one device; Keras' own fit
does not run under MultiWorkerMirroredStrategy), trains the next 10 batches with `tfdist.fit(zero_stage=STAGE)`,
then writes OUT/task{N}.npz: the user's optimizer variables after the fit. STRATEGY: a `tfdist.make_strategy`
name (multi_worker_mirrored, the default, under tfdist-launch; horovod under horovodrun).
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import keras  # noqa: E402

import tfdist  # noqa: E402
from tests.zero_model import BATCH, data, model  # noqa: E402
from tfdist.distribute import strategies  # noqa: E402


def main() -> None:
    out, stage = sys.argv[1], int(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) > 3 else "multi_worker_mirrored"
    strategy = tfdist.make_strategy(name, precision="float32")  # Before any TensorFlow op.
    x, y = data()
    reference = model(lambda: keras.optimizers.Adam(0.01))
    reference.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    with strategy.scope():
        net = model(lambda: keras.optimizers.Adam(0.01))
        net.optimizer.build(net.trainable_variables)  # As a loaded model.keras holds it.
    net.set_weights(reference.get_weights())
    for variable, value in zip(net.optimizer.variables, reference.optimizer.variables):
        variable.assign(np.asarray(value))
    tfdist.fit(net, x[10 * BATCH:], y[10 * BATCH:], batch_size=BATCH, shuffle=False, verbose=0, zero_stage=stage)
    index = strategies.current_backend().worker_index
    np.savez(os.path.join(out, f"task{index}.npz"), *[np.asarray(v) for v in net.optimizer.variables])


if __name__ == "__main__":
    main()
