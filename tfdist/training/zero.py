"""ZeRO-style sharding of the optimizer state over the data-parallel replicas (`tfdist.fit(zero_stage=1|2)`).

Each trainable variable has one owner replica, the variables dealt out by bytes, largest first
(`owners`). A replica keeps the optimizer state (slots, EMA averages, accumulators) of the variables it owns
only, in a clone of the user's own Keras optimizer built on them: its class, schedule, weight decay, clipping
and EMA are Keras' own code. A step: the gradients all-reduced as before (TensorFlow has no reduce-scatter on
CPU; a replica drops what it does not own as it arrives), the owner applies its clone to its variables, then
the updated variables are gathered into every replica's copy, a bucket at a time (`all_gather`, or a sum of
zero-filled buffers where the strategy cannot gather). What Keras computes over the whole gradient is
computed over the whole gradient: `global_clipnorm`'s norm and a `LossScaleOptimizer`'s finite check (one
vector of per-variable figures summed over the replicas, then Keras' formula). Stage 2 also reduces each
micro-batch of ``grad_accum_steps`` and accumulates the owned part only. The user's optimizer is not built
(no whole state anywhere); its ``iterations`` and learning rate stay the run's truth. docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import weakref
from typing import Any, Iterator, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer
from tensorflow.python.ops import resource_variable_ops

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.errors import UserError
from tfdist.training import keras_hooks

STAGES = (0, 1, 2, 3)
SHARD_DIR = "zero-{step}"
SHARD_FILE = "replica-{replica}-of-{replicas}"
BUCKET_BYTES = 32 << 20  # What one all-gather of updated variables moves at most (one variable may be more).
# The TensorFlow optimizer overrides these to go through the strategy (merge calls, mirrored slots); a clone
# on one replica's own variables uses Keras' backend-agnostic versions (`_plain_methods`), also where its own
# class overrides one and calls the TensorFlow optimizer's through super() (Nadam's update step).
_PLAIN_METHODS = ("add_variable_from_reference", "_backend_update_step", "_apply_weight_decay",
                  "_overwrite_model_variables_with_average_value", "_backend_increment_gradient_accumulators")


def owners(variables: Sequence[Any], num_replicas: int) -> list[int]:
    """The owner replica of each variable: largest first to the replica holding the fewest bytes (ties: the
    lower index), so each holds the total over N plus at most one variable."""
    held = [0] * num_replicas
    owner = [0] * len(variables)
    sizes = [_bytes(v) for v in variables]
    for i in sorted(range(len(variables)), key=lambda i: (-sizes[i], i)):
        r = min(range(num_replicas), key=lambda r: (held[r], r))
        owner[i] = r
        held[r] += sizes[i]
    return owner


def _size(variable: Any) -> int:
    return int(np.prod(variable.shape))


def buckets(variables: Sequence[Any], limit: int = 0) -> list[list[int]]:
    """What each all-gather of updated variables moves: runs of variables in order, of one dtype, at most
    `limit` bytes (`BUCKET_BYTES`; one larger variable alone). (Runs that take an equal share from every owner
    were tried: a 4-replica process then held four owners' parts and their slices at once, and its peak rose
    by 400 MB.)"""
    limit = limit or BUCKET_BYTES
    groups: list[list[int]] = []
    held = 0
    for i, v in enumerate(variables):
        size = _bytes(v)
        if not groups or held + size > limit or variables[groups[-1][0]].dtype != v.dtype:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    return groups


def _bytes(variable: Any) -> int:
    return _size(variable) * tf.as_dtype(variable.dtype).size


@contextlib.contextmanager
def _plain_variables() -> Iterator[None]:
    """Variables created here are plain, on the current device, even inside a strategy's scope."""
    def create(next_creator: Any, **kwargs: Any) -> tf.Variable:
        kwargs.pop("experimental_enable_variable_lifting", None)
        return resource_variable_ops.ResourceVariable(**kwargs)

    with tf.variable_creator_scope(create):
        yield


@contextlib.contextmanager
def _plain_methods() -> Iterator[None]:
    """While a clone is built or traced: the TensorFlow optimizer's strategy-bound methods defer to Keras'
    backend-agnostic ones for tfdist's clones (`_tfdist_plain`), and stay Keras' own for every other optimizer."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    def plain(name: str) -> Any:
        def make(before: Any, key: tuple) -> Any:
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                chosen = getattr(BaseOptimizer, name) if getattr(self, "_tfdist_plain", False) else before
                return chosen(self, *args, **kwargs)
            return method
        return make

    with contextlib.ExitStack() as stack:
        for name in _PLAIN_METHODS:
            stack.enter_context(keras_hooks._replaced(TFOptimizer, name, plain(name), this_thread=False))
        yield


def _component(variable: Any, local: int) -> tf.Variable:
    """This process's `local`-th copy of a (mirrored) variable."""
    value = tf_variable(variable)
    copies = getattr(value, "values", None)
    return copies[local] if copies else value


