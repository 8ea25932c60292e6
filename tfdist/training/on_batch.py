"""`tfdist.train_on_batch`: Keras' `Model.train_on_batch` on every synchronous backend.

Keras' own (keras/src/backend/tensorflow/trainer.py) resets the model's metrics, runs one optimizer step on the
one batch it is given and returns that step's logs: the loss alone (a float) when the model has no other
metric, else a list in ``model.metrics_names`` order, or a dict with ``return_dict=True``; ``class_weight``
becomes per-example weights. Here the batch is one `tfdist.fit` step: the whole batch is the global batch, split
over the replicas and workers, so the update is Keras' one-device one (a replica count that does not divide it
leaves some replicas one example fewer). GAN and custom-loop programs call it once a step.

Each call runs `tfdist.fit`'s phases (`fitting`: the checks, the inputs, the plan, the build, one epoch of one
step in its `Controller`), but the compiled steps are kept, as Keras keeps ``model.train_function``: one
`StepFunctions` (and its step counter) per model, backend and batch signature (the inputs'
structure, dtypes and shapes past the batch dimension), traced on the first call and again only where Keras'
own function retraces (a new batch size: the batches' shapes are static). The cache is dropped when the model
is compiled again or given another optimizer (Keras resets its ``train_function`` in ``compile``); it holds the
model weakly, so a model the program drops is freed with its steps. On one process's replicas the batch is placed
on them as the input pipeline would give it (`_replica_batches`), without building one: a tf.data pipeline and
its iterator cost far more than a small model's step. Multi-worker jobs (every worker calls with the same batch)
read it through `tfdist.fit`'s pipeline.

`tfdist.fit` leaves ``model.history`` and ``model.stop_training`` as a fit does; Keras' `train_on_batch` touches
neither, so both are put back. Nor does it end with fit's ``finalize_variable_values``: with ``use_ema=True`` the
model keeps its trained weights (the moving averages stay in the optimizer), as after Keras' own call. Parameter
servers are refused: one step at a time leaves every worker but one idle, and the step is applied asynchronously,
after the call could return its logs.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from typing import Any, Optional, Union

import keras
import tensorflow as tf

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import checks, columns, custom_steps, fitting, inputs, preparing, sources
from tfdist.training.checkpoints import Checkpoints
from tfdist.training.controller import LoopResult
from tfdist.training.held_out import rows
from tfdist.training.plan import LoopPlan
from tfdist.training.steps import StepFunctions

_ABSENT = object()


def train_on_batch(model: keras.Model, x: Any, y: Any = None, sample_weight: Any = None,
                   class_weight: Optional[dict] = None, return_dict: bool = False, *,
                   strategy: Any = None) -> Union[float, list, dict]:
    """Keras' `Model.train_on_batch`: one optimizer step on the batch `x` (`y`, `sample_weight` or
    `class_weight`), its metrics reset first; returns the step's loss, its logs as a list, or a dict."""
    if class_weight is not None and sample_weight is not None:
        raise UserError("train_on_batch takes sample_weight or class_weight, not both (as Keras' own): "
                        "class_weight becomes per-example weights. Fold the class weights into sample_weight.")
    backend = preparing.backend_for(strategy, model)
    if backend.asynchronous:
        raise UserError(
            "tfdist.train_on_batch is not available on parameter servers: a step there is scheduled onto one "
            "worker and applied asynchronously, so one step a call would leave every other worker idle, and the "
            "logs would not be the step's. Train with tfdist.fit (steps in flight on every worker), or use a "
            "synchronous strategy (mirrored, multi_worker_mirrored, horovod) for a step-by-step loop.")
    kept = {name: getattr(model, name, _ABSENT) for name in ("history", "stop_training")}
    try:
        result = _one_step(model, x, y, sample_weight=sample_weight, class_weight=class_weight, strategy=strategy)
    finally:
        for name, value in kept.items():
            if value is _ABSENT:
                model.__dict__.pop(name, None)
            else:
                setattr(model, name, value)
    logs = {key: float(value) for key, value in result.train_logs.items()}
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


