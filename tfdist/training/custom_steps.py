"""Models that override ``train_step`` or ``test_step``: the user's own step, on every backend.

Keras 3's ``fit`` calls a custom ``train_step`` once per replica and leaves the
distribution to it: under tf.distribute the optimizer sums the gradients it is
given across replicas, which is right only for losses that went through
Keras' own per-replica scaling (``compute_loss``); a loss the step computes
itself then trains with N times the gradient (keras-team/keras#19308), and
Horovod's or parameter-server workers are not seen at all. tfdist runs the
user's step per replica inside its own execution (`tfdist.training.steps`)
and changes three things while that step is being traced, all undone before
the trace returns (`tfdist.training.keras_hooks`):

- Keras sees one replica (``one_replica_losses``): every loss the step
  computes, through ``compute_loss`` or its own, is the one-device loss of the
  replica's batch.
- ``apply`` of every optimizer the model holds (`optimizers_of`: ``model.
  optimizer`` and any optimizer attribute, as a GAN's ``d_optimizer`` and
  ``g_optimizer``) receives the *global-batch* gradients: each replica's
  gradients weighted by its share of the step's examples, ``n_r / N``, and
  summed across replicas and workers before the optimizer, its ``clipnorm``
  and a loss-scale finite check see them (`GlobalGradients`). For a step whose
  loss is a mean over its batch (Keras' losses by default) this is the
  one-device gradient of the global batch, whatever the replica count.
- Keras' own cross-replica sum inside the optimizer is the identity
  (``no_gradient_sum``), as for tfdist's built-in step.

The logs the step returns reach History and callbacks under the same keys.
A key that is the name of one of ``model.metrics``' results gets that result
from the metrics' state summed over every replica and step of the epoch (what
Keras' ``fit`` reports at an epoch's end); any other value is the last step's,
averaged over the replicas weighted by their examples (exact for a batch mean).

Before any step, `probe` traces the step once on a symbolic batch (nothing
runs): it builds every optimizer under the strategy's scope (Keras builds an
unbuilt one inside the step, where a compiled or scheduled function cannot
create variables), learns the log keys, and refuses what cannot be honoured
with a `UserError`: variables the step itself creates, ``optimizer.apply`` on
variables from outside the strategy's scope, and log values that are not
scalars.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.errors import UserError
from tfdist.training import keras_hooks


def overrides(model: keras.Model, name: str) -> bool:
    """Whether the model's class overrides Keras' TensorFlow ``train_step``/``test_step``/``predict_step``."""
    keras_own = [c.__dict__[name] for c in type(model).__mro__
                 if c.__module__.startswith("keras.src.backend.tensorflow") and name in c.__dict__]
    return bool(keras_own) and getattr(type(model), name) is not keras_own[0]


def optimizers_of(model: keras.Model) -> list:
    """``model.optimizer`` and every other optimizer the model holds as an attribute (a GAN's two)."""
    found, seen = [], set()
    candidates = [getattr(model, "optimizer", None)] + list(vars(model).values())
    for value in candidates:
        if isinstance(value, (list, tuple)):
            candidates.extend(value)
            continue
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)
    return found


def keras_data(element: tuple) -> Any:
    """What Keras passes a custom step for one element of tfdist's pipeline.

    tfdist's batches are tuples ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``;
    Keras passes ``x`` alone when there is no ``y`` (``pack_x_y_sample_weight``).
    """
    if isinstance(element, tuple) and len(element) == 1 and not isinstance(element[0], (list, tuple)):
        return element[0]
    return element


def batch_size(data: Any) -> tf.Tensor:
    return tf.shape(tf.nest.flatten(data)[0])[0]


class _StepState(threading.local):
    """Per replica thread (MirroredStrategy runs each local replica on a thread of its own)."""

    examples: Optional[tf.Tensor] = None  # This replica's examples in the step (float32).
    share: Optional[tf.Tensor] = None  # n_r / N.
    finite: Optional[list] = None  # Whether each apply's global gradients were finite.
    checking: bool = False  # In `probe`: check the variables, reduce nothing.
    applying: int = 0  # Inside an optimizer's apply (an inner optimizer's apply is not hooked again).
    claimed: Any = None  # Parameter servers: the step's claim, made at its first apply.


class _Unbuilt(Exception):
    """Raised from inside a probe trace at an unbuilt optimizer's first ``apply``."""


