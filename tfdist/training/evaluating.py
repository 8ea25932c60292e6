"""`tfdist.evaluate`, `test_on_batch`, and the `Evaluator` that fit's validation shares with them.

Each replica evaluates whole Keras batches (replica ``r`` of step ``s`` takes
batch ``s * R + r``, `inputs.eval_arrays_fn`), so the results equal Keras' on
one device with the same batch size, batch-dependent losses included; where a
callback has per-batch test hooks each step is one Keras batch split over the
replicas, so the hooks come once a Keras batch. A parameter-server chief
evaluates inline, alone. Every example counts once (docs/evaluate-predict.md).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import keras
import tensorflow as tf

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import checks, columns, custom_steps, inputs, preparing, steps as steps_lib
from tfdist.training.callbacks import TEST_BATCH_HOOKS, callbacks_for_task, has_batch_hooks
from tfdist.training.held_out import held_out, rows
from tfdist.training.plan import resolve_steps_per_execution


def evaluating_replicas(backend: Backend) -> int:
    """Replicas that evaluate: all of them, or the chief alone on a parameter-server job."""
    return backend.num_replicas if backend.sharded_input else 1


def per_execution_steps(value: Optional[int], backend: Backend, model: keras.Model, callbacks: Any,
                        hooks: Sequence[str]) -> int:
    value = resolve_steps_per_execution(value, model, callbacks, backend, hooks)
    if isinstance(value, bool) or int(value) < 1:
        raise UserError(f"steps_per_execution={value!r} must be 1 or more.")
    return int(value)


def check_evaluable(model: keras.Model, backend: Backend) -> None:
    if not getattr(model, "compiled", False):
        raise UserError("The model is not compiled, so it has no loss or metrics to evaluate; call model.compile("
                        "loss=..., metrics=[...]) under the strategy's scope before tfdist.evaluate (as Keras' "
                        "evaluate needs).")
    if custom_steps.overrides(model, "test_step") and backend.device_kind == "tpu":
        raise UserError(f"{type(model).__name__} overrides test_step(); on a TPU every batch has one shape, so the "
                        "last batch would reach the custom step with padding rows it cannot tell from examples. "
                        "Evaluate with a test set that divides into batches, or move the logic into compute_loss() "
                        "and compiled metrics, which tfdist masks.")


def callback_list(model: keras.Model, backend: Backend, callbacks: Optional[Sequence[Any]], verbose: Any,
                  num_steps: int) -> keras.callbacks.CallbackList:
    if isinstance(callbacks, keras.callbacks.CallbackList):
        raise UserError("callbacks must be a list of keras.callbacks.Callback, not a CallbackList.")
    own = callbacks_for_task(list(callbacks or []), backend)  # File writers on the chief only.
    return keras.callbacks.CallbackList(own, add_progbar=verbose != 0 and backend.is_chief, verbose=verbose,
                                        epochs=1, steps=num_steps, model=model)


def keras_batch_steps(model: keras.Model, backend: Backend, callbacks: Any, hooks: Sequence[str]) -> bool:
    """Whether each step is one Keras batch split over the replicas (instead of one whole batch per replica):
    where a callback has per-batch `hooks`, so they come once per Keras batch, as in Keras. Not for a custom
    test_step (its trackers average whole batches' means), a TPU (one shape) or parameter servers (the chief
    evaluates alone)."""
    return (evaluating_replicas(backend) > 1 and backend.device_kind != "tpu"
            and not custom_steps.overrides(model, "test_step") and has_batch_hooks(list(callbacks or []), hooks))


def num_steps(num_examples: int, batch: int, backend: Backend, split: bool) -> int:
    """Steps over `num_examples` in Keras batches of `batch`: one a step (`split`), or one per replica."""
    if split:
        return -(-num_examples // batch)
    return inputs.eval_steps(num_examples, batch, evaluating_replicas(backend))


def executions(steps: int, per_execution: int) -> list[tuple[int, int]]:
    """(first step, steps) of each compiled execution."""
    return [(first, min(per_execution, steps - first)) for first in range(0, steps, per_execution)]


class Evaluator:
    """One evaluation of held-out `arrays` in Keras batches of `batch` with `functions`' eval executions: what
    `tfdist.evaluate` runs once and `tfdist.fit` at each validated epoch."""

    def __init__(self, functions: steps_lib.StepFunctions, arrays: inputs.Arrays, batch: int, *, split: bool,
                 per_execution: Optional[int] = None):
        """`split`: each step one Keras batch split over the replicas (`keras_batch_steps`). `per_execution`:
        steps between the test hooks (None: all in one execution)."""
        backend = functions.backend
        self.functions, self.backend, self.num_examples = functions, backend, arrays.num_examples
        self.steps = num_steps(arrays.num_examples, batch, backend, split)
        self.per_execution = per_execution or max(1, self.steps)
        self.dataset = backend.distribute_eval_dataset(inputs.eval_arrays_fn(
            arrays, per_replica_batch=batch, steps=self.steps, static_shapes=backend.device_kind == "tpu",
            keras_batch=batch if split else None))

    def run(self, callbacks: keras.callbacks.CallbackList) -> dict[str, Any]:
        """Keras' evaluate: its metrics reset, the test hooks every `per_execution` steps; returns its logs."""
        functions, backend, per_execution = self.functions, self.backend, self.per_execution
        layout = functions.eval_layout
        iterator = iter(self.dataset)
        callbacks.on_test_begin()
        totals = functions.reset_metrics(layout)  # Keras' evaluate begins with reset_metrics.
        logs = layout.results(totals)
        for first, count in executions(self.steps, per_execution):
            callbacks.on_test_batch_begin(first)
            with backend.scope():
                totals = layout.combine(totals, backend.execute(functions.eval_execution, iterator,
                                                                tf.constant(count, tf.int64)))
            logs = layout.results(totals)
            callbacks.on_test_batch_end(first + per_execution - 1, logs)
        counted = int(round(float(totals[0])))
        if counted != self.num_examples:
            raise RuntimeError(f"Evaluation counted {counted} examples, expected {self.num_examples}.")
        functions.store_metrics(totals, layout)
        callbacks.on_test_end(logs)
        return logs


