"""The outer training loop (after Orbit's Controller): when to train, validate, checkpoint and stop.

`Controller.run` drives `tfdist.training.steps.StepFunctions` through the plan's epochs in segments (up to the
next epoch end, checkpoint or calibration boundary) of executions of at most ``steps_per_execution`` steps,
dispatching the next before fetching the last. It does not look inside the model: the step's results come back
as one totals vector (`tfdist.training.metric_state`), and what is done with them besides training (progress,
scalars, the profiler, the non-finite guard, the checkpoint policy) are the actions of
`tfdist.training.loop_actions`. Checkpoints are saved through `tfdist.training.checkpoints.Checkpoints`,
validation is `tfdist.training.evaluating.Evaluator`, and a signal stops it (`tfdist.training.preemption`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.distribute.backend import Backend
from tfdist.training import checks
from tfdist.training.callbacks import finalize_optimizer, has_batch_hooks
from tfdist.training.fit_args import should_validate
from tfdist.training.loop_actions import (CheckpointPolicy, NonFiniteGuard, Profiler, Progress, Summaries,
                                          finite_loss, show_logs)
from tfdist.training.plan import LoopPlan
from tfdist.training.preemption import Preempted, StopRequest, host_variable
from tfdist.training.steps import StepFunctions

__all__ = ["Controller", "LoopOptions", "LoopResult", "Preempted"]


@dataclasses.dataclass
class LoopResult:
    history: keras.callbacks.History
    steps: int
    resumed_from: int
    train_logs: dict[str, float]
    val_logs: dict[str, float]
    first_loss: Optional[float]
    last_loss: Optional[float]
    examples_per_sec: Optional[float]
    epoch_seconds: list[float]
    device_step_count: Optional[int]
    val_examples: Optional[int] = None  # Examples the last evaluation counted (None: no evaluation ran).
    diverged: bool = False  # A non-finite step was trained (a callback may have stopped training after it).
    # A sharded optimizer state's bytes per replica and in all (`tfdist.training.zero.state_report`).
    optimizer_state: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LoopOptions:
    """How the loop runs besides the plan: checkpoint cadence, summaries, profiling, progress, Keras' epochs."""

    checkpoint_every_steps: int = 0
    checkpoint_every_secs: float = 0.0
    summary_every_steps: int = 0
    profile: Optional[tuple[tuple[int, int], str]] = None  # ((first, last) step, logdir).
    progress: bool = True
    batch_hooks: Optional[bool] = None  # Whether callbacks have per-batch hooks (None: read them).
    precision: str = ""
    initial_epoch: int = 0
    validation_freq: Any = 1
    stop_on_nonfinite: bool = False  # A non-finite step raises (`NonFiniteGuard`); else training goes on, as Keras'.
    finalize: bool = True  # Keras' fit's end: ``finalize_variable_values`` (EMA weights); not in train_on_batch.


@dataclasses.dataclass
class _Run:
    """Where a run stands: its step, input, epoch, segment and what it has measured."""

    step: int
    iterator: Any
    stream_epoch: int  # A stream's epochs are found as it runs: the epoch, the step it began at, and
    stream_start: int  # whether its data has ended.
    ended: bool
    epoch_totals: np.ndarray
    epoch: int = 0
    start: int = 0
    end: int = 0
    epoch_open: bool = False
    epoch_seconds: dict = dataclasses.field(default_factory=dict)
    steady_examples: int = 0
    steady_seconds: float = 0.0
    first_segment: bool = True
    first_loss: Optional[float] = None
    last_totals: Optional[np.ndarray] = None
    train_logs: dict = dataclasses.field(default_factory=dict)
    val_logs: dict = dataclasses.field(default_factory=dict)
    diverged: bool = False
    # The segment running: its end, the executions dispatched and pending, its examples and timing.
    boundary: int = 0
    dispatched: int = 0
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    segment_start: int = 0
    segment_examples: int = 0
    t0: float = 0.0
    agreed_stop: bool = False
    fetching: bool = False


