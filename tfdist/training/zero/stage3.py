"""Stage 3 (`tfdist.fit(zero_stage=3)`): the trainable weights themselves in equal flat shards during fit.

`Stage3Optimizer` is stage 1/2's `ShardedOptimizer` with buckets per layer (`gathering.units`; a variable of
1 MiB or more alone, `plan_layout`) whose weight shards are the truth while fit runs: a step differentiates the loss by this replica's shards (the
layers' gathers reduce-scatter the gradient, `gathering`), the clone of the user's optimizer updates them, and
nothing is gathered back into the model after the update.

`sharded_weights` is the fit's life cycle: each replica's [S/N] slices copied from the model's whole variables
(a model built before fit holds them whole once), then the whole copies freed (each replica's buffer of each
trainable variable assigned no elements, the variable objects kept); at the end, on every exit path, the
shards gathered back into every replica's whole copy and the shards emptied. `whole_weights` is the same round
trip around anything that reads the model between steps (validation, callbacks, checkpoints).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.ops import gen_resource_variable_ops

from tfdist.distribute.backend import tf_variable
from tfdist.errors import UserError
from tfdist.training.controller import Preempted
from tfdist.training.zero import gathering
from tfdist.training.zero.layout import Bucket, variable_bytes, variable_size
from tfdist.training.zero.sharded import ShardedOptimizer, _component


ALONE_BYTES = 1 << 20  # A variable this large is gathered and reduce-scattered alone (`plan_layout`).


class Stage3Optimizer(ShardedOptimizer):
    """The sharded weights and optimizer state of one model at stage 3."""

    def __init__(self, model: keras.Model, backend: Any, stage: int):
        gathering.check(model)  # Built now: what stage 3 cannot gather, refused before any step.
        self.gathering: Optional[gathering.Gathering] = None
        self.whole = False  # Inside `whole_weights`.
        super().__init__(model, backend, stage)

    def plan_layout(self, model: keras.Model) -> list:
        """Each layer's variables of one dtype: a variable of `ALONE_BYTES` or more in a bucket of its own (its
        gather is then its whole value and its gradient the reduce-scatter's input, without a concatenated
        copy of either), the layer's smaller ones together."""
        index = {id(v): i for i, v in enumerate(self.variables)}
        buckets = []
        for unit in gathering.units(model):
            mine = [index[id(v)] for v in unit.trainable_variables]
            for dtype in sorted({self.variables[i].dtype for i in mine}):
                group = [i for i in mine if self.variables[i].dtype == dtype]
                small = tuple(i for i in group if variable_bytes(self.variables[i]) < ALONE_BYTES)
                runs = [(i,) for i in group if i not in small] + ([small] if small else [])
                buckets += [Bucket(run, tuple(variable_size(self.variables[i]) for i in run), tf.as_dtype(dtype),
                                   self.backend.num_replicas) for run in runs]
        return buckets

    def gradient_sources(self) -> list:
        return [getattr(p, "_value", p) for p in self._mine().params]  # The variables (Keras' `value` may cast).

    reduced_in_backward = True

    def before_backward(self, empty: Optional[tf.Tensor]) -> None:  # Zeroed by the gathers' gradients.
        if self.gathering is not None:  # (Set for the fit by `sharded_weights`, before any step is traced.)
            self.gathering.local.empty = empty

    def reduce(self, grads: list, tag: str = "", fresh: bool = True) -> list:
        """Already this replica's summed slices (the gathers' gradients); a bucket no layer used: zeros."""
        return [tf.zeros([b.shard], b.dtype) if g is None else g for g, b in zip(grads, self.layout)]

    def apply(self, grads: list, present: Any) -> tf.Tensor:
        absent = getattr(self, "gathering", None)
        absent = absent.absent if absent is not None else set()
        return super().apply(grads, [i for i in range(len(self.variables)) if i not in absent])

    def _refresh(self, shard: Any) -> None:  # The shards are the weights: nothing to copy in.
        pass

    def share(self, shard: Any) -> None:  # Nothing to copy out until fit ends (`sharded_weights`).
        pass

    def _constrain(self, shard: Any, present: Any) -> None:  # Refused (`gathering.check`).
        pass

    # Between the shards and the model's whole variables (eager, outside any step) ---------------------------
    def _components(self, i: int) -> list:
        value = tf_variable(self.variables[i])
        return list(getattr(value, "values", None) or [value])

    def shard_in(self) -> None:
        """Each local replica's shards from its whole copy of the weights."""
        for local, (replica, device) in enumerate(self.backend.local_replicas()):
            shard = self.shards[replica]
            with tf.device(device):
                for k, bucket in enumerate(self.layout):
                    whole = [self._components(i)[local].read_value() for i in bucket.indices]
                    # A copy: a slice may share the whole variable's buffer, which freeing it would then keep.
                    tf_variable(shard.params[k]).assign(tf.raw_ops.DeepCopy(x=bucket.owned_part(replica, whole)))

    def free_whole(self) -> None:
        """Every local replica's buffer of every trainable variable emptied (the variables stay)."""
        for i, variable in enumerate(self.variables):
            for component in self._components(i):
                with tf.device(component.device):
                    gen_resource_variable_ops.assign_variable_op(component.handle,
                                                                 tf.zeros([0], component.dtype))

    def gather_whole(self) -> None:
        """Every local replica's whole copy of every trainable variable, from all replicas' shards."""
        if len(self.shards) == self.backend.num_replicas:  # All replicas here: no collective needed.
            for k, bucket in enumerate(self.layout):
                flat = np.concatenate([np.asarray(tf_variable(self.shards[r].params[k]).read_value())
                                       for r in range(self.backend.num_replicas)])
                for i, piece in zip(bucket.indices, np.split(flat[:bucket.total], np.cumsum(bucket.sizes)[:-1])):
                    self._assign_whole(i, piece.reshape(self.variables[i].shape))
            return
        if getattr(self, "_gather_fn", None) is None:  # One trace for every gather of the fit (and the next).
            self._gather_fn = self.backend.compile(self._gather_all)
        self._gather_fn()

    def _gather_all(self) -> None:
        self.backend.run(self._gather_replica, ())

    def _gather_replica(self) -> None:
        from tfdist.training.zero import collectives
        shard = self._mine()
        done: list = []
        for k, bucket in enumerate(self.layout):
            with tf.control_dependencies(done):
                whole = collectives.all_gather(self.backend, tf_variable(shard.params[k]).read_value(),
                                               shard.replica, f"tfdist_zero3_out_{k}")
                done = [gen_resource_variable_ops.assign_variable_op(
                    _component(self.variables[i], shard.replica - self.backend.worker_index * len(self.shards))
                    .handle, tf.reshape(piece, self.variables[i].shape), validate_shape=False)
                    for i, piece in zip(bucket.indices, bucket.split(whole))]

    def _assign_whole(self, i: int, value: np.ndarray) -> None:
        for component in self._components(i):
            with tf.device(component.device):
                gen_resource_variable_ops.assign_variable_op(component.handle, tf.constant(value, component.dtype),
                                                             validate_shape=False)

    def empty_shards(self) -> None:
        for shard in self.shards.values():
            for param in shard.params:
                tf_variable(param).assign(tf.zeros([0], param.dtype), read_value=False)


