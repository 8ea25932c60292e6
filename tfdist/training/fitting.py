"""`tfdist.fit`: train any compiled Keras 3 model under the strategy `tfdist.make_strategy` built.

`fit` takes what `Model.fit` takes and returns Keras' History; `train` is the same call returning the loop's
`LoopResult` (tfdist-train reads it). Its phases, each a function below: check the call, adapt the inputs
(`sources`, `held_out`), plan (`plan`), build the model, open the run directory and its checkpoints
(`workdir`, `checkpoints`), build the steps (`steps`), run the loop (`controller`), export (`export`). Bad
input raises `tfdist.UserError` before any step (docs/python-api.md).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
import warnings
from typing import Any, Optional, Sequence

import keras
import tensorflow as tf
from absl import logging

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import checkpoints as checkpoints_lib, checks, custom_steps, evaluating, export as export_lib, \
    fit_args, held_out, inputs, plan as plan_lib, preparing, sources, sync_batchnorm, workdir as workdir_lib, zero
from tfdist.training.callbacks import BATCH_HOOKS, TEST_BATCH_HOOKS, callbacks_for_task, has_batch_hooks
from tfdist.training.checkpoints import Checkpoints
from tfdist.training.controller import Controller, LoopOptions, LoopResult
from tfdist.training.plan import LoopPlan
from tfdist.training import steps as steps_lib
from tfdist.training.steps import StepFunctions
from tfdist.training.zero import handover, stage3


def fit(
    model: keras.Model, x: Any = None, y: Any = None, *,
    batch_size: Optional[int] = None, epochs: int = 1, validation_data: Any = None, sample_weight: Any = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None, workdir: Any = None, strategy: Any = None,
    steps_per_epoch: Optional[int] = None, steps_per_execution: Optional[int] = None, grad_accum_steps: int = 1,
    zero_stage: int = 0,
    seed: int = 0, max_steps: Optional[int] = None,
    checkpoint_every_steps: int = 0, checkpoint_every_secs: float = 0.0, keep_checkpoints: int = 3,
    resume: Optional[bool] = None, verbose: int = 1, step_counter: Optional[tf.Variable] = None,
    jit_compile: Any = "auto", summary_every_steps: int = 0, profile_steps: Optional[tuple[int, int]] = None,
    export: Sequence[str] = ("keras",), plan_extra: Optional[dict] = None,
    # Keras' own fit arguments beyond the ones above (docs/fit-arguments.md).
    shuffle: Any = True, class_weight: Optional[dict] = None, validation_split: float = 0.0,
    validation_freq: Any = 1, initial_epoch: int = 0, validation_steps: Optional[int] = None,
    validation_batch_size: Optional[int] = None, drop_remainder: bool = False,
    sync_batchnorm: bool = False,  # Every BatchNormalization on the global batch's statistics (sync_batchnorm.py).
    stop_on_nonfinite: bool = False,  # A non-finite loss raises a UserError (Keras' fit, the default, goes on).
) -> keras.callbacks.History:
    """Trains `model` (built and compiled under the strategy's scope); returns its History.

    See the README's "Use it from Python" section for every argument.
    """
    return train(**locals()).history


@preparing.naming_bad_ids
@preparing.releasing_the_runner
@sync_batchnorm.restoring
def train(model: keras.Model, x: Any = None, y: Any = None, **arguments: Any) -> LoopResult:
    """`fit` (the same arguments), returning the loop's result."""
    call = types.SimpleNamespace(**_bound(model, x, y, arguments))
    backend = preparing.backend_for(call.strategy, model)
    _check_call(call, backend)
    source, validation = _inputs(call, backend)
    plan = _plan(call, backend, source)
    _build(call, backend, source, plan)
    sync_batchnorm.apply(model, backend, plan.micro_batch, call.sync_batchnorm)  # Before the steps are traced.
    step_counter = _step_counter(call, backend)
    checkpoint = checkpoints_lib.training_checkpoint(model, step_counter)  # Seed generators' state included.
    if call.workdir is not None:
        export_lib.check_exportable(model, call.export)  # Before any step: a failed export would come after.
    rundir = call.workdir if isinstance(call.workdir, workdir_lib.RunDir) else \
        workdir_lib.RunDir(call.workdir, is_chief=backend.is_chief) if call.workdir else None
    owned = rundir is not None and rundir is not call.workdir
    with rundir if owned else contextlib.nullcontext():
        checkpoints = Checkpoints(checkpoint, step_counter, rundir, backend, call.keep_checkpoints, zero=call.zero)
        start_step = _open_run(checkpoints, plan, call, backend)
        functions = StepFunctions(
            model, backend, grad_accum_steps=call.grad_accum_steps, step_counter=step_counter,
            jit_compile=checks.resolve_jit(call.jit_compile, backend, model), partial_last=plan.partial_last,
            row_sparse=backend.sum_rows_each_step(plan.steps_per_execution), streamed=plan.streamed,
            train_example=custom_steps.keras_data(inputs.drop_none(source.example(plan.micro_batch))),
            eval_example=custom_steps.keras_data(inputs.drop_none(validation[0].structure)) if validation else None,
            zero=call.zero, one_step=steps_lib.one_step_executions(plan))
        # After the step functions: a custom step's optimizers are built when its step is first traced.
        backend.broadcast_initial_state(list(model.variables) + custom_steps.optimizer_variables(model))
        optimizer_state = zero.state_report(call.zero, backend)
        controller = _controller(call, backend, plan, source, functions, checkpoints, rundir, validation)
        # Stage 3: the weights in shards meanwhile; a user's optimizer built before: its slots freed meanwhile.
        stage3.check_tasks_alike(call.zero, call.callbacks)
        with handover.handed_over(call.zero, controller, call.callbacks), \
                stage3.sharded_weights(call.zero, model, functions, controller, call.callbacks):
            result = controller.run(start_step)
        result.optimizer_state = optimizer_state
        if call.zero is not None and call.zero.loss_scale:
            result.optimizer_state["loss_scale"] = call.zero.current_scale()
        if rundir is not None and not result.diverged:  # Chief only; staged and renamed into place.
            export_lib.write_exports(rundir, model, call.export, result, checkpoints.latest)
    # After on_train_end and the exports: what the chief's callbacks wrote is there for every worker's next line.
    backend.wait_for_peers()
    return result


def _bound(model: keras.Model, x: Any, y: Any, arguments: dict) -> dict:
    """`fit`'s arguments by name, defaults filled in (an unknown name is the TypeError Python raises)."""
    bound = inspect.signature(fit).bind(model, x, y, **arguments)
    bound.apply_defaults()
    values = dict(bound.arguments)
    values["export"] = export_lib.parse_export_formats(",".join(values["export"])) if values["export"] else ()
    return values


def _check_call(call: Any, backend: Backend) -> None:
    """The arguments' own refusals (and Keras' global epoch cap), before the inputs are read."""
    checks.check_model(call.model)
    checks.check_ema_overwrite(call.model, backend)
    checks.check_custom_steps(call.model, backend, grad_accum_steps=call.grad_accum_steps)
    checks.check_zero(call.model, backend, call.zero_stage, call.callbacks, call.grad_accum_steps)
    if call.epochs < 1:
        raise UserError(f"epochs={call.epochs} must be 1 or more.")
    if keras.config.max_epochs() and keras.config.max_epochs() < call.epochs:  # Keras' global cap, as its fit.
        logging.warning("Limiting epochs to %d (keras.config.max_epochs).", keras.config.max_epochs())
        call.epochs = keras.config.max_epochs()
    if call.grad_accum_steps < 1:
        raise UserError(f"grad_accum_steps={call.grad_accum_steps} must be 1 or more.")
    if not call.checkpoint_every_secs >= 0:
        raise UserError(f"checkpoint_every_secs={call.checkpoint_every_secs} must be 0 (off) or more.")
    fit_args.check_arguments(shuffle=call.shuffle, class_weight=call.class_weight,
                             validation_split=call.validation_split, validation_freq=call.validation_freq,
                             initial_epoch=call.initial_epoch)


def _inputs(call: Any, backend: Backend) -> tuple[sources.Source, Optional[tuple[inputs.Arrays, int]]]:
    """The training `Source` and the validation arrays with Keras' validation batch (`held_out.validation`)."""
    model = call.model
    validation_data = fit_args.limit_validation(call.validation_data, call.validation_steps)
    batch = call.validation_batch_size
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise UserError(f"validation_batch_size={batch!r} must be a positive number of examples.")
    streamable = sources.can_stream(backend, model)
    given = fit_args.prepare(call.x, call.y, call.sample_weight, validation_data=validation_data,
                             batch_size=call.batch_size, steps_per_epoch=call.steps_per_epoch, shuffle=call.shuffle,
                             class_weight=call.class_weight, validation_split=call.validation_split, seed=call.seed,
                             epochs=call.epochs, stream=streamable)
    if given.one_pass and call.epochs > call.initial_epoch + 1:
        warnings.warn(f"x is a Python generator without steps_per_epoch: its one pass is epoch "
                      f"{call.initial_epoch + 1}, and your input ran out of data, so epochs {call.initial_epoch + 2}-"
                      f"{call.epochs} are not trained (Keras runs them without data). Pass steps_per_epoch= with a "
                      "generator that does not end, or a keras.utils.PyDataset (read once an epoch).", stacklevel=6)
        call.epochs = call.initial_epoch + 1
    spe = call.steps_per_epoch
    if spe is not None and (isinstance(spe, bool) or spe < 1):
        raise UserError(f"steps_per_epoch={spe!r} must be 1 or more (steps in an epoch), or None.")
    source = sources.adapt(model, backend, given.x, given.y, given.sample_weight, given.batch_size,
                           call.steps_per_epoch, examples=given.examples,
                           stream=streamable and (call.steps_per_epoch is not None or given.one_pass))
    source.shuffle = bool(call.shuffle)
    checks.check_composite(source, backend, call.grad_accum_steps)
    fit_args.check_backend(backend, source.kind, source.shuffle)
    if source.batch_size is None or int(source.batch_size) < 1:
        raise UserError(f"batch_size={source.batch_size!r} must be a positive global batch size (examples per "
                        "optimizer step over all replicas).")
    keras_batch = call.validation_batch_size or (int(call.batch_size) if call.batch_size is not None else None)
    validation = held_out.validation(model, given.validation_data, source, batch_size=keras_batch,
                                     steps=call.validation_steps)
    checks.check_scope(model, backend)
    return source, validation


def _plan(call: Any, backend: Backend, source: sources.Source) -> LoopPlan:
    model = call.model
    plan = plan_lib.make_plan(
        backend, num_train=source.num_examples, batch_size=int(source.batch_size), epochs=call.epochs,
        grad_accum_steps=call.grad_accum_steps,
        steps_per_execution=plan_lib.resolve_steps_per_execution(call.steps_per_execution, model, call.callbacks,
                                                                 backend, BATCH_HOOKS, source.sparse_inputs()),
        steps_per_epoch=source.steps_per_epoch, seed=call.seed, max_steps=call.max_steps,
        extra={"data": source.kind, "num_train": source.num_examples, **(call.plan_extra or {}),
               **({"sharded_optimizer_state": True} if call.zero_stage else {}),
               **fit_args.plan_fields(shuffle=source.shuffle, class_weight=call.class_weight,
                                      validation_split=call.validation_split)},
        pass_batches=source.pass_batches() if backend.sharded_input else None,  # PS: no passes.
        partial_dataset=source.partial, streamed=source.streamed, drop_remainder=call.drop_remainder,
        row_layers=source.streamed and any(isinstance(layer, keras.layers.Embedding)
                                           for layer in model._flatten_layers()),
        why_even=checks.why_even(backend, source), keras_execution=plan_lib.compiled_execution(model))
    source.check_batches(plan)
    return plan


def _build(call: Any, backend: Backend, source: sources.Source, plan: LoopPlan) -> None:
    checks.check_short_custom_step(call.model, backend, plan, source.num_examples)
    if not _may_resume(call):  # A checkpoint's state would win (and its optimizer has no slots to fill).
        zero.carry_over(call.model, backend, call.zero_stage)  # An earlier sharded fit's state, if this one leaves it.
    preparing.build(call.model, backend, source.example(plan.micro_batch), optimizer_state=not call.zero_stage)
    checks.check_metrics(call.model)  # Compiled metrics have variables only once built.
    call.zero = zero.for_model(call.model, backend, call.zero_stage) if call.zero_stage else None


def _may_resume(call: Any) -> bool:
    """Whether this fit's workdir holds a checkpoint it may resume (`Checkpoints.resume` decides)."""
    if call.workdir is None or call.resume is False:
        return False
    path = call.workdir.path if isinstance(call.workdir, workdir_lib.RunDir) else str(call.workdir)
    return tf.train.get_checkpoint_state(os.path.join(path, "checkpoints")) is not None


def _step_counter(call: Any, backend: Backend) -> tf.Variable:
    """The steps applied: the caller's counter, or a new one (a replica's is the truth: ONLY_FIRST_REPLICA)."""
    step_counter = call.step_counter
    if step_counter is None:
        with backend.scope():
            step_counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_step",
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    model = call.model
    backend.report_placement(list(model.variables) + custom_steps.optimizer_variables(model) + [step_counter])
    return step_counter


def _open_run(checkpoints: Checkpoints, plan: LoopPlan, call: Any, backend: Backend) -> int:
    """The run directory taken (its lock), the checkpoint resumed, the plan and this start recorded; returns the
    step training starts from."""
    rundir = checkpoints.rundir
    if rundir is None:
        return 0
    rundir.acquire()
    start_step = checkpoints.resume(plan, call.resume)
    plan_lib.write_plan(rundir, plan)
    rundir.record_membership(start_step, backend.num_workers, backend.num_replicas)
    return start_step


def _controller(call: Any, backend: Backend, plan: LoopPlan, source: sources.Source, functions: StepFunctions,
                checkpoints: Checkpoints, rundir: Any, validation: Optional[tuple]) -> Controller:
    model, callbacks = call.model, list(call.callbacks or [])
    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        callbacks_for_task(callbacks, backend) + [history], add_history=False, add_progbar=False, model=model,
        verbose=0, epochs=plan.epochs, steps=plan.known_steps_per_epoch())
    evaluator = None
    if validation is not None:  # As Keras' fit validates: by its evaluate, in Keras' batches.
        arrays, batch = validation
        hooks = has_batch_hooks(callbacks, TEST_BATCH_HOOKS)
        evaluator = evaluating.Evaluator(
            functions, arrays, batch, split=evaluating.keras_batch_steps(model, backend, callbacks, TEST_BATCH_HOOKS),
            per_execution=evaluating.per_execution_steps(None, backend, model, callbacks, TEST_BATCH_HOOKS)
            if hooks else None)
    profile = (call.profile_steps, rundir.join("tensorboard")) if call.profile_steps and rundir is not None \
        and backend.is_chief else None
    options = LoopOptions(
        checkpoint_every_steps=call.checkpoint_every_steps, checkpoint_every_secs=float(call.checkpoint_every_secs),
        summary_every_steps=call.summary_every_steps, profile=profile, progress=bool(call.verbose),
        batch_hooks=has_batch_hooks(callbacks), precision=keras.mixed_precision.dtype_policy().name,
        initial_epoch=int(call.initial_epoch), validation_freq=call.validation_freq,
        stop_on_nonfinite=bool(call.stop_on_nonfinite))
    train_fn = lambda first: iter(backend.distribute_dataset(source.dataset_fn(plan, backend, first)))  # noqa: E731
    return Controller(steps=functions, backend=backend, plan=plan, train_iterator_fn=train_fn,
                      callbacks=callback_list, history=history, checkpoints=checkpoints, options=options,
                      validation=evaluator, writer=rundir.summary_writer() if rundir is not None else None)
