"""The run's numbers (`LoopPlan`): batches, steps, epochs and executions, the checks a resume makes on them, and
what the workers' plans differ in (`task_plans`, `plan_differences`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.distribute.backend import Backend
from tfdist.errors import UserError
from tfdist.training import epochs as epochs_lib
from tfdist.training.callbacks import has_batch_hooks


UNBOUNDED = 2 ** 50  # A stream's steps_per_epoch where none is given (`LoopPlan.streamed`).


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


PLAN_FILE = "plan.json"


# Plan -----------------------------------------------------------------------------
def make_plan(backend: Backend, *, num_train: int, batch_size: int, epochs: int, grad_accum_steps: int,
              steps_per_execution: Optional[int], steps_per_epoch: Optional[int], seed: int,
              max_steps: Optional[int], extra: dict, pass_batches: Optional[int] = None,
              partial_dataset: bool = False, why_even: str = "", keras_execution: int = 1,
              streamed: bool = False, drop_remainder: bool = False, row_layers: bool = False) -> LoopPlan:
    """The run's numbers; `why_even` (if any) is why this input needs a batch the replicas divide.

    `pass_batches`: the batches of one pass over the data where they are known (arrays, a dataset of known
    length): a `steps_per_epoch` below them gives Keras' continuing epochs (epochs.py), `keras_execution`
    (compile's steps_per_execution) batches an execution. `streamed`: a stream (`_stream_plan`).
    `drop_remainder`: a pass over arrays is its whole global batches only (tfdist-train's plan; on a TPU with
    steps_per_epoch, which compiles one shape).
    """
    replicas = backend.num_replicas
    for name, value in (("steps_per_epoch", steps_per_epoch), ("max_steps", max_steps),
                        ("steps_per_execution", steps_per_execution)):
        if value is not None and value < 1:
            raise UserError(f"{name}={value} must be 1 or more.")
    limit = keras.config.max_steps_per_epoch()  # Keras' global cap (keras.config.set_max_steps_per_epoch).
    if limit and (steps_per_epoch is None or steps_per_epoch > limit):
        logging.warning("Limiting steps_per_epoch to %d (keras.config.max_steps_per_epoch).", limit)
        steps_per_epoch = limit
    if streamed:
        if steps_per_execution is None and row_layers and not backend.sum_rows_each_step(2):
            steps_per_execution = 1  # An Embedding's rows vary with the batch: a collective takes one shape a call.
        return _stream_plan(backend, batch_size=batch_size, epochs=epochs, grad_accum_steps=grad_accum_steps,
                            steps_per_execution=steps_per_execution, steps_per_epoch=steps_per_epoch, seed=seed,
                            max_steps=max_steps, extra=extra)
    uneven = _uneven(batch_size, replicas, grad_accum_steps, why_even)
    whole = num_train // batch_size
    partial_last = partial_dataset
    drop_remainder = drop_remainder or (backend.device_kind == "tpu" and steps_per_epoch is not None)
    if drop_remainder and pass_batches is not None and not partial_dataset:
        pass_batches = whole
    if pass_batches is not None and steps_per_epoch is not None and steps_per_epoch >= pass_batches:
        # As Keras: every batch, the last one short if it is; past them it warns the input ran out of data.
        if steps_per_epoch > pass_batches:
            logging.warning("steps_per_epoch=%d is more than the %d batches of the input: your input ran out of "
                            "data, so each epoch trains those %d batches (as Keras does).", steps_per_epoch,
                            pass_batches, pass_batches)
        steps_per_epoch = None
    # As Keras: every example once a pass, the last batch holding what is left. Parameter-server workers read
    # without epochs (each in its own random order), in whole batches.
    pass_partial = bool(num_train % batch_size) and backend.sharded_input and not drop_remainder
    epoch_steps: tuple = ()
    pass_steps = 0
    if steps_per_epoch is None:
        partial_last = pass_partial
        steps_per_epoch = -(-num_train // batch_size) if partial_last else whole
        if steps_per_epoch < 1:
            raise UserError(f"batch_size={batch_size} is larger than the training set ({num_train} examples).")
    elif pass_batches is not None:  # Below a pass: Keras' epochs go on where the last one stopped.
        partial_last = pass_partial
        pass_steps = pass_batches if partial_last else whole
        if pass_steps < 1:
            raise UserError(f"batch_size={batch_size} is larger than the training set ({num_train} examples).")
        epoch_steps, pass_steps = _below_a_pass(steps_per_epoch, pass_steps, epochs, keras_execution)
    if partial_last and backend.device_kind == "tpu":
        raise UserError(f"The training set ({num_train} examples) does not divide into global batches of "
                        f"{batch_size}, and a TPU compiles one shape: its last, partial batch cannot be trained as "
                        "Keras trains it. Use a batch_size that divides the training set, pass steps_per_epoch= "
                        "(whole batches), or batch a dataset with drop_remainder=True.")
    total = sum(epoch_steps) if epoch_steps else steps_per_epoch * epochs
    if max_steps is not None:
        total = min(total, max_steps)
    partial_last = partial_last or uneven  # Parts of differing sizes, each carrying the step's global count.
    per_replica = -(-batch_size // replicas)  # The largest share.
    return LoopPlan(
        global_batch=batch_size, per_replica_batch=per_replica, micro_batch=-(-per_replica // grad_accum_steps),
        num_replicas=replicas,
        grad_accum_steps=grad_accum_steps, steps_per_epoch=steps_per_epoch, epochs=epochs, total_steps=total,
        steps_per_execution=steps_per_execution or default_steps_per_execution(backend), seed=seed,
        extra=tuple(sorted(extra.items())), partial_last=partial_last, epoch_steps=epoch_steps,
        pass_steps=pass_steps,
    )


def _uneven(batch_size: int, replicas: int, grad_accum_steps: int, why_even: str) -> bool:
    """Whether the global batch splits unevenly over replicas x micro-batches (then as evenly as can be, some
    parts one example short); refused where `why_even` says the input needs it even."""
    unit = replicas * grad_accum_steps
    uneven = bool(batch_size % unit)
    if uneven and why_even:
        lower, upper = (batch_size // unit) * unit, (batch_size // unit + 1) * unit
        raise UserError(f"batch_size={batch_size} does not divide evenly across {replicas} replica(s) x "
                        f"{grad_accum_steps} accumulation step(s), and {why_even}; use a multiple of {unit}, e.g. "
                        + (f"{lower} or {upper}." if lower else f"{upper}."))
    return uneven


def _below_a_pass(steps_per_epoch: int, pass_steps: int, epochs: int, keras_execution: int) -> tuple[tuple, int]:
    """Keras' epochs of `steps_per_epoch` below a pass of `pass_steps` (epochs.py): (the steps of each epoch,
    empty where all are alike; the steps of a pass, 0 where a pass is an epoch)."""
    epoch_steps = epochs_lib.keras_epoch_steps(steps_per_epoch, pass_steps, epochs, keras_execution)
    if min(epoch_steps) < steps_per_epoch:
        logging.warning("steps_per_epoch=%d with %d batches a pass: each epoch goes on where the last stopped, "
                        "and one that reaches the end of the data ends there (your input ran out of data), as "
                        "in Keras' fit: epochs of %s steps.", steps_per_epoch, pass_steps,
                        ", ".join(map(str, epoch_steps[:6])) + (", ..." if len(epoch_steps) > 6 else ""))
    if pass_steps == steps_per_epoch:
        pass_steps = 0  # A pass an epoch.
    if set(epoch_steps) == {steps_per_epoch}:
        epoch_steps = ()  # Epochs alike: steps_per_epoch each (passes may still span several).
    return epoch_steps, pass_steps


def _stream_plan(backend: Backend, *, batch_size: int, epochs: int, grad_accum_steps: int,
                 steps_per_execution: Optional[int], steps_per_epoch: Optional[int], seed: int,
                 max_steps: Optional[int], extra: dict) -> LoopPlan:
    """A stream's numbers (`_plan` checked them): each of its batches a step (any size, carrying its example
    count), an epoch `steps_per_epoch` steps or until the data ends (`UNBOUNDED` when not given)."""
    per_epoch = steps_per_epoch or UNBOUNDED
    total = per_epoch * epochs if max_steps is None else min(per_epoch * epochs, max_steps)
    per_replica = -(-batch_size // backend.num_replicas)
    return LoopPlan(
        global_batch=batch_size, per_replica_batch=per_replica, micro_batch=-(-per_replica // grad_accum_steps),
        num_replicas=backend.num_replicas, grad_accum_steps=grad_accum_steps, steps_per_epoch=per_epoch,
        epochs=epochs, total_steps=total,
        steps_per_execution=steps_per_execution or default_steps_per_execution(backend), seed=seed,
        extra=tuple(sorted(extra.items())), partial_last=True, streamed=True)


def compiled_execution(model: keras.Model) -> int:
    """compile(steps_per_execution=): the batches an epoch's executions take in Keras (epochs.py)."""
    compiled = getattr(model, "steps_per_execution", 1)
    return compiled if isinstance(compiled, int) and not isinstance(compiled, bool) and compiled > 1 else 1


