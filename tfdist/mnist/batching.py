"""Batch sizes, step counts and learning rate, resolved for one backend.

`plan()` turns the user's batch flags and the backend's replica count into the
numbers the loop and the input pipeline use, and checks them:

  global batch = per-replica batch x replicas (one optimizer step's examples)
  micro-batch  = per-replica batch / grad_accum_steps (what one forward pass sees)

``--per_replica_batch_size`` is the per-replica micro-batch; with gradient
accumulation each replica accumulates ``grad_accum_steps`` micro-batches
before the single optimizer step, so the global batch grows by that factor.
The learning rate is ``--learning_rate`` times the replica scaling factor
(``--lr_scaling``), reached by linear warm-up over ``--warmup_epochs`` and then,
with ``--lr_schedule=cosine`` (the default), decayed to 0 by the last step of
``--epochs`` along a cosine.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import tensorflow as tf

from tfdist.mnist.config import DEFAULT_GLOBAL_BATCH_SIZE, TrainConfig
from tfdist.errors import UserError


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    num_replicas: int
    global_batch: int
    per_replica_batch: int  # Examples a replica gets per optimizer step.
    micro_batch: int  # Examples per forward/backward pass.
    grad_accum_steps: int
    steps_per_epoch: int
    total_steps: int
    steps_per_execution: int
    learning_rate: float  # After replica scaling.
    lr_scale: float
    warmup_steps: int
    decay_steps: int  # 0: constant after warm-up.
    eval_per_replica_batch: int
    eval_steps: int

    def describe(self) -> str:
        return (
            f"replicas={self.num_replicas} global_batch={self.global_batch} "
            f"per_replica_batch={self.per_replica_batch} micro_batch={self.micro_batch} "
            f"grad_accum_steps={self.grad_accum_steps} steps_per_epoch={self.steps_per_epoch} "
            f"total_steps={self.total_steps} steps_per_execution={self.steps_per_execution} "
            f"learning_rate={self.learning_rate:g} (x{self.lr_scale:g} for {self.num_replicas} "
            f"replica(s)) warmup_steps={self.warmup_steps} decay_steps={self.decay_steps}"
        )


def plan(config: TrainConfig, *, num_replicas: int, num_train: int, num_eval: int,
         default_steps_per_execution: int = 10) -> BatchPlan:
    accum = config.grad_accum_steps
    if config.per_replica_batch_size is not None:
        micro = config.per_replica_batch_size
        global_batch = micro * accum * num_replicas
    else:
        global_batch = config.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE
        if global_batch < num_replicas:
            raise UserError(
                f"--global_batch_size={global_batch} is smaller than the number of replicas "
                f"({num_replicas}); every replica needs at least one example. Use "
                f"--global_batch_size={num_replicas * 32} or more."
            )
        if global_batch % (num_replicas * accum):
            unit = num_replicas * accum
            lower, upper = (global_batch // unit) * unit, (global_batch // unit + 1) * unit
            raise UserError(
                f"--global_batch_size={global_batch} does not divide evenly across "
                f"{num_replicas} replica(s) x {accum} accumulation step(s); use a multiple "
                f"of {unit}, e.g. {lower or upper} or {upper}."
            )
        micro = global_batch // (num_replicas * accum)
    per_replica = micro * accum
    steps_per_epoch = num_train // global_batch
    if steps_per_epoch < 1:
        raise UserError(
            f"The global batch ({global_batch}) is larger than the training set "
            f"({num_train} examples); lower --global_batch_size."
        )
    total = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    lr_scale = {"none": 1.0, "linear": float(num_replicas), "sqrt": math.sqrt(num_replicas)}[config.lr_scaling]
    eval_batch = max(per_replica, 64)
    return BatchPlan(
        num_replicas=num_replicas,
        global_batch=global_batch,
        per_replica_batch=per_replica,
        micro_batch=micro,
        grad_accum_steps=accum,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        steps_per_execution=config.steps_per_execution or default_steps_per_execution,
        learning_rate=config.learning_rate * lr_scale,
        lr_scale=lr_scale,
        warmup_steps=int(round(config.warmup_epochs * steps_per_epoch)),
        decay_steps=steps_per_epoch * config.epochs if config.lr_schedule == "cosine" else 0,
        eval_per_replica_batch=eval_batch,
        eval_steps=max(1, -(-num_eval // (eval_batch * num_replicas))),
    )


@keras.saving.register_keras_serializable("tfdist")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to `peak` over `warmup_steps`, then (if `decay_steps`) cosine decay to 0.

    With ``decay_steps=0`` the rate stays at `peak` after warm-up.
    """

    def __init__(self, peak: float, warmup_steps: int, decay_steps: int = 0):
        self.peak = float(peak)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = tf.minimum(1.0, (step + 1.0) / float(max(1, self.warmup_steps)))
        if self.decay_steps <= self.warmup_steps:
            return self.peak * warm
        progress = tf.clip_by_value((step - self.warmup_steps) / float(self.decay_steps - self.warmup_steps), 0.0, 1.0)
        return self.peak * warm * 0.5 * (1.0 + tf.cos(math.pi * progress))

    def get_config(self) -> dict:
        return {"peak": self.peak, "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps}


@keras.saving.register_keras_serializable("tfdist")
class CountedSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`schedule` evaluated at tfdist's exact step counter instead of ``optimizer.iterations``.

    ``optimizer.iterations`` under-counts under asynchronous (parameter-server)
    training and stands still while loss scaling skips steps. Saved models keep
    the inner schedule only (a loaded model then reads its own iterations).
    """

    def __init__(self, schedule: keras.optimizers.schedules.LearningRateSchedule, counter: tf.Variable):
        self.schedule = schedule
        self.counter = counter

    def __call__(self, step):
        return self.schedule(self.counter)

    def get_config(self) -> dict:
        return {"schedule": keras.saving.serialize_keras_object(self.schedule)}

    @classmethod
    def from_config(cls, config: dict) -> keras.optimizers.schedules.LearningRateSchedule:
        return keras.saving.deserialize_keras_object(config["schedule"])