@preparing.naming_bad_ids
def evaluate(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: Optional[int] = None,
    verbose: Any = "auto",
    sample_weight: Any = None,
    steps: Optional[int] = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
    return_dict: bool = False,
    strategy: Any = None,
    steps_per_execution: Optional[int] = None,
) -> Union[float, list, dict]:
    """Keras' `Model.evaluate` of `model` (built and compiled under the strategy's scope) on every backend.

    Returns the loss (a float) when the model has no other metric, else a list in
    ``model.metrics_names`` order, or a dict with ``return_dict=True``.
    """
    backend = preparing.backend_for(strategy, model)
    check_evaluable(model, backend)
    arrays, batch = held_out(model, x, y, sample_weight, batch_size, steps, targets=True)
    per_execution = per_execution_steps(steps_per_execution, backend, model, callbacks, TEST_BATCH_HOOKS)
    checks.check_scope(model, backend)
    preparing.build(model, backend, inputs.map_present(lambda a: columns.head(a, batch), arrays.structure))
    checks.check_metrics(model)
    custom = custom_steps.overrides(model, "test_step")  # Each replica's step gets whole Keras batches.
    functions = steps_lib.StepFunctions(
        model, backend, grad_accum_steps=1, step_counter=None, training=False,
        eval_example=custom_steps.keras_data(inputs.drop_none(arrays.structure)) if custom else None)
    evaluator = Evaluator(functions, arrays, batch, split=keras_batch_steps(model, backend, callbacks,
                                                                            TEST_BATCH_HOOKS),
                          per_execution=per_execution)
    logs = evaluator.run(callback_list(model, backend, callbacks, verbose, evaluator.steps))
    backend.leave_last()  # As after fit: the coordination-service leader exits after the other tasks.
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def test_on_batch(model: keras.Model, x: Any, y: Any = None, sample_weight: Any = None, *,
                  return_dict: bool = False, strategy: Any = None) -> Union[float, list, dict]:
    """Keras' `Model.test_on_batch`: `evaluate` of the one batch `x` (its metrics reset first, as Keras')."""
    return evaluate(model, x, y, sample_weight=sample_weight, batch_size=rows(x), verbose=0,
                    return_dict=return_dict, strategy=strategy)
