"""What fit, evaluate and predict share before and around their steps: the backend, the model built under
its scope, and the wrappers that release the step runner and name bad embedding ids."""

from __future__ import annotations

import functools
from typing import Any

import keras
import tensorflow as tf

from tfdist.distribute import adopting, strategies
from tfdist.distribute.backend import Backend
from tfdist.errors import UserError, error_text
from tfdist.training import columns, custom_steps, inputs
from tfdist.training.controller import Preempted


# Strategy and model ---------------------------------------------------------------
def backend_for(strategy: Any, model: Any = None) -> Backend:
    """The backend of `strategy` (make_strategy's, or the program's own tf.distribute strategy, wrapped: `adopting`);
    without one, of the strategy `model` was built under; else of the last make_strategy (TensorFlow's default)."""
    if strategy is None and model is not None:
        strategy = adopting.model_strategy(model)
    if strategy is not None:
        return adopting.backend_for_strategy(strategy)
    return strategies.current_backend()


def backend_used(strategy: Any, model: Any) -> Any:
    """The backend `backend_for` gave this call, or None (never raises: for the way out)."""
    if strategy is None and model is not None:
        strategy = adopting.model_strategy(model)
    if strategy is None:
        return strategies._CURRENT[0] if strategies._CURRENT else None
    return adopting.known_backend(strategy)


def build(model: keras.Model, backend: Backend, example: tuple, *, optimizer_state: bool = True) -> None:
    """Creates all model, metric and optimizer state, under the strategy's scope (``optimizer_state=False``:
    not the optimizer's, which a sharded optimizer keeps instead: `tfdist.training.zero`)."""
    x, y, sample_weight = example
    if (custom_steps.overrides(model, "train_step") or custom_steps.overrides(model, "test_step")) and \
            not custom_steps.has_call(model):
        return  # Nothing to call: its parts are built, and its step is traced before any step (custom_steps.probe).
    optimizer = model.optimizer
    unbuilt = not optimizer_state and not optimizer.built
    with backend.scope():
        try:
            if unbuilt:  # Keras builds an unbuilt optimizer here: marked built while the model builds.
                optimizer.built = True
            data = inputs.map_present(columns.symbolic, (inputs.absent_as_none(x), y, sample_weight))
            model._symbolic_build(data_batch=data)  # Text as tf.string, as Keras' adapters hand it over.
        except (ValueError, TypeError) as e:
            raise UserError(f"The model cannot take these inputs: {error_text(e)}") from None
        finally:
            if unbuilt:
                optimizer.built = False


# The public function ---------------------------------------------------------------
def releasing_the_runner(fit_fn: Any) -> Any:
    """Each fit call ends its backend's step-runner thread on the way out, whether it returns or raises."""
    @functools.wraps(fit_fn)
    def fit_and_release(*args: Any, **kwargs: Any) -> Any:
        finished = False
        try:
            history = fit_fn(*args, **kwargs)
            finished = True
            return history
        except Preempted:
            finished = True  # Every task stopped together and saved.
            raise
        finally:
            backend = backend_used(kwargs.get("strategy"), kwargs.get("model", args[0] if args else None))
            if backend is not None:
                backend.release_runner(finished=finished)
    return fit_and_release


def naming_bad_ids(fn: Any) -> Any:
    """A step that failed `ShardedEmbedding`'s id check raises its one-paragraph `UserError` instead."""
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except tf.errors.InvalidArgumentError as e:
            from tfdist.layers.sharded_embedding import id_error

            clear = id_error(e)
            if clear is None:
                raise
            raise clear from None
    return checked
