"""What the training loop does around its executions, apart from training (Orbit's actions): progress, tfdist's
own TensorBoard scalars, the profiler, the non-finite guard and the checkpoint policy. Each is called by
`tfdist.training.controller.Controller` with an execution's results."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from typing import Any, Callable, Iterator, Optional

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError

# A loss that stays non-finite this many steps in a row under loss scaling
# is divergence, not an overflow the scale can absorb.
MAX_NONFINITE_STEPS = 50


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


def show_logs(logs: dict) -> str:
    """``name=value`` pairs; a metric with one value per class (F1Score(average=None)) as its list."""
    return " ".join(f"{k}={v:.4f}" if np.ndim(v) == 0 else f"{k}={np.round(v, 4).tolist()}" for k, v in logs.items())


def finite_loss(layout: Any, totals: np.ndarray) -> Optional[float]:
    loss = layout.results(totals).get("loss")
    return loss if loss is not None and math.isfinite(loss) else None


def _learning_rate(optimizer: Any) -> Optional[float]:
    try:
        return float(np.asarray(optimizer.learning_rate))
    except Exception:  # A schedule Keras cannot evaluate eagerly here.
        return None


class Summaries:
    """tfdist's own scalars (train/..., eval/..., examples per second), to the run directory's writer only: a
    Keras TensorBoard callback makes its writer the default while it runs, and these do not belong there."""

    def __init__(self, writer: Optional[Any], every_steps: int, model: keras.Model, layout: Any):
        self.writer, self.every, self.model, self.layout = writer, every_steps, model, layout
        self.totals: Optional[np.ndarray] = None

    def scalar(self, name: str, value: Any, step: int) -> None:
        # None, not the no-op writer: its as_default() leaves the user's writer the default. Scalars only.
        if self.writer is None or np.ndim(value) != 0:
            return
        with self.writer.as_default():
            tf.summary.scalar(name, value, step=step)

    def add(self, totals: np.ndarray, step: int, num: int) -> None:
        """An execution of `num` steps ending at `step`: written every ``every_steps`` steps (0: each time)."""
        if self.writer is None:  # Nothing to write (a worker, or no run directory): nothing computed.
            return
        layout = self.layout
        self.totals = totals if self.totals is None else layout.combine(self.totals, totals)
        if self.every and step // self.every == (step - num) // self.every:
            return
        for name, value in layout.results(self.totals).items():
            self.scalar(f"train/{name}", value, step=step)
        learning_rate = _learning_rate(self.model.optimizer)  # Read while the next execution may run.
        if learning_rate is not None:
            self.scalar("train/learning_rate", learning_rate, step=step)
        self.totals = None

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()


class Profiler:
    """The TensorFlow profiler over steps ``(first, last)`` into ``logdir`` (None: off)."""

    def __init__(self, profile: Optional[tuple[tuple[int, int], str]], steps_per_execution: int):
        self.profile, self.steps_per_execution, self.running = profile, steps_per_execution, False

    def start(self, first_step: int) -> None:
        """Before dispatching the execution that runs step FIRST."""
        if self.profile is None or self.running:
            return
        (first, last), logdir = self.profile
        if first_step + self.steps_per_execution > first and first_step < last:
            tf.profiler.experimental.start(logdir)
            self.running = True
            logging.info("Profiling steps %d-%d into %s.", first_step, last, logdir)

    def stop(self, step: int) -> None:
        """Once the execution that ran step LAST has finished."""
        if self.running and step >= self.profile[0][1]:
            tf.profiler.experimental.stop()
            self.running = False

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Stops a running profiler on every way out of the loop (errors and preemption included)."""
        try:
            yield
        finally:
            if self.running:
                tf.profiler.experimental.stop()
                self.running = False


