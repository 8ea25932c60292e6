"""Models that override ``train_step`` or ``test_step``: the user's own step, on every backend
(docs/training.md, "train_step/test_step overrides").

tfdist runs the user's step per replica inside its own execution and, while it is traced
(`tfdist.training.keras_hooks`, undone before the trace returns): Keras sees one replica
(``one_replica_losses``); every optimizer the model holds (`optimizers_of`) receives the global batch's
gradients, summed across replicas before it, its clipping and a loss-scale finite check see them
(`GlobalGradients`); Keras' own cross-replica sum is the identity. The step's logs reach History under the
same keys: a metric's result from the state summed over the epoch, any other value the last step's. `probe`
traces the step once before any step: it builds the optimizers, learns the log keys, and refuses (`UserError`)
what cannot be honoured. The step bodies `StepFunctions` runs for such models are at the end of this file.
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
from tfdist.errors import UserError, error_text
from tfdist.training import columns, keras_hooks, overwrites
from tfdist.training.inputs import absent_as_none
from tfdist.training.layer_state import RecordingScope, write_state
from tfdist.training.metric_state import flatten_logs


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
    Keras passes ``x`` alone when there is no ``y`` (``pack_x_y_sample_weight``). An optional input given none
    is None again (`inputs.absent_as_none`).
    """
    if isinstance(element, tuple) and element:
        element = (absent_as_none(element[0]), *element[1:])
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

    def __init__(self, optimizers: Sequence[Any], backend: Backend):
        self.optimizers = list(optimizers)
        self.backend = backend
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
                refusal = overwrites.custom_step_refusal(hooks.backend, opt, variables)
                if refusal is not None:
                    hooks.refused.append(refusal)
                    raise refusal
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
                self.refused.append(UserError(
                    f"The custom train_step calls {type(opt).__name__}.apply on variable "
                    f"{getattr(variable, 'path', variable.name)}, which was not created under the strategy's scope; "
                    "its updates could not reach the other replicas. Create every layer and variable the step "
                    "trains inside `with strategy.scope():` of the strategy the model was built under (the "
                    "program's own tf.distribute strategy, or tfdist.make_strategy's)."))
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


def _symbolic_spec(example: Any) -> Any:
    def spec(value: Any) -> Any:
        if value is None:
            return None
        shape = tuple(value.shape)
        dtype = value.dtype if isinstance(value.dtype, tf.DType) else tf.string if columns.is_text_dtype(
            value.dtype) else tf.as_dtype(keras.backend.standardize_dtype(value.dtype))
        return tf.TensorSpec((None, *shape[1:]), dtype)

    return tf.nest.map_structure(spec, example)


def probe(model: keras.Model, backend: Backend, name: str, example: Any, hooks: GlobalGradients) -> list[str]:
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
        refused.append(UserError(message))
        return refused[-1]

    def record(next_creator: Callable, **kwargs: Any) -> Any:
        attempted.append(str(kwargs.get("name") or "Variable"))
        variable = next_creator(**kwargs)
        created.append(variable)
        return variable

    def replica(data: Any) -> Any:
        hooks.state.checking = True
        try:
            with keras_hooks.one_replica_losses(), hooks.hooks():
                logs = step(data)
        finally:
            hooks.state.checking = False
        keys.extend(k for k in _log_keys(model, name, logs, refuse) if k not in keys)
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
                strangers = [n for n in attempted if n not in _known_names(model)]
                if strangers and not hooks.unbuilt:  # Under a strategy the creation itself may fail.
                    raise _foreign(model, name, strangers) from None
                if not hooks.unbuilt:
                    raise UserError(f"{type(model).__name__}.{name}() failed on a batch of this input: "
                                    f"{type(e).__name__}: {error_text(e)}") from None
                _build_optimizers(hooks.unbuilt)
                continue
            break
    # Layers built on first use and optimizers built by their first apply are the model's own state.
    known = {id(tf_variable(v)) for v in list(model.variables) + [v for m in model.metrics for v in m.variables]
             + [v for opt in optimizers_of(model) for v in opt.variables]}
    foreign = [v for v in created if id(v) not in known]
    if foreign:
        raise _foreign(model, name, [v.name.split(":")[0] for v in foreign])
    return keys


def _log_keys(model: keras.Model, name: str, logs: Any, refuse: Callable[[str], Exception]) -> list[str]:
    """The keys of the logs a custom step returned: a dict of scalars (else refused)."""
    if not isinstance(logs, dict):
        raise refuse(f"{type(model).__name__}.{name}() returned {type(logs).__name__}, not a dict of logs; "
                     "return a dict such as {m.name: m.result() for m in self.metrics}, as Keras expects.")
    keys = []
    for key, value in flatten_logs(logs).items():
        shape = getattr(value, "shape", ())
        if shape is not None and len(shape) > 0 and int(np.prod([d if d is not None else 2 for d in shape])) != 1:
            raise refuse(
                f"{type(model).__name__}.{name}() returns the log {key!r} with shape {tuple(shape)}; every log "
                "value must be a scalar (tfdist averages it over the replicas and shows it in History). "
                "Reduce it in the step (e.g. keras.ops.mean) or track it with a keras.metrics.Mean.")
        keys.append(str(key))
    return keys


