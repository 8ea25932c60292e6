"""The user's Keras optimizer on one replica's flat shards: a clone of its class and settings built on one
flat variable per bucket, with what Keras computes per variable made exact over shards.

Elementwise updates (SGD, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Ftrl, Lion), the
learning-rate schedule (the user's own object, shared), ``clipvalue``, EMA and Keras' gradient accumulation
run as Keras' own code on the shard. Per-variable rules get what they need:
- weight decay and its exclusions (by variable or name): a per-element mask of the variables that decay;
- ``clipnorm`` and ``global_clipnorm``: per-variable partial square sums, all-reduced (`ShardedOptimizer`);
- LAMB's trust ratio: per-variable partial norms of the weights and the update, all-reduced, then Keras'
  formula per element (`lamb_update_step`).
Anything else whose update is not elementwise (Adafactor's factored moments, Muon's orthogonalised update,
a class with its own ``update_step``) is refused before any step (`check_supported`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer

from tfdist.errors import UserError
from tfdist.training import keras_hooks
from tfdist.training.zero import tf_private

# The TensorFlow optimizer overrides these to go through the strategy (merge calls, mirrored slots); a clone
# on one replica's shards uses Keras' backend-agnostic versions, or tfdist's (`_tfdist_<name>` on the clone).
_PLAIN_METHODS = ("add_variable_from_reference", "_backend_update_step", "_apply_weight_decay",
                  "_overwrite_model_variables_with_average_value", "_backend_increment_gradient_accumulators")
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion")


def _update_steps() -> dict:
    return {getattr(keras.optimizers, n).update_step: n for n in _ELEMENTWISE if hasattr(keras.optimizers, n)}


def is_lamb(optimizer: Any) -> bool:
    lamb = getattr(keras.optimizers, "Lamb", None)
    return lamb is not None and type(optimizer).update_step is lamb.update_step


def check_supported(optimizer: Any) -> None:
    """Refuses an optimizer whose update of a variable reads more than its own elements (before any step)."""
    if type(optimizer).update_step in _update_steps() or is_lamb(optimizer):
        return
    name = type(optimizer).__name__
    why = {"Adafactor": "its factored second moments are a row and a column statistic of each whole matrix",
           "Muon": "its update orthogonalises each whole matrix (Newton-Schulz iterations)"}.get(
        name, "its update_step is not one of Keras' elementwise optimizers' (SGD, Adam, AdamW, Adamax, Nadam, "
              "RMSprop, Adagrad, Adadelta, Ftrl, Lion) or Lamb's, so tfdist cannot tell whether it reads only "
              "each element's own gradient and state")
    raise UserError(f"zero_stage cannot shard {name}: each replica updates an equal flat 1/N of the weights' "
                    f"elements, which may cut a variable in two, and {why}. An update that needs a whole "
                    "variable cannot be made exact on a piece of it. Use zero_stage=0 for this optimizer, or "
                    "one of Keras' elementwise optimizers or Lamb.")


def check_variables(variables: Any, stage: int) -> None:
    """Refuses a trainable variable Keras overwrites with its gradient (float8 training's scales)."""
    from tfdist.training.overwrites import is_overwritten

    for v in variables:
        if is_overwritten(v):
            raise UserError(f"zero_stage={stage} cannot shard {v.path}: Keras overwrites it with its gradient (the "
                            "scales and amax histories of float8 training), the largest over the replicas' batches, "
                            "where a sharded optimizer steps each replica's slice of the summed gradients. Use "
                            "zero_stage=0 for a float8 model.")


@contextlib.contextmanager
def plain_variables(any_length: bool = False) -> Iterator[None]:
    """Variables created here are plain, on the current device, even inside a strategy's scope; with
    `any_length`, of a length TensorFlow does not fix (1-D), so a step can free one's buffer by assigning it
    no elements (Keras' own shape of it stays the first)."""
    def create(next_creator: Any, **kwargs: Any) -> Any:
        if any_length:
            kwargs["shape"] = tf.TensorShape([None])
        return tf_private.plain_variable(**kwargs)

    with tf.variable_creator_scope(create):
        yield


@contextlib.contextmanager
def plain_methods() -> Iterator[None]:
    """While a clone is built or traced: the TensorFlow optimizer's strategy-bound methods defer to tfdist's
    (``_tfdist_<name>`` on the clone) or Keras' backend-agnostic ones for tfdist's clones (`_tfdist_plain`),
    and stay Keras' own for every other optimizer."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    def plain(name: str) -> Callable:
        def make(before: Any, key: tuple) -> Any:
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                if not getattr(self, "_tfdist_plain", False):
                    return before(self, *args, **kwargs)
                own = self.__dict__.get("_tfdist" + name)
                return own(*args, **kwargs) if own is not None else getattr(BaseOptimizer, name)(self, *args, **kwargs)
            return method
        return make

    with contextlib.ExitStack() as stack:
        for name in _PLAIN_METHODS:
            stack.enter_context(keras_hooks._replaced(TFOptimizer, name, plain(name), this_thread=False))
        yield


def clone(optimizer: Any) -> Any:
    """A new optimizer of the user's class and settings (its learning rate set to the user's own after)."""
    rate = optimizer.__dict__["_learning_rate"]
    try:
        # Read with a plain rate: a schedule need not be serializable (the clone shares the user's own), and
        # set back on every path.
        optimizer.__dict__["_learning_rate"] = 0.0
        try:
            config = dict(optimizer.get_config())
        finally:
            optimizer.__dict__["_learning_rate"] = rate
        made = type(optimizer).from_config(config)
    except Exception as e:  # A user's class whose config does not rebuild it.
        raise UserError(f"zero_stage makes one copy of the optimizer per replica from its get_config(), and "
                        f"{type(optimizer).__name__} could not be rebuilt from it ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}). Give the class a get_config()/from_config() that "
                        "rebuilds it, or use zero_stage=0.") from None
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if hasattr(optimizer, name):
            setattr(made, name, getattr(optimizer, name))
    made._learning_rate = optimizer._learning_rate  # The user's: its variable callbacks set, its schedule.
    made._tfdist_plain = True
    return made


def masked_weight_decay(optimizer: Any, masks: list) -> Callable[[list], None]:
    """Keras' ``_apply_weight_decay`` on flat shards: ``variable - variable * wd * lr`` on the elements of
    variables that decay (`masks`: one [shard] 0/1 vector per shard, or None where every element decays)."""
    def apply(variables: list) -> None:
        if optimizer.weight_decay is None:
            return
        for variable, mask in zip(variables, masks):
            if mask is not None and not mask.any():
                continue
            lr = keras.ops.cast(optimizer.learning_rate, variable.dtype)
            wd = keras.ops.cast(optimizer.weight_decay, variable.dtype)
            if mask is not None:
                wd = wd * tf.constant(mask, variable.dtype)
            variable.assign(variable - variable * wd * lr)
    return apply