class GlobalGradients:
    """Hooks each optimizer's ``apply`` so the gradients it receives are the global batch's."""

    def __init__(self, optimizers: Sequence[Any], backend: Backend, *, error: Callable[[str], Exception]):
        self.optimizers = list(optimizers)
        self.backend = backend
        self.error = error
        self.state = _StepState()
        self.unbuilt: list = []  # (optimizer, variables) found unbuilt by `probe` (any thread).
        self.refused: list = []  # UserErrors raised inside a trace (autograph rewraps them; `probe` re-raises).

    @contextlib.contextmanager
    def replica_step(self, examples: tf.Tensor, total: tf.Tensor) -> Iterator[None]:
        """Around one replica's call of the user's step (compiled, in the replica's context)."""
        state = self.state
        state.examples = tf.cast(examples, tf.float32)
        state.share = tf.math.divide_no_nan(state.examples, tf.cast(total, tf.float32))
        state.finite = []
        state.claimed = None
        try:
            with self.hooks():
                yield
        finally:
            state.examples = state.share = None

    def all_finite(self) -> tf.Tensor:
        finite = self.state.finite or []
        return tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers:
                stack.enter_context(keras_hooks.no_gradient_sum(opt))
                if self.backend.asynchronous:
                    stack.enter_context(keras_hooks.atomic_iterations(opt))
                stack.enter_context(keras_hooks._replaced(opt, "apply", self._hooked_apply(opt), this_thread=False))
            yield

    def _hooked_apply(self, opt: Any) -> Callable:
        hooks = self

        def make(before: Any, key: tuple) -> Callable:
            keras_own = type(opt).apply.__get__(opt) if before is keras_hooks._MISSING else before

            def apply(grads: Any, trainable_variables: Any = None) -> Any:
                state = hooks.state
                if not keras_hooks._acting(key) or state.applying:
                    return keras_own(grads, trainable_variables)
                grads = list(grads)
                variables = list(trainable_variables) if trainable_variables is not None else None
                hooks._check_variables(opt, variables)
                if state.checking and not opt.built and variables is not None:
                    hooks.unbuilt.append((opt, variables))  # Built by `probe` outside the step, then traced again.
                    raise _Unbuilt()
                if not state.checking:
                    grads = hooks._global(grads)
                state.applying += 1
                try:
                    if state.checking or not hooks.backend.asynchronous:
                        return keras_own(grads, variables)
                    # Parameter servers: the step claims once, at its first update, and applies every
                    # update only if no earlier run of its execution did (`parameter_server.ProgressSlots`).
                    if state.claimed is None:
                        state.claimed = hooks.backend.claim(grads)
                    hooks.backend.when_claimed(state.claimed, lambda: keras_own(grads, variables))
                    return None
                finally:
                    state.applying -= 1

            return apply

        return make

    def _check_variables(self, opt: Any, variables: Optional[list]) -> None:
        extended = getattr(self.backend.strategy, "extended", None)
        if variables is None or extended is None or not tf.distribute.has_strategy():
            return
        for variable in variables:
            if not extended.variable_created_in_scope(tf_variable(variable)):
                self.refused.append(self.error(
                    f"The custom train_step calls {type(opt).__name__}.apply on variable "
                    f"{getattr(variable, 'path', variable.name)}, which was not created under the strategy's scope; "
                    "its updates could not reach the other replicas. Create every layer and variable the step "
                    "trains inside `with strategy.scope():` (with the strategy from tfdist.make_strategy)."))
                raise self.refused[-1]

    def _global(self, grads: list) -> list:
        """This replica's gradients weighted by n_r / N, summed over all replicas (the global batch's)."""
        state = self.state
        share = state.share

        def weigh(g: Any) -> Any:
            if g is None:
                return None
            if isinstance(g, tf.IndexedSlices):
                return tf.IndexedSlices(g.values * tf.cast(share, g.values.dtype), g.indices, g.dense_shape)
            # A replica with no example of a short last batch (its mean loss is 0/0) adds nothing.
            return tf.where(share > 0, g * tf.cast(share, g.dtype), tf.zeros_like(g))

        reduced = self.backend.finish_gradients([weigh(g) for g in grads])
        values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in reduced if g is not None]
        if values and state.finite is not None:
            state.finite.append(tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values]))
        return reduced


class LogLayout:
    """The tail of the totals vector that holds the last step's non-metric logs (weighted by examples).

    Slot 0 is the step's examples on this replica; slot 1+i is log i times them.
    Each step replaces the tail (Keras reports a custom step's last logs).
    """

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.size = 1 + len(self.keys)

    def pack(self, examples: tf.Tensor, logs: dict) -> tf.Tensor:
        n = tf.cast(examples, tf.float32)
        logs = flatten_logs(logs)
        values = [tf.where(n > 0, tf.reshape(tf.cast(logs[k], tf.float32), []) * n, 0.0) for k in self.keys]
        return tf.stack([n] + values)

    def results(self, tail: np.ndarray) -> dict[str, float]:
        n = float(tail[0])
        return {k: (float(tail[1 + i]) / n if n else float("nan")) for i, k in enumerate(self.keys)}


def flatten_logs(logs: dict) -> dict:
    """Nested dicts of logs (``CompileMetrics.result()``) flattened into one, sorted, as Keras' fit does."""
    flat: dict = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(flatten_logs(value))
        else:
            flat[str(key)] = value
    return flat


