"""tfdist: the Keras 3 training loop that works under every tf.distribute strategy and Horovod.

  import tfdist
  strategy = tfdist.make_strategy("auto")
  with strategy.scope():
      model = ...; model.compile(...)
  history = tfdist.fit(model, x, y, batch_size=64, epochs=10, validation_data=(xv, yv))
  loss, accuracy = tfdist.evaluate(model, x_test, y_test)
  predictions = tfdist.predict(model, x_test)

Public names: `make_strategy`, `fit`, `evaluate` and `predict` (Keras' `Model.evaluate` and
`Model.predict` under the same strategy and input handling), `train_on_batch`, `test_on_batch` and
`predict_on_batch` (theirs of one batch), `is_chief` and `task_path` (a script's
own files on a multi-worker job), `UserError` (what bad input raises; a
`ValueError`), `Preempted` (raised after SIGTERM saved a checkpoint). Layers: `tfdist.layers`
(`ShardedEmbedding`: an embedding table in row shards over parameter servers).
Entry points: `tfdist-train` (the MNIST program, tfdist.cli.train),
`tfdist-launch`, `tfdist-env`. Importing this package does not import
TensorFlow; the first use of a public name does.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"
__all__ = ["make_strategy", "fit", "evaluate", "predict", "test_on_batch", "predict_on_batch", "is_chief", "task_path",
           "UserError", "Preempted", "train_on_batch"]

from tfdist.errors import UserError  # noqa: E402  (no TensorFlow import)


def __getattr__(name: str) -> Any:
    if name == "make_strategy":
        from tfdist.distribute.strategies import make_strategy

        return make_strategy
    if name == "fit":
        from tfdist.training.fitting import fit

        return fit
    if name == "train_on_batch":
        from tfdist.training.on_batch import train_on_batch

        return train_on_batch
    if name in ("evaluate", "test_on_batch"):
        from tfdist.training import evaluating

        return getattr(evaluating, name)
    if name in ("predict", "predict_on_batch"):
        from tfdist.training import predicting

        return getattr(predicting, name)
    if name in ("is_chief", "task_path"):
        from tfdist.distribute import tasks

        return getattr(tasks, name)
    if name == "layers":
        import tfdist.layers

        return tfdist.layers
    if name == "Preempted":
        from tfdist.training.preemption import Preempted

        return Preempted
    raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