@preparing.naming_bad_ids
@preparing.releasing_the_runner
def _one_step(model: keras.Model, x: Any, y: Any, **arguments: Any) -> LoopResult:
    """`fitting.train` of one epoch of the one batch, with the compiled steps kept (`_steps`)."""
    call = types.SimpleNamespace(**fitting._bound(model, x, y, dict(
        arguments, batch_size=rows(x), epochs=1, shuffle=False, verbose=0, export=())))
    backend = preparing.backend_for(call.strategy, model)
    fitting._check_call(call, backend)
    source, validation = fitting._inputs(call, backend)
    plan = fitting._plan(call, backend, source)
    fitting._build(call, backend, source, plan)
    kept = _steps(call, backend, source, plan)
    kept.step_counter.assign(0)  # This call's one step, counted from 0 as fit's own counter.
    # No run directory: nothing is saved (fit's checkpoint, which would hold the model, is never read).
    checkpoints = Checkpoints(tf.train.Checkpoint(), kept.step_counter, None, backend, call.keep_checkpoints)
    controller = fitting._controller(call, backend, plan, source, kept.functions, checkpoints, None, validation)
    # Keras' train_on_batch ends no fit: the optimizer's EMA weights (use_ema) are not written into the model.
    controller.options = dataclasses.replace(controller.options, finalize=False)
    if _direct(backend, source, plan):  # The batch placed on the replicas as it is: no input pipeline to build.
        batch = _Batch(backend.strategy.experimental_distribute_values_from_function(_replica_batches(source, plan)))
        controller.train_iterator_fn = lambda first: batch
    controller.guard.warned = model in _WARNED_NONFINITE  # Warned once a model, not once a call.
    result = controller.run(0)
    if controller.guard.warned:
        _WARNED_NONFINITE.add(model)
    return result


# The batch without an input pipeline ---------------------------------------------------------------------
@dataclasses.dataclass
class _Batch:
    """The one step's per-replica batches, in place of the iterator the training execution reads."""

    element: Any


def _direct(backend: Backend, source: sources.Source, plan: LoopPlan) -> bool:
    """Whether the step's per-replica batches can be made here, as `inputs.train_arrays_fn` makes step 0's:
    arrays (not sparse or ragged) of one step, unshuffled, on one process's replicas. A tf.data pipeline and
    its iterator (a multi-device one on several replicas) cost 0.1-0.5 s to build, far more than the step."""
    return (source.kind == "arrays" and backend.sharded_input and not source.arrays.composite and
            not plan.streamed and not source.shuffle and plan.total_steps == 1 and backend.num_workers == 1 and
            backend.name in ("default", "one_device", "mirrored"))


def _replica_batches(source: sources.Source, plan: LoopPlan) -> Any:
    """Replica r's batch of step 0: `inputs.train_arrays_fn`'s rows and layout (with `partial_last`, the rows
    split as evenly as can be and the step's example count last)."""
    tensors = inputs.map_present(columns.constant, source.arrays.structure)
    replicas, per_replica, total = plan.num_replicas, plan.per_replica_batch, plan.global_batch

    def batch(ctx: tf.distribute.ValueContext) -> tuple:
        r = ctx.replica_id_in_sync_group
        if plan.partial_last:
            indices = inputs.split_range(0, total, replicas, r)
            return inputs.drop_none(_gather(tensors, indices)) + (tf.constant(float(total), tf.float32),)
        return inputs.drop_none(_gather(tensors, tf.range(r * per_replica, (r + 1) * per_replica, dtype=tf.int64)))

    return batch


def _gather(tensors: tuple, indices: tf.Tensor) -> tuple:
    return inputs.map_present(lambda t: columns.gather(t, indices), tensors)