def default_steps_per_execution(backend: Backend) -> int:
    """Steps per compiled execution when nothing asks for a number: 100 on TPUs (round trips cost most), else 10."""
    return 100 if backend.device_kind == "tpu" else 10


def resolve_steps_per_execution(given: Optional[int], model: keras.Model, callbacks: Any, backend: Backend,
                                hooks: Sequence[str], sparse_inputs: bool = False) -> Optional[int]:
    """Steps per execution: tfdist's argument; else `compile(steps_per_execution=)` where the model was compiled
    with more than 1; else 1 where a callback has per-batch `hooks` (Keras calls them after every
    `steps_per_execution` batches, and compile's default is 1), or where sparse inputs' gradients can reach the
    optimizer row-sparse only one step an execution (`Backend.sum_rows_each_step`); else tfdist's default.
    """
    if given is not None:
        return given
    if compiled_execution(model) > 1:
        return compiled_execution(model)
    if has_batch_hooks(list(callbacks or []), hooks):
        return 1
    if sparse_inputs and backend.sum_rows_each_step(1) and not backend.sum_rows_each_step(2):
        return 1
    return default_steps_per_execution(backend)


def check_resume(path: str, plan: LoopPlan) -> None:
    """Refuses to resume a run whose resolved plan differs, naming each field (or a stream's, which cannot)."""
    if plan.streamed and plan.known_steps_per_epoch() is not None:
        raise UserError(
            f"Cannot resume the run in --workdir={path}: its input is a dataset of unknown length read as a stream "
            "with steps_per_epoch, and where its passes ended (its epochs can end early) was not recorded, so the "
            "data cannot be continued exactly. Give the dataset its length "
            "(dataset.apply(tf.data.experimental.assert_cardinality(batches))), or start a new --workdir.")
    saved_path = os.path.join(path, PLAN_FILE)
    if not tf.io.gfile.exists(saved_path):
        return
    try:
        with tf.io.gfile.GFile(saved_path) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"Cannot resume the run in --workdir={path}: its {PLAN_FILE} is damaged ({e}). Start a "
                        "new run with a new --workdir.") from None
    now = plan.resume_fields()
    changed = [f"{k} (was {saved.get(k)!r}, now {now.get(k)!r})" for k in sorted(set(saved) | set(now))
               if k != "num_replicas" and saved.get(k) != now.get(k)]
    if changed:
        raise UserError(
            f"Cannot resume the run in --workdir={path}: {'; '.join(changed)} changed what a training step "
            "means. Restore the old setting, or start a new run with a new --workdir.")
    if saved.get("num_replicas") not in (None, plan.num_replicas):
        logging.info("Resuming on another topology (%s replica(s) before, %s now); the plan is unchanged, so "
                     "training continues the same trajectory.", saved.get("num_replicas"), plan.num_replicas)


