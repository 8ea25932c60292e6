"""`ShardedOptimizer`: one model's optimizer state in equal flat shards, and the update each replica makes.

A step on each replica: its gradients are reduce-scattered a bucket at a time (`reduce`; at stage 2 with
``grad_accum_steps`` each micro-batch's, so only the owned slices accumulate; a bucket's gradient is made once
the next bucket's reduce-scatter has summed, `pacing`); its [S/N] slice of the weights
is refreshed from its copy of the model (so anything that set the weights between steps is seen); one small
all-reduce of per-variable figures gives the loss scale's finite check and the norms clipping needs
(`figures`); the clone of the user's optimizer updates the shard; the updated shards are all-gathered a bucket
at a time into every replica's copy of every variable; variable constraints then run on the whole variables,
as Keras runs them after its update.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.training.zero import collectives, figures, layout, optimizer as optimizers, pacing


@dataclasses.dataclass
class Shard:
    """One replica's part: its copies of the model's variables, its flat weight shards, its optimizer clone."""
    replica: int
    proxies: list[Any]  # One per trainable variable: this replica's copy.
    params: list[Any]  # One per bucket: this replica's [shard] of the flat weights.
    optimizer: Any
    keys: list[str]  # One per piece of state: ``b{bucket}_{slot}`` or ``global_{k}``.
    state: list[Any]
    segments: list[np.ndarray]
    scale: Optional[tf.Variable] = None  # A loss scale's dynamic scale and growth counter (alike everywhere).
    counter: Optional[tf.Variable] = None

    def slots(self) -> dict[str, tf.Variable]:
        found = dict(zip(self.keys, (tf_variable(v) for v in self.state)))
        if self.scale is not None:
            found["loss_scale.dynamic_scale"] = self.scale
            found["loss_scale.step_counter"] = self.counter
        return found


def _component(variable: Any, local: int) -> tf.Variable:
    value = tf_variable(variable)
    copies = getattr(value, "values", None)
    return copies[local] if copies else value


def _proxy(variable: Any, component: tf.Variable) -> Any:
    """A Keras variable that reads and writes one replica's copy of `variable` (same name, path and key)."""
    proxy = object.__new__(type(variable))
    proxy.__dict__.update(variable.__dict__)
    proxy._value = component
    return proxy


def _dense(grad: Any) -> Any:
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def _slot_key(path: str, clone: Any, buckets: int) -> Optional[str]:
    rest = path[len(clone.name) + 1:] if path.startswith(clone.name + "/") else path
    for k in range(buckets):
        if rest.startswith(f"zero_bucket_{k}_"):
            return f"b{k}_{rest[len(f'zero_bucket_{k}_'):]}"
    return None


