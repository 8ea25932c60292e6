"""One task of a job whose user optimizer is built before a sharded fit, for tests/test_zero_handover.py.

  python tests/programs/zero_handover_job.py OUT STAGE[,STAGE2] [STRATEGY]

Sets the model and its Adam state to Keras' 10 steps (computed in this process on one device; Keras' own fit
does not run under MultiWorkerMirroredStrategy), trains the next 10 batches with `tfdist.fit(zero_stage=STAGE)`,
then writes OUT/task{N}.npz: the user's optimizer variables after the fit (OUT/weights{N}.npz: the weights).
With two stages: the optimizer left unbuilt, a fit of the first 10 batches at the first stage, one of the next
10 at the second (the first's state carried over: `zero.carry_over`). STRATEGY: a `tfdist.make_strategy`
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
    out, stages = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    name = sys.argv[3] if len(sys.argv) > 3 else "multi_worker_mirrored"
    strategy = tfdist.make_strategy(name, precision="float32")  # Before any TensorFlow op.
    x, y = data()
    if len(stages) == 2:  # Unbuilt: the first fit's state in its shards alone, carried over to the second's.
        with strategy.scope():
            net = model(lambda: keras.optimizers.Adam(0.01))
        for k, stage in enumerate(stages):
            tfdist.fit(net, x[10 * k * BATCH:10 * (k + 1) * BATCH], y[10 * k * BATCH:10 * (k + 1) * BATCH],
                       batch_size=BATCH, shuffle=False, verbose=0, zero_stage=stage)
        save(out, net)
        return
    stage = stages[0]
    reference = model(lambda: keras.optimizers.Adam(0.01))
    reference.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    with strategy.scope():
        net = model(lambda: keras.optimizers.Adam(0.01))
        net.optimizer.build(net.trainable_variables)  # As a loaded model.keras holds it.
    net.set_weights(reference.get_weights())
    for variable, value in zip(net.optimizer.variables, reference.optimizer.variables):
        variable.assign(np.asarray(value))
    tfdist.fit(net, x[10 * BATCH:], y[10 * BATCH:], batch_size=BATCH, shuffle=False, verbose=0, zero_stage=stage)
    save(out, net)


def save(out: str, net: keras.Model) -> None:
    index = strategies.current_backend().worker_index
    np.savez(os.path.join(out, f"task{index}.npz"), *[np.asarray(v) for v in net.optimizer.variables])
    np.savez(os.path.join(out, f"weights{index}.npz"), *net.get_weights())


if __name__ == "__main__":
    main()