class Controller:
    """Runs a `LoopPlan` with `StepFunctions`; owns validation, callbacks, checkpoint saves and stopping."""

    def __init__(self, *, steps: StepFunctions, backend: Backend, plan: LoopPlan,
                 train_iterator_fn: Callable[[int], Any], callbacks: keras.callbacks.CallbackList,
                 history: keras.callbacks.History, checkpoints: Any, options: LoopOptions,
                 validation: Optional[Any] = None, writer: Optional[Any] = None):
        """`checkpoints`: saves with ``save(step)`` (`tfdist.training.checkpoints.Checkpoints`). `validation`:
        an `Evaluator` run at validated epochs' ends. `writer`: the run directory's summary writer (or None)."""
        self.steps, self.backend, self.plan, self.model = steps, backend, plan, steps.model
        self.train_iterator_fn, self.callbacks, self.history = train_iterator_fn, callbacks, history
        self.checkpoints, self.options, self.validation = checkpoints, options, validation
        self.progress = Progress(options.progress and backend.is_chief, plan.known_steps_per_epoch())
        self.summaries = Summaries(writer, options.summary_every_steps, self.model, steps.layout)
        self.profiler = Profiler(options.profile, plan.steps_per_execution)
        self.guard = NonFiniteGuard(isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer),
                                    stop=options.stop_on_nonfinite)
        self.checkpointing = CheckpointPolicy(backend, options.checkpoint_every_steps,
                                              options.checkpoint_every_secs, checkpoints.save)
        # Keras calls per-batch hooks once per execution (steps_per_execution batches); where a
        # callback has them, executions run one at a time so a stop a hook requests (TerminateOnNaN,
        # a batch-level EarlyStopping) takes effect before the next execution, as in Keras.
        # Decided from the user's callbacks on every task alike (the chief runs more of them), so every
        # worker keeps the same number of executions in flight and collectives stay matched.
        self.batch_hooks = has_batch_hooks(callbacks.callbacks) if options.batch_hooks is None \
            else options.batch_hooks
        self.in_flight = 1 if (self.batch_hooks or plan.streamed) and not backend.asynchronous \
            else backend.max_in_flight  # A stream: each execution's steps known before the next is sent.
        self.val_examples: Optional[int] = None
        self.stop_arg: Any = None

    def run(self, start_step: int) -> LoopResult:
        """Trains from `start_step` to the plan's end (or a stop); returns what the run did."""
        plan = self.plan
        self.model.stop_training = False  # As Keras' fit: a stop requested in an earlier fit does not carry over.
        self.callbacks.on_train_begin()
        start_step = self._initial_step(start_step)
        # After the callbacks began: a BackupAndRestore that found no backup on one task shows here.
        checks.check_agreement(self.backend, plan, start_step, self.options.precision,
                               self.options.checkpoint_every_secs)
        run = _Run(start_step, self.train_iterator_fn(start_step), *self._stream_position(start_step),
                   epoch_totals=np.zeros(self.steps.layout.size))
        # Single-controller runs stop dispatching at once; the workers of a multi-worker job
        # agree on the stop through a flag each step reads, summed in the execution's reduction.
        flag = None if self.backend.single_controller else host_variable(0.0, "tfdist_stop")
        self.stop_arg = flag if flag is not None else tf.constant(0.0)
        with StopRequest(flag) as stop, self.profiler.guard():
            while run.step < plan.total_steps and not self.model.stop_training and run.stream_epoch < plan.epochs:
                self._open_epoch(run)
                self._segment(run, stop)
                self._after_segment(run, stop)
            if run.step == start_step and self.validation is not None:
                run.val_logs = self.evaluate()  # Resumed a finished run: evaluate what was restored.
        if self.options.finalize:
            finalize_optimizer(self.model, self.backend, self.steps.zero)
        self.callbacks.on_train_end({**run.train_logs, **run.val_logs})
        self.summaries.flush()
        return LoopResult(
            history=self.history, steps=run.step, resumed_from=start_step, train_logs=run.train_logs,
            val_logs=run.val_logs, first_loss=run.first_loss,
            last_loss=finite_loss(self.steps.layout, run.last_totals) if run.last_totals is not None else None,
            examples_per_sec=(run.steady_examples / run.steady_seconds) if run.steady_seconds else None,
            epoch_seconds=[round(run.epoch_seconds[e], 4) for e in sorted(run.epoch_seconds)],
            device_step_count=self.checkpoints.applied, val_examples=self.val_examples, diverged=run.diverged)

    def evaluate(self) -> dict[str, float]:
        """The validation logs (``val_`` names), as Keras' fit validates: by its own evaluate (the callbacks'
        test hooks around it: SwapEMAWeights swaps there, TensorBoard writes evaluation scalars)."""
        if self.validation is None:
            return {}
        logs = self.validation.run(self.callbacks)
        self.val_examples = self.validation.num_examples
        return {f"val_{name}": value for name, value in logs.items()}

    # An epoch and its segments ---------------------------------------------------------------------
    def _open_epoch(self, run: _Run) -> None:
        plan = self.plan
        if plan.streamed:
            run.epoch, run.start, run.end = run.stream_epoch, run.stream_start, run.stream_start + plan.steps_per_epoch
        else:
            run.epoch = plan.epoch_of(run.step)
            run.start, run.end = plan.epoch_start(run.epoch), plan.epoch_start(run.epoch + 1)
        if not run.epoch_open:
            run.epoch_totals = self.steps.reset_metrics()
            self.callbacks.on_epoch_begin(run.epoch)
            run.epoch_open = True

    def _segment(self, run: _Run, stop: StopRequest) -> None:
        """Runs the executions up to the next boundary, handling each one's results as it is fetched."""
        plan, backend = self.plan, self.backend
        run.boundary = self.checkpointing.boundary(run.step, min(plan.total_steps, run.end), plan.steps_per_execution)
        run.t0, run.segment_start, run.dispatched = time.perf_counter(), run.step, run.step
        run.pending, run.segment_examples, run.agreed_stop, run.fetching = collections.deque(), 0, False, False
        self.guard.batch = False
        try:
            self._fill(run, stop)
            while run.pending:
                num, handle = run.pending.popleft()
                run.fetching = True
                totals = backend.fetch(handle)
                run.fetching = False
                self._after_execution(run, stop, num, totals)
        except BaseException as error:
            # An error every worker raises alike (a non-finite loss) lets the executions
            # already dispatched finish; an execution that failed here (perhaps here only),
            # or a second Ctrl-C, does not wait for them: they may never finish.
            # A single controller has no collective partner to hang on: it always waits,
            # so no execution changes the model after the error reaches the caller.
            wait = isinstance(error, Exception) and (backend.single_controller or not run.fetching)
            for _, handle in run.pending:
                backend.abandon(handle, wait=wait)
            raise

    def _fill(self, run: _Run, stop: StopRequest) -> None:
        """Keeps up to ``in_flight`` executions outstanding, never past the boundary: for synchronous strategies
        execution k+1 is dispatched before k's results are fetched (on every worker alike, so collectives stay
        matched), and parameter-server workers get a new one as each finishes."""
        plan, backend = self.plan, self.backend
        while run.dispatched < run.boundary and len(run.pending) < self.in_flight and not run.ended:
            if (backend.single_controller and stop.requested) or self.model.stop_training:
                return
            num = min(plan.steps_per_execution, run.boundary - run.dispatched)
            if plan.partial_last and not plan.streamed:
                # A pass's short last step runs as an execution of its own: collectives of
                # one compiled loop must keep their shapes (sparse gradients' all-gather).
                short = (run.dispatched // plan.steps_per_pass() + 1) * plan.steps_per_pass() - 1
                if run.dispatched < short:
                    num = min(num, short - run.dispatched)
            if self.batch_hooks and (run.dispatched - run.start) % plan.steps_per_execution == 0:
                self.callbacks.on_train_batch_begin(run.dispatched - run.start)  # Keras' executions begin here.
            self.profiler.start(run.dispatched)
            run.pending.append((num, backend.dispatch(self.steps.train_execution, run.iterator,
                                                      tf.constant(num, tf.int64), self.stop_arg)))
            run.dispatched += num

    def _after_execution(self, run: _Run, stop: StopRequest, num: int, totals: Optional[np.ndarray]) -> None:
        """One execution's results: counts, the stop flag, the batch hooks, the guard, summaries and progress."""
        plan, layout = self.plan, self.steps.layout
        if totals is None:  # The steps ran; their sums were lost with a worker.
            totals = np.zeros(layout.size)
        if plan.streamed:  # The steps the execution ran: fewer where the data ended.
            done = int(self.steps.step_counter.numpy()) - run.step
            run.ended, num = run.ended or done < num, done
        run.step += num
        run.segment_examples += int(round(float(totals[0]))) if plan.streamed else num * plan.global_batch
        # Multi-worker jobs agree through the stop flag that travelled with the execution's reduction: no
        # worker dispatches more once it is seen.
        run.agreed_stop = run.agreed_stop or totals[2] > 0
        self.profiler.stop(run.step)
        if not run.agreed_stop and not self.batch_hooks:
            self._fill(run, stop)  # The next execution runs while this one's results are handled.
        nonfinite = int(round(float(totals[1])))
        run.epoch_totals = layout.combine(run.epoch_totals, totals)
        self.guard.note(nonfinite)
        if self.batch_hooks and num and (plan.streamed or self._keras_execution_ends(run.step, run.start, run.end)):
            # Keras' index: the execution's first batch + steps_per_execution - 1, also for a short last one.
            local, per = run.step - 1 - run.start, plan.steps_per_execution
            self.callbacks.on_train_batch_end(local - local % per + per - 1,
                                              self.guard.logs(layout.results(run.epoch_totals), "batch"))
        self.guard.check(nonfinite, num, run.step, self.model.stop_training)
        if nonfinite < num:
            run.last_totals = totals
            if run.first_loss is None:
                run.first_loss = finite_loss(layout, totals)
        self.summaries.add(totals, run.step, num)
        self.progress.update(run.epoch, run.step - run.start, run.epoch_totals, layout)
        if not run.agreed_stop and self.batch_hooks:
            self._fill(run, stop)  # After the hooks: a stop they requested dispatches nothing more.

    def _after_segment(self, run: _Run, stop: StopRequest) -> None:
        """Timing, a preemption, the epoch's end and the checkpoint the policy asks for."""
        seconds = time.perf_counter() - run.t0
        run.epoch_seconds[run.epoch] = run.epoch_seconds.get(run.epoch, 0.0) + seconds
        self.checkpointing.timed(seconds, run.step - run.segment_start, run.first_segment)
        if run.first_segment:
            run.first_segment = False
        elif run.segment_examples:
            run.steady_examples += run.segment_examples
            run.steady_seconds += seconds
        if run.segment_examples:
            self.summaries.scalar("train/examples_per_sec", run.segment_examples / seconds, step=run.step)
        if run.agreed_stop or (self.backend.single_controller and stop.requested):
            raise Preempted(run.step, self.checkpoints.save(run.step))
        at_epoch_end = run.step == run.end or run.step == self.plan.total_steps or run.ended or \
            self.model.stop_training
        if at_epoch_end:
            self._end_epoch(run)
        if self.guard.diverged_stop(self.model):
            logging.warning("A callback stopped training at step %d after a non-finite loss; the weights are not "
                            "finite, so no checkpoint or export was written for these steps.", run.step)
            run.diverged = True
        elif self.guard.seen:  # Training went on after a non-finite step (as Keras'): the last good checkpoint stays.
            if not run.diverged and self.checkpoints.rundir is not None:  # Nothing to write without a run dir.
                logging.warning("The weights are not finite since a non-finite step before step %d: tfdist writes "
                                "no further checkpoint and no export in this run.", run.step)
            run.diverged = True
        elif self.checkpointing.due(run.step, at_epoch_end):
            self.checkpoints.save(run.step)

    def _end_epoch(self, run: _Run) -> None:
        """Keras' epoch end: the metrics' state stored, validation, the logs to the callbacks."""
        layout = self.steps.layout
        self.steps.store_metrics(run.epoch_totals)  # Before validation, which reads them (Keras' evaluate).
        run.train_logs = self.guard.logs(layout.results(run.epoch_totals), "epoch")
        epoch_val = self.evaluate() if should_validate(run.epoch, self.options.validation_freq) else {}
        run.val_logs = epoch_val or run.val_logs
        for name, value in epoch_val.items():
            self.summaries.scalar(f"eval/{name[4:]}", value, step=run.step)
        logs = {**run.train_logs, **epoch_val}
        if self.backend.is_chief:
            logging.info("epoch %d/%d step %d: %s (%.1fs)", run.epoch + 1, self.plan.epochs, run.step,
                         show_logs(logs), run.epoch_seconds[run.epoch])
        run.epoch_totals = np.zeros(layout.size)
        self.callbacks.on_epoch_end(run.epoch, logs)
        run.epoch_open = False
        if self.plan.streamed:
            self._next_stream_epoch(run)

    def _next_stream_epoch(self, run: _Run) -> None:
        plan = self.plan
        if run.ended and plan.known_steps_per_epoch() is not None and run.step - run.start < run.end - run.start:
            logging.warning("Your input ran out of data: epoch %d ended after %d of %d steps; the next epoch reads "
                            "it again from its start (as Keras' fit).", run.epoch + 1, run.step - run.start,
                            run.end - run.start)
        run.stream_epoch, run.stream_start = run.stream_epoch + 1, run.step
        if run.ended and run.stream_epoch < plan.epochs and not self.model.stop_training:
            run.iterator, run.ended = self.train_iterator_fn(0), False  # A new pass over the data.

    def _keras_execution_ends(self, step: int, start: int, end: int) -> bool:
        """Whether `step` ends one of Keras' executions (every steps_per_execution batches of the epoch that
        began at `start`, or its `end`): tfdist may run one in several (a short last batch, a checkpoint), its
        hooks run once."""
        plan = self.plan
        return (step - start) % plan.steps_per_execution == 0 or step == end or step == plan.total_steps

    # Where training starts ---------------------------------------------------------------------------
    def _stream_position(self, start_step: int) -> tuple[int, int, bool]:
        """A stream's epoch at `start_step`, the step that epoch began at, and False (its data has not ended):
        with steps_per_epoch, as counted; without, the first (its one pass). Other inputs: (0, 0, False)."""
        plan = self.plan
        if not plan.streamed:
            return 0, 0, False
        initial = int(getattr(self.model, "_initial_epoch", None) or self.options.initial_epoch or 0)
        if plan.known_steps_per_epoch() is None:
            return initial, 0, False
        epoch = max(initial, start_step // plan.steps_per_epoch)
        return epoch, min(start_step, epoch * plan.steps_per_epoch), False

    def _initial_step(self, start_step: int) -> int:
        """Where training starts once callbacks began: a `BackupAndRestore` may move it to a later epoch.

        As in Keras' fit, ``model._initial_epoch`` (set by `BackupAndRestore.on_train_begin`, which also
        restored the weights) names the first epoch to train, else ``fit(initial_epoch=)``; the data order
        continues from there. A checkpoint resumed further on (tfdist's workdir) wins.
        """
        initial = getattr(self.model, "_initial_epoch", None) or self.options.initial_epoch or 0
        if self.plan.streamed:  # Its epochs' steps are not known ahead: it starts where it is (`_stream_position`).
            return start_step
        first = min(self.plan.epoch_start(int(initial)), self.plan.total_steps)
        if first <= start_step:
            return start_step
        logging.info("Starting at epoch %d (%s): training starts at step %d.", initial,
                     "restored by a callback" if getattr(self.model, "_initial_epoch", None) else "initial_epoch",
                     first)
        self.steps.step_counter.assign(first)
        return first
