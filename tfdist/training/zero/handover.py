"""A user's optimizer built before a sharded fit: its state handed over to the shards, freed, and given back.

When the user's Keras optimizer is already built (an earlier Keras ``fit``, a loaded ``model.keras``), its
state is what the sharded fit goes on from: `seed_from` copies each replica's slices of it into the shards
(`ShardedOptimizer.__init__`). `handed_over` is the fit's life cycle around the loop: each per-variable slot of
the user's optimizer (Adam's moments, EMA averages, Keras' gradient accumulators) has its buffer freed on every
local replica (the variable objects kept, assigned no elements, as stage 3 frees the weights), so only the
shards hold the state while the fit runs; at the end, on every exit path, the slots are given back whole with
the trained state gathered from the shards, as Keras' ``fit`` leaves its optimizer (its global state, Nadam's
running product, and a loss scale's figures too), and the shards' copy is emptied. What reads or writes the
user's optimizer during the fit sees it whole: tfdist's checkpoint saves, and the hooks in which Keras'
ModelCheckpoint and BackupAndRestore save or restore the model (the slots gathered for them, then freed again;
what a restore wrote is handed over to the shards first). In one process the gather is a copy on the host; a
multi-worker job all-gathers in a replica step, which every task must run: one whose fit stopped on an error
(its own, or a peer's: the peers may be gone, and waiting would hang) gives back zeros, with an error line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Any, Iterator, Optional

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.ops import gen_resource_variable_ops

from tfdist.distribute.backend import tf_variable


@dataclasses.dataclass
class Handed:
    """What the user's optimizer handed over: its per-variable slots by shard key (``b{bucket}_{slot}``: one
    user variable per variable of the bucket, in bucket order), and its other state by shard key."""
    slots: dict[str, list[Any]]
    others: dict[str, Any]
    user: Any = None  # The user's optimizer, and the one it wraps (a loss scale's inner one, or itself).
    inner: Any = None


def seed_from(sharded: Any, user: Any, inner: Any) -> None:
    """A user's optimizer already built (a loaded model, an earlier Keras fit) hands over its state: each
    shard takes its slices of the user's per-variable state, and its global state. What was handed over is
    recorded as ``sharded.handed_over`` (`handed_over` frees it during the fit and gives it back after)."""
    sharded.handed_over = _seed(sharded, user, inner) if getattr(inner, "built", False) else None


def take_back(sharded: Any, model: Any) -> None:
    """An earlier sharded fit's state, kept in its shards alone (the user's optimizer was not built before
    it), given to the user's optimizer whole: built under the strategy's scope, its slots and other state get
    what the shards hold (gathered as at the end of a fit: an all-gather on several workers, which every task
    runs, as every task calls `fit`); the shards are then emptied and not used again (`zero.carry_over`)."""
    user = model.optimizer
    inner = user.inner_optimizer if sharded.loss_scale else user
    with sharded.backend.scope():
        user.build(model.trainable_variables)
    handed = _seed(sharded, user, inner, assign=False)
    if handed is not None and give_back(sharded, handed, together=True):
        release(sharded, handed)
    sharded.broken = True


def _seed(sharded: Any, user: Any, inner: Any, assign: bool = True) -> Optional[Handed]:
    """The user's built state matched to the shards' keys (`Handed`), each shard given its slices of it
    (`assign`; else only matched)."""
    from tfdist.training.zero.checkpoint import _slot_key

    own = {id(inner._iterations), id(inner._learning_rate)}
    state = [v for v in inner.variables if id(v) not in own]
    paths = [v.path for v in sharded.variables]
    built, ordinal = {}, 0
    for variable in state:
        key = _slot_key(variable.path, inner.name, paths)
        if not re.match(r"var\d+_", key):
            key, ordinal = f"global_{ordinal}", ordinal + 1
        built[key] = variable
    if sharded.loss_scale and getattr(user, "built", False):
        built["loss_scale.dynamic_scale"] = user.dynamic_scale
        built["loss_scale.step_counter"] = user.step_counter
    handed = Handed({}, {}, user, inner)
    for shard in sharded.shards.values():
        for key, variable in shard.slots().items():
            match = re.fullmatch(r"b(\d+)_(.+)", key)
            if match:
                bucket, slot = sharded.layout[int(match.group(1))], match.group(2)
                names = [f"var{i}_{slot}" for i in bucket.indices]
                if all(n in built and tuple(built[n].shape) == tuple(sharded.variables[i].shape)
                       for n, i in zip(names, bucket.indices)):
                    if assign:
                        part = bucket.owned_part(shard.replica, [tf.convert_to_tensor(built[n]) for n in names])
                        # A copy: a slice may share the buffer of the whole bucket it was cut from, and keep it.
                        variable.assign(tf.raw_ops.DeepCopy(x=part))
                    handed.slots[key] = [built[n] for n in names]
            elif key in built and tuple(built[key].shape) == tuple(variable.shape):
                if assign:
                    variable.assign(tf.cast(tf.convert_to_tensor(built[key]), variable.dtype))
                handed.others[key] = built[key]
    return handed if handed.slots or handed.others else None


def _components(variable: Any) -> list:
    value = tf_variable(variable)
    return list(getattr(value, "values", None) or [value])


def _assign(component: Any, value: Any) -> None:
    with tf.device(component.device):
        gen_resource_variable_ops.assign_variable_op(component.handle, tf.cast(value, component.dtype),
                                                     validate_shape=False)


def free(handed: Handed) -> None:
    """Every local replica's buffer of each handed-over slot emptied (the variables stay)."""
    for users in handed.slots.values():
        for variable in users:
            for component in _components(variable):
                _assign(component, tf.zeros([0], component.dtype))


