"""Stage 3's layer gathering: each layer's weights all-gathered from the replicas' flat shards just before it
runs, and again in the backward pass; their gradient reduce-scattered into the shards.

The user's layers are not rewritten. While a stage-3 fit runs, each *unit* (a layer of the model with trainable
weights, nested models looked into) has its ``call`` replaced by an instance attribute (removed on every exit
path, `wrapped`). Inside a training step the replacement
- all-gathers the unit's buckets (equal parts) once its inputs exist, and feeds the whole weights to the
  layer's own ``call`` through a Keras `StatelessScope` (``Variable.value`` returns the mapped tensor);
- runs that gather and the call under ``tf.recompute_grad``: the tape keeps the unit's inputs and the shards,
  not the whole weights; the backward pass gathers them again and recomputes the unit. The last units (`held`,
  at most `HOLD_FACTOR` times the largest unit's weights, never the first), with which the backward pass
  begins, keep their gathered weights instead (as FSDP keeps its root unit's): no second gather;
- in the forward pass, gathers a unit once the previous unit's input exists, so it overlaps that unit's
  computation (prefetched one unit ahead);
- the gather's custom gradient reduce-scatters the weights' gradient (all-to-all plus a local sum): a replica
  never holds the summed gradient of more than one layer at a time, nor any layer's weights between layers.
Non-trainable state the unit writes (BatchNormalization's moving statistics, a seed generator's counter) is
written to the step's scope by the forward pass only: the recomputation starts from the state the forward pass
read (the same Dropout masks, the same statistics) and its own writes are dropped. A weight read outside its
own unit (tied weights, a layer reading another's kernel, a model reading a layer's weight in its own call) is
refused when the step is traced (`UserError`), as is a layer called twice in one forward pass.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import keras
import tensorflow as tf
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

from tfdist.errors import UserError
from tfdist.training.zero import collectives, layout


def units(model: keras.Model) -> list:
    """The layers stage 3 gathers one at a time: in model order, each layer with trainable weights (a nested
    model is looked into; a layer's sublayers are gathered with it)."""
    found: list = []

    def walk(container: Any) -> None:
        # A Keras model lists its layers in `layers`; a layer given Keras' trainer as a model (`Trainer` and
        # `Dense`, as Keras' own trainer tests build them) has no `layers`: its sublayers, as `Model.layers`.
        children = container.layers if isinstance(container, keras.Model) else \
            container._flatten_layers(include_self=False, recursive=False)
        for layer in children:
            if isinstance(layer, keras.Model) and not layer._trainable_variables:
                walk(layer)
            elif layer.trainable_variables:
                found.append(layer)
    walk(model)
    return found


def check(model: keras.Model) -> None:
    """Refuses, before any step, what stage 3 cannot gather layer by layer (one paragraph each)."""
    if model._trainable_variables:
        raise UserError(f"zero_stage=3 gathers each layer's weights just before the layer runs, and "
                        f"{type(model).__name__} owns trainable weights itself ({model._trainable_variables[0].path}), "
                        "which its own call reads outside any layer. Move them into a layer, or use zero_stage=2.")
    owner: dict = {}
    for layer in units(model):
        for v in layer.trainable_variables:
            if id(v) in owner:
                raise UserError(f"zero_stage=3 cannot shard {v.path}: layers {owner[id(v)].name!r} and "
                                f"{layer.name!r} both hold it (a tied or shared weight). Each weight is gathered "
                                "with the one layer that holds it; untie the weights, or use zero_stage=2.")
            owner[id(v)] = layer
    for v in model.trainable_variables:
        if id(v) not in owner:
            raise UserError(f"zero_stage=3 cannot shard {v.path}: no layer of the model holds it. Use "
                            "zero_stage=2.")
        if getattr(v, "regularizer", None) is not None or getattr(v, "constraint", None) is not None:
            what = "regularizer" if getattr(v, "regularizer", None) is not None else "constraint"
            raise UserError(f"zero_stage=3 cannot shard {v.path}: its {what} reads the whole weight outside "
                            f"its layer's call, and between a layer's gather and its next one no replica "
                            f"holds it. Drop the {what}, or use zero_stage=2.")


class _Refusal(UserError):
    """A refusal raised while the step is traced (Keras and autograph rewrite it on its way out:
    `stage3.sharded_weights` raises it again as it was)."""


class _Unmapped:
    """What a unit's scope maps another unit's weight to: converting it (a read) is refused."""

    def __init__(self, variable: Any, reader: str, local: Any):
        self.variable, self.reader, self.local = variable, reader, local
        self.shape, self.dtype = variable.shape, variable.dtype

    def __tf_tensor__(self, dtype: Any = None, name: Any = None) -> Any:
        raise _refuse(self.local, f"zero_stage=3 cannot shard {self.variable.path}: {self.reader} reads it outside the "
                        "layer that holds it (a tied weight, or a weight read in a model's own call), and stage 3 "
                        "gathers each weight only for its own layer's call. Read it in its own layer, or use "
                        "zero_stage=2.")

    def __getattr__(self, name: str) -> Any:  # Anything else done with it is a read too.
        if name.startswith("__"):
            raise AttributeError(name)
        self.__tf_tensor__()


def _refuse(local: Any, message: str) -> UserError:
    local.refusal = local.gathering.refusal = message
    return _Refusal(message)


class _UnitScope(StatelessScope):
    """A unit's scope: its whole weights and the step's state; remembers what the unit writes."""

    def __init__(self, mapping: dict):
        super().__init__(collect_losses=True, initialize_variables=False)
        self.state_mapping = mapping
        self.updated: dict = {}

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        self.updated[id(update[0])] = update[0]


def gather(backend: Any, bucket: Any, shapes: list, part: tf.Tensor, replica: int, name: str,
           absent: set, sparse: Callable[[int], None], empty: Optional[tf.Tensor] = None) -> list:
    """The bucket's variables whole (`shapes`), all-gathered from every replica's [S/N] `part`; the gradient
    is reduce-scattered back to this replica's part (`absent` collects the variables given no gradient;
    ``sparse(i)`` is told of a row-sparse one, which goes dense; where `empty`, this replica's part of a short
    batch held no example, and its gradient is zeros before the sum, as the step zeroes it at stages 0-2)."""
    @tf.custom_gradient
    def run(shard: tf.Tensor) -> Any:
        whole = collectives.all_gather(backend, shard, replica, name)
        pieces = [tf.reshape(p, s) for p, s in zip(bucket.split(whole), shapes)]

        def grad(*upstream: Any) -> tf.Tensor:
            dense = []
            for i, g in zip(bucket.indices, upstream):
                if g is None:
                    absent.add(i)
                if isinstance(g, tf.IndexedSlices):
                    sparse(i)
                dense.append(tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
            if empty is not None:  # (Its mean loss is 0/0 where no stand-in row ran.)
                dense = [None if g is None else tf.where(empty, tf.zeros_like(g), g) for g in dense]
            return collectives.reduce_scatter(backend, bucket.flatten(dense), replica, name + "_rs")
        return pieces, grad
    return run(part)


HOLD_FACTOR = 2.25  # `held`: the trailing units kept gathered hold at most this times the largest unit's bytes.


def _in_call_order(model: keras.Model) -> bool:
    """Whether the model's layers (`units` walks) are in the order its forward pass calls them: a Sequential or
    functional model, nested ones alike. A subclassed model's layers are in the order its attributes were set,
    which its call may not follow: `held` then keeps none (a unit kept gathered from the start of the forward
    pass would hold its weights through all of it)."""
    from keras.src.models.functional import Functional

    if not isinstance(model, (keras.Sequential, Functional)):
        return False
    return all(_in_call_order(layer) for layer in model.layers
               if isinstance(layer, keras.Model) and not layer._trainable_variables)


def held(found: list) -> set:
    """The units kept gathered from the forward pass to their backward pass (no gather again, no recomputation):
    the last ones in model order, while together they hold at most `HOLD_FACTOR` times the largest unit's
    weights, and never the first unit (its weights would be held through the whole step). The backward pass
    begins with them, and its peak is a unit's own backward (its gathered weights, their gradient, the
    reduce-scatter's rows, the next unit's gather): on issue 41's 4 x 4096 MLP keeping the last two large
    layers left the allocator peak where it was (588 against 589 MiB a worker) and took the step at 1 Gbit/s
    from 0.72x to 0.84x of unsharded."""
    sizes = [sum(layout.variable_bytes(v) for v in unit.trainable_variables) for unit in found]
    budget, total, kept = HOLD_FACTOR * max(sizes, default=0), 0, set()
    for unit, size in list(zip(found, sizes))[:0:-1]:
        total += size
        if total > budget:
            break
        kept.add(id(unit))
    return kept


class Gathering:
    """The call replacements of one stage-3 fit (`wrapped`); `active` while a training step is traced."""

    def __init__(self, sharded: Any, model: keras.Model):
        self.sharded, self.model = sharded, model
        # Per replica thread (MirroredStrategy traces its replicas in threads, which hand over at each merge
        # call): whether its training step's forward pass is being traced, and each unit's calls in it.
        self.local = threading.local()
        self.local.gathering = self
        self.refusal = None  # A refusal raised while the step was traced (`stage3.sharded_weights` raises it).
        self.units = units(model)
        index = {id(v): i for i, v in enumerate(sharded.variables)}
        self.buckets = {}  # id(unit) -> the indices of its buckets.
        for unit in self.units:
            mine = {index[id(v)] for v in unit.trainable_variables}
            self.buckets[id(unit)] = [k for k, b in enumerate(sharded.layout) if set(b.indices) <= mine]
        self.absent: set = set()
        self.held = held(self.units) if _in_call_order(model) else set()


    def whole_weights(self, unit: Any) -> list:
        """The unit's weights whole, gathered (inside a replica step), as (variable, tensor) pairs."""
        sharded = self.sharded
        shard = sharded._mine()
        pairs = []
        for k in self.buckets[id(unit)]:
            bucket = sharded.layout[k]
            variables = [sharded.variables[i] for i in bucket.indices]
            # The variable itself: Keras' `value` would cast it to a mixed policy's compute dtype in a layer's call.
            part = getattr(shard.params[k], "_value", shard.params[k]).read_value()
            values = gather(sharded.backend, bucket, [tuple(v.shape) for v in variables], part, shard.replica,
                            f"tfdist_zero3_{k}", self.absent, self.sparse, getattr(self.local, "empty", None))
            pairs += list(zip(variables, values))
        return pairs

    @property
    def active(self) -> bool:
        return getattr(self.local, "active", False)

    def sparse(self, index: int) -> None:
        """Refuses a row-sparse gradient (an Embedding's) unless Keras' optimizer updates from it as from its
        dense form (the rule of stages 1 and 2, `checks.sparse_exact`): Keras' Adam and the other slots move
        only the rows a batch touches, and the flat shards carry the gradient dense."""
        from tfdist.training.checks import SPARSE_WHY, sparse_exact

        clone = next(iter(self.sharded.shards.values())).optimizer
        if sparse_exact(clone):
            return
        variable = self.sharded.variables[index]
        raise _refuse(self.local, f"zero_stage=3 cannot shard {variable.path} with {type(clone).__name__}: "
                      f"{SPARSE_WHY} Use keras.optimizers.SGD (momentum too) without clipping, or zero_stage=0 for "
                      "this model.")

    def replacement(self, unit: Any, original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            if tf.compat.v1.get_default_graph() is not self.local.graph:
                raise _refuse(self.local, f"zero_stage=3 cannot shard layer {unit.name!r}: the model calls it inside "
                              "a conditional or a loop of its own (keras.ops.cond, while_loop), where the gather "
                              "of its weights and their recomputed backward pass cannot run. Call it outside, or "
                              "use zero_stage=2.")
            calls = self.local.calls
            calls[id(unit)] = calls.get(id(unit), 0) + 1
            if calls[id(unit)] > 1:
                raise _refuse(self.local, f"zero_stage=3 cannot shard layer {unit.name!r}: the model calls it "
                              "more than once in a forward pass (a shared layer), and stage 3 gathers a layer's "
                              "weights for one call. Use a layer per call, or zero_stage=2.")
            return self._run(unit, original, args, kwargs)
        return call

    def _run(self, unit: Any, original: Callable, args: tuple, kwargs: dict) -> Any:
        leaves = tf.nest.flatten((args, kwargs))
        # The recomputation's inputs; a boolean one (a mask) has no gradient to give and is taken as it is.
        at = [i for i, t in enumerate(leaves) if isinstance(t, tf.Tensor) and t.dtype not in (tf.bool, tf.string)]
        outer = get_stateless_scope()
        autocast = get_autocast_scope()  # The recomputation runs outside the layer's __call__, which set it.
        cast_to = autocast.dtype if autocast is not None else None
        entry = dict(outer.state_mapping) if outer is not None else {}
        for v in self.sharded.variables:  # Every other unit's weights: a read is refused (`_Unmapped`).
            if isinstance(entry.get(id(v), self), (_Unmapped, Gathering)):
                entry[id(v)] = _Unmapped(v, f"layer {unit.name!r}", self.local)
        runs = []

        def forward(*tensors: tf.Tensor) -> Any:
            first = not runs
            runs.append(1)
            given = list(leaves)
            for i, t in zip(at, tensors):
                given[i] = t
            a, kw = tf.nest.pack_sequence_as((args, kwargs), given)
            # Gathered once the unit's input exists; in the forward pass once the previous unit's does, so the
            # gather overlaps that unit's computation (prefetched one unit ahead).
            after = self.local.previous if first and self.local.previous is not None else list(tensors[:1])
            if first and tensors:  # (A unit called on no tensor it differentiates leaves the chain as it was.)
                self.local.previous = list(tensors[:1])
            with tf.control_dependencies(after):
                pairs = self.whole_weights(unit)
            scope = _UnitScope({**entry, **{id(v): t for v, t in pairs}})
            with scope, AutocastScope(cast_to):
                out = original(*a, **kw)
            written = [v for v in self.sharded.variables if id(v) in scope.updated]
            if written:
                raise _refuse(self.local, f"zero_stage=3 cannot shard layer {unit.name!r}: its call assigns the "
                              f"trainable weight {written[0].path} (as SpectralNormalization does), and while fit "
                              "runs only the replicas' shards of it exist. Use zero_stage=2.")
            if scope.losses:
                raise _refuse(self.local, f"zero_stage=3 cannot shard layer {unit.name!r}: its call adds a loss "
                              "(add_loss), whose gradient would have to pass the recomputation of the layer. "
                              "Add it from the model's compile() loss, or use zero_stage=2.")
            if first:  # A weight the call did not read has no gradient (Keras' optimizer leaves it alone).
                index = {id(v): i for i, v in enumerate(self.sharded.variables)}
                self.absent.update(index[id(v)] for v, t in pairs if hasattr(t, "consumers") and not t.consumers())
            if first:  # The forward pass's writes go to the step's scope; a recomputation's are dropped.
                for key, variable in scope.updated.items():
                    value = scope.state_mapping[key]
                    if outer is not None:
                        outer.add_update((variable, value))
                    else:
                        variable.assign(value)
            return out

        tensors = [leaves[i] for i in at]
        if not tensors or id(unit) in self.held:  # Kept gathered for the backward pass (`held`).
            return forward(*tensors)
        return tf.recompute_grad(forward)(*tensors)  # Graph-mode custom gradients take positional tensors.

    def guarded(self, original: Callable, name: str = "call") -> Callable:
        """The model's own call (or loss, ``name``): a weight it reads outside its layers' calls is refused
        (`_Unmapped`)."""
        reader = f"{type(self.model).__name__}.{name.lstrip('_')}"

        def call(*args: Any, **kwargs: Any) -> Any:
            scope = get_stateless_scope()
            if not self.active or scope is None:
                return original(*args, **kwargs)
            # The loss's own scope maps every weight to its value (here its freed buffer): all are unmapped
            # there. The model's call runs in the step's scope, where a unit's gathered weights stay.
            before = {id(v): scope.state_mapping.get(id(v)) for v in self.sharded.variables}
            for v in self.sharded.variables:
                if name != "call" or before[id(v)] is None:
                    scope.state_mapping[id(v)] = _Unmapped(v, reader, self.local)
            try:
                return original(*args, **kwargs)
            finally:
                for key, value in before.items():
                    if value is None:
                        scope.state_mapping.pop(key, None)
                    else:
                        scope.state_mapping[key] = value
        return call

    def forward_backward(self, original: Callable) -> Callable:
        """The step's forward and backward pass (`StepFunctions._forward_backward`), traced with the units'
        calls gathering."""
        def run(*args: Any, **kwargs: Any) -> Any:
            self.local.active, self.local.calls, self.local.gathering = True, {}, self
            self.local.previous = None  # The input of the unit the forward pass ran last.
            self.local.empty = None  # Whether this replica's part holds no example (the step, `before_backward`).
            self.local.graph = tf.compat.v1.get_default_graph()  # A unit called in another (a cond's) is refused.
            try:
                return original(*args, **kwargs)
            finally:
                self.local.active, self.local.empty = False, None
        return run


@contextlib.contextmanager
def replacing() -> Iterator[Callable[[Any, str, Callable], None]]:
    """``replace(obj, name, make)`` sets the instance attribute ``obj.name`` to ``make(obj.name)`` for the
    block; on every exit path each is put back as it was (removed where ``obj`` had none of its own)."""
    replaced: list = []

    def replace(obj: Any, name: str, make: Callable) -> None:
        replaced.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, make(getattr(obj, name)))
    try:
        yield replace
    finally:
        for obj, name, own in reversed(replaced):
            if own is None:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = own


@contextlib.contextmanager
def wrapped(gathering: Gathering, functions: Any) -> Iterator[None]:
    """The units' calls and the step's forward/backward replaced for the block; put back on every exit path."""
    with replacing() as replace:
        for unit in gathering.units:
            replace(unit, "call", lambda call, unit=unit: gathering.replacement(unit, call))
            if getattr(unit, "quantization_mode", None) is not None:  # Keras calls it instead of `call`.
                replace(unit, "quantized_call", lambda call, unit=unit: gathering.replacement(unit, call))
        model = gathering.model
        replace(model, "call", gathering.guarded)
        # The loss (a compute_loss override reading a weight: refused, not a failed step).
        replace(model, "_compute_loss", lambda method: gathering.guarded(method, "compute_loss"))
        replace(functions, "_forward_backward", gathering.forward_backward)
        yield