class NonFiniteGuard:
    """Non-finite steps (the summed gradients, hence the loss, NaN or inf): Keras' fit goes on, and so does this.

    By default (``stop``: False) a non-finite step is trained as Keras trains it (the weights stop being finite)
    and logged once as a warning; a callback (TerminateOnNaN) may stop training. ``stop``: True (tfdist-train,
    ``fit(stop_on_nonfinite=True)``) raises a `UserError` at such a step unless a callback already stopped it,
    with a NaN loss in the logs of its batch and epoch. Under loss scaling a step whose gradients overflowed is
    skipped either way, and only ``MAX_NONFINITE_STEPS`` in a row are divergence (a `UserError`)."""

    def __init__(self, loss_scaling: bool, stop: bool = False):
        self.loss_scaling, self.stop = loss_scaling, stop
        self.in_a_row = 0
        self.batch = False  # Since the last per-batch hook.
        self.epoch = False  # In this epoch.
        self.seen = False  # In this run: a callback that stops after it leaves weights not worth saving.
        self.warned = False

    def note(self, nonfinite: int) -> None:
        """An execution's count of non-finite steps, before its batch hooks."""
        self.batch = self.batch or bool(nonfinite and not self.loss_scaling)

    def check(self, nonfinite: int, num: int, step: int, stopping: bool) -> None:
        """After the batch hooks (which may have stopped training): refuses a diverged run, or warns once."""
        unskipped = bool(nonfinite and not self.loss_scaling)
        self.epoch = self.epoch or unskipped
        self.seen = self.seen or self.epoch
        if unskipped and self.stop and not stopping:
            raise UserError(
                f"The training loss became non-finite (NaN or inf) in {nonfinite} of the steps up to step {step}; "
                "lower the learning rate (or add warm-up). No checkpoint was written for these steps. (Keras' fit "
                "would go on; tfdist.fit does so unless stop_on_nonfinite=True.)")
        if unskipped and not self.warned:
            self.warned = True
            logging.warning(
                "The training loss (or its gradients) became non-finite (NaN or inf) in %d of the steps up to step "
                "%d. Training goes on, as Keras' fit does, and the weights are no longer finite. To stop at such a "
                "step add keras.callbacks.TerminateOnNaN(), or pass tfdist.fit(..., stop_on_nonfinite=True) to stop "
                "with an error.", nonfinite, step)
        if not self.loss_scaling:
            return
        self.in_a_row = self.in_a_row + nonfinite if nonfinite == num else 0
        if self.in_a_row >= MAX_NONFINITE_STEPS:
            raise UserError(
                f"The training loss stayed non-finite for {self.in_a_row} consecutive steps up to step {step} "
                "although loss scaling skipped them and lowered the scale each time: training diverged. Lower the "
                "learning rate (or add warm-up). No checkpoint was written for these steps.")

    def logs(self, logs: dict, scope: str) -> dict:
        """With ``stop``, the logs show a NaN loss after a non-finite step; `scope` "batch" or "epoch" (then reset).
        Without, they are the running means, as Keras' (NaN once a NaN loss is in them)."""
        if getattr(self, scope) and self.stop:
            logs["loss"] = float("nan")
        setattr(self, scope, False)
        return logs

    def diverged_stop(self, model: keras.Model) -> bool:
        """Whether a callback stopped training after a non-finite (unskipped) step: nothing to save then."""
        return bool(model.stop_training and self.seen)


class CheckpointPolicy:
    """When to save: every ``every_steps`` steps, at each epoch's end, and every ``every_secs`` seconds as a step
    interval every task shares (the chief's step time, measured on the second of two short segments)."""

    def __init__(self, backend: Backend, every_steps: int, every_secs: float, save: Callable[[int], Optional[str]]):
        self.backend, self.every, self.every_secs, self.save = backend, every_steps, every_secs, save
        self.calibrating = bool(every_secs)  # Until the interval is set from a timed segment.

    def boundary(self, step: int, boundary: int, steps_per_execution: int) -> int:
        """The step the next segment ends at: `boundary` or before, at a checkpoint or a calibration segment."""
        if self.every:
            boundary = min(boundary, (step // self.every + 1) * self.every)
        if self.calibrating:  # Two short segments: the first compiles, the second is timed.
            boundary = min(boundary, step + 2 * steps_per_execution)
        return boundary

    def timed(self, seconds: float, steps: int, first_segment: bool) -> None:
        """A segment of `steps` steps took `seconds` (the first one compiled the step)."""
        if self.calibrating and not first_segment and steps > 0:
            self._set_interval(seconds / steps)
            self.calibrating = False

    def due(self, step: int, at_epoch_end: bool) -> bool:
        return at_epoch_end or bool(self.every and step % self.every == 0)

    def _set_interval(self, seconds_per_step: float) -> None:
        steps = max(1, int(round(self.every_secs / seconds_per_step)))
        if not self.backend.single_controller:  # One collective, at the same step on every task.
            table = self.backend.gather_from_tasks(np.array([self.backend.worker_index, steps], np.int64))
            steps = int(next(row[1] for row in table if int(row[0]) == 0))
        self.every = min(self.every, steps) if self.every else steps
        if self.backend.is_chief:
            logging.info("Checkpointing every %d step(s): about every %g s at the %.3g s a step measured.",
                         self.every, self.every_secs, seconds_per_step)