class ShardedOptimizer:
    """The sharded optimizer state of one model on one backend, and the update each replica step makes."""

    def __init__(self, model: keras.Model, backend: Backend, stage: int):
        self.backend, self.stage = backend, stage
        user = model.optimizer
        self.loss_scale = isinstance(user, keras.optimizers.LossScaleOptimizer)
        inner = user.inner_optimizer if self.loss_scale else user
        optimizers.check_supported(inner)
        optimizers.check_variables(model.trainable_variables, stage)
        self.iterations = tf_variable(inner._iterations)  # The raw count (`iterations` divides it when accumulating).
        self.use_ema = inner.use_ema
        self.clipping = bool(inner.clipnorm or inner.global_clipnorm)
        self.loss_scale_factor = None if self.loss_scale else inner.loss_scale_factor
        self.broken = False  # A restore failed part-way: `for_model` does not reuse this state.
        self.growth_steps = user.dynamic_growth_steps if self.loss_scale else None
        self.variables = list(model.trainable_variables)
        self.layout = self.plan_layout(model)
        self.shards = {replica: self._shard(user, inner, replica, local, device)
                       for local, (replica, device) in enumerate(backend.local_replicas())}
        from tfdist.training.zero import checkpoint
        checkpoint.seed_from(self, user, inner)

    def _shard(self, user: Any, inner: Any, replica: int, local: int, device: str) -> Shard:
        proxies = [_proxy(v, _component(v, local)) for v in self.variables]
        count = len(self.variables)
        with optimizers.plain_variables(), optimizers.plain_methods(), tf.device(device):
            clone = optimizers.clone(inner)
            params = []
            for k, bucket in enumerate(self.layout):  # Filled at the start of each step, emptied at its end.
                with optimizers.plain_variables(any_length=True):
                    params.append(keras.Variable("zeros", shape=(bucket.shard,), dtype=bucket.dtype.name,
                                                 name=f"zero_bucket_{k}"))
            if inner.weight_decay is not None:
                masks = [bucket.mask(replica, lambda i: clone._use_weight_decay(self.variables[i]))
                         for bucket in self.layout]
                clone._tfdist_apply_weight_decay = optimizers.masked_weight_decay(
                    clone, [None if m.all() else m for m in masks])
            segs = [figures.segments(bucket, replica, count) for bucket in self.layout]
            if optimizers.is_lamb(inner):
                def lamb_sum(t: tf.Tensor, k: int) -> tf.Tensor:
                    return collectives.all_sum(self.backend, [t], replica, f"tfdist_zero_lamb_{k}")[0]
                clone.update_step = figures.lamb_update_step(clone, segs, count, lamb_sum)
            before = {id(v) for v in clone.variables}
            clone.build(params)
            state = [v for v in clone.variables if id(v) not in before]
            keys, ordinal = [], 0
            for v in state:
                key = _slot_key(v.path, clone, len(self.layout))
                if key is None:
                    key, ordinal = f"global_{ordinal}", ordinal + 1
                keys.append(key)
            shard = Shard(replica, proxies, params, clone, keys, state, segs)
            for param in params:
                tf_variable(param).assign(tf.zeros([0], param.dtype), read_value=False)
            if self.loss_scale:
                shard.scale = tf.Variable(float(user.initial_scale), dtype=tf.float32, trainable=False,
                                          name="dynamic_scale")
                shard.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_counter")
        return shard

    def plan_layout(self, model: keras.Model) -> list:
        """The buckets (stage 3: one layer's variables each, `stage3`)."""
        return layout.plan(self.variables, self.backend.num_replicas)

    reduced_in_backward = False  # Stage 3: the tape's gradients are this replica's summed slices already.

    def gradient_sources(self) -> list:
        """What a replica step differentiates the loss by (stage 3: its weight shards)."""
        return self.variables

    def before_backward(self, empty: Optional[tf.Tensor]) -> None:
        """Told before a replica's forward pass whether its part of a short batch holds no example (None: every
        part holds some); stages 1 and 2 zero such a part's gradient before their reduce-scatter (the step)."""
        del empty

    # Accounting --------------------------------------------------------------------------------------------
    def local_state_bytes(self) -> list[int]:
        """The optimizer-state bytes each of this process's replicas holds."""
        return [sum(layout.variable_bytes(v) for v in shard.state) for shard in self.shards.values()]

    def current_scale(self) -> float:
        """A loss scale's dynamic scale now (alike on every replica)."""
        return float(next(iter(self.shards.values())).scale.numpy())

    # The step (inside a replica) ---------------------------------------------------------------------------
    def _mine(self) -> Shard:
        return self.shards[self.backend.replica_index()]

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """The loss a loss-scaled step differentiates (Keras' LossScaleOptimizer.scale_loss)."""
        if not self.loss_scale:  # Keras' Optimizer.scale_loss (its clone divides the gradients back).
            return loss * self.loss_scale_factor if self.loss_scale_factor else loss
        return loss * tf.cast(self._mine().scale, loss.dtype)

    def reduce(self, grads: list, tag: str = "", fresh: bool = True) -> list[tf.Tensor]:
        """This replica's [S/N] slice of each bucket of the gradients summed over the replicas (None
        gradients as zeros), a bucket at a time. `fresh`: `grads` are one backward pass's own, made only as
        the reduce-scatters let them (`pacing`); sums of micro-batches (stage 1's accumulators) are not held."""
        replica = self._mine().replica
        grads = [_dense(g) for g in grads]
        if not collectives.plain_sum(self.backend):  # Compressed or Adasum: the backend's own reduction.
            present = [i for i, g in enumerate(grads) if g is not None]
            summed = self.backend.finish_gradients(grads)
            return [bucket.owned_part(replica, [summed[i] if i in present else tf.zeros(
                self.variables[i].shape, bucket.dtype) for i in bucket.indices]) for bucket in self.layout]
        reduced, scopes = [None] * len(self.layout), [""] * len(self.layout)
        # Last layers first: their gradients exist first, and the collectives run in the order they are issued,
        # so the reduce-scatters overlap the rest of the backward pass (as the unsharded all-reduce's packs do).
        for k in reversed(range(len(self.layout))):
            bucket = self.layout[k]
            with tf.name_scope(f"tfdist_zero_rs{tag}_{k}") as scopes[k]:
                flat = bucket.flatten([grads[i] for i in bucket.indices])
                reduced[k] = collectives.reduce_scatter(self.backend, flat, replica, f"tfdist_zero_rs{tag}_{k}")
        if fresh and self.backend.num_replicas > 1:  # At most a few buckets' local gradients at once.
            pacing.pace(grads, reduced, self.layout, scopes)
        return reduced

    def apply(self, grads: list[tf.Tensor], present: Sequence[int]) -> tf.Tensor:
        """Applies one step's summed shard gradients (`reduce`) and gathers every replica's updated shards
        into its copies; returns whether the whole gradient was finite (alike on every replica). `present`:
        the variables with a gradient (Keras leaves the others as they are)."""
        shard = self._mine()
        clone = shard.optimizer
        self._refresh(shard)
        clone._iterations.assign(tf.cast(self.iterations, clone._iterations.dtype))
        scale = shard.scale if self.loss_scale else None
        unscaled = [g if scale is None else g / tf.cast(scale, g.dtype) for g in grads]
        finite, sums = self._figures(grads, unscaled, shard)
        clip = figures.clipping(clone, sums, shard.segments, list(present)) if self.clipping else None
        if clip is not None:
            clone._clip_gradients = clip
        absent = [i for i in range(len(self.variables)) if i not in set(present)]
        kept = self._keep(shard, absent)

        def update() -> None:
            if kept and self.use_ema:  # Put back before the averages are taken, as Keras averages them unchanged.
                average = type(clone)._update_model_variables_moving_average.__get__(clone)

                def put_back_then_average(variables: list) -> None:
                    self._restore_absent(shard, absent, kept)
                    average(variables)
                clone._update_model_variables_moving_average = put_back_then_average
            with optimizers.plain_methods():
                clone.apply(unscaled, shard.params)
            clone.__dict__.pop("_update_model_variables_moving_average", None)
            if not self.use_ema:
                self._restore_absent(shard, absent, kept)

        if scale is None:
            update()
        else:  # Keras' LossScaleOptimizer: the update only for a finite gradient.
            tf.cond(finite, lambda: _finite_step(update, shard, self.growth_steps), lambda: _nonfinite_step(shard))
        # Keras counts an apply (a loss-scaled one only where finite).
        self.iterations.assign_add(tf.cast(finite, self.iterations.dtype) if scale is not None else
                                   tf.constant(1, self.iterations.dtype))
        self.share(shard)
        self._constrain(shard, present)
        return finite

    def _refresh(self, shard: Shard) -> None:
        for k, bucket in enumerate(self.layout):  # The weights as the model holds them now.
            tf_variable(shard.params[k]).assign(bucket.owned_part(shard.replica, [shard.proxies[i].value
                                                                                   for i in bucket.indices]))

    def _figures(self, grads: list, unscaled: list, shard: Shard) -> tuple[tf.Tensor, Optional[tf.Tensor]]:
        """Whether the whole (scaled) gradient is finite, and the per-variable square sums of the unscaled
        gradient where clipping needs them: one small all-reduce of this replica's partial figures."""
        count = len(self.variables)
        parts = [tf.reshape(figures.nonfinite(grads), [1])]
        if self.clipping:
            factor = self.loss_scale_factor  # Keras divides by it before clipping.
            values = [g / factor if factor else g for g in unscaled]
            parts.append(figures.square_sums(values, shard.segments, count))
        summed = collectives.all_sum(self.backend, [tf.concat(parts, 0)], shard.replica, "tfdist_zero_figures")[0]
        return tf.equal(summed[0], 0.0), (summed[1:] if self.clipping else None)

    def _keep(self, shard: Shard, absent: list[int]) -> list:
        """Where some variables have no gradient: the shard's weights and state as they were, to put back
        on those variables' elements after the update (Keras' update skips them; EMA averages excepted)."""
        if not absent:
            return []
        return [(v, tf.identity(tf_variable(v)), k) for v, k in
                [(p, int(k)) for k, p in enumerate(shard.params)] +
                [(s, int(key[1:].split("_")[0])) for s, key in zip(shard.state, shard.keys)
                 if key.startswith("b") and not key.endswith("_average")]]

    def _restore_absent(self, shard: Shard, absent: list[int], kept: list) -> None:
        for variable, before, k in kept:
            mask = self.layout[k].mask(shard.replica, lambda i: i in absent)
            if mask.any():
                value = tf_variable(variable)
                value.assign(tf.where(tf.constant(mask > 0), before, value))

    def share(self, shard: Shard) -> None:
        """Every replica's copy of every variable set from the owners' shards (a copy: exact), a bucket at
        a time, so the step holds one bucket's gathered buffer, not the model's; each weight slice is then
        emptied (its elements live in the model's variables between steps: no 1/N copy is kept)."""
        done: list = []
        for k, bucket in enumerate(self.layout):
            with tf.control_dependencies(done):
                param = tf_variable(shard.params[k])
                whole = collectives.all_gather(self.backend, tf.reshape(param.read_value(), [bucket.shard]),
                                               shard.replica, f"tfdist_zero_gather_{k}")
                pieces = bucket.split(whole)
                done = [shard.proxies[i].value.assign(tf.reshape(piece, self.variables[i].shape), read_value=False)
                        for i, piece in zip(bucket.indices, pieces)]
                done.append(param.assign(tf.zeros([0], param.dtype), read_value=False))

    def _constrain(self, shard: Shard, present: Sequence[int]) -> None:
        for i in present:
            constraint = getattr(self.variables[i], "constraint", None)
            if constraint is not None:
                proxy = shard.proxies[i]
                proxy.value.assign(constraint(proxy.value))

    def finalize(self) -> None:
        """Keras' ``finalize_variable_values`` (EMA weights, `use_ema`) on every replica, then gathered."""
        if self.use_ema:
            self.backend.compile(self._finalize_all)()  # Bound methods: autograph converts them quietly.

    def _finalize_all(self) -> None:
        self.backend.run(self._finalize_replica, ())

    def _finalize_replica(self) -> None:
        shard = self._mine()
        with optimizers.plain_methods():
            shard.optimizer.finalize_variable_values(shard.optimizer._trainable_variables)
        self.share(shard)

    # Checkpoints (`checkpoint`) ----------------------------------------------------------------------------
    def save(self, directory: str, step: int) -> None:
        from tfdist.training.zero import checkpoint
        checkpoint.save(self, directory, step)

    def restore(self, directory: str, step: int) -> None:
        """Reads the state of this replica's shards from a step's files, written on any replica count."""
        from tfdist.training.zero import checkpoint
        self.broken = True  # Until every part is read.
        checkpoint.restore(self, directory, step)
        self.broken = False


def _finite_step(update: Any, shard: Shard, growth_steps: int) -> tf.Tensor:
    """Keras' LossScaleOptimizer after a finite gradient: the update, then the scale grows every
    ``dynamic_growth_steps``."""
    update()
    grow = tf.equal(shard.counter, growth_steps - 1)
    shard.scale.assign(tf.where(grow, shard.scale * 2.0, shard.scale))
    shard.counter.assign(tf.where(grow, tf.constant(0, tf.int64), shard.counter + 1))
    return tf.constant(True)


def _nonfinite_step(shard: Shard) -> tf.Tensor:
    shard.counter.assign(0)
    shard.scale.assign(shard.scale * 0.5)
    return tf.constant(False)