@contextlib.contextmanager
def sharded_weights(sharded: Optional[ShardedOptimizer], model: keras.Model, functions: Any,
                    controller: Any = None, callbacks: Any = ()) -> Iterator[None]:
    """A stage-3 fit's weights in shards for the block (a no-op at other stages): the model's whole weights on
    every exit path after it, trained. What reads the model between steps (`controller`'s validation, checkpoint
    saves, and the hooks the user's `callbacks` define) runs with the weights whole (`whole_weights`)."""
    if not isinstance(sharded, Stage3Optimizer):
        yield
        return
    gather = gathering.Gathering(sharded, model)
    try:
        sharded.shard_in()
    except BaseException:  # The model untouched: only the shards to empty.
        sharded.empty_shards()
        raise
    sharded.gathering = gather
    alike = False  # Whether every task leaves the block the same way (the gather back is a collective).
    try:
        sharded.free_whole()
        with gathering.wrapped(gather, functions), _readers_whole(sharded, controller, callbacks):
            try:
                yield
                alike = True
            except Preempted:
                alike = True  # Every task stopped together.
                raise
            except Exception:
                if gather.refusal is not None:  # As it was raised, not as Keras and autograph rewrote it.
                    alike = True  # Every task traces the same step.
                    raise UserError(gather.refusal) from None
                raise
    finally:
        sharded.gathering = None
        _gather_back(sharded, alike)


def _gather_back(sharded: Stage3Optimizer, alike: bool) -> None:
    """The whole weights back into the model, and the shards emptied. A task of a multi-worker job that
    stopped on its own error (its peers are not there to gather with: waiting for them would hang the job)
    leaves its model's trainable variables empty and says so; the job resumes from its last checkpoint."""
    if not alike and len(sharded.shards) != sharded.backend.num_replicas:
        logging.error("tfdist: zero_stage=3: this task stopped on its own error while the weights were sharded "
                      "over the workers, so they are not gathered back: this process's model holds no trainable "
                      "weights now. Resume the job from its last checkpoint.")
        return
    sharded.gather_whole()  # (If it fails, the shards are kept: the only copy of the weights.)
    sharded.empty_shards()


