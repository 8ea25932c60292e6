"""The training loop: one compiled loop for every backend.

`train_and_evaluate(config)` builds the backend, data, model and optimizer,
then alternates compiled multi-step training (an inner ``tf.range`` loop of
``steps_per_execution`` replica steps, the equivalent of Keras'
``steps_per_execution``) with checkpoints and an evaluation at each epoch end.
It talks to the backend only through `tfdist.backend.Backend`, so the same
code trains under MirroredStrategy, MultiWorkerMirroredStrategy, TPUStrategy
and Horovod. Keras 3 ``model.fit`` is not used: it fails under
MultiWorkerMirroredStrategy and has no ParameterServerStrategy path.

The loss of each replica is its per-example loss summed and divided by the
*global* batch, so summing gradients across replicas (as the optimizer does)
yields the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import signal
import sys
import time
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist import batching, data, model as model_lib, precision, strategies, workdir as workdir_lib
from tfdist.backend import Backend
from tfdist.config import TrainConfig
from tfdist.errors import UserError


class Preempted(Exception):
    """Raised after a SIGTERM/SIGINT stopped training and a checkpoint was saved."""

    def __init__(self, step: int, checkpoint: Optional[str]):
        super().__init__(
            f"Training was stopped by a signal at step {step}; checkpoint {checkpoint} was "
            "saved. Run the same command with the same --workdir to resume from it."
        )
        self.step = step
        self.checkpoint = checkpoint


class _StopRequest:
    """Turns SIGTERM/SIGINT into a flag the loop checks between executions."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopRequest":
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

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class _Progress:
    """A progress bar on an interactive chief; a few log lines per epoch otherwise."""

    enabled: bool
    steps_per_epoch: int
    bar: Optional[keras.utils.Progbar] = None
    last_logged: int = -1

    def update(self, epoch: int, step_in_epoch: int, loss: float, accuracy: float) -> None:
        if not self.enabled:
            return
        if sys.stdout.isatty():
            if self.bar is None or step_in_epoch <= 0:
                self.bar = keras.utils.Progbar(self.steps_per_epoch, stateful_metrics=["loss", "accuracy"])
            self.bar.update(step_in_epoch, [("loss", loss), ("accuracy", accuracy)])
            return
        quarter = max(1, self.steps_per_epoch // 4)
        if step_in_epoch // quarter != self.last_logged // quarter or step_in_epoch == self.steps_per_epoch:
            logging.info("epoch %d: step %d/%d loss=%.4f accuracy=%.4f", epoch + 1, step_in_epoch,
                         self.steps_per_epoch, loss, accuracy)
        self.last_logged = step_in_epoch


def train_and_evaluate(
    config: TrainConfig,
    *,
    backend: Optional[Backend] = None,
    digits: Optional[data.Digits] = None,
) -> dict[str, Any]:
    """Trains and evaluates as `config` says; returns the metrics written to metrics.json.

    `backend` and `digits` let tests and embedding code inject a strategy and data.
    """
    config.validate()
    start = time.time()
    backend = backend or strategies.build_backend(config)
    try:
        if backend.serve():  # A task that only serves (parameter-server jobs) is done here.
            return {"task": backend.task_label, "served": True}
        run = _Run(config, backend, digits)
        with run.rundir:  # tfdist.workdir: failed writes become WriteError; lock and scratch released on any exit.
            return run.run(start)
    finally:
        backend.shutdown()


class _Run:
    def __init__(self, config: TrainConfig, backend: Backend, digits: Optional[data.Digits]):
        self.config = config
        self.backend = backend
        self.digits = digits or data.load_dataset(config.dataset, data_dir=config.data_dir, download=config.download)
        self.precision = precision.choose(
            config.precision, device_kind=backend.device_kind,
            gpu_compute_capability=backend.gpu_compute_capability,
        )
        self.plan = batching.plan(
            config, num_replicas=backend.num_replicas, num_train=self.digits.num_train,
            num_eval=self.digits.num_eval,
            default_steps_per_execution=100 if backend.device_kind == "tpu" else 10,
        )
        path = config.workdir or workdir_lib.default_workdir(backend.name)
        self.config = config = config.replace(workdir=path)
        self.rundir = workdir_lib.RunDir(path, is_chief=backend.is_chief)
        self.resume_from = self.rundir.prepare(config)

    # Building -------------------------------------------------------------
    def _build(self) -> None:
        plan = self.plan
        precision.apply(self.precision, device_kind=self.backend.device_kind)
        with self.backend.scope():
            # The step counter lives with the model (on the parameter servers under
            # ParameterServerStrategy) and is incremented atomically by every step;
            # the learning-rate schedule reads it, not optimizer.iterations, which
            # under-counts under asynchronous training.
            self.step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_step",
                                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.model = model_lib.build_cnn(self.config.seed)
            schedule = batching.WarmupCosine(plan.learning_rate, plan.warmup_steps, plan.decay_steps)
            optimizer = keras.optimizers.Adam(learning_rate=lambda: schedule(self.step_var))
            if self.precision.loss_scaling:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            self.optimizer = optimizer
            self.optimizer.build(self.model.trainable_variables)
        self.backend.report_placement(self.model.variables + self.optimizer.variables + [self.step_var])
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step_var)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, self.rundir.checkpoint_dir, max_to_keep=self.config.keep_checkpoints,
            checkpoint_name="ckpt",
        )
        self.step = 0
        if self.resume_from:
            self.checkpoint.restore(self.resume_from).assert_existing_objects_matched()
            self.step = int(self.step_var.numpy())
            logging.info("Resuming from checkpoint %s at step %d.", self.resume_from, self.step)
        self.backend.broadcast_initial_state(self.model.variables + self.optimizer.variables)
        logging.info("[%s] initial weights fingerprint %s", self.backend.task_label, self._fingerprint())

    def _compile(self) -> None:
        plan, model, optimizer, backend = self.plan, self.model, self.optimizer, self.backend
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        variables = model.trainable_variables
        k, micro = plan.grad_accum_steps, plan.micro_batch

        def forward_backward(images, labels):
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                per_example = loss_fn(labels, logits)
                loss = tf.reduce_sum(per_example) / plan.global_batch
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, variables)
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32))
            return grads, tf.reduce_sum(per_example), correct

        def train_step(images, labels, stop):
            if k == 1:
                grads, loss_sum, correct = forward_backward(images, labels)
            else:
                images = tf.reshape(images, [k, micro, *model_lib.IMAGE_SHAPE])
                labels = tf.reshape(labels, [k, micro])
                grads, loss_sum, correct = forward_backward(images[0], labels[0])
                for i in tf.range(1, k):
                    g, l, c = forward_backward(images[i], labels[i])
                    grads = [a + b for a, b in zip(grads, g)]
                    loss_sum += l
                    correct += c
            optimizer.apply(backend.finish_gradients(grads), variables)
            self.step_var.assign_add(1)
            return tf.stack([loss_sum, correct, tf.cast(tf.size(labels), tf.float32), stop])

        def train_chunk(iterator, num_steps, stop):
            totals = tf.zeros([4], tf.float32)
            for _ in tf.range(num_steps):
                # One step at a time: collectives of two steps in flight at once would
                # collide (Horovod names its all-reduces by graph node).
                tf.autograph.experimental.set_loop_options(parallel_iterations=1)
                images, labels = next(iterator)
                totals += backend.reduce_sum(backend.run(train_step, (images, labels, stop)))
            return totals

        def eval_step(images, labels, weights):
            logits = model(images, training=False)
            per_example = loss_fn(labels, logits)
            correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
            return tf.stack([tf.reduce_sum(per_example * weights), tf.reduce_sum(correct * weights),
                             tf.reduce_sum(weights)])

        def eval_chunk(iterator, num_steps):
            totals = tf.zeros([3], tf.float32)
            for _ in tf.range(num_steps):
                tf.autograph.experimental.set_loop_options(parallel_iterations=1)
                totals += backend.reduce_eval(backend.run_eval(eval_step, next(iterator)))
            return totals

        self.train_chunk = backend.compile(train_chunk)
        self.eval_chunk = backend.compile(eval_chunk)

    # Running --------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        plan = self.plan
        dataset = self.backend.distribute_eval_dataset(data.eval_dataset_fn(
            self.digits.eval_images, self.digits.eval_labels,
            per_replica_batch=plan.eval_per_replica_batch, steps=plan.eval_steps,
        ))
        totals = self.backend.execute(self.eval_chunk, iter(dataset), tf.constant(plan.eval_steps, tf.int64))
        loss_sum, correct, count = (float(x) for x in totals)
        if int(round(count)) != self.digits.num_eval:
            raise RuntimeError(f"Evaluation counted {count} examples, expected {self.digits.num_eval}.")
        return {"eval_loss": loss_sum / count, "eval_accuracy": correct / count, "eval_examples": int(round(count))}

    def _save(self) -> Optional[str]:
        if not (self.backend.is_chief or self.backend.all_tasks_save):
            return None
        # What the steps themselves counted, before the exact host count is stored.
        self.device_step_count = int(self.step_var.numpy())
        self.step_var.assign(self.step)
        path = self.rundir.save_checkpoint(self.manager, self.step)  # A failed write: WriteError.
        if self.backend.is_chief:
            logging.info("Saved checkpoint %s at step %d.", path, self.step)
        return path if self.backend.is_chief else None

    def run(self, start: float) -> dict[str, Any]:
        plan, config, backend = self.plan, self.config, self.backend
        logging.info(
            "[%s] strategy=%s workers=%d precision=%s (%s) dataset=%s train=%d eval=%d %s",
            backend.task_label, backend.name, backend.num_workers, self.precision.policy,
            self.precision.reason, self.digits.name, self.digits.num_train, self.digits.num_eval, plan.describe(),
        )
        self._build()
        self._compile()
        self.rundir.write_config(config)
        writer = self.rundir.summary_writer()
        train_ds = backend.distribute_dataset(data.train_dataset_fn(
            self.digits.train_images, self.digits.train_labels, per_replica_batch=plan.per_replica_batch,
            steps_per_epoch=plan.steps_per_epoch, seed=config.seed if backend.sharded_input else None,
            start_step=self.step if backend.sharded_input else 0,
        ))
        iterator = iter(train_ds)
        progress = _Progress(backend.is_chief, plan.steps_per_epoch)
        resumed_from = self.step
        epoch_seconds: dict[int, float] = {}
        steady_examples, steady_seconds, first = 0, 0.0, True
        epoch_totals = np.zeros(4)
        first_loss: Optional[float] = None
        last_loss: Optional[float] = None
        eval_metrics: dict[str, float] = {}
        every = config.checkpoint_every_steps
        with _StopRequest() as stop, writer.as_default():
            while self.step < plan.total_steps:
                epoch = self.step // plan.steps_per_epoch
                boundary = min(plan.total_steps, (epoch + 1) * plan.steps_per_epoch)
                if every:
                    boundary = min(boundary, (self.step // every + 1) * every)
                # Start up to max_in_flight executions (1 for synchronous strategies),
                # never past the boundary, then collect them in order.
                t0 = time.perf_counter()
                pending: collections.deque = collections.deque()
                dispatched = self.step
                while dispatched < boundary and len(pending) < backend.max_in_flight:
                    if backend.single_controller and stop.requested:
                        break
                    num = min(plan.steps_per_execution, boundary - dispatched)
                    pending.append((num, backend.dispatch(self.train_chunk, iterator, tf.constant(num, tf.int64),
                                                          tf.constant(1.0 if stop.requested else 0.0))))
                    dispatched += num
                segment_examples, agreed_stop = 0, False
                while pending:
                    num, handle = pending.popleft()
                    totals = backend.fetch(handle)
                    self.step += num
                    segment_examples += num * plan.global_batch
                    agreed_stop = agreed_stop or totals[3] > 0
                    epoch_totals += totals
                    loss, accuracy = totals[0] / max(totals[2], 1), totals[1] / max(totals[2], 1)
                    last_loss = float(loss)
                    first_loss = last_loss if first_loss is None else first_loss
                    if not math.isfinite(loss) and not self.precision.loss_scaling:
                        raise UserError(
                            f"The training loss became {loss} at step {self.step}; lower --learning_rate "
                            "(or add --warmup_epochs). No checkpoint was written for this step."
                        )
                    tf.summary.scalar("train/loss", loss, step=self.step)
                    tf.summary.scalar("train/accuracy", accuracy, step=self.step)
                    progress.update(epoch, self.step - epoch * plan.steps_per_epoch,
                                    epoch_totals[0] / max(epoch_totals[2], 1),
                                    epoch_totals[1] / max(epoch_totals[2], 1))
                seconds = time.perf_counter() - t0
                epoch_seconds[epoch] = epoch_seconds.get(epoch, 0.0) + seconds
                if first:
                    first = False
                elif segment_examples:
                    steady_examples += segment_examples
                    steady_seconds += seconds
                if segment_examples:
                    tf.summary.scalar("train/learning_rate", float(self.optimizer.learning_rate), step=self.step)
                    tf.summary.scalar("train/examples_per_sec", segment_examples / seconds, step=self.step)
                # Multi-controller jobs agree through the stop flag that travelled with
                # the step's all-reduce; a single controller decides alone.
                if agreed_stop or (backend.single_controller and stop.requested):
                    raise Preempted(self.step, self._save())
                at_epoch_end = self.step % plan.steps_per_epoch == 0 or self.step == plan.total_steps
                if at_epoch_end:
                    eval_metrics = self.evaluate()
                    for key in ("eval_loss", "eval_accuracy"):
                        tf.summary.scalar(key.replace("_", "/", 1), eval_metrics[key], step=self.step)
                    if backend.is_chief:
                        logging.info(
                            "epoch %d/%d step %d: train_loss=%.4f train_accuracy=%.4f eval_loss=%.4f "
                            "eval_accuracy=%.4f (%.1fs)", epoch + 1, config.epochs, self.step,
                            epoch_totals[0] / max(epoch_totals[2], 1), epoch_totals[1] / max(epoch_totals[2], 1),
                            eval_metrics["eval_loss"], eval_metrics["eval_accuracy"], epoch_seconds[epoch],
                        )
                    epoch_totals = np.zeros(4)
                if at_epoch_end or (every and self.step % every == 0):
                    self._save()
            writer.flush()
        if not eval_metrics:  # Resumed a finished run: evaluate what was restored.
            eval_metrics = self.evaluate()
        fingerprint = self._fingerprint()
        metrics = {
            "strategy": backend.name,
            "task": backend.task_label,
            "num_replicas": backend.num_replicas,
            "num_workers": backend.num_workers,
            "precision": self.precision.policy,
            "precision_reason": self.precision.reason,
            "dataset": self.digits.name,
            "global_batch_size": plan.global_batch,
            "per_replica_batch_size": plan.per_replica_batch,
            "grad_accum_steps": plan.grad_accum_steps,
            "learning_rate": plan.learning_rate,
            "steps": self.step,
            "steps_per_epoch": plan.steps_per_epoch,
            "steps_per_execution": plan.steps_per_execution,
            "epochs": config.epochs,
            "resumed_from_step": resumed_from,
            "step_counter": getattr(self, "device_step_count", None),
            **eval_metrics,
            "first_train_loss": first_loss,
            "last_train_loss": last_loss,
            "loss_scale": float(self.optimizer.dynamic_scale.numpy()) if self.precision.loss_scaling else None,
            "train_examples_per_sec": (steady_examples / steady_seconds) if steady_seconds else None,
            "epoch_train_seconds": [round(epoch_seconds[e], 4) for e in sorted(epoch_seconds)],
            "wall_seconds": round(time.time() - start, 3),
            "weights_fingerprint": fingerprint,
            "workdir": config.workdir,
            "tensorflow_version": tf.__version__,
            "keras_version": keras.__version__,
        }
        self.rundir.export_model(self.model)
        self.rundir.write_json("metrics.json", metrics)
        self.rundir.cleanup()
        return metrics

    def _fingerprint(self) -> str:
        per_variable = [self.backend.local_replica_values(v) for v in self.model.weights]
        replicas = {model_lib.fingerprint([values[r] for values in per_variable])
                    for r in range(len(per_variable[0]))}
        if len(replicas) != 1:
            raise RuntimeError(f"Replicas of {self.backend.task_label} ended with different weights: {sorted(replicas)}")
        return replicas.pop()
