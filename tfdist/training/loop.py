"""The outer training loop: when to train, evaluate, checkpoint, summarise and stop.

`Controller` (after Orbit's Controller) drives `tfdist.training.steps.StepFunctions`
through whole epochs. It knows nothing about the model: it schedules
executions of at most ``steps_per_execution`` steps, never past an epoch or
checkpoint boundary, dispatching the next before fetching the last (several
in flight where the backend runs them asynchronously); guards against non-finite losses; writes TensorBoard scalars and
progress; evaluates at each epoch end; calls Keras callbacks with Keras'
log names; checkpoints (chief only, through `tfdist.training.workdir.RunDir`); and turns
SIGTERM/SIGINT into a checkpoint and `Preempted`.

Before the first step every task of a multi-worker job compares what it
restored and what it plans to run with one all-gather, so a workdir that is
not shared, or a worker started with other flags, fails at once with a message
naming the tasks instead of hanging later.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import math
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import epochs as epochs_lib
from tfdist.training.fit_args import should_validate
from tfdist.training.steps import StepFunctions

# A loss that stays non-finite this many steps in a row under loss scaling
# is divergence, not an overflow the scale can absorb.
MAX_NONFINITE_STEPS = 50
UNBOUNDED = 2 ** 50  # A stream's steps_per_epoch where none is given (`LoopPlan.streamed`).


class Preempted(Exception):
    """Raised after a SIGTERM/SIGINT stopped training and a checkpoint was saved."""

    def __init__(self, step: int, checkpoint: Optional[str]):
        saved = (f"checkpoint {checkpoint} was saved. Run the same command with the same --workdir to resume "
                 "from it.") if checkpoint else "the chief saved the checkpoint (if the run has a workdir)."
        super().__init__(f"Training was stopped by a signal at step {step}; {saved}")
        self.step = step
        self.checkpoint = checkpoint


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag the loop checks between executions.

    With a `flag` variable (multi-worker jobs) the request is also written
    there, where the running execution's next step reads it: the request then
    travels with that execution's reduction to every worker.
    """

    def __init__(self, flag: Optional[tf.Variable] = None) -> None:
        self.requested = False
        self.flag = flag
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # Not the main thread: leave signals alone.
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # Second signal: stop now.
            raise KeyboardInterrupt
        logging.warning("Received signal %d: saving a checkpoint and stopping.", signum)
        self.requested = True
        if self.flag is not None:
            with tf.init_scope():  # Runs now, even if the signal lands while a function is being traced.
                self.flag.assign(1.0)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """The resolved numbers of one run. `resume_fields()` must match for a resume.

    ``total_steps`` is not among them: a run stopped early by ``max_steps`` may
    be continued further with a larger one.
    """

    global_batch: int
    per_replica_batch: int
    micro_batch: int
    grad_accum_steps: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    steps_per_execution: int
    seed: int
    extra: tuple = ()  # (name, value) pairs the caller adds: dataset, learning rate, precision, ...
    # Whether the last step of an epoch may hold fewer examples (Keras' partial last batch), or the
    # replicas do not divide the global batch: each replica's batch then carries the step's global
    # example count, and `per_replica_batch` is the largest share.
    partial_last: bool = False
    num_replicas: int = 1
    # Keras' epochs where steps_per_epoch is below the batches of one pass over the data (epochs.py): the
    # steps of each epoch (empty: `steps_per_epoch` each), and the steps of a pass, whose order continues
    # across epochs (0: a pass an epoch).
    epoch_steps: tuple = ()
    pass_steps: int = 0
    # A stream (a dataset of unknown length, a generator): its epochs end where the data ends, or after
    # `steps_per_epoch` steps (`UNBOUNDED`: not given); known only as the loop runs.
    streamed: bool = False

    def epoch_start(self, epoch: int) -> int:
        """The step an epoch begins at (the total past the last epoch)."""
        if not self.epoch_steps:
            return epoch * self.steps_per_epoch
        return epochs_lib.epoch_start(self.epoch_steps, epoch)

    def epoch_of(self, step: int) -> int:
        """The epoch the step after `step` steps belongs to."""
        if not self.epoch_steps:
            return step // self.steps_per_epoch
        return epochs_lib.epoch_of(self.epoch_steps, step)

    def known_steps_per_epoch(self) -> Optional[int]:
        """Steps in an epoch, or None for a stream without steps_per_epoch (its epoch ends with its data)."""
        return None if self.streamed and self.steps_per_epoch >= UNBOUNDED else self.steps_per_epoch

    def steps_per_pass(self) -> int:
        """Steps in one pass over the data (the order is drawn anew for each)."""
        return self.pass_steps or self.steps_per_epoch

    def resume_fields(self) -> dict[str, Any]:
        fields = {
            "global_batch": self.global_batch,
            "grad_accum_steps": self.grad_accum_steps, "steps_per_epoch": self.steps_per_epoch,
            "epochs": self.epochs, "seed": self.seed,
        }
        if self.streamed:
            fields.update(streamed=True)
        if self.pass_steps:  # Only where epochs are Keras' continuing ones: older plans stay comparable.
            fields.update(pass_steps=self.pass_steps)
        if self.epoch_steps:
            fields.update(epoch_steps=list(self.epoch_steps))
        fields.update(dict(self.extra))
        return json.loads(json.dumps(fields))  # What a JSON round trip keeps.

    def digest(self) -> int:
        text = json.dumps(self.resume_fields(), sort_keys=True)
        return int(hashlib.sha256(text.encode()).hexdigest()[:7], 16)


