"""The MNIST program: tfdist's first user of its own library.

`train_and_evaluate(config)` builds the backend the config names, chooses the
precision, builds and compiles the CNN (Adam with warm-up and cosine decay)
under the strategy's scope, and trains it with `tfdist.fit` on the digits of
``--dataset``: arrays, or for ``tfds:NAME`` a dataset function that streams the
train split from its files (`data.Stream`). It adds what `tfdist-train`
promises on top of `fit`: the resolved configuration and flagfile in the
workdir, ``model.keras`` and ``metrics.json`` with the run's figures, and the
weights fingerprint every worker prints.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import keras
import tensorflow as tf
from absl import logging

from tfdist.mnist import batching, data, model as model_lib
from tfdist import precision
from tfdist.distribute import strategies
from tfdist.training import workdir as workdir_lib
from tfdist.distribute.backend import Backend
from tfdist.mnist.config import TrainConfig
from tfdist.training.fitting import train as fit_and_report
from tfdist.training.preemption import Preempted

__all__ = ["train_and_evaluate", "Preempted", "fingerprint_of"]


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
        return _run(config, backend, digits, start)
    finally:
        backend.shutdown()


def _compile(config: TrainConfig, plan: batching.BatchPlan, backend: Backend) -> tuple[keras.Model, tf.Variable]:
    with backend.scope():
        # The step counter lives with the model (on the parameter servers under
        # ParameterServerStrategy) and is incremented by every step; the schedule
        # reads it, not optimizer.iterations, which under-counts under
        # asynchronous training and stops while loss scaling skips steps.
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_step",
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        model = model_lib.build_cnn(config.seed)
        schedule = batching.WarmupCosine(plan.learning_rate, plan.warmup_steps, plan.decay_steps)
        learning_rate = batching.CountedSchedule(schedule, step)
        optimizer = keras.optimizers.SGD(learning_rate) if config.optimizer == "sgd" else \
            keras.optimizers.Adam(learning_rate)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model, step


def _run(config: TrainConfig, backend: Backend, digits: Optional[data.Digits], start: float) -> dict[str, Any]:
    digits = digits or data.load_dataset(config.dataset, data_dir=config.data_dir, download=config.download)
    choice = precision.choose(config.precision, device_kind=backend.device_kind,
                              gpu_compute_capability=backend.gpu_compute_capability)
    plan = batching.plan(config, num_replicas=backend.num_replicas, num_train=digits.num_train,
                         num_eval=digits.num_eval,
                         default_steps_per_execution=100 if backend.device_kind == "tpu" else 10)
    path = config.workdir or workdir_lib.default_workdir(backend.name)
    config = config.replace(workdir=path)
    rundir = workdir_lib.RunDir(path, is_chief=backend.is_chief)
    logging.info("[%s] strategy=%s workers=%d precision=%s (%s) dataset=%s train=%d eval=%d %s",
                 backend.task_label, backend.name, backend.num_workers, choice.policy, choice.reason, digits.name,
                 digits.num_train, digits.num_eval, plan.describe())
    precision.apply(choice, device_kind=backend.device_kind)
    strategies.remember(backend)
    with rundir:  # The workdir's lock; failed writes become WriteError; scratch removed on any exit.
        return _train(config, backend, digits, plan, choice, rundir, start)


def _train(config: TrainConfig, backend: Backend, digits: data.Digits, plan: batching.BatchPlan,
           choice: precision.PrecisionChoice, rundir: workdir_lib.RunDir, start: float) -> dict[str, Any]:
    model, step = _compile(config, plan, backend)
    if digits.train_stream is not None:  # Read from files by each input pipeline: fit's dataset-function path.
        # Parameter-server workers take steps as they become free: each reads in an unseeded order of its own.
        seed = config.seed if backend.sharded_input else None
        x, y = digits.train_stream.dataset_fn(plan.global_batch, seed=seed), None
        steps_per_epoch: Optional[int] = plan.steps_per_epoch
    else:
        # tfdist-train's plan trains whole global batches (batching.BatchPlan), on every backend alike.
        x, y, steps_per_epoch = digits.train_images, digits.train_labels, plan.steps_per_epoch
    result = fit_and_report(
        model, x, y, batch_size=plan.global_batch, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
        validation_data=(digits.eval_images, digits.eval_labels), workdir=rundir, strategy=backend.public_strategy,
        # Each replica evaluates whole batches of validation_batch_size (Keras' rule): the per-replica batch, at
        # least 64, keeps evaluation's memory near training's (accuracy and this loss do not depend on it).
        validation_batch_size=max(plan.per_replica_batch, 64),
        drop_remainder=True,  # Whole global batches a pass: each epoch a new permutation's (batching.BatchPlan).
        steps_per_execution=plan.steps_per_execution, grad_accum_steps=plan.grad_accum_steps, seed=config.seed,
        zero_stage=config.zero_stage, max_steps=config.max_steps, checkpoint_every_steps=config.checkpoint_every_steps,
        checkpoint_every_secs=config.checkpoint_every_secs,
        keep_checkpoints=config.keep_checkpoints, resume=config.resume, step_counter=step,
        jit_compile={"auto": "auto", "true": True, "false": False}[config.jit_compile],
        summary_every_steps=config.summary_every_steps, profile_steps=config.profile_range(),
        export=config.export_formats(), callbacks=[_WriteConfig(rundir, config)],
        stop_on_nonfinite=config.stop_on_nonfinite,
        plan_extra={"dataset": digits.name, "learning_rate": plan.learning_rate, "lr_schedule": config.lr_schedule, "optimizer": config.optimizer,
                    "warmup_steps": plan.warmup_steps, "precision": choice.policy})
    fingerprint = fingerprint_of(model, backend)
    optimizer = model.optimizer
    metrics = {
        "strategy": backend.name,
        "task": backend.task_label,
        "num_replicas": backend.num_replicas,
        "num_workers": backend.num_workers,
        "precision": choice.policy,
        "precision_reason": choice.reason,
        "dataset": digits.name,
        "train_input": "streamed" if digits.train_stream is not None else "arrays",
        "global_batch_size": plan.global_batch,
        "per_replica_batch_size": plan.per_replica_batch,
        "grad_accum_steps": plan.grad_accum_steps,
        "learning_rate": plan.learning_rate,
        "steps": result.steps,
        "steps_per_epoch": plan.steps_per_epoch,
        "steps_per_execution": plan.steps_per_execution,
        "epochs": config.epochs,
        "resumed_from_step": result.resumed_from,
        "step_counter": result.device_step_count,
        "eval_loss": result.val_logs.get("val_loss"),
        "eval_accuracy": result.val_logs.get("val_accuracy"),
        "eval_examples": result.val_examples,  # Counted by the evaluation itself.
        "first_train_loss": result.first_loss,
        "last_train_loss": result.last_loss,
        "loss_scale": _loss_scale(optimizer, result.optimizer_state),
        "train_examples_per_sec": result.examples_per_sec,
        "epoch_train_seconds": result.epoch_seconds,
        "wall_seconds": round(time.time() - start, 3),
        "weights_fingerprint": fingerprint,
        "workdir": config.workdir,
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        **result.optimizer_state,  # zero_stage: the optimizer-state bytes each replica holds.
    }
    rundir.write_json("metrics.json", metrics)
    return metrics


def _loss_scale(optimizer: Any, sharded: dict) -> Optional[float]:
    """The dynamic loss scale at the end (a sharded optimizer state keeps its own: `sharded`)."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    return sharded["loss_scale"] if "loss_scale" in sharded else float(optimizer.dynamic_scale.numpy())


class _WriteConfig(keras.callbacks.Callback):
    """Writes config.json and flags.txt once fit has accepted the workdir (after its resume checks)."""

    def __init__(self, rundir: workdir_lib.RunDir, config: TrainConfig):
        super().__init__()
        self.rundir, self.config = rundir, config

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.rundir.write_text("config.json", self.config.to_json() + "\n")
        self.rundir.write_text("flags.txt", self.config.to_flagfile())


def fingerprint_of(model: keras.Model, backend: Backend) -> str:
    """The weights fingerprint of this task; every local replica must agree."""
    per_variable = [backend.local_replica_values(v) for v in model.weights]
    replicas = {model_lib.fingerprint([values[r] for values in per_variable])
                for r in range(len(per_variable[0]))}
    if len(replicas) != 1:
        raise RuntimeError(f"Replicas of {backend.task_label} ended with different weights: {sorted(replicas)}")
    logging.info("[%s] final weights fingerprint %s", backend.task_label, next(iter(replicas)))
    return replicas.pop()