def _symbolic_spec(example: Any) -> Any:
    def spec(value: Any) -> Any:
        if value is None:
            return None
        shape = tuple(value.shape)
        dtype = value.dtype if isinstance(value.dtype, tf.DType) else tf.as_dtype(keras.backend.standardize_dtype(
            value.dtype))
        return tf.TensorSpec((None, *shape[1:]), dtype)

    return tf.nest.map_structure(spec, example)


def probe(model: keras.Model, backend: Backend, name: str, example: Any, hooks: GlobalGradients,
          error: Callable[[str], Exception]) -> list[str]:
    """Traces the user's ``name`` step once on a symbolic batch; returns its log keys (checks, module docstring).

    ``example``: the element structure the step gets (`keras_data`), arrays or
    Keras tensors with a batch dimension.
    """
    step = getattr(model, name)
    spec = _symbolic_spec(example)
    created: list = []
    keys: list[str] = []

    attempted: list[str] = []
    refused: list[Exception] = []  # Raised inside the trace, where autograph would rewrap them.

    def refuse(message: str) -> Exception:
        refused.append(error(message))
        return refused[-1]

    def record(next_creator: Callable, **kwargs: Any) -> Any:
        attempted.append(str(kwargs.get("name") or "Variable"))
        variable = next_creator(**kwargs)
        created.append(variable)
        return variable

    def foreign_error(names: Sequence[str]) -> Exception:
        return error(
            f"{type(model).__name__}.{name}() creates variables that are not the model's, its metrics' or its "
            f"optimizers' ({', '.join(sorted(set(names))[:3])}); a distributed step cannot keep such state in "
            "step on every replica. Create them in __init__ (or build()) under the strategy's scope, as layer or "
            "model weights (self.add_weight), and only use them in the step.")

    def known_names() -> set:
        every = list(model.variables) + [v for m in model.metrics for v in m.variables] + \
            [v for opt in optimizers_of(model) for v in opt.variables]
        return {tf_variable(v).name.split(":")[0].split("/")[-1] for v in every} | {v.name for v in every}

    def replica(data: Any) -> Any:
        hooks.state.checking = True
        try:
            with keras_hooks.one_replica_losses(), hooks.hooks():
                logs = step(data)
        finally:
            hooks.state.checking = False
        if not isinstance(logs, dict):
            raise refuse(f"{type(model).__name__}.{name}() returned {type(logs).__name__}, not a dict of logs; "
                        "return a dict such as {m.name: m.result() for m in self.metrics}, as Keras expects.")
        for key, value in flatten_logs(logs).items():
            shape = getattr(value, "shape", ())
            if shape is not None and len(shape) > 0 and int(np.prod([d if d is not None else 2 for d in shape])) != 1:
                raise refuse(
                    f"{type(model).__name__}.{name}() returns the log {key!r} with shape {tuple(shape)}; every log "
                    "value must be a scalar (tfdist averages it over the replicas and shows it in History). "
                    "Reduce it in the step (e.g. keras.ops.mean) or track it with a keras.metrics.Mean.")
            if str(key) not in keys:
                keys.append(str(key))
        return tf.constant(0)

    def traced(data: Any) -> Any:
        return backend.run(replica, (data,))

    with backend.scope(), tf.variable_creator_scope(record):
        for _ in range(len(optimizers_of(model)) + 1):
            hooks.unbuilt.clear()
            hooks.refused.clear()
            keys.clear()
            attempted.clear()
            try:
                tf.function(traced).get_concrete_function(spec)
            except Exception as e:
                if refused or hooks.refused:
                    raise (refused + hooks.refused)[0] from None
                strangers = [n for n in attempted if n not in known_names()]
                if strangers and not hooks.unbuilt:  # Under a strategy the creation itself may fail.
                    raise foreign_error(strangers) from None
                if not hooks.unbuilt:
                    raise error(f"{type(model).__name__}.{name}() failed on a batch of this input: "
                                f"{type(e).__name__}: {' '.join(str(e).split())[:400]}") from None
                # Keras builds an optimizer at its first apply; a replica step cannot create its variables.
                for opt, variables in hooks.unbuilt:
                    if not opt.built:
                        with keras_backend.name_scope(opt.name, caller=opt):  # As Keras' own apply builds it.
                            opt.build(variables)
                        opt.built = True
                continue
            break
    # Layers built on first use and optimizers built by their first apply are the model's own state.
    known = {id(tf_variable(v)) for v in list(model.variables) + [v for m in model.metrics for v in m.variables]
             + [v for opt in optimizers_of(model) for v in opt.variables]}
    foreign = [v for v in created if id(v) not in known]
    if foreign:
        raise foreign_error([v.name.split(":")[0] for v in foreign])
    return keys


def has_call(model: keras.Model) -> bool:
    """Whether the model implements ``call`` (a GAN wrapping two models often does not)."""
    return type(model).call not in (keras.Model.call, keras.layers.Layer.call)