@dataclasses.dataclass
class Progress:
    """A progress bar on an interactive chief; a few log lines per epoch otherwise."""

    enabled: bool
    steps_per_epoch: Optional[int]
    bar: Optional[keras.utils.Progbar] = None
    last_logged: int = -1

    def update(self, epoch: int, step_in_epoch: int, totals: np.ndarray, layout: Any) -> None:
        """Shows the epoch's running logs (computed from `totals` only when something is shown)."""
        if not self.enabled:
            return
        if sys.stdout.isatty():
            logs = layout.results(totals)
            if self.bar is None or step_in_epoch <= 0:
                self.bar = keras.utils.Progbar(self.steps_per_epoch, stateful_metrics=list(logs))
            self.bar.update(step_in_epoch, list(logs.items()))
            return
        quarter = max(1, self.steps_per_epoch // 4) if self.steps_per_epoch else 100
        if step_in_epoch // quarter != self.last_logged // quarter or step_in_epoch == self.steps_per_epoch:
            shown = show_logs(layout.results(totals))
            logging.info("epoch %d: step %d/%s %s", epoch + 1, step_in_epoch, self.steps_per_epoch or "?", shown)
        self.last_logged = step_in_epoch


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
    diverged: bool = False  # A callback (TerminateOnNaN) stopped training after a non-finite step.


class Controller:
    """Runs a `LoopPlan` with `StepFunctions`; owns checkpoints, evaluation, callbacks and stopping."""

    def __init__(
        self,
        *,
        steps: StepFunctions,
        backend: Backend,
        plan: LoopPlan,
        train_iterator_fn: Callable[[int], Any],
        eval_iterator_fn: Optional[Callable[[], Any]],
        eval_steps: int,
        eval_examples: Optional[int],
        checkpoint: tf.train.Checkpoint,
        manager: Optional[tf.train.CheckpointManager],
        save_fn: Callable[[int], Optional[str]],
        callbacks: keras.callbacks.CallbackList,
        history: keras.callbacks.History,
        loss_scaling: bool,
        checkpoint_every_steps: int = 0,
        checkpoint_every_secs: float = 0.0,
        progress: bool = True,
        error: Callable[[str], Exception] = UserError,
        summary_every_steps: int = 0,
        profile: Optional[tuple[tuple[int, int], str]] = None,
        batch_hooks: Optional[bool] = None,
        precision: str = "",
        initial_epoch: int = 0,
        validation_freq: Any = 1,
    ):
        self.steps = steps
        self.backend = backend
        self.plan = plan
        self.train_iterator_fn = train_iterator_fn
        self.eval_iterator_fn = eval_iterator_fn
        self.eval_steps = eval_steps
        self.eval_examples = eval_examples
        self.checkpoint = checkpoint
        self.manager = manager
        self.save_fn = save_fn
        self.callbacks = callbacks
        self.history = history
        self.loss_scaling = loss_scaling
        self.every = checkpoint_every_steps
        self.every_secs = checkpoint_every_secs
        self.progress = Progress(progress and backend.is_chief, plan.known_steps_per_epoch())
        self.error = error
        self.model = steps.model
        self.summary_every = summary_every_steps
        self.profile = profile
        self.precision = precision
        self._profiling = False
        # Keras calls per-batch hooks once per execution (steps_per_execution batches); where a
        # callback has them, executions run one at a time so a stop a hook requests (TerminateOnNaN,
        # a batch-level EarlyStopping) takes effect before the next execution, as in Keras.
        # Decided from the user's callbacks on every task alike (the chief runs more of them), so every
        # worker keeps the same number of executions in flight and collectives stay matched.
        self.batch_hooks = has_batch_hooks(callbacks.callbacks) if batch_hooks is None else batch_hooks
        self.in_flight = 1 if (self.batch_hooks or plan.streamed) and not backend.asynchronous \
            else backend.max_in_flight  # A stream: each execution's steps known before the next is sent.
        self.val_examples: Optional[int] = None
        self.initial_epoch = initial_epoch  # fit(initial_epoch=): a BackupAndRestore's restored epoch wins.
        self.validation_freq = validation_freq
        self.writer: Optional[Any] = None  # The run directory's summary writer (set by fitting); None: none.
        self.test_batch_hooks = 0  # Validation steps per execution where callbacks have per-batch test hooks.

    # Agreement ----------------------------------------------------------------
    def check_agreement(self, step: int, precision: str) -> None:
        """All tasks compare (step, plan, precision) before the first step; a mismatch fails all of them."""
        if self.backend.single_controller:
            return
        # Time-based checkpoints gather once at a step every task must reach alike: on or off everywhere.
        mine = np.array([self.backend.worker_index, step, self.plan.digest(),
                         int(hashlib.sha256(precision.encode()).hexdigest()[:7], 16), int(self.every_secs > 0)],
                        np.int64)
        table = self.backend.gather_from_tasks(mine)
        rows = sorted({tuple(int(v) for v in row) for row in table})
        if len({row[1:] for row in rows}) == 1:
            return
        steps = ", ".join(f"worker {r[0]} step {r[1]}" for r in rows)
        if len({r[1] for r in rows}) > 1:
            raise self.error(
                f"The workers restored different checkpoints ({steps}): is --workdir on storage every machine "
                "shares? Point every worker at the same shared --workdir, and a BackupAndRestore at a backup_dir they "
                "all share (or start them all from scratch in a new one).")
        what = "plan (batch sizes, steps, seed, learning rate, dataset)" if len({r[2] for r in rows}) > 1 \
            else f"precision policy (this task: {precision})" if len({r[3] for r in rows}) > 1 \
            else f"time-based checkpoints (checkpoint_every_secs: {self.every_secs:g} on this task)"
        raise self.error(
            f"The workers disagree about the {what}: tasks {', '.join(f'worker {r[0]}' for r in rows)} resolved "
            "different values. Start every worker with the same command, flags and software on the same kind of "
            "machine.")

    def _checkpoint_interval(self, seconds_per_step: float) -> None:
        """checkpoint_every_secs as a step interval every task shares: the chief's measured step time decides."""
        steps = max(1, int(round(self.every_secs / seconds_per_step)))
        if not self.backend.single_controller:  # One collective, at the same step on every task.
            table = self.backend.gather_from_tasks(np.array([self.backend.worker_index, steps], np.int64))
            steps = int(next(row[1] for row in table if int(row[0]) == 0))
        self.every = min(self.every, steps) if self.every else steps
        if self.backend.is_chief:
            logging.info("Checkpointing every %d step(s): about every %g s at the %.3g s a step measured.",
                         self.every, self.every_secs, seconds_per_step)

    # Running ------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The validation logs (``val_`` names); the callbacks' on_test_begin/on_test_end around it, as Keras' fit
        validates by calling its evaluate (SwapEMAWeights swaps there, TensorBoard writes evaluation scalars)."""
        if self.eval_iterator_fn is None:
            return {}
        self.callbacks.on_test_begin()
        iterator = self.eval_iterator_fn()
        totals = self.steps.reset_metrics(self.steps.eval_layout)
        if not self.test_batch_hooks:
            totals = self.steps.eval_layout.combine(totals, self.backend.execute(
                self.steps.eval_chunk, iterator, tf.constant(self.eval_steps, tf.int64)))
        else:  # As Keras' evaluate: the hooks every steps_per_execution batches, with the running logs.
            per = self.test_batch_hooks
            for first in range(0, self.eval_steps, per):
                self.callbacks.on_test_batch_begin(first)
                count = tf.constant(min(per, self.eval_steps - first), tf.int64)
                totals = self.steps.eval_layout.combine(totals, self.backend.execute(self.steps.eval_chunk,
                                                                                     iterator, count))
                self.callbacks.on_test_batch_end(first + per - 1, self.steps.eval_layout.results(totals))
        count = int(round(float(totals[0])))
        if self.eval_examples is not None and count != self.eval_examples:
            raise RuntimeError(f"Evaluation counted {count} examples, expected {self.eval_examples}.")
        self.val_examples = count
        self.steps.store_metrics(totals, self.steps.eval_layout)
        self.callbacks.on_test_end(self.steps.eval_layout.results(totals))
        return self.steps.eval_layout.results(totals, prefix="val_")

    def _keras_execution_ends(self, step: int, start: int, end: int) -> bool:
        """Whether `step` ends one of Keras' executions (every steps_per_execution batches of the epoch that
        began at `start`, or its `end`): tfdist may run one in several (a short last batch, a checkpoint), its
        hooks run once."""
        plan = self.plan
        return (step - start) % plan.steps_per_execution == 0 or step == end or step == plan.total_steps

    def run(self, start_step: int) -> LoopResult:
        plan, backend, steps = self.plan, self.backend, self.steps
        self.model.stop_training = False  # As Keras' fit: a stop requested in an earlier fit does not carry over.
        self.callbacks.on_train_begin()
        start_step = self._initial_step(start_step)
        # After the callbacks began: a BackupAndRestore that found no backup on one task shows here.
        self.check_agreement(start_step, self.precision)
        step = start_step
        iterator = self.train_iterator_fn(start_step)
        # A stream's epochs are found as it runs: the epoch, the step it began at, whether the data ended.
        stream_epoch, stream_start, ended = self._stream_position(start_step)
        layout = steps.layout
        epoch_totals = np.zeros(layout.size)
        epoch_seconds: dict[int, float] = {}
        steady_examples, steady_seconds, first_segment = 0, 0.0, True
        first_loss: Optional[float] = None
        last_loss: Optional[float] = None
        train_logs: dict[str, float] = {}
        val_logs: dict[str, float] = {}
        nonfinite_run = 0
        summary_totals: Optional[np.ndarray] = None
        last_totals: Optional[np.ndarray] = None
        epoch_open, epoch_nonfinite = False, False
        epoch_nonfinite_seen, diverged = False, False  # A non-finite step a callback (TerminateOnNaN) stopped at.
        # Single-controller runs stop dispatching at once; the workers of a multi-worker job
        # agree on the stop through a flag each step reads, summed in the execution's reduction.
        flag = None if backend.single_controller else host_variable(0.0, "tfdist_stop")
        stop_arg = flag if flag is not None else tf.constant(0.0)
        calibrating = bool(self.every_secs)  # Until the checkpoint interval is set from a timed segment.
        with StopRequest(flag) as stop, self._profiler_guard():
            while step < plan.total_steps and not self.model.stop_training and stream_epoch < plan.epochs:
                if plan.streamed:
                    epoch, start, end = stream_epoch, stream_start, stream_start + plan.steps_per_epoch
                else:
                    epoch = plan.epoch_of(step)
                    start, end = plan.epoch_start(epoch), plan.epoch_start(epoch + 1)
                if not epoch_open:
                    epoch_totals = steps.reset_metrics()
                    self.callbacks.on_epoch_begin(epoch)
                    epoch_open = True
                boundary = min(plan.total_steps, end)
                if self.every:
                    boundary = min(boundary, (step // self.every + 1) * self.every)
                if calibrating:  # Two short segments: the first compiles, the second is timed.
                    boundary = min(boundary, step + 2 * plan.steps_per_execution)
                t0, segment_start = time.perf_counter(), step
                pending: collections.deque = collections.deque()
                dispatched = step

                def fill() -> None:
                    # Keep up to max_in_flight executions outstanding, never past the boundary:
                    # for synchronous strategies execution k+1 is dispatched before k's results
                    # are fetched (on every worker alike, so collectives stay matched), and
                    # parameter-server workers get a new one as each finishes.
                    nonlocal dispatched
                    while dispatched < boundary and len(pending) < self.in_flight and not ended:
                        if (backend.single_controller and stop.requested) or self.model.stop_training:
                            return
                        num = min(plan.steps_per_execution, boundary - dispatched)
                        if plan.partial_last and not plan.streamed:
                            # A pass's short last step runs as an execution of its own: collectives of
                            # one compiled loop must keep their shapes (sparse gradients' all-gather).
                            short = (dispatched // plan.steps_per_pass() + 1) * plan.steps_per_pass() - 1
                            if dispatched < short:
                                num = min(num, short - dispatched)
                        if self.batch_hooks and (dispatched - start) % \
                                plan.steps_per_execution == 0:  # Keras' executions begin at these batches.
                            self.callbacks.on_train_batch_begin(dispatched - start)
                        self._profile_start(dispatched)
                        pending.append((num, backend.dispatch(steps.train_chunk, iterator, tf.constant(num, tf.int64),
                                                              stop_arg)))
                        dispatched += num

                segment_examples, agreed_stop, fetching, batch_nonfinite = 0, False, False, False
                try:
                    fill()
                    while pending:
                        num, handle = pending.popleft()
                        fetching = True
                        totals = backend.fetch(handle)
                        fetching = False
                        if totals is None:  # The steps ran; their sums were lost with a worker.
                            totals = np.zeros(layout.size)
                        if plan.streamed:  # The steps the execution ran: fewer where the data ended.
                            done = int(steps.step_counter.numpy()) - step
                            ended, num = ended or done < num, done
                        step += num
                        segment_examples += int(round(float(totals[0]))) if plan.streamed else num * plan.global_batch
                        # Multi-worker jobs agree through the stop flag that travelled with the
                        # execution's reduction: no worker dispatches more once it is seen.
                        agreed_stop = agreed_stop or totals[2] > 0
                        self._profile_stop(step)
                        if not agreed_stop and not self.batch_hooks:
                            fill()  # The next execution runs while this one's results are handled.
                        nonfinite = int(round(float(totals[1])))
                        epoch_totals = layout.combine(epoch_totals, totals)
                        batch_nonfinite = batch_nonfinite or bool(nonfinite and not self.loss_scaling)
                        if self.batch_hooks and num and (plan.streamed or self._keras_execution_ends(step, start, end)):
                            batch_logs = layout.results(epoch_totals)
                            if batch_nonfinite:
                                batch_logs["loss"] = float("nan")  # What Keras' logs show (TerminateOnNaN reads it).
                            batch_nonfinite = False
                            # Keras' index: the execution's first batch + steps_per_execution - 1, also for a
                            # short last execution.
                            local = step - 1 - start
                            self.callbacks.on_train_batch_end(
                                local - local % plan.steps_per_execution + plan.steps_per_execution - 1, batch_logs)
                        epoch_nonfinite = epoch_nonfinite or bool(nonfinite and not self.loss_scaling)
                        epoch_nonfinite_seen = epoch_nonfinite_seen or epoch_nonfinite
                        if nonfinite and not self.loss_scaling and not self.model.stop_training:
                            raise self.error(
                                f"The training loss became non-finite (NaN or inf) in {nonfinite} of the steps up to "
                                f"step {step}; lower the learning rate (or add warm-up). No checkpoint was written "
                                "for these steps.")
                        nonfinite_run = nonfinite_run + nonfinite if nonfinite == num else 0
                        if nonfinite_run >= MAX_NONFINITE_STEPS:
                            raise self.error(
                                f"The training loss stayed non-finite for {nonfinite_run} consecutive steps up to "
                                f"step {step} although loss scaling skipped them and lowered the scale each time: "
                                "training diverged. Lower the learning rate (or add warm-up). No checkpoint was "
                                "written for these steps.")
                        if nonfinite < num:
                            last_totals = totals
                            if first_loss is None:
                                first_loss = _loss(layout, totals)
                        summary_totals = totals if summary_totals is None else layout.combine(summary_totals, totals)
                        if not self.summary_every or step // self.summary_every != (step - num) // self.summary_every:
                            self._train_summaries(layout.results(summary_totals), step)
                            summary_totals = None
                        self.progress.update(epoch, step - start, epoch_totals, layout)
                        if not agreed_stop and self.batch_hooks:
                            fill()  # After the hooks: a stop they requested dispatches nothing more.
                except BaseException as error:
                    # An error every worker raises alike (a non-finite loss) lets the executions
                    # already dispatched finish; an execution that failed here (perhaps here only),
                    # or a second Ctrl-C, does not wait for them: they may never finish.
                    # A single controller has no collective partner to hang on: it always waits,
                    # so no execution changes the model after the error reaches the caller.
                    wait = isinstance(error, Exception) and (backend.single_controller or not fetching)
                    for _, handle in pending:
                        backend.abandon(handle, wait=wait)
                    raise
                seconds = time.perf_counter() - t0
                epoch_seconds[epoch] = epoch_seconds.get(epoch, 0.0) + seconds
                if calibrating and not first_segment and step > segment_start:
                    self._checkpoint_interval(seconds / (step - segment_start))
                    calibrating = False
                if first_segment:
                    first_segment = False
                elif segment_examples:
                    steady_examples += segment_examples
                    steady_seconds += seconds
                if segment_examples:
                    self._scalar("train/examples_per_sec", segment_examples / seconds, step=step)
                if agreed_stop or (backend.single_controller and stop.requested):
                    raise Preempted(step, self.save_fn(step))
                at_epoch_end = step == end or step == plan.total_steps or ended or \
                    self.model.stop_training
                if at_epoch_end:
                    steps.store_metrics(epoch_totals)  # Before validation, which reads them (Keras' evaluate).
                    train_logs = layout.results(epoch_totals)
                    if epoch_nonfinite:
                        train_logs["loss"] = float("nan")
                    epoch_nonfinite = False
                    epoch_val = self.evaluate() if should_validate(epoch, self.validation_freq) else {}
                    val_logs = epoch_val or val_logs
                    for name, value in epoch_val.items():
                        self._scalar(f"eval/{name[4:]}", value, step=step)
                    logs = {**train_logs, **epoch_val}
                    if backend.is_chief:
                        logging.info("epoch %d/%d step %d: %s (%.1fs)", epoch + 1, plan.epochs, step,
                                     show_logs(logs), epoch_seconds[epoch])
                    epoch_totals = np.zeros(layout.size)
                    self.callbacks.on_epoch_end(epoch, logs)
                    epoch_open = False
                    if plan.streamed:
                        if ended and plan.known_steps_per_epoch() is not None and step - start < end - start:
                            logging.warning("Your input ran out of data: epoch %d ended after %d of %d steps; the "
                                            "next epoch reads it again from its start (as Keras' fit).", epoch + 1,
                                            step - start, end - start)
                        stream_epoch, stream_start = stream_epoch + 1, step
                        if ended and stream_epoch < plan.epochs and not self.model.stop_training:
                            iterator, ended = self.train_iterator_fn(0), False  # A new pass over the data.
                if diverged_stop(self.model, epoch_nonfinite_seen):
                    logging.warning("A callback stopped training at step %d after a non-finite loss; the weights "
                                    "are not finite, so no checkpoint or export was written for these steps.", step)
                    diverged = True
                elif at_epoch_end or (self.every and step % self.every == 0):
                    self.save_fn(step)
            if last_totals is not None:
                last_loss = _loss(layout, last_totals)
            if step == start_step and self.eval_iterator_fn is not None:
                val_logs = self.evaluate()  # Resumed a finished run: evaluate what was restored.
        finalize_optimizer(self.model, backend)
        self.callbacks.on_train_end({**train_logs, **val_logs})
        return LoopResult(
            history=self.history, steps=step, resumed_from=start_step, train_logs=train_logs, val_logs=val_logs,
            first_loss=first_loss, last_loss=last_loss,
            examples_per_sec=(steady_examples / steady_seconds) if steady_seconds else None,
            epoch_seconds=[round(epoch_seconds[e], 4) for e in sorted(epoch_seconds)],
            device_step_count=None, val_examples=self.val_examples, diverged=diverged,
        )

    def _stream_position(self, start_step: int) -> tuple[int, int, bool]:
        """A stream's epoch at `start_step`, the step that epoch began at, and False (its data has not ended):
        with steps_per_epoch, as counted; without, the first (its one pass). Other inputs: (0, 0, False)."""
        plan = self.plan
        if not plan.streamed:
            return 0, 0, False
        initial = int(getattr(self.model, "_initial_epoch", None) or self.initial_epoch or 0)
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
        initial = getattr(self.model, "_initial_epoch", None) or self.initial_epoch or 0
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

    @contextlib.contextmanager
    def _profiler_guard(self) -> Iterator[None]:
        """Stops a running profiler on every way out of the loop (errors and preemption included)."""
        try:
            yield
        finally:
            if self._profiling:
                tf.profiler.experimental.stop()
                self._profiling = False

    def _scalar(self, name: str, value: Any, step: int) -> None:
        """One of tfdist's own scalars, to its run directory's writer only: a Keras TensorBoard callback makes
        its writer the default while it runs, and tfdist's scalars do not belong in the user's logs."""
        # None, not the no-op writer: its as_default() leaves the user's writer the default. Scalars only.
        if self.writer is None or np.ndim(value) != 0:
            return
        with self.writer.as_default():
            tf.summary.scalar(name, value, step=step)

    def _train_summaries(self, logs: dict[str, float], step: int) -> None:
        for name, value in logs.items():
            self._scalar(f"train/{name}", value, step=step)
        learning_rate = _learning_rate(self.model.optimizer)  # Read while the next execution may run.
        if learning_rate is not None:
            self._scalar("train/learning_rate", learning_rate, step=step)

    def _profile_start(self, first_step: int) -> None:
        """Starts the TensorFlow profiler before dispatching the execution that runs step START."""
        if self.profile is None or self._profiling:
            return
        (first, last), logdir = self.profile
        if first_step + self.plan.steps_per_execution > first and first_step < last:
            tf.profiler.experimental.start(logdir)
            self._profiling = True
            logging.info("Profiling steps %d-%d into %s.", first_step, last, logdir)

    def _profile_stop(self, step: int) -> None:
        """Stops it once the execution that ran step END has finished."""
        if self._profiling and step >= self.profile[0][1]:
            tf.profiler.experimental.stop()
            self._profiling = False


BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


def show_logs(logs: dict) -> str:
    """``name=value`` pairs; a metric with one value per class (F1Score(average=None)) as its list."""
    return " ".join(f"{k}={v:.4f}" if np.ndim(v) == 0 else f"{k}={np.round(v, 4).tolist()}" for k, v in logs.items())


def diverged_stop(model: keras.Model, nonfinite_seen: bool) -> bool:
    """Whether a callback stopped training after a non-finite (unskipped) step: nothing to save then."""
    return bool(model.stop_training and nonfinite_seen)


TEST_BATCH_HOOKS = ("on_test_batch_begin", "on_test_batch_end")
PREDICT_BATCH_HOOKS = ("on_predict_batch_begin", "on_predict_batch_end")


def has_batch_hooks(callbacks: Any, hooks: Sequence[str] = BATCH_HOOKS) -> bool:
    """Whether any of `callbacks` overrides one of the per-batch `hooks` (Keras marks the base ones as defaults)
    to some effect: Keras' ModelCheckpoint and BackupAndRestore saving per epoch, and a TensorBoard writing per
    epoch without profiling, do nothing in them (their hooks are still called, once per execution)."""
    from keras.src.utils.python_utils import is_default

    return any(not is_default(getattr(cb, name)) for cb in callbacks if not _inert_batch_hooks(cb)
               for name in hooks)


def _inert_batch_hooks(callback: Any) -> bool:
    if isinstance(callback, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)):
        return type(callback) in (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore) and \
            getattr(callback, "save_freq", None) == "epoch"
    if type(callback) is keras.callbacks.TensorBoard:
        return callback.update_freq == "epoch" and not getattr(callback, "_stop_batch", 0)
    return False


def finalize_optimizer(model: keras.Model, backend: Backend) -> None:
    """What Keras' fit does after the last epoch: ``finalize_variable_values`` (EMA weights, ``use_ema``)."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        with backend.scope():
            optimizer.finalize_variable_values(model.trainable_weights)


def host_variable(value: float, name: str) -> tf.Variable:
    """A float32 variable on this host, outside any distribution strategy.

    Strategy scopes are per thread, so it is created on a thread of its own:
    even inside a caller's ``strategy.scope()`` it is a plain variable, not a
    mirrored one whose creation would be a collective.
    """
    made: list = []

    def create() -> None:
        try:
            with tf.device("/CPU:0"):
                made.append(tf.Variable(value, trainable=False, name=name))
        except Exception as e:  # Re-raised in the caller's thread.
            made.append(e)

    creator = threading.Thread(target=create)
    creator.start()
    creator.join()
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]


def _loss(layout: Any, totals: np.ndarray) -> Optional[float]:
    loss = layout.results(totals).get("loss")
    return loss if loss is not None and math.isfinite(loss) else None


def _learning_rate(optimizer: Any) -> Optional[float]:
    try:
        return float(np.asarray(optimizer.learning_rate))
    except Exception:  # A schedule Keras cannot evaluate eagerly here.
        return None