def write_plan(rundir: Any, plan: LoopPlan) -> None:
    """plan.json: what a resume must match (`check_resume`), and the replicas it ran on."""
    rundir.write_text(PLAN_FILE, json.dumps({**plan.resume_fields(), "num_replicas": plan.num_replicas},
                                            indent=2, sort_keys=True) + "\n")


# The plan check across tasks (`checks.check_agreement`) ---------------------------------------------
def task_plans(backend: Backend, plan: LoopPlan) -> dict[int, dict[str, Any]]:
    """Every training task's `resume_fields`, by worker index: two gathers every task joins (the text's lengths,
    then the texts, padded), so all tasks must call it together."""
    text = json.dumps({"worker": backend.worker_index, "fields": plan.resume_fields()}, sort_keys=True).encode()
    lengths = backend.gather_from_tasks(np.array([len(text)], np.int64)).reshape(-1)
    row = np.zeros([int(lengths.max())], np.int64)
    row[:len(text)] = np.frombuffer(text, np.uint8)
    rows = backend.gather_from_tasks(row)
    plans = [json.loads(bytes(r[:n].astype(np.uint8)).decode()) for r, n in zip(rows, lengths)]
    return {p["worker"]: p["fields"] for p in plans}  # A worker of several replicas sends one row per replica.


def plan_differences(plans: dict[int, dict[str, Any]]) -> str:
    """Each field whose value differs between tasks, with each task's value: "global_batch (worker 0: 128,
    worker 1: 64); ..." ("absent" where a task's plan lacks the field)."""
    def text(value: Any) -> str:
        return "absent" if value is _ABSENT else json.dumps(value, sort_keys=True)

    parts = []
    for name in sorted(set().union(*plans.values())):
        values = {worker: text(fields.get(name, _ABSENT)) for worker, fields in sorted(plans.items())}
        if len(set(values.values())) > 1:
            shown = (f"worker {w}: {v if len(v) <= 200 else v[:197] + '...'}" for w, v in values.items())
            parts.append(f"{name} ({', '.join(shown)})")
    return "; ".join(parts)


_ABSENT = object()
