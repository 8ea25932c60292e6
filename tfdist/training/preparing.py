"""What fit, evaluate and predict share before and around their steps: the backend, the model built under
its scope, and the wrappers that release the step runner and name bad embedding ids."""

from __future__ import annotations

import functools
from typing import Any

import keras
import tensorflow as tf

from tfdist.distribute import strategies
from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import custom_steps
from tfdist.training.controller import Preempted


# Strategy and model ---------------------------------------------------------------
def backend_for(strategy: Any) -> Backend:
    if strategy is not None:
        backend = strategies.backend_of(strategy)
        if backend is None:
            raise UserError("The strategy passed to tfdist.fit was not made by tfdist.make_strategy; build it with "
                            "tfdist.make_strategy(name, ...) so tfdist knows its topology.")
        return backend
    return strategies.current_backend()


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
            model._symbolic_build(data_batch=(x, y, sample_weight))
        except (ValueError, TypeError) as e:
            raise UserError(f"The model cannot take these inputs: {' '.join(str(e).split())[:400]}") from None
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
            backend = strategies.backend_of(kwargs["strategy"]) if kwargs.get("strategy") is not None \
                else strategies.current_backend()
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