def _proxy(variable: Any, component: tf.Variable) -> Any:
    """A Keras variable that reads and writes one replica's copy of `variable` (same name, path and key)."""
    proxy = object.__new__(type(variable))
    proxy.__dict__.update(variable.__dict__)
    proxy._value = component
    return proxy


@dataclasses.dataclass
class _Shard:
    """One replica's part: the variables it owns, its copies of all of them and its optimizer clone."""
    replica: int
    owned: list[int]
    proxies: list[Any]  # One per trainable variable: this replica's copy.
    optimizer: Any
    scale: Optional[tf.Variable] = None  # A loss scale's dynamic scale and growth counter (alike everywhere).
    counter: Optional[tf.Variable] = None

    state: list[Any] = dataclasses.field(default_factory=list)  # What the clone's build created.

    def slots(self) -> dict[str, tf.Variable]:
        """The optimizer state this replica holds, by a key that names the variable it belongs to by its index
        among the model's trainable variables (layer names differ from one model object to the next)."""
        found = dict(zip(_state_keys(self), (tf_variable(v) for v in self.state)))
        if self.scale is not None:
            found["loss_scale.dynamic_scale"] = self.scale
            found["loss_scale.step_counter"] = self.counter
        return found


def _clone(optimizer: Any) -> Any:
    """A new optimizer of the user's class and settings (its learning rate set to the user's own after)."""
    rate = optimizer.__dict__["_learning_rate"]
    try:
        # Read with a plain rate: a schedule need not be serializable (the clone shares the user's own), and
        # set back on every path.
        optimizer.__dict__["_learning_rate"] = 0.0
        try:
            config = dict(optimizer.get_config())
        finally:
            optimizer.__dict__["_learning_rate"] = rate
        return type(optimizer).from_config(config)
    except Exception as e:  # A user's class whose config does not rebuild it.
        raise UserError(f"zero_stage makes one copy of the optimizer per replica from its get_config(), and "
                        f"{type(optimizer).__name__} could not be rebuilt from it ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}). Give the class a get_config()/from_config() that "
                        "rebuilds it, or use zero_stage=0.") from None


def _state_keys(shard: _Shard) -> list[str]:
    return _keys(shard.state, shard.optimizer.name, [shard.proxies[i] for i in shard.owned], shard.owned,
                 names={v.name for v in shard.proxies})


def _keys(state: Sequence[Any], optimizer_name: str, variables: Sequence[Any], indices: Sequence[int],
          names: Optional[set] = None) -> list[str]:
    """A key for each piece of optimizer state: ``var{index}_{slot}`` for a variable's (its index among the
    model's trainable variables: layer names differ from one model object to the next), ``global_{k}`` for the
    k-th not named after any variable (Nadam's running product, alike on every replica that updates)."""
    paths = [v.path for v in variables]
    names = names if names is not None else {v.name for v in variables}
    keys, ordinal = [], 0
    for variable in state:
        key = _slot_key(variable.path, optimizer_name, paths, indices)
        if not re.match(r"var\d+_", key) and key not in names:
            key, ordinal = f"global_{ordinal}", ordinal + 1
        keys.append(key)
    return keys


def _check_keys(shard: _Shard, optimizer: Any) -> None:
    """Each piece of state must name the one variable it belongs to, or no checkpoint could say which."""
    keys = _state_keys(shard)
    unclear = sorted({k for k in keys if keys.count(k) > 1 or not re.match(r"(var|global_)\d+", k)})
    if unclear:
        raise UserError(f"zero_stage cannot shard {type(optimizer).__name__}'s state: its variable {unclear[0]!r} "
                        "is not named after one model variable's path (Adafactor names its factored moments by "
                        "the variable's name alone; or the model has two variables of one path), so a checkpoint "
                        "could not say which variable it belongs to. Use zero_stage=0 for this optimizer or "
                        "model.")