def _build_optimizers(unbuilt: list) -> None:
    """Keras builds an optimizer at its first apply; a replica step cannot create its variables."""
    for opt, variables in unbuilt:
        if not opt.built:
            with keras_backend.name_scope(opt.name, caller=opt):  # As Keras' own apply builds it.
                opt.build(variables)
            opt.built = True


def _known_names(model: keras.Model) -> set:
    every = list(model.variables) + [v for m in model.metrics for v in m.variables] + \
        [v for opt in optimizers_of(model) for v in opt.variables]
    return {tf_variable(v).name.split(":")[0].split("/")[-1] for v in every} | {v.name for v in every}


def _foreign(model: keras.Model, name: str, names: Sequence[str]) -> Exception:
    return UserError(
        f"{type(model).__name__}.{name}() creates variables that are not the model's, its metrics' or its "
        f"optimizers' ({', '.join(sorted(set(names))[:3])}); a distributed step cannot keep such state in "
        "step on every replica. Create them in __init__ (or build()) under the strategy's scope, as layer or "
        "model weights (self.add_weight), and only use them in the step.")


def has_call(model: keras.Model) -> bool:
    """Whether the model implements ``call`` (a GAN wrapping two models often does not)."""
    return type(model).call not in (keras.Model.call, keras.layers.Layer.call)


# The step bodies (`StepFunctions` calls them for a model with its own train_step/test_step) ----------
def train_step(functions: Any, element: Any, stop: tf.Tensor, totals: tf.Tensor) -> tf.Tensor:
    """The user's ``train_step`` on this replica's batch, with global-batch gradients (`custom_steps`)."""
    layout = functions.layout
    if functions.partial_last:
        *element, total = element  # The step's global example count (`inputs.train_arrays_fn`).
        element = tuple(element)
    data = keras_data(element)
    examples = batch_size(data)
    if not functions.partial_last:
        total = examples * functions.backend.num_replicas  # Every replica holds the same number of examples.
    with functions.gradients.replica_step(examples, total), keras_hooks.one_replica_losses(), \
            keras_hooks.synchronized_moments(functions.backend.replica_sum()):
        if functions.backend.asynchronous:
            logs, deltas = _asynchronous_step(functions, data)
        else:
            state = [tf_variable(v) for v in layout.variables]
            before = [v.read_value() for v in state]
            logs = functions.model.train_step(data)
            deltas = [v.read_value() - b for v, b in zip(state, before)]
        claimed = functions.gradients.state.claimed
        if functions.backend.asynchronous and claimed is None:
            claimed = functions.backend.claim()  # A step that applied nothing still uses up its claim.
        functions.backend.when_claimed(claimed, lambda: functions.step_counter.assign_add(1))
    if functions.partial_last:  # A replica with no example adds nothing (refused in fit; kept exact here).
        deltas = [tf.where(examples > 0, d, tf.zeros_like(d)) for d in deltas]
    nonfinite = 1.0 - tf.cast(functions.gradients.all_finite(), tf.float32)
    share = nonfinite / float(functions.backend.num_replicas)
    tail = layout.logs.pack(examples, logs) if layout.logs is not None else None
    return layout.add_step(totals, [examples, share, stop], deltas, tail)


def _asynchronous_step(functions: Any, data: Any) -> tuple:
    """The user's step where workers share the variables (parameter servers); returns (logs, metric deltas).

    Other workers update the same metric variables concurrently, so their before/after
    difference is not this step's: the step runs in a `StatelessScope` that starts the
    metrics from zero (their values at the end are this step's contribution) and records
    the other state it writes (BatchNormalization statistics, seed generators), written
    back as increments (`write_state`). The optimizers' updates and step counters go to
    the variables directly (Keras' TensorFlow optimizer assigns them outside the scope).
    """
    model, layout = functions.model, functions.layout
    zeros = layout.zeros()
    metric_ids = {id(v) for v in layout.variables}
    others = [(v, tf_variable(v).read_value()) for v in model.non_trainable_variables if id(v) not in metric_ids]
    weights = [(v, v.value) for v in model.trainable_variables]
    scope = RecordingScope(weights + others + list(zip(layout.variables, zeros)))
    with scope:
        logs = model.train_step(data)
    deltas = [zero if scope.get_current_value(v) is None else scope.get_current_value(v)
              for v, zero in zip(layout.variables, zeros)]
    for key in metric_ids:
        scope.updated.pop(key, None)
    write_state(scope, {id(v): value for v, value in others}, atomic=True)
    functions.updated_state.update(scope.updated)
    return logs, deltas


def eval_step(functions: Any, element: tuple, mask: tf.Tensor, totals: tf.Tensor) -> tf.Tensor:
    layout = functions.eval_layout

    def update() -> tf.Tensor:
        data = keras_data(element)
        state = [tf_variable(v) for v in layout.variables]
        before = [v.read_value() for v in state]
        with keras_hooks.one_replica_losses():
            logs = functions.model.test_step(data)
        deltas = [v.read_value() - b for v, b in zip(state, before)]
        examples = tf.reduce_sum(mask)
        tail = layout.logs.pack(examples, logs) if layout.logs is not None else None
        return layout.add_step(totals, [examples, 0.0, 0.0], deltas, tail)

    return tf.cond(tf.size(mask) > 0, update, lambda: totals)


def optimizer_variables(model: keras.Model) -> list:
    """The variables of every optimizer the model holds (a custom step's several included)."""
    return [v for opt in optimizers_of(model) for v in opt.variables]