def _bucket(sharded: Any, key: str) -> Any:
    return sharded.layout[int(re.match(r"b(\d+)_", key).group(1))]


def _all_here(sharded: Any) -> bool:
    """Whether every replica's shard is in this process (one process: no collective needed)."""
    return len(sharded.shards) == sharded.backend.num_replicas


def give_back(sharded: Any, handed: Handed, together: bool) -> bool:
    """The handed-over slots whole again, with the state the shards hold now, and the other state (alike on
    every replica) from this process's first shard. `together`: every task of the job gives back now (else a
    process without every shard gives back zeros). Returns whether the state given back is the trained one."""
    first = next(iter(sharded.shards.values())).slots()
    for key, variable in handed.others.items():
        for component in _components(variable):
            _assign(component, tf.convert_to_tensor(first[key]))
    if _all_here(sharded):  # Every shard here: gathered on the host.
        for key, users in handed.slots.items():
            bucket = _bucket(sharded, key)
            flat = np.concatenate([np.asarray(shard.slots()[key].read_value())
                                   for _, shard in sorted(sharded.shards.items())])
            for variable, piece in zip(users, np.split(flat[:bucket.total], np.cumsum(bucket.sizes)[:-1])):
                for component in _components(variable):
                    _assign(component, tf.constant(piece.reshape(variable.shape)))
        return True
    if not together:
        logging.error("tfdist: zero_stage=%d: this fit stopped on an error (this task's own, or a peer's) while "
                      "the optimizer's state was sharded over the workers, and the peers may be gone, so it is not "
                      "gathered back: this process's optimizer slots hold zeros now. Resume the job from its last "
                      "checkpoint.", sharded.stage)
        for users in handed.slots.values():
            for variable in users:
                for component in _components(variable):
                    _assign(component, tf.zeros(variable.shape, component.dtype))
        return False
    if getattr(sharded, "_give_back_fn", None) is None:  # One trace for every give-back of the fit.
        def gather_all() -> None:
            sharded.backend.run(functools.partial(_gather_replica, sharded, handed), ())
        sharded._give_back_fn = sharded.backend.compile(gather_all)
    sharded._give_back_fn()
    return True


def release(sharded: Any, handed: Handed) -> None:
    """After the fit, the shards' copy of the state given back emptied: the user's optimizer holds it, and the
    next fit hands it over again (`zero.for_model` makes new shards for an optimizer that is built)."""
    sharded.broken = True  # Never reused.
    for shard in sharded.shards.values():
        slots = shard.slots()
        for key in handed.slots:
            _assign(slots[key], tf.zeros([0], slots[key].dtype))