def _slot_key(path: str, optimizer_name: str, paths: Sequence[str], indices: Sequence[int]) -> str:
    """``var{index}_{slot}`` for a slot Keras named ``{optimizer}/{variable path}_{slot}``."""
    rest = path[len(optimizer_name) + 1:] if path.startswith(optimizer_name + "/") else path
    for variable_path, index in sorted(zip(paths, indices), key=lambda pair: -len(pair[0])):
        prefix = variable_path.replace("/", "_") + "_"
        if rest.startswith(prefix):
            return f"var{index}_{rest[len(prefix):]}"
    return rest


class ShardedOptimizer:
    """The sharded optimizer state of one model on one backend, and the update each replica step makes."""

    def __init__(self, model: keras.Model, backend: Backend, stage: int):
        # Nothing here refers to the user's optimizer (`for_model` keeps this while the optimizer lives).
        self.backend, self.stage = backend, stage
        user = model.optimizer
        self.loss_scale = isinstance(user, keras.optimizers.LossScaleOptimizer)
        inner = user.inner_optimizer if self.loss_scale else user
        self.iterations = tf_variable(inner._iterations)  # The raw count (`iterations` divides it when accumulating).
        self.global_clipnorm, self.use_ema = inner.global_clipnorm, inner.use_ema
        self.loss_scale_factor = None if self.loss_scale else inner.loss_scale_factor
        self.broken = False  # A restore failed part-way: `for_model` does not reuse this state.
        self.growth_steps = user.dynamic_growth_steps if self.loss_scale else None
        self.variables = list(model.trainable_variables)
        self.owner = owners(self.variables, backend.num_replicas)
        # Horovod: one all-gather a dtype, every rank sending as many values (several a step, or a rank with
        # nothing to send, hung under horovodrun here; the cause is not found yet).
        self.equal_parts = type(backend).__name__ == "HorovodBackend"
        self.buckets = buckets(self.variables, limit=2 ** 62 if self.equal_parts else 0)
        self.shards = {replica: self._shard(user, inner, replica, local, device)
                       for local, (replica, device) in enumerate(backend.local_replicas())}
        self._seed_from(user, inner)

    # Building ----------------------------------------------------------------------------------------------
    def _shard(self, user: Any, inner: Any, replica: int, local: int, device: str) -> _Shard:
        proxies = [_proxy(v, _component(v, local)) for v in self.variables]
        owned = [i for i, r in enumerate(self.owner) if r == replica]
        with _plain_variables(), _plain_methods(), tf.device(device):
            clone = _clone(inner)
            clone._tfdist_plain = True
            for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
                if hasattr(inner, name):
                    setattr(clone, name, getattr(inner, name))
            clone._learning_rate = inner._learning_rate  # The user's: its variable callbacks set, its schedule.
            before = {id(v) for v in clone.variables}
            clone.build([proxies[i] for i in owned])
            shard = _Shard(replica, owned, proxies, clone,
                           state=[v for v in clone.variables if id(v) not in before])
            _check_keys(shard, inner)
            if self.loss_scale:
                shard.scale = tf.Variable(float(user.initial_scale), dtype=tf.float32, trainable=False,
                                          name="dynamic_scale")
                shard.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_counter")
        return shard

    def _seed_from(self, user: Any, inner: Any) -> None:
        """A user's optimizer already built (a loaded model, an earlier Keras fit) hands over its state."""
        if not getattr(inner, "built", False):
            return
        own = {id(inner._iterations), id(inner._learning_rate)}
        state = [v for v in inner.variables if id(v) not in own]
        built = dict(zip(_keys(state, inner.name, self.variables, range(len(self.variables))), state))
        if self.loss_scale and getattr(user, "built", False):
            built["loss_scale.dynamic_scale"] = user.dynamic_scale
            built["loss_scale.step_counter"] = user.step_counter
        for shard in self.shards.values():
            for key, variable in shard.slots().items():
                if key in built and tuple(built[key].shape) == tuple(variable.shape):
                    variable.assign(tf.cast(tf.convert_to_tensor(built[key]), variable.dtype))

    # Accounting --------------------------------------------------------------------------------------------
    def local_state_bytes(self) -> list[int]:
        """The optimizer-state bytes each of this process's replicas holds."""
        return [sum(_bytes(v) for v in shard.state)
                for shard in self.shards.values()]

    def current_scale(self) -> float:
        """A loss scale's dynamic scale now (alike on every replica)."""
        return float(next(iter(self.shards.values())).scale.numpy())

    # The step (inside a replica) ---------------------------------------------------------------------------
    def _mine(self) -> _Shard:
        return self.shards[self.backend.replica_index()]

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """The loss a loss-scaled step differentiates (Keras' LossScaleOptimizer.scale_loss)."""
        if not self.loss_scale:  # Keras' Optimizer.scale_loss (its clone divides the gradients back).
            return loss * self.loss_scale_factor if self.loss_scale_factor else loss
        return loss * tf.cast(self._mine().scale, loss.dtype)

    def keep_owned(self, grads: list) -> list:
        """The gradients of this replica's variables; None elsewhere (what a reduce-scatter leaves)."""
        owned = set(self._mine().owned)
        return [g if i in owned else None for i, g in enumerate(grads)]

    def apply(self, grads: list, present: Sequence[int]) -> tf.Tensor:
        """Applies one step's summed gradients of the owned variables (`grads`: None elsewhere) to them and
        gathers every replica's updates; returns whether the whole gradient was finite (alike on every
        replica). `present`: the variables with a gradient."""
        shard = self._mine()
        clone, owned = shard.optimizer, shard.owned
        iterations = self.iterations
        clone._iterations.assign(tf.cast(iterations, clone._iterations.dtype))
        scale = shard.scale if self.loss_scale else None
        unscaled = {i: grads[i] if scale is None or grads[i] is None else _unscale(grads[i], scale) for i in owned}
        finite, norm = self._global_figures(grads, unscaled, present, owned)
        if self.global_clipnorm:
            clone._clip_gradients = _clip_by_norm_of(norm, self.global_clipnorm)
        mine, variables = [unscaled[i] for i in owned], [shard.proxies[i] for i in owned]

        def update() -> None:
            with _plain_methods():
                clone.apply(mine, variables)

        def finite_step() -> tf.Tensor:
            return _finite_step(update, shard, self.growth_steps)

        def overflow_step() -> tf.Tensor:
            return _nonfinite_step(shard)
        if scale is None:
            update()
        else:  # Keras' LossScaleOptimizer: the update only for a finite gradient.
            tf.cond(finite, finite_step, overflow_step)
        # Keras counts an apply (a loss-scaled one only where finite), here also where a replica owns nothing.
        iterations.assign_add(tf.cast(finite, iterations.dtype) if scale is not None else
                              tf.constant(1, iterations.dtype))
        self._share(shard)
        return finite

    def _global_figures(self, grads: list, unscaled: dict, present: Sequence[int],
                        owned: Sequence[int]) -> tuple[tf.Tensor, Optional[tf.Tensor]]:
        """Whether the whole (scaled) gradient is finite, and the whole unscaled gradient's norm where
        ``global_clipnorm`` needs it: Keras' formulas on per-variable figures in variable order, each replica
        adding its own and zeros elsewhere (exact) in one small all-reduce."""
        need_norm = bool(self.global_clipnorm)
        if not present:
            return tf.constant(True), None
        slot = {i: k for k, i in enumerate(present)}
        mine = [i for i in owned if i in slot]

        def vector(values: list) -> tf.Tensor:
            if not mine:
                return tf.zeros([len(present)], tf.float32)
            return tf.scatter_nd([[slot[i]] for i in mine], tf.stack([tf.cast(v, tf.float32) for v in values]),
                                 [len(present)])
        factor = self.loss_scale_factor  # Keras divides by it before clipping.
        sums = self.backend.all_sum(
            [vector([tf.reduce_all(tf.math.is_finite(_values(grads[i]))) for i in mine])] +
            ([vector([_square_sum(unscaled[i] if not factor else tf.convert_to_tensor(unscaled[i]) / factor)
                      for i in mine])] if need_norm else []), name="tfdist_zero_figures")
        finite = tf.equal(tf.reduce_sum(sums[0]), float(len(present)))
        norm = tf.sqrt(tf.reduce_sum(sums[1])) if need_norm else None
        return finite, norm

    def _share(self, shard: _Shard) -> None:
        """Every replica's copy of every variable set to its owner's (exact: a copy, or a sum with zeros), a
        bucket of at most `BUCKET_BYTES` at a time, so the step holds one bucket's buffers, not the model's."""
        done: list = []
        for k, bucket in enumerate(self.buckets):
            with tf.control_dependencies(done):
                done = self._share_bucket(shard, bucket, f"tfdist_zero_gather_{k}")

    def _share_bucket(self, shard: _Shard, bucket: list[int], name: str) -> list:
        """One bucket's owners' values into every replica's copy; returns what the next bucket waits for."""
        dtype = self.variables[bucket[0]].dtype
        replicas = self.backend.num_replicas
        parts = [[i for i in bucket if self.owner[i] == r] for r in range(replicas)]
        sizes = [sum(_size(self.variables[i]) for i in part) for part in parts]
        flat = [tf.reshape(shard.proxies[i].value, [-1]) for i in parts[shard.replica]]
        width = max(sizes) if self.equal_parts else sizes[shard.replica]
        if width > sizes[shard.replica]:  # Horovod: every rank sends as many values (none hung it here).
            flat.append(tf.zeros([width - sizes[shard.replica]], dtype))
        gathered = self.backend.all_gather(tf.concat(flat, 0) if flat else tf.zeros([0], dtype), name)
        if gathered is not None:  # Each replica's part in replica order (tf.distribute pads and unpads).
            order = [i for part in parts for i in part]
            if self.equal_parts:
                gathered = tf.concat([gathered[r * width:r * width + sizes[r]] for r in range(replicas)], 0)
        else:  # A sum in which each replica adds its own values and zeros elsewhere.
            order = bucket
            filled = [tf.reshape(shard.proxies[i].value, [-1]) if self.owner[i] == shard.replica
                      else tf.zeros([_size(self.variables[i])], dtype) for i in bucket]
            gathered = self.backend.all_sum([tf.concat(filled, 0)], name)[0]
        pieces = tf.split(gathered, [_size(self.variables[i]) for i in order])
        assigns = [shard.proxies[i].value.assign(tf.reshape(piece, self.variables[i].shape), read_value=False)
                   for i, piece in zip(order, pieces) if self.owner[i] != shard.replica]
        return assigns + [gathered]

    def finalize(self) -> None:
        """Keras' ``finalize_variable_values`` (EMA weights, `use_ema`) on every replica, then gathered."""
        if self.use_ema:
            self.backend.compile(self._finalize_all)()  # Bound methods: autograph converts them quietly.

    def _finalize_all(self) -> None:
        self.backend.run(self._finalize_replica, ())

    def _finalize_replica(self) -> None:
        shard = self._mine()
        with _plain_methods():
            shard.optimizer.finalize_variable_values(shard.optimizer._trainable_variables)
        self._share(shard)

    # Checkpoints -------------------------------------------------------------------------------------------
    def save(self, directory: str, step: int) -> None:
        """Writes each local replica's state under ``directory/zero-{step}/replica-{r}-of-{N}``, first removing
        what a run on another replica count left there unrecorded (it died between its parts and its checkpoint)."""
        where = os.path.join(directory, SHARD_DIR.format(step=step))
        if tf.io.gfile.exists(where):
            for name in tf.io.gfile.listdir(where):
                count = re.match(r"replica-\d+-of-(\d+)", name)
                if count and int(count.group(1)) != self.backend.num_replicas:
                    stale = os.path.join(where, name.rstrip("/"))
                    try:
                        tf.io.gfile.rmtree(stale) if tf.io.gfile.isdir(stale) else tf.io.gfile.remove(stale)
                    except tf.errors.NotFoundError:  # Another process of this job removed it first.
                        pass
        for replica, shard in self.shards.items():
            path = os.path.join(directory, SHARD_DIR.format(step=step),
                                SHARD_FILE.format(replica=replica, replicas=self.backend.num_replicas))
            tf.train.Checkpoint(**{_attribute(k): v for k, v in shard.slots().items()}).write(path)

    def restore(self, directory: str, step: int) -> None:
        """Reads the state of this replica's variables from a step's shards, written on any replica count."""
        self.broken = True  # Until every part is read.
        self._restore(directory, step)
        self.broken = False

    def _restore(self, directory: str, step: int) -> None:
        where = os.path.join(directory, SHARD_DIR.format(step=step))
        files = sorted({f.split(".")[0] for f in tf.io.gfile.listdir(where)}) if tf.io.gfile.exists(where) else []
        counts = {re.sub(r".*-of-", "", f) for f in files}
        found = {}
        if len(counts) == 1:
            n = int(counts.pop())
            if sorted(files) == sorted(SHARD_FILE.format(replica=r, replicas=n) for r in range(n)):
                for name in files:
                    reader = tf.train.load_checkpoint(os.path.join(where, name))
                    for key in reader.get_variable_to_shape_map():
                        if key.endswith("/.ATTRIBUTES/VARIABLE_VALUE"):  # Replica 0's global state first.
                            found.setdefault(key.split("/")[0], (reader, key))
        if not found:
            raise UserError(f"Cannot resume with zero_stage: the sharded optimizer state of step {step} ({where}) "
                            "is missing or incomplete (every replica's file is needed). Was the run written "
                            "without zero_stage? Resume it with the zero_stage it was written with, or start a "
                            "new run with a new workdir.")
        for shard in self.shards.values():
            for key, variable in shard.slots().items():
                if _attribute(key) not in found:
                    raise UserError(f"Cannot resume from {where}: it holds no optimizer state for {key!r}; the "
                                    "checkpoint was written for another model or optimizer. Use the model and "
                                    "optimizer it was written with, or a new workdir.")
                reader, full = found[_attribute(key)]
                value = reader.get_tensor(full)
                if tuple(value.shape) != tuple(variable.shape):
                    raise UserError(f"Cannot resume from {where}: its optimizer state {key!r} has shape "
                                    f"{tuple(value.shape)}, this model's {tuple(variable.shape)}; the checkpoint "
                                    "was written for a model of another shape. Use that model, or a new workdir.")
                variable.assign(value)


