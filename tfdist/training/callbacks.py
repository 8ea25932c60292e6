"""The user's Keras callbacks: which run on a task, and which per-batch hooks they really have."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras

from tfdist.distribute.backend import Backend


BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


TEST_BATCH_HOOKS = ("on_test_batch_begin", "on_test_batch_end")


PREDICT_BATCH_HOOKS = ("on_predict_batch_begin", "on_predict_batch_end")


def has_batch_hooks(callbacks: Any, hooks: Sequence[str] = BATCH_HOOKS) -> bool:
    """Whether any of `callbacks` overrides one of the per-batch `hooks` (Keras marks the base ones as defaults)
    to some effect: Keras' ModelCheckpoint and BackupAndRestore saving per epoch, and a TensorBoard writing per
    epoch without profiling, do nothing in them (their hooks are still called, once per execution)."""
    from keras.src.utils.python_utils import is_default

    return any(not is_default(getattr(cb, name)) for cb in callbacks if not _inert_batch_hooks(cb)
               for name in hooks)


def _inert_batch_hooks(callback: Any) -> bool:
    if isinstance(callback, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)):
        return type(callback) in (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore) and \
            getattr(callback, "save_freq", None) == "epoch"
    if type(callback) is keras.callbacks.TensorBoard:
        return callback.update_freq == "epoch" and not getattr(callback, "_stop_batch", 0)
    return False


def finalize_optimizer(model: keras.Model, backend: Backend, zero: Any = None) -> None:
    """What Keras' fit does after the last epoch: ``finalize_variable_values`` (EMA weights, ``use_ema``);
    a sharded optimizer state (`tfdist.training.zero`) on each replica."""
    if zero is not None:
        zero.finalize()
        return
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        with backend.scope():
            optimizer.finalize_variable_values(model.trainable_weights)


# Keras callbacks that write files: on a multi-worker job only the chief runs them, so workers
# never race on shared storage. BackupAndRestore also reads: every task restores, the chief writes.
FILE_WRITERS = (keras.callbacks.TensorBoard, keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger)


class _RestoreOnly(keras.callbacks.Callback):
    """A `BackupAndRestore` on a non-chief task: it restores at the start and writes nothing."""

    def __init__(self, callback: keras.callbacks.Callback):
        super().__init__()
        self.callback = callback

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        self.callback.set_params(params)

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.callback.on_train_begin(logs)


def callbacks_for_task(callbacks: list, backend: Backend) -> list:
    """The user's callbacks this task runs: all on the chief; on other workers none that write files."""
    if backend.is_chief:
        return callbacks
    kept = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            kept.append(_RestoreOnly(callback))
        elif not isinstance(callback, FILE_WRITERS):
            kept.append(callback)
    return kept
