"""`tfdist.fit(sync_batchnorm=True)`: every BatchNormalization layer takes the global batch's statistics.

PyTorch's `convert_sync_batchnorm` for a Keras model, for the duration of one `fit`. Keras 3 already has the
layer form, `BatchNormalization(synchronized=True)`, which tfdist honours on every synchronous backend
(`keras_hooks.synchronized_moments`); the option sets that attribute on every `BatchNormalization` of the
model (nested models and layers included) before the step functions are traced, and gives each layer its own
value back when `fit` ends, however it ends. While it is set, `get_config()` still reports the layer's own
value, so a model saved during `fit` (ModelCheckpoint, the run directory's export) is the user's model.

Without the option, `fit` says once per process (on the chief), at its start, when several replicas each
normalize by a batch smaller than `SMALL_BATCH` examples (docs/training.md#batchnormalization-and-other-layer-state).

Where the option changes nothing, it is left alone: on one replica, and under parameter servers, where each
step is one worker's whole global batch (its statistics are the global batch's already).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import keras
import numpy as np
from absl import logging

from tfdist.errors import UserError

# Per-replica batches below this many examples get the warning: 32 is the batch a device normalizes in the
# usual ImageNet recipes (Goyal et al., 2017), and Wu & He (Group Normalization, 2018) measure
# BatchNormalization's error rising as it falls below 32; keras.io's Siamese program (issue 40: 8 a replica
# on 2 replicas) lost 6 points of accuracy against one device. Larger batches stay quiet.
SMALL_BATCH = 32

_changed = threading.local()  # .stack: per fit call in progress, the (layer, its own get_config) it changed.
_warned = False  # Once per process: the advice does not change from one fit to the next.


def batch_norm_layers(model: keras.Model) -> list:
    """Every `keras.layers.BatchNormalization` (subclasses included) in `model`, nested ones included."""
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization)]


def restoring(fit_fn: Callable) -> Callable:
    """Decorates `train`: the layers `apply` synchronized during the call get their own value back on every
    exit path (a return, an exception, KeyboardInterrupt)."""
    @functools.wraps(fit_fn)
    def fit_restoring(*args: Any, **kwargs: Any) -> Any:
        stack = _stack()
        stack.append([])
        try:
            return fit_fn(*args, **kwargs)
        finally:
            _restore(stack.pop())
    return fit_restoring


def apply(model: keras.Model, backend: Any, micro_batch: int, enabled: Any) -> None:
    """At fit's start (after the model is built, before the step functions): synchronizes the model's
    BatchNormalization layers if `enabled` and several synchronous replicas share each step; else, where
    their per-replica batches (`micro_batch` examples) are small, says so once."""
    if not isinstance(enabled, (bool, np.bool_)):
        raise UserError(f"sync_batchnorm={enabled!r} must be True or False.")
    local = [layer for layer in batch_norm_layers(model) if not layer.synchronized]
    if not local or backend.num_replicas < 2 or backend.asynchronous:
        return  # Each step's statistics are already the global batch's (one replica; a ps worker's step).
    if enabled:
        changed = _stack()[-1]
        for layer in local:
            changed.append((layer, vars(layer).get("get_config")))
            _synchronize(layer)
    elif micro_batch < SMALL_BATCH and backend.is_chief:  # The chief speaks for a multi-worker job.
        _warn_once(small_batch_warning(len(local), backend.num_replicas, micro_batch))


def small_batch_warning(layers: int, replicas: int, micro_batch: int) -> str:
    """The text of the warning: what differs from one device and the option that makes it the same."""
    return (f"The model has {layers} BatchNormalization layer(s) that normalize each replica's batch by its "
            f"own statistics, and each of the {replicas} replicas takes {micro_batch} example(s) a step (under "
            f"{SMALL_BATCH}): training can differ from one device (Keras' own fit under a strategy does the "
            "same). Pass tfdist.fit(..., sync_batchnorm=True) to normalize by the global batch's statistics, "
            "exactly as one device does (its cost: a few small all-reduces per layer and step), or build the "
            "layers with BatchNormalization(synchronized=True). Said once per process.")


def _warn_once(text: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logging.warning("%s", text)


def _stack() -> list:
    if not hasattr(_changed, "stack"):
        _changed.stack = []
    return _changed.stack


def _synchronize(layer: keras.layers.BatchNormalization) -> None:
    """Sets the attribute Keras' `BatchNormalization._moments` reads when the step is traced; `get_config`
    keeps reporting the layer's own value (False) meanwhile."""
    own: Optional[Callable[[], dict]] = vars(layer).get("get_config")

    def get_config() -> dict:
        config = own() if own is not None else type(layer).get_config(layer)
        return {**config, "synchronized": False}

    layer.synchronized = True
    layer.get_config = get_config


def _restore(changed: list) -> None:
    """Each layer's own `synchronized` (False: only those were changed) and `get_config`, last first."""
    for layer, own in reversed(changed):
        layer.synchronized = False
        if own is not None:
            layer.get_config = own
        else:
            vars(layer).pop("get_config", None)
