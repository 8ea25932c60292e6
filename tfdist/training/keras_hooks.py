"""The Keras internals tfdist's step relies on, and the hooks it sets in them while that step is traced.

tfdist's training step (`tfdist.training.steps`) differs from Keras' own in
three places, each of which goes through a private Keras name:

- Under tf.distribute Keras divides each loss by ``num_replicas_in_sync``
  (``keras.src.losses.loss.scale_loss_for_distribution``, used by the mean
  reductions of `keras.losses.Loss` and by the TensorFlow trainer's
  ``_aggregate_additional_loss``) and multiplies it back for the loss metrics
  (``unscale_loss_for_distribution``, in ``CompileLoss``). A ``compute_loss``
  override that returns a plain mean escapes the division, and Horovod's
  replicas are invisible to it. tfdist therefore makes Keras see one replica
  (`one_replica_losses`): every replica's loss is Keras' one-device loss of its
  (micro-)batch, and tfdist alone scales it into its share of the global-batch loss.
- Keras' TensorFlow optimizer sums the gradients across replicas inside
  ``apply`` (``_all_reduce_sum_gradients``); tfdist has already summed them
  (before clipping and the loss-scale finite check), so `no_gradient_sum` makes
  that sum the identity in the model's optimizer and in every one it wraps
  (`wrapped_optimizers`: a loss scale's, a ``MultiOptimizer``'s), and merges a
  sparse increment's repeated rows, so every worker applies it bit for bit alike.
- Under parameter servers, ``optimizer._iterations.assign_add`` must be an atomic
  increment (`atomic_iterations`).

One TensorFlow internal, too: `forgetting_traced_gradients` drops the gradient functions that
``tf.custom_gradient`` (``ReplicaContext.all_reduce``) registers for good while an execution is traced;
each kept its whole traced graph alive after the function was gone (issue 40).

Python runs only while a ``tf.function`` is traced, so these hooks are entered
around the Keras calls inside tfdist's traced step and left (in ``finally``)
before the trace returns: the user's optimizer, its step counter and Keras'
module functions are untouched whenever any other code runs. A replacement also
acts only for the thread that entered it (another thread calling Keras during
a trace gets Keras' own loss scaling; the optimizer's hooks act on every
thread, see `_replaced`), and nested or concurrent entries restore the
original once, when the last one leaves.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, Callable, Iterator, Optional

import keras
import tensorflow as tf
from keras.src.losses import loss as loss_module

from tfdist.errors import UserError

_MISSING = object()
_lock = threading.RLock()
_installed: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [owner, value before, entries].
_local = threading.local()  # Per thread: which replacements act, and the unscale factors in force.
_everywhere: dict[tuple[int, str], int] = {}  # Replacements that act for every thread (entries).


def optimizers(optimizer: Any) -> list:
    """The optimizer and, for a `LossScaleOptimizer`, the one it wraps."""
    found = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        found.append(inner)
    return found


def wrapped_optimizers(optimizer: Any) -> list:
    """The optimizer and every Keras optimizer it wraps, at any depth: a `LossScaleOptimizer`'s, a
    `MultiOptimizer`'s, or a user's wrapper's, found among its attributes (alone, or in a list, tuple or dict).

    Each applies the gradients it is given with Keras' own ``apply``, which sums them across replicas: every
    one of them needs tfdist's hooks, not only the outermost.
    """
    found: list = []

    def visit(opt: Any) -> None:
        if any(opt is seen for seen in found):
            return
        found.append(opt)
        for value in list(vars(opt).values()):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else (value,)
            for item in list(items):
                if isinstance(item, keras.optimizers.Optimizer):
                    visit(item)

    visit(optimizer)
    return found


def check_internals(model: keras.Model, *, asynchronous: bool = False) -> None:
    """Raises a `UserError` naming each Keras internal tfdist needs that this Keras lacks."""
    missing = [f"keras.src.losses.loss.{name}" for name in ("scale_loss_for_distribution",
                                                            "unscale_loss_for_distribution")
               if not callable(getattr(loss_module, name, None))]
    for name in ("_compute_loss", "_aggregate_additional_loss", "_get_regularization_losses", "_flatten_layers",
                 "_loss_tracker", "_compile_loss", "_losses_override"):
        if not hasattr(model, name):
            missing.append(f"Model.{name}")
    for opt in wrapped_optimizers(model.optimizer):
        if not callable(getattr(type(opt), "_all_reduce_sum_gradients", None)):
            missing.append(f"{type(opt).__name__}._all_reduce_sum_gradients")
        if asynchronous and not callable(getattr(getattr(opt, "_iterations", None), "assign_add", None)):
            missing.append(f"{type(opt).__name__}._iterations.assign_add")
    if missing:
        raise UserError(
            f"tfdist.fit relies on Keras internals that this Keras ({keras.__version__}) does not have: "
            f"{', '.join(missing)}. Install a Keras 3 release tfdist supports (tested with 3.15.1), e.g. "
            "pip install 'keras==3.15.1'.")


def _acting(key: tuple) -> bool:
    return _everywhere.get(key, 0) > 0 or getattr(_local, "acting", {}).get(key, 0) > 0


@contextlib.contextmanager
def _replaced(owner: Any, name: str, make: Callable[[Any, tuple], Any], *,
              this_thread: bool = True) -> Iterator[None]:
    """Replaces ``owner.name`` by ``make(before, key)`` until the last entry leaves.

    ``before`` is what the attribute was on ``owner`` itself (or `_MISSING`);
    the replacement must defer to Keras' own behaviour when ``_acting(key)`` is
    false: on other threads, unless ``this_thread`` is false (the optimizer's
    hooks: MirroredStrategy runs a `LossScaleOptimizer`'s inner ``apply`` on
    threads of its own, through ``merge_call``). Leaving restores exactly the
    attribute as it was: set again, or deleted if ``owner`` did not have its own.
    """
    key = (id(owner), name)
    module = isinstance(owner, (types.ModuleType, type))  # Set with setattr (an instance: object.__setattr__).
    with _lock:
        entry = _installed.get(key)
        if entry is None:
            before = vars(owner).get(name, _MISSING)
            replacement = make(before, key)  # Registered only once made: a `make` that raises leaves nothing behind.
            setattr(owner, name, replacement) if module else object.__setattr__(owner, name, replacement)
            entry = _installed[key] = [owner, before, 0]
        entry[2] += 1
        acting = _local.__dict__.setdefault("acting", {}) if this_thread else _everywhere
        acting[key] = acting.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            acting[key] -= 1
            entry[2] -= 1
            if entry[2] == 0:
                del _installed[key]
                before = entry[1]
                if before is _MISSING:
                    delattr(owner, name) if module else object.__delattr__(owner, name)
                else:
                    setattr(owner, name, before) if module else object.__setattr__(owner, name, before)


def _factors() -> list:
    return _local.__dict__.setdefault("factors", [])


def _one_replica_scale(original: Callable, key: tuple) -> Callable:
    def scale(value: Any) -> Any:
        return value if _acting(key) else original(value)

    return scale


def _one_replica_unscale(original: Callable, key: tuple) -> Callable:
    def unscale(value: Any) -> Any:
        if not _acting(key):
            return original(value)
        factor = _factors()[-1] if _factors() else None
        return value if factor is None else keras.ops.multiply(value, keras.ops.cast(factor, value.dtype))

    return unscale


@contextlib.contextmanager
def one_replica_losses(unscale_factor: Optional[tf.Tensor] = None) -> Iterator[None]:
    """Keras computes losses as on one device: no division by the replica count.

    Keras' loss metrics multiply each loss by ``unscale_factor`` (none: by 1)
    instead of the replica count: what turns a part's loss into the loss of
    the global batch it belongs to.
    """
    with contextlib.ExitStack() as stack:
        for name, make in (("scale_loss_for_distribution", _one_replica_scale),
                           ("unscale_loss_for_distribution", _one_replica_unscale)):
            original = getattr(loss_module, name)
            stack.enter_context(_replaced(loss_module, name,
                                          lambda before, key, o=original, m=make: m(o, key)))
        _factors().append(unscale_factor)
        try:
            yield
        finally:
            _factors().pop()


def _summed_already(opt: Any) -> Callable:
    def make(before: Any, key: tuple) -> Callable:
        keras_own = type(opt)._all_reduce_sum_gradients.__get__(opt) if before is _MISSING else before

        def all_reduce_sum_gradients(grads_and_vars: Any) -> list:
            return list(grads_and_vars) if _acting(key) else keras_own(grads_and_vars)

        return all_reduce_sum_gradients

    return make


def _merged_rows(opt: Any, name: str) -> Callable:
    def make(before: Any, key: tuple) -> Callable:
        keras_own = getattr(type(opt), name).__get__(opt) if before is _MISSING else before

        def scatter(variable: Any, value: Any) -> Any:
            if _acting(key) and isinstance(value, tf.IndexedSlices):
                rows, position = tf.unique(value.indices)
                value = tf.IndexedSlices(tf.math.unsorted_segment_sum(value.values, position, tf.size(rows)), rows,
                                         value.dense_shape)
            return keras_own(variable, value)

        return scatter

    return make


@contextlib.contextmanager
def no_gradient_sum(optimizer: Any) -> Iterator[None]:
    """Keras' optimizer does not sum the gradients across replicas (tfdist already did), and its sparse
    increments add each row once.

    A row-sparse increment (an Embedding's gradient, Adagrad's squared rows)
    repeats a row once per lookup, and more so once all-gathered from every
    replica. TensorFlow's CPU scatter adds the repeats in whatever order its
    threads take them, so workers given bit-identical gradients drift apart by a
    few ULPs. ``assign_add``/``assign_sub`` therefore sum each row's repeats first
    (`unsorted_segment_sum` adds in input order): the same sum, in a fixed order.
    """
    with contextlib.ExitStack() as stack:
        for opt in wrapped_optimizers(optimizer):
            stack.enter_context(_replaced(opt, "_all_reduce_sum_gradients", _summed_already(opt),
                                          this_thread=False))
            for name in ("assign_add", "assign_sub"):
                stack.enter_context(_replaced(opt, name, _merged_rows(opt, name), this_thread=False))
        yield


def _tf_variable(variable: Any) -> Any:
    return variable if isinstance(variable, tf.Variable) else getattr(variable, "value", variable)


def _atomic(counter: Any) -> Callable:
    def make(before: Any, key: tuple) -> Callable:
        keras_own = type(counter).assign_add.__get__(counter) if before is _MISSING else before

        def assign_add(value: Any) -> Any:
            if not _acting(key):
                return keras_own(value)
            target = _tf_variable(counter)
            return target.assign_add(tf.cast(value, target.dtype))

        return assign_add

    return make


@contextlib.contextmanager
def atomic_iterations(optimizer: Any) -> Iterator[None]:
    """The optimizers' step counters count every step when workers update them concurrently.

    Keras increments ``iterations`` as ``assign(iterations + 1)`` (a read, then a
    write): two parameter-server workers stepping at once lose one increment, and
    learning-rate schedules and Adam's bias correction then run behind (measured:
    228 of 300 steps counted with 2 workers). An atomic ``assign_add`` counts all.
    """
    with contextlib.ExitStack() as stack:
        for opt in wrapped_optimizers(optimizer):
            counter = opt._iterations
            stack.enter_context(_replaced(counter, "assign_add", _atomic(counter), this_thread=False))
        yield


def _moments_over(replica_sum: Callable[[list], list]) -> Callable:
    def make(before: Any, key: tuple) -> Callable:
        from keras.src.backend.tensorflow import nn as tf_nn

        keras_own = tf_nn._compute_moments_sync if before is _MISSING else before

        def moments(x: tf.Tensor, axes: Any, keepdims: bool) -> tuple:
            if not _acting(key):
                return keras_own(x, axes, keepdims)
            local = [tf.reduce_sum(x, axis=axes, keepdims=True), tf.reduce_sum(tf.square(x), axis=axes, keepdims=True),
                     tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True)]
            total, squared, count = replica_sum(local)
            mean = tf.math.divide_no_nan(total, count)  # As Keras' own _compute_moments_sync, over every rank.
            variance = tf.maximum(tf.math.divide_no_nan(squared, count) - tf.square(mean), 0.0)
            if not keepdims:
                mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
            return mean, variance

        return moments

    return make


@contextlib.contextmanager
def synchronized_moments(replica_sum: Optional[Callable[[list], list]]) -> Iterator[None]:
    """``BatchNormalization(synchronized=True)`` takes its batch statistics over every replica.

    Under tf.distribute Keras' own code does it through the replica context;
    Horovod has none, so there (``replica_sum``: a sum over the ranks) the
    statistics' sums go through Horovod instead. Without ``replica_sum``: nothing.
    """
    if replica_sum is None:
        yield
        return
    from keras.src.backend.tensorflow import nn as tf_nn

    with _replaced(tf_nn, "_compute_moments_sync", _moments_over(replica_sum)):
        yield


@contextlib.contextmanager
def forgetting_traced_gradients() -> Iterator[None]:
    """While a ``tf.function`` is traced: the ``CustomGradient-*`` entries registered inside are removed on exit.

    In graph mode ``tf.custom_gradient`` registers each call's gradient function in TensorFlow's
    process-wide gradient registry (``ops._gradient_registry``), never removed; the function's
    closure holds the call's symbolic tensors, so every traced graph with a replica all-reduce
    (``ReplicaContext.all_reduce`` is one) stayed alive, with its nested functions in the eager
    context, after its ``tf.function`` was gone: about 190 MB each fit of a new stacked-LSTM model
    on 2 replicas. The entries are needed only by a ``tf.GradientTape`` inside the same trace (all
    of tfdist's are); nothing differentiates an execution from outside. A TensorFlow without the
    registry's ``_registry`` dict makes this a no-op.
    """
    from tensorflow.python.framework import ops

    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    before = set(registry) if isinstance(registry, dict) else None
    try:
        yield
    finally:
        if before is not None:
            for name in set(registry) - before:
                if isinstance(name, str) and name.startswith("CustomGradient-"):
                    registry.pop(name, None)