_SHARDED: "weakref.WeakKeyDictionary[Any, ShardedOptimizer]" = weakref.WeakKeyDictionary()


def for_model(model: keras.Model, backend: Backend, stage: int) -> ShardedOptimizer:
    """The model's sharded optimizer state: the one an earlier `tfdist.fit` call left (so a second call goes on
    from the first's moments, as Keras' second ``fit`` does), or a new one."""
    previous = _SHARDED.get(model.optimizer)
    if previous is not None and previous.backend is backend and not previous.broken and \
            not model.optimizer.built and \
            [id(v) for v in previous.variables] == [id(v) for v in model.trainable_variables]:
        previous.stage = stage
        return previous
    sharded = _SHARDED[model.optimizer] = ShardedOptimizer(model, backend, stage)
    return sharded


def _unscale(grad: Any, scale: tf.Variable) -> tf.Tensor:
    """Keras' LossScaleOptimizer's ``divide(g, scale)`` (a row-sparse gradient goes dense there too)."""
    grad = tf.convert_to_tensor(grad)
    return grad / tf.cast(scale, grad.dtype)


def _values(grad: Any) -> tf.Tensor:
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _square_sum(grad: Any) -> tf.Tensor:
    """Keras' ``sum(square(g))`` of `global_norm` (a row-sparse gradient summed dense first, as Keras does)."""
    return tf.reduce_sum(tf.square(tf.convert_to_tensor(grad)))