def _gather_replica(sharded: Any, handed: Handed) -> None:
    """Inside a replica: each handed-over slot all-gathered from every replica's shard into this replica's copy
    of the user's variables, a bucket's slot at a time."""
    from tfdist.training.zero import collectives
    from tfdist.training.zero.sharded import _component

    shard = sharded._mine()
    local = shard.replica - sharded.backend.worker_index * len(sharded.shards)
    slots = shard.slots()
    done: list = []
    for n, (key, users) in enumerate(sorted(handed.slots.items())):
        bucket = _bucket(sharded, key)
        with tf.control_dependencies(done):
            whole = collectives.all_gather(sharded.backend, slots[key].read_value(), shard.replica,
                                           f"tfdist_zero_handback_{n}")
            done = [gen_resource_variable_ops.assign_variable_op(
                _component(variable, local).handle, tf.reshape(piece, variable.shape), validate_shape=False)
                for variable, piece in zip(users, bucket.split(whole))]


@contextlib.contextmanager
def handed_over(sharded: Optional[Any], controller: Any = None, callbacks: Any = ()) -> Iterator[None]:
    """For the block (a sharded fit's loop), the user's handed-over optimizer slots freed; given back whole with
    the trained state on every exit path after it. `controller`'s checkpoint saves, and the hooks in which the
    user's Keras `ModelCheckpoint` and `BackupAndRestore` callbacks save or restore the model, run with them
    whole (what such a hook sets is kept: the shards take it)."""
    handed = getattr(sharded, "handed_over", None) if sharded is not None else None
    if handed is None:
        yield
        return
    from tfdist.training.controller import Preempted

    together = False  # Whether every task leaves the block the same way (the gather back is a collective).
    try:
        free(handed)
        with _readers_whole(sharded, handed, controller, callbacks):
            try:
                yield
                together = True
            except Preempted:
                together = True  # Every task stopped together.
                raise
    finally:
        if give_back(sharded, handed, together):
            release(sharded, handed)


def _hooks(callbacks: Any) -> list[str]:
    """The hooks in which the user's Keras ModelCheckpoint and BackupAndRestore save or restore the model (its
    optimizer included). Decided from the user's list, alike on every task (the chief runs more of them)."""
    import keras

    names: set[str] = set()
    for callback in callbacks or ():
        if isinstance(callback, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)):
            names.add("on_epoch_end")
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                names.add("on_train_begin")  # It restores there.
            if getattr(callback, "save_freq", "epoch") != "epoch":
                names.add("on_train_batch_end")
    return sorted(names)


@contextlib.contextmanager
def _readers_whole(sharded: Any, handed: Handed, controller: Any, callbacks: Any) -> Iterator[None]:
    """The controller's checkpoint saves (every task makes them: a checkpoint holds the user's optimizer, and a
    resume reads its slots back at their shapes) and the model-saving callbacks' hooks with the slots whole."""
    from tfdist.training.zero.gathering import replacing

    checkpoints = getattr(controller, "checkpoints", None)
    with replacing() as replace:
        if getattr(checkpoints, "manager", None) is not None:  # Saves only where a run dir is.
            replace(checkpoints, "save", lambda save: _whole_for(sharded, handed, save, False))
            policy = getattr(controller, "checkpointing", None)
            if policy is not None and hasattr(policy, "save"):  # The policy holds the bound save it was given.
                replace(policy, "save", lambda _: checkpoints.save)
        if controller is not None:
            for name in _hooks(callbacks):
                replace(controller.callbacks, name, lambda hook: _whole_for(sharded, handed, hook, True))
        yield


def _whole_for(sharded: Any, handed: Handed, method: Any, writes: bool) -> Any:
    """`method` with the slots whole; where it may write them (`writes`), the shards take what it left."""
    def run(*args: Any, **kwargs: Any) -> Any:
        give_back(sharded, handed, True)
        try:
            return method(*args, **kwargs)
        finally:
            if writes:
                _seed(sharded, handed.user, handed.inner)
            free(handed)
    return run
