"""Two MultiWorkerMirrored workers whose callbacks differ per task, as a job's do.

`nan`: every worker trains with a TensorBoard callback (only the chief runs it, and it has
per-batch hooks) on NaN data with stop_on_nonfinite=True; both must stop with the non-finite error,
not hang with one execution more in flight on one of them.
`backup`: each worker's BackupAndRestore points at a directory of its own, so only the chief
finds the backup it wrote; the workers must refuse to start from different steps.
"""

import sys

import keras

import tfdist
from callbacks_per_task import Interrupt, setup  # Beside this file (the script's directory is on sys.path).


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    _, index, model, x, y = setup()
    if mode == "nan":
        y[:] = float("nan")  # Every step's loss is NaN: the first execution fails on both workers.
        tfdist.fit(model, x, y, batch_size=32, epochs=2, verbose=0, steps_per_execution=2, stop_on_nonfinite=True,
                   callbacks=[keras.callbacks.TensorBoard(f"{out}/tb", update_freq="batch")])
        return
    backup = keras.callbacks.BackupAndRestore(f"{out}/backup{index}")
    try:
        tfdist.fit(model, x, y, batch_size=32, epochs=3, callbacks=[backup, Interrupt()], verbose=0)
    except RuntimeError:
        pass
    tfdist.fit(model, x, y, batch_size=32, epochs=3, verbose=0,
               callbacks=[keras.callbacks.BackupAndRestore(f"{out}/backup{index}")])


if __name__ == "__main__":
    main()