def _attribute(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", key)


def _finite_step(update: Any, shard: _Shard, growth_steps: int) -> tf.Tensor:
    """Keras' LossScaleOptimizer after a finite gradient: the update, then the scale grows every
    ``dynamic_growth_steps``."""
    update()
    grow = tf.equal(shard.counter, growth_steps - 1)
    shard.scale.assign(tf.where(grow, shard.scale * 2.0, shard.scale))
    shard.counter.assign(tf.where(grow, tf.constant(0, tf.int64), shard.counter + 1))
    return tf.constant(True)


def _nonfinite_step(shard: _Shard) -> tf.Tensor:
    shard.counter.assign(0)
    shard.scale.assign(shard.scale * 0.5)
    return tf.constant(False)


def _clip_by_norm_of(norm: tf.Tensor, clip_norm: float) -> Any:
    """Keras' clip_by_global_norm with the whole gradient's norm (a clone sees its own part only)."""
    def clip(grads: list) -> list:
        use_norm = tf.cast(norm, grads[0].dtype) if grads else norm
        scale = clip_norm * keras.ops.minimum(1.0 / use_norm, 1.0 / clip_norm) + (use_norm - use_norm)
        return [g * scale if g is not None else g for g in grads]
    return clip


def state_report(zero: Optional[ShardedOptimizer], backend: Backend) -> dict[str, Any]:
    """metrics.json's figures: the optimizer-state bytes each replica holds, and their total."""
    if zero is None:
        return {}
    local = zero.local_state_bytes()
    if backend.num_workers > 1:
        per_replica = [int(b) for b in np.asarray(backend.gather_from_tasks(np.asarray(local, np.int64))).ravel()]
    else:
        per_replica = local
    largest = max((_bytes(v) for v in zero.variables), default=0)
    return {"zero_stage": zero.stage, "optimizer_state_bytes_per_replica": per_replica,
            "optimizer_state_bytes_total": int(sum(per_replica)), "largest_variable_bytes": largest}