@contextlib.contextmanager
def whole_weights(sharded: Optional[ShardedOptimizer]) -> Iterator[None]:
    """The model's whole weights for the block, in the middle of a stage-3 fit; shards again after it (what the
    block set the weights to is kept)."""
    if not isinstance(sharded, Stage3Optimizer) or sharded.gathering is None or sharded.whole:
        yield
        return
    sharded.gather_whole()
    sharded.whole = True
    try:
        yield
    finally:
        sharded.whole = False
        sharded.shard_in()
        sharded.free_whole()


_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end")


_LEGACY = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}  # Keras calls them.


def _defines(callback: Any, name: str) -> bool:
    """Whether `callback` has a hook `name` of its own: its class's, an instance attribute (LambdaCallback), or
    the legacy ``on_batch_*`` Keras' ``on_train_batch_*`` calls."""
    from keras.src.utils.python_utils import is_default

    return any(not is_default(getattr(callback, n)) for n in (name, _LEGACY.get(name)) if n and hasattr(callback, n))


def _hooks(users: Any) -> list[str]:
    """The hooks of `_HOOKS` the user's callbacks define (each gathers the weights whole: a collective)."""
    return [name for name in _HOOKS if any(_defines(c, name) for c in users or ())]


def check_tasks_alike(sharded: Optional[ShardedOptimizer], users: Any) -> None:
    """Before any step of a sharded fit on several workers: every task must gather in the same hooks (stage 3:
    each hook the callbacks define gathers the weights; a user's optimizer built before fit: the hooks in which
    ModelCheckpoint and BackupAndRestore save gather its state, `handover`), and hand a built optimizer's state
    over alike (its give-back is a gather too), else one task waits in a gather its peers never start. One small
    gather of each task's figures; a mismatch fails every task alike, with one paragraph."""
    from tfdist.training.zero import handover

    if sharded is None or len(sharded.shards) == sharded.backend.num_replicas:  # One process: one list.
        return
    names = list(_HOOKS)
    mine = _hooks(users) if isinstance(sharded, Stage3Optimizer) else []
    handed = getattr(sharded, "handed_over", None) is not None
    if handed:
        mine = sorted(set(mine) | set(handover._hooks(users)))
    backend = sharded.backend
    row = [backend.worker_index, sum(1 << names.index(n) for n in mine), int(handed)]
    table = sorted({tuple(int(v) for v in r) for r in backend.gather_from_tasks(np.array(row, np.int64)).reshape(-1, 3)})
    if len({(int(r[1]), int(r[2])) for r in table}) == 1:
        return
    if len({int(r[2]) for r in table}) > 1:
        built = ", ".join(f"worker {int(r[0])}" for r in table if r[2])
        raise UserError(f"zero_stage={sharded.stage}: the model's optimizer was built before fit on some workers "
                        f"only ({built}), whose state each hands over to the shards and gathers back at the end (a "
                        "collective the others would not join). Build or load the model the same way on every "
                        "worker.")
    which = "; ".join(f"worker {int(r[0])}: {', '.join(n for k, n in enumerate(names) if int(r[1]) >> k & 1) or 'none'}"
                      for r in table)
    raise UserError(f"zero_stage={sharded.stage} gathers the whole weights or optimizer state in the hooks the "
                    f"callbacks define (a collective every worker joins), and the workers were given callbacks with "
                    f"different hooks ({which}): one would wait in a gather the others never start. Give every "
                    "worker the same callbacks (one meant for the chief alone can be given to all and check the task "
                    "index inside its hooks).")


def _with_whole_weights(sharded: Stage3Optimizer, method: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with whole_weights(sharded):
            return method(*args, **kwargs)
    return run


@contextlib.contextmanager
def _readers_whole(sharded: Stage3Optimizer, controller: Any, users: Any) -> Iterator[None]:
    """Validation, checkpoint saves and the hooks the user's callbacks define (each costs a gather of the
    weights and a copy back into the shards) wrapped in `whole_weights` for the block. Decided from the user's
    callbacks, alike on every task (the chief runs more of them; the gather is a collective)."""
    with gathering.replacing() as replace:
        if controller is not None:
            targets = [(controller.callbacks, name) for name in _hooks(users)]
            if getattr(controller.checkpoints, "manager", None) is not None:  # Saves only where a run dir is.
                targets.append((controller.checkpoints, "save"))
            if controller.validation is not None:
                targets.append((controller.validation, "run"))
            for obj, name in targets:
                replace(obj, name, lambda method: _with_whole_weights(sharded, method))
            policy = getattr(controller, "checkpointing", None)
            if policy is not None and hasattr(policy, "save"):  # The policy holds the bound save it was given.
                replace(policy, "save", lambda _: controller.checkpoints.save)
        yield
