"""One task of a job that trains with the optimizer state sharded (`zero_stage`), for tests/test_zero.py.

  python tests/programs/zero_job.py OUT STRATEGY STAGE STEPS [WORKDIR]

STRATEGY: a `tfdist.make_strategy` name, or ``mirrored:N`` (N in-process replicas, collective ops).
TFDIST_TEST_BUCKET_BYTES: the bucket size; TFDIST_TEST_ACCUM: grad_accum_steps (2); TFDIST_TEST_UNEVEN_HOOKS:
first a fit in which worker 1 alone has a callback with a batch hook (its refusal written to OUT/refused{N}.txt).

Trains `tests.zero_model.model()` on `tests.zero_model.data()` for STEPS steps in all (resuming from WORKDIR's
checkpoint when there is one, saving every 5 steps), then writes OUT/task{N}.npz: its weights and the
optimizer-state figures tfdist reports.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tfdist  # noqa: E402
from tests import zero_model as job  # noqa: E402
from tfdist.distribute import strategies  # noqa: E402
from tfdist.training.fitting import train  # noqa: E402


def main() -> None:
    if os.environ.get("TFDIST_TEST_BUCKET_BYTES"):  # Small buckets: some replicas send nothing in some.
        from tfdist.training.zero import layout

        layout.BUCKET_BYTES = int(os.environ["TFDIST_TEST_BUCKET_BYTES"])
    out, name, stage, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    workdir = sys.argv[5] if len(sys.argv) > 5 else None
    if name.startswith("mirrored:"):  # In-process replicas on MirroredStrategy's collective ops.
        strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=int(name.split(":")[1]), precision="float32")
    else:
        strategy = tfdist.make_strategy(name, precision="float32")
    with strategy.scope():
        model = job.model()
    x, y = job.data()
    accum = int(os.environ.get("TFDIST_TEST_ACCUM", "2"))
    if os.environ.get("TFDIST_TEST_UNEVEN_HOOKS"):
        import keras

        index = strategies.current_backend().worker_index
        hook = [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)] if index == 1 else []
        try:
            train(model, x, y, batch_size=job.BATCH, max_steps=steps, verbose=0, zero_stage=stage, export=(),
                  callbacks=hook)
        except tfdist.UserError as error:
            with open(os.path.join(out, f"refused{index}.txt"), "w") as f:
                f.write(str(error))
    result = train(model, x, y, batch_size=job.BATCH, epochs=1, max_steps=steps, shuffle=False, verbose=0,
                   zero_stage=stage, grad_accum_steps=accum, workdir=workdir, checkpoint_every_steps=5, export=())
    index = strategies.current_backend().worker_index
    np.savez(os.path.join(out, f"task{index}.npz"), *model.get_weights(),
             state=json.dumps(result.optimizer_state), steps=result.steps)


if __name__ == "__main__":
    main()