# The kept steps ----------------------------------------------------------------------------------------
class _Steps(StepFunctions):
    """`StepFunctions` holding its model weakly (the cache that keeps it is keyed by the model, so a strong
    reference would keep every model alive), whose training execution also takes a `_Batch`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.iterated = self.train_execution
        # One process's backends only (`_direct`): traced again for a new batch size at most once, as Keras'
        # train_function (reduce_retracing: the second size traces for any).
        self.direct = tf.function(self._direct_execution, reduce_retracing=True)
        self.train_execution = self._execute

    def _execute(self, iterator: Any, num_steps: Any, stop: Any) -> Any:
        if isinstance(iterator, _Batch):
            return self.direct(iterator.element, stop)
        return self.iterated(iterator, num_steps, stop)

    def _direct_execution(self, element: Any, stop: Any) -> Any:
        """`steps.execution` of one step, its batch given."""
        totals = self._train_one(element, self._train_totals(), stop)
        self._sync_state()
        return self.backend.reduce_sum(totals)

    @property
    def model(self) -> keras.Model:
        return self._model_ref()

    @model.setter
    def model(self, model: keras.Model) -> None:
        self._model_ref = weakref.ref(model)


@dataclasses.dataclass
class _Kept:
    """One batch signature's compiled steps and the step counter they count in."""

    functions: StepFunctions
    step_counter: tf.Variable
    backend: Backend  # Held: the key's id(backend) stays its own.


@dataclasses.dataclass
class _Compiled:
    """A model's kept steps and what they were made after: its compile (`model._compile_config`, a new object
    each `compile`) and its optimizer."""

    compile_config: Any
    optimizer: Any
    steps: dict = dataclasses.field(default_factory=dict)


_KEPT: "weakref.WeakKeyDictionary[keras.Model, _Compiled]" = weakref.WeakKeyDictionary()
_WARNED_NONFINITE: "weakref.WeakSet[keras.Model]" = weakref.WeakSet()  # Models warned of a non-finite loss.


def traces(model: keras.Model) -> int:
    """How many times the model's kept training executions were traced (tests: Keras traces once)."""
    compiled = _KEPT.get(model)
    if compiled is None:
        return 0
    return sum(function.experimental_get_tracing_count() for kept in compiled.steps.values()
               for function in (kept.functions.iterated, kept.functions.direct))


def _signature(source: sources.Source, plan: LoopPlan, jit: bool, row_sparse: bool) -> str:
    """What the steps are traced for, but the batch size: each input's kind, shape past the batch and dtype."""
    example = inputs.drop_none(source.example(plan.micro_batch))
    leaves = tf.nest.map_structure(
        lambda a: (type(a).__name__, tuple(a.shape[1:]), str(a.dtype)), example)
    return repr((leaves, plan.partial_last, plan.streamed, jit, row_sparse))


def _steps(call: Any, backend: Backend, source: sources.Source, plan: LoopPlan) -> _Kept:
    """The model's kept steps for this batch's signature under `backend`: made (and traced) once, again after
    the model is compiled again or given another optimizer."""
    model = call.model
    config = getattr(model, "_compile_config", None)
    compiled = _KEPT.get(model)
    if compiled is None or compiled.compile_config is not config or compiled.optimizer is not model.optimizer:
        compiled = _KEPT[model] = _Compiled(config, model.optimizer)
    jit = checks.resolve_jit(call.jit_compile, backend, model)
    row_sparse = backend.sum_rows_each_step(plan.steps_per_execution)
    key = (id(backend), _signature(source, plan, jit, row_sparse))
    if key not in compiled.steps:
        compiled.steps[key] = _new_steps(call, backend, source, plan, jit, row_sparse)
    return compiled.steps[key]


def _new_steps(call: Any, backend: Backend, source: sources.Source, plan: LoopPlan, jit: bool,
               row_sparse: bool) -> _Kept:
    model = call.model
    step_counter = fitting._step_counter(call, backend)
    functions = _Steps(
        model, backend, grad_accum_steps=1, step_counter=step_counter, jit_compile=jit,
        partial_last=plan.partial_last, row_sparse=row_sparse, streamed=plan.streamed,
        train_example=custom_steps.keras_data(inputs.drop_none(source.example(plan.micro_batch))))
    # After the step functions: a custom step's optimizers are built when its step is first traced.
    backend.broadcast_initial_state(list(model.variables) + custom_steps.optimizer_variables(model))
    return _Kept(functions, step_counter, backend)
