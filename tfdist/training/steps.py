"""The compiled inner loops: training and evaluation steps for any compiled Keras 3 model.

`StepFunctions` owns what runs on the devices (Orbit's StandardTrainer /
StandardEvaluator): an execution of ``n`` replica steps inside one
``tf.function``, for every backend through `tfdist.distribute.backend.Backend`. It honours
what the user compiled: the loss (via the model's own ``compute_loss``, so
loss objects of any reduction, ``loss_weights``, several outputs and
``model.losses`` regularisers all count as Keras counts them), the compiled
metrics, and the optimizer with its own schedule and ``clipnorm``.

Per step the only collective is the gradient all-reduce (`Backend.
finish_gradients`). Gradients are summed across replicas *before* the
optimizer sees them, so ``clipnorm`` and a `LossScaleOptimizer`'s finite check
act on the all-reduced gradients and every replica and worker takes the same
apply-or-skip decision. Keras 3's optimizer would sum again; tfdist turns that
off while it traces its own step (`tfdist.training.keras_hooks`), so the
user's optimizer is never changed.

The loss. Keras sees one replica while tfdist traces its step, so every part
of a global batch (replica x micro-batch) computes Keras' one-device loss of
its examples; tfdist alone scales it into the part's share of the one-device
loss of the global batch, the same way on every backend (`loss_kind`):
mean-type losses (and ``add_loss`` terms, which Keras 3 makes batch means) by
``n_part / n_global``; a ``"sum"`` compiled loss by 1, its ``model.losses``
terms by ``n_part / n_global`` (so weight regularisers count once a step).
Summed over the parts, the gradient is the one-device gradient.

Loss and metric statistics are accumulated per replica as the *deltas* of the
metrics' own state (Keras metrics keep sum/count state), carried through the
execution as one flat vector and reduced once per execution. The forward pass
runs in a recording `StatelessScope`, so tfdist knows which non-trainable
state it updates (BatchNormalization's moving statistics, not a frozen layer's
weights); that float, replica-local state is averaged across replicas once per
execution, which equals averaging every step because the moving-average update
is affine. Under asynchronous workers (parameter servers) that state, and the
optimizers' step counters, are written back as atomic increments instead, so
concurrent steps lose no update.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.errors import UserError
from tfdist.layers.sharded_embedding import sharded_tables
from tfdist.training import custom_steps, inputs as inputs_lib, keras_hooks, sparse_updates

NUM_SCALARS = 3  # examples, non-finite losses, stop requests.


class MetricLayout:
    """Where each of the model's metric variables sits in the flat totals vector.

    ``[examples, non-finite steps, stop requests, metric state...]``, summed over
    replicas, steps and executions. A custom step (`tfdist.training.custom_steps`)
    adds ``logs``: a tail holding its last step's non-metric logs, replaced by
    each step instead of summed, and ``keys``: the log keys it returns, in order.
    """

    def __init__(self, model: keras.Model, *, keys: Optional[Sequence[str]] = None,
                 logs: Optional[custom_steps.LogLayout] = None):
        self.metrics = list(model.metrics)
        self.variables = [v for m in self.metrics for v in m.variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.base = NUM_SCALARS + sum(self.sizes)
        self.keys = list(keys) if keys is not None else None
        self.logs = logs
        self.size = self.base + (logs.size if logs is not None else 0)

    def zeros(self) -> list[tf.Tensor]:
        return [tf.zeros(v.shape, v.dtype) for v in self.variables]

    def pack(self, scalars: Sequence[tf.Tensor], values: Sequence[tf.Tensor]) -> tf.Tensor:
        parts = [tf.cast(tf.reshape(s, [1]), tf.float32) for s in scalars]
        parts += [tf.reshape(tf.cast(v, tf.float32), [-1]) for v in values]
        return tf.concat(parts, 0)

    def add_step(self, totals: tf.Tensor, scalars: Sequence[tf.Tensor], values: Sequence[tf.Tensor],
                 tail: Optional[tf.Tensor] = None) -> tf.Tensor:
        """``totals`` with one step added (compiled); a custom step's ``tail`` replaces the last one."""
        summed = totals[:self.base] + self.pack(scalars, values)
        if self.logs is None:
            return summed
        return tf.concat([summed, tail if tail is not None else totals[self.base:]], 0)

    def opening(self) -> np.ndarray:
        """As Keras' reset_metrics at an epoch's or an evaluation's start: each metric's own reset_state(), then
        its state (zeros, unless its reset_state keeps it) as the totals the steps add to."""
        totals = np.zeros(self.size)
        for metric in self.metrics:
            metric.reset_state()
        offset = NUM_SCALARS
        for variable, size in zip(self.variables, self.sizes):
            totals[offset:offset + size] = np.reshape(tf_variable(variable).read_value(), [-1])
            offset += size
        return totals

    def store(self, totals: np.ndarray) -> None:
        """The summed states written into the metrics' variables, where Keras' fit leaves them (a metric read
        after fit, or by a callback at an epoch's end, shows what Keras' would)."""
        offset = NUM_SCALARS
        for variable, size, shape in zip(self.variables, self.sizes, self.shapes):
            value = np.asarray(totals[offset:offset + size]).reshape(shape).astype(variable.dtype)
            held = tf_variable(variable)
            copies = getattr(held, "values", None) \
                if getattr(held, "synchronization", None) == tf.VariableSynchronization.ON_READ else None
            if copies and len(copies) > 1:  # Sync-on-read (summed when read): the total on the first copy only.
                for index, copy in enumerate(copies):  # (Assigning the whole would split it, truncating ints.)
                    copy.assign(value if index == 0 else np.zeros_like(value))
            else:
                variable.assign(value)
            offset += size

    def combine(self, earlier: np.ndarray, later: np.ndarray) -> np.ndarray:
        """Two executions' totals (on the host): sums, and the later logs tail where it holds a step."""
        combined = np.asarray(earlier, np.float64) + np.asarray(later, np.float64)
        if self.logs is not None:
            tail = later[self.base:] if later[self.base] > 0 else earlier[self.base:]
            combined[self.base:] = tail
        return combined

    def results(self, totals: np.ndarray, prefix: str = "") -> dict[str, float]:
        """Keras' own names and values (`Model.get_metrics_result`) for summed states.

        For a custom step: its own keys, each a metric's result where it names one,
        else the last step's value.
        """
        values, offset = [], NUM_SCALARS
        for shape, size, variable in zip(self.shapes, self.sizes, self.variables):
            values.append(np.asarray(totals[offset:offset + size], variable.dtype).reshape(shape))
            offset += size
        logs: dict[str, float] = {}
        start = 0
        for metric in self.metrics:
            count = len(metric.variables)
            result = metric.stateless_result(values[start:start + count])
            start += count
            items = result.items() if isinstance(result, dict) else [(metric.name, result)]
            for name, value in items:
                value = np.asarray(value)
                logs[name] = float(value) if value.ndim == 0 else value  # As Keras' pythonify_logs.
        if self.keys is not None:
            last = self.logs.results(np.asarray(totals[self.base:])) if self.logs is not None else {}
            logs = {key: logs[key] if key in logs else last[key] for key in self.keys}
        return {prefix + name: value for name, value in logs.items()}


def _batch_size(x: Any) -> tf.Tensor:
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _unpack(data: Any) -> tuple:
    if isinstance(data, (tuple, list)):
        data = tuple(data) + (None,) * (3 - len(data))
        return data[0], data[1], data[2]
    return data, None, None


def _add_grads(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):  # Embedding rows: stay sparse.
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0),
                                a.dense_shape)
    if isinstance(a, tf.IndexedSlices) or isinstance(b, tf.IndexedSlices):
        a, b = (tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in (a, b))
    return a + b


def _all_finite(grads: list) -> tf.Tensor:
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])


class _RecordingScope(StatelessScope):
    """A `StatelessScope` that remembers which variables the forward pass updated."""

    def __init__(self, state_mapping: list):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.updated: dict[int, Any] = {}

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        self.updated[id(update[0])] = update[0]


def _forward_losses(model: keras.Model) -> list:
    """The ``add_loss`` values (activity regularisers included) of the forward pass just run.

    Outside a `StatelessScope` (evaluation) Keras keeps them on the layers; inside
    one (the training step's recording scope) in the scope, filtered by layer, as
    Keras filters them.
    """
    return [loss for layer in model._flatten_layers(include_self=True) for loss in layer._get_own_losses()]


@contextlib.contextmanager
def _model_losses(model: keras.Model, added: list) -> Iterator[None]:
    """Makes ``model.losses`` inside a `StatelessScope` what Keras' own steps see.

    Inside a scope Keras looks for ``add_loss`` values in the scope, where a
    forward pass run outside it (or in another scope) left none: without this,
    activity regularisers and ``add_loss`` terms would silently drop out of the loss. Weight
    regularisers are computed here, inside the scope, as Keras computes them.
    """
    if not added:
        yield
        return
    before = model._losses_override
    model._losses_override = list(added) + model._get_regularization_losses()
    try:
        yield
    finally:
        model._losses_override = before


def _where_present(empty: tf.Tensor, grad: Any) -> Any:
    """A gradient, or zeros where the part held no example (its mean loss is 0/0)."""
    if grad is None or isinstance(grad, tf.IndexedSlices):  # No rows gathered: nothing to zero.
        return grad
    return tf.where(empty, tf.zeros_like(grad), grad)


def _global_statistics(model: keras.Model) -> set:
    """Ids of the moving statistics of `BatchNormalization(synchronized=True)` layers: an empty part computes
    them from the global batch too, so it writes them like every other part."""
    return {id(tf_variable(v)) for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "synchronized", False)
            for v in (layer.moving_mean, layer.moving_variance)}


def _write_state(scope: _RecordingScope, before: dict, atomic: bool, keep: Optional[tf.Tensor] = None,
                 global_state: frozenset = frozenset()) -> None:
    """Writes the forward pass's non-trainable state updates back to the variables.

    Synchronous replicas assign them, as Keras' own step would. Under asynchronous
    workers (``atomic``) a layer's moving average (BatchNormalization:
    ``m <- m * momentum + mean * (1 - momentum)``) is written back as
    ``m += new - old``: concurrent workers each add their own contribution, as
    with the optimizer's slots, instead of overwriting each other's (with 2
    parameter-server workers many updates were lost, and the lagging statistics
    cost 3-6 points of validation accuracy after 3 epochs). Integer counters
    (seed generators) are incremented the same way.
    """
    for key, variable in scope.updated.items():
        target = tf_variable(variable)
        new = tf.cast(scope.get_current_value(variable), target.dtype)
        old = before.get(key)
        if keep is not None and old is not None and id(target) not in global_state:  # An empty part: its
            # own statistics are 0/0, keep the state (a synchronized layer's are the global batch's).
            new = tf.where(keep, tf.cast(old, target.dtype), new)
        if atomic and old is not None and (target.dtype.is_floating or target.dtype in (tf.int32, tf.int64)):
            target.assign_add(new - old)
        else:  # Synchronous, or state the forward pass did not declare: written as Keras would.
            target.assign(new)


def synced_state(model: keras.Model, updated: Any) -> list:
    """The state replicas must agree on: replica-local float variables the forward pass updates.

    ``updated`` holds the ids of the variables a traced forward pass wrote
    (BatchNormalization's moving statistics); a frozen layer's weights are not
    among them, so they are never all-reduced.
    """
    found = []
    for variable in model.non_trainable_variables:
        value = tf_variable(variable)
        if id(variable) in updated and value.dtype.is_floating and \
                getattr(value, "aggregation", None) == tf.VariableAggregation.NONE:
            found.append(variable)
    return found


def _mask_padding(y_pred: Any, mask: tf.Tensor) -> Any:
    """Gives every output a Keras mask that also excludes the padding rows (``mask`` 0, static shapes).

    Keras' losses and mean metrics read the mask of ``y_pred`` (`keras.src.losses.loss.apply_mask`):
    a ``sum_over_batch_size`` loss then divides by the real (unmasked) entries, as Keras does on the
    real examples alone. An output's own mask (``Embedding(mask_zero=True)``, per timestep) is kept
    and combined with the padding; an output without one gets the padding mask in the shape of its
    per-entry losses (all of the output's dimensions but the last). Without padding (every batch
    but a padded one) every factor this adds is exactly 1.
    """
    real = tf.cast(mask, tf.bool)
    for output in tf.nest.flatten(y_pred):
        own = get_keras_mask(output)
        rank = len(own.shape) if own is not None else max(1, len(output.shape) - 1)
        rows = tf.reshape(real, tf.concat([[-1], tf.ones([rank - 1], tf.int32)], 0))
        if own is not None:
            combined = tf.logical_and(tf.cast(own, tf.bool), rows)
        else:
            combined = tf.broadcast_to(rows, tf.shape(output)[:rank]) if len(output.shape) > 1 else real
        set_keras_mask(output, combined)
    return y_pred


MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def _overrides_compute_loss(model: keras.Model) -> bool:
    from keras.src.trainers.trainer import Trainer

    return type(model).compute_loss is not Trainer.compute_loss


def loss_kind(model: keras.Model, parts: int) -> str:
    """How a part's one-device loss becomes its share of the global batch's: "mean" or "sum".

    "mean": the whole loss scales by ``n_part / n_global`` (mean reductions,
    ``add_loss`` terms, a ``compute_loss`` override, whose value is taken as a
    mean over its batch). "sum": the compiled loss counts whole, ``model.losses``
    by ``n_part / n_global``. With one part (one replica, no accumulation) any
    loss is exact. Refuses (`UserError`) what no scaling makes exact when a
    global batch is split: reductions by the weight sum or none at all, and
    compiled losses that mix mean and sum reductions or a "sum" loss under a
    ``compute_loss`` override (their terms cannot be told apart).
    """
    compiled = getattr(model, "_compile_loss", None)
    flat = getattr(compiled, "_flat_losses", None) or []
    reductions = [getattr(getattr(entry, "loss", None), "reduction", "sum_over_batch_size") for entry in flat]
    kinds = {"mean" if r in MEAN_REDUCTIONS else "sum" if r == "sum" else None for r in reductions}
    if parts == 1 or not reductions or kinds == {"mean"}:
        return "mean"
    where = f"split over {parts} parts (replicas x grad_accum_steps)"
    if None in kinds:
        odd = sorted({str(r) for r in reductions if r not in MEAN_REDUCTIONS + ("sum",)})
        raise UserError(
            f"The compiled loss has reduction {', '.join(odd)}, which divides by each part's own sample-weight sum "
            f"(or does not reduce); with the global batch {where} no scaling gives the one-device gradient. Use "
            "reduction='sum_over_batch_size' (the default) or 'sum', or train on one replica with "
            "grad_accum_steps=1.")
    if len(kinds) > 1:
        raise UserError(
            f"The compiled losses mix reductions ({', '.join(sorted(set(map(str, reductions))))}); with the global "
            f"batch {where} tfdist scales a mean by each part's share of the examples and a sum by 1, and cannot "
            "tell their terms apart in the total. Give every output the same kind of reduction (e.g. all "
            "'sum_over_batch_size'), or train on one replica with grad_accum_steps=1.")
    if _overrides_compute_loss(model):
        raise UserError(
            f"{type(model).__name__} overrides compute_loss() and compiles a reduction='sum' loss; with the "
            f"global batch {where} tfdist takes compute_loss()'s value as a mean over its batch and cannot find "
            "the sum inside it. Use reduction='sum_over_batch_size' (or return a mean from compute_loss), or "
            "train on one replica with grad_accum_steps=1.")
    return "sum"


class StepFunctions:
    """The compiled training and evaluation executions for one model under one backend."""

    def __init__(self, model: keras.Model, backend: Backend, *, grad_accum_steps: int, step_counter: tf.Variable,
                 jit_compile: bool = False, train_example: Any = None, eval_example: Any = None,
                 partial_last: bool = False, training: bool = True, row_sparse: bool = True,
                 streamed: bool = False):
        """``train_example``/``eval_example``: a batch's element structure (`custom_steps.keras_data`),
        for models with a custom ``train_step``/``test_step`` (traced once, `custom_steps.probe`).
        ``training=False``: evaluation only (`tfdist.evaluate`). ``row_sparse``: a sparse input's kernel
        gradient may reach the optimizer row-sparse (`Backend.sum_rows_each_step`). ``streamed``: the input
        may end in an execution (a stream: `_train_chunk`)."""
        self.model = model
        self.backend = backend
        self.row_sparse = row_sparse
        self.streamed = streamed
        self.optimizer = model.optimizer
        self.accum = grad_accum_steps
        self.partial_last = partial_last  # Batches end with the step's global count (`inputs`).
        self.step_counter = step_counter
        keras_hooks.check_internals(model, asynchronous=backend.asynchronous)
        if training:
            sparse_updates.check(model)
            if backend.asynchronous:
                sparse_updates.warn_whole_table_reads(model)
        # The parts a global batch is split into: each computes the one-device loss of its examples.
        self.parts = backend.num_replicas * grad_accum_steps
        self.custom_train = custom_steps.overrides(model, "train_step") and training
        self.custom_test = custom_steps.overrides(model, "test_step")
        # Evaluation only: no gradient is split, so any loss is exact.
        self.loss_kind = "mean" if self.custom_train or not training else loss_kind(model, self.parts)
        self.gradients = custom_steps.GlobalGradients(custom_steps.optimizers_of(model), backend, error=UserError)
        self.layout = self._custom_layout("train_step", train_example) if self.custom_train else MetricLayout(model)
        self.eval_layout = self._custom_layout("test_step", eval_example) if self.custom_test and \
            eval_example is not None else \
            (MetricLayout(model) if self.custom_train else self.layout)
        self._updated: dict[int, Any] = {}  # State the traced forward passes write (ids), for `synced`.
        self._all_shards = {id(shard) for table in sharded_tables(model) for shard in table.shards}
        self._shards = {id(shard) for table in sharded_tables(model) for shard in table.shards
                        if table.embeddings_regularizer is None}
        self.jit_compile = jit_compile
        # XLA compiles one step (as Keras does); the loop around it reads the iterator.
        self._train_step = tf.function(self._distributed_train_step, jit_compile=True) if jit_compile \
            else self._distributed_train_step
        self.train_chunk = backend.compile(self._train_chunk)
        self.eval_chunk = backend.compile(self._eval_chunk)

    def _custom_layout(self, name: str, example: Any) -> MetricLayout:
        plain = MetricLayout(self.model)
        if example is None:
            raise ValueError(f"A model with a custom {name} needs an example batch to trace it.")
        keys = custom_steps.probe(self.model, self.backend, name, example, self.gradients, error=UserError)
        names = set(plain.results(np.zeros(plain.size)))
        return MetricLayout(self.model, keys=keys, logs=custom_steps.LogLayout([k for k in keys if k not in names]))

    def reset_metrics(self, layout: Optional[MetricLayout] = None) -> np.ndarray:
        """At an epoch's (or an evaluation's) start, as Keras' reset_metrics: the totals to start from.

        A custom step's own trackers count from zero (its logs read them); compiled metrics start from their
        state after their own reset_state() (`MetricLayout.opening`). Parameter servers: zeros (their
        variables are never written: steps are stateless there).
        """
        layout = layout or self.layout
        if self.backend.asynchronous:
            return np.zeros(layout.size)
        if self.custom_train:
            for metric in self.model.metrics:
                metric.reset_state()
            return np.zeros(layout.size)
        return layout.opening() if layout.logs is None else np.zeros(layout.size)

    def store_metrics(self, totals: np.ndarray, layout: Optional[MetricLayout] = None) -> None:
        """Where Keras leaves them: the compiled metrics' states at an epoch's or an evaluation's end."""
        layout = layout or self.layout
        if not self.backend.asynchronous and not self.custom_train and layout.logs is None:
            layout.store(totals)

    @property
    def synced(self) -> list:
        """The replica-local state averaged after each execution (known once the step is traced)."""
        return synced_state(self.model, self._updated)

    # Training ---------------------------------------------------------------
    def _tracked_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool, added: list,
                      mask: Any = None, share: Optional[tf.Tensor] = None):
        """Runs the model's compute_loss and its metric updates; returns (loss, unscaled, metric deltas).

        ``added`` holds the forward pass's ``add_loss`` values (`_forward_losses`).
        Keras sees one replica, so compute_loss returns Keras' one-device loss of
        this batch. With ``share`` (training: ``n_part / n_global``) ``loss`` is this
        part's share of the global batch's loss (what the gradient is taken of) and
        ``unscaled`` is ``loss / share``, what the loss metric averages weighted by
        the part's examples: for a mean loss the part's one-device loss, for a sum
        the global batch's loss the part stands for. Without ``share`` (evaluation)
        both are the one-device loss of the batch.
        """
        model, layout = self.model, self.layout
        zeros = layout.zeros()
        summed = share is not None and self.loss_kind == "sum"
        # Keras' per-output loss metrics: a summed part stands for 1/share of the global batch's sum.
        factor = 1.0 / share if summed else None
        # Metric state starts from zero (its deltas are what is collected); model
        # weights read as themselves (regularisers read them inside the scope).
        # (Not a ShardedEmbedding table's shards, unless a regulariser reads them: a lookup gathers its rows
        # on the ps, and a whole read there can cost a copy of the table at every step.)
        weights = [(v, v.value) for v in model.variables if id(v) not in self._shards]
        with StatelessScope(state_mapping=weights + list(zip(layout.variables, zeros))) as scope, \
                _model_losses(model, added), keras_hooks.one_replica_losses(factor):
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
            loss = tf.cast(loss, tf.float32)
            unscaled = loss
            if summed:  # The compiled sum counts whole, model.losses (batch means, regularisers) by share.
                extra = [tf.cast(model._aggregate_additional_loss(term), tf.float32) for term in model.losses]
                loss = loss - (1.0 - share) * tf.add_n(extra) if extra else loss
                unscaled = loss / share
            elif share is not None:
                loss = loss * share
            if training:
                model._loss_tracker.update_state(unscaled, sample_weight=_batch_size(x))
                if model._compile_metrics is not None:
                    model._compile_metrics.update_state(y, y_pred, sample_weight)
            else:
                self._eval_updates(x, y, y_pred, sample_weight, unscaled, mask)
        deltas = []
        for variable, zero in zip(layout.variables, zeros):
            value = scope.get_current_value(variable)
            deltas.append(zero if value is None else value)
        return loss, unscaled, deltas

    def _forward_backward(self, x: Any, y: Any, sample_weight: Any, total: Optional[tf.Tensor] = None):
        """``total``: the step's global example count where parts may differ in size (partial batches)."""
        model = self.model
        variables = model.trainable_variables
        # The forward pass records what state it updates (written back below).
        # (A frozen ShardedEmbedding table is never written by the forward pass: not read whole here.)
        mapping = [(v, tf_variable(v).read_value()) for v in model.non_trainable_variables
                   if id(v) not in self._all_shards]
        before = {id(v): value for v, value in mapping}
        size = _batch_size(x)
        # This part's fraction of the global batch (without `total` all parts hold as many examples).
        share = tf.cast(size, tf.float32) / (tf.cast(size * self.parts, tf.float32) if total is None else total)
        with tf.GradientTape() as tape:
            forward = _RecordingScope(mapping)
            with forward, keras_hooks.synchronized_moments(self.backend.replica_sum()):
                y_pred = model(x, training=True)
                added = _forward_losses(model)
            loss, unscaled, deltas = self._tracked_loss(x, y, y_pred, sample_weight, training=True, added=added,
                                                        share=share)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        empty = None
        if total is not None:  # A part of a short last batch may hold no example: it adds nothing.
            empty = tf.equal(size, 0)
            grads = [_where_present(empty, g) for g in grads]
        _write_state(forward, before, atomic=self.backend.asynchronous, keep=empty,
                     global_state=_global_statistics(model))
        self._updated.update(forward.updated)
        finite = tf.math.is_finite(unscaled)
        deltas = [tf.where(finite, d, tf.zeros_like(d)) for d in deltas]
        return grads, deltas, finite, size

    def _micro_batches(self, data: Any) -> list:
        if self.accum == 1:
            return [data]
        k = self.accum
        if self.partial_last:  # Parts of a short batch differ in size: split as evenly as can be.
            n = tf.shape(tf.nest.flatten(data)[0], out_type=tf.int64)[0]
            return [inputs_lib.map_present(lambda t, i=i: tf.gather(t, inputs_lib.split_range(0, n, k, i)), data)
                    for i in range(k)]

        def split(t: tf.Tensor) -> tf.Tensor:
            return tf.reshape(t, tf.concat([[k, -1], tf.shape(t)[1:]], 0))

        stacked = tf.nest.map_structure(split, data)
        return [tf.nest.map_structure(lambda t, i=i: t[i], stacked) for i in range(k)]

    def _replica_custom_train_step(self, element: Any, stop: tf.Tensor, totals: tf.Tensor) -> tf.Tensor:
        """The user's ``train_step`` on this replica's batch, with global-batch gradients (`custom_steps`)."""
        layout = self.layout
        if self.partial_last:
            *element, total = element  # The step's global example count (`inputs.train_arrays_fn`).
            element = tuple(element)
        data = custom_steps.keras_data(element)
        examples = custom_steps.batch_size(data)
        if not self.partial_last:
            total = examples * self.backend.num_replicas  # Every replica holds the same number of examples.
        with self.gradients.replica_step(examples, total), keras_hooks.one_replica_losses(), \
                keras_hooks.synchronized_moments(self.backend.replica_sum()):
            if self.backend.asynchronous:
                logs, deltas = self._asynchronous_custom_step(data)
            else:
                state = [tf_variable(v) for v in layout.variables]
                before = [v.read_value() for v in state]
                logs = self.model.train_step(data)
                deltas = [v.read_value() - b for v, b in zip(state, before)]
            claimed = self.gradients.state.claimed
            if self.backend.asynchronous and claimed is None:
                claimed = self.backend.claim()  # A step that applied nothing still uses up its claim.
            self.backend.when_claimed(claimed, lambda: self.step_counter.assign_add(1))
        if self.partial_last:  # A replica with no example adds nothing (refused in fit; kept exact here).
            deltas = [tf.where(examples > 0, d, tf.zeros_like(d)) for d in deltas]
        nonfinite = 1.0 - tf.cast(self.gradients.all_finite(), tf.float32)
        share = nonfinite / float(self.backend.num_replicas)
        tail = layout.logs.pack(examples, logs) if layout.logs is not None else None
        return layout.add_step(totals, [examples, share, stop], deltas, tail)

    def _asynchronous_custom_step(self, data: Any) -> tuple:
        """The user's step where workers share the variables (parameter servers); returns (logs, metric deltas).

        Other workers update the same metric variables concurrently, so their before/after
        difference is not this step's: the step runs in a `StatelessScope` that starts the
        metrics from zero (their values at the end are this step's contribution) and records
        the other state it writes (BatchNormalization statistics, seed generators), written
        back as increments (`_write_state`). The optimizers' updates and step counters go to
        the variables directly (Keras' TensorFlow optimizer assigns them outside the scope).
        """
        model, layout = self.model, self.layout
        zeros = layout.zeros()
        metric_ids = {id(v) for v in layout.variables}
        others = [(v, tf_variable(v).read_value()) for v in model.non_trainable_variables if id(v) not in metric_ids]
        weights = [(v, v.value) for v in model.trainable_variables]
        scope = _RecordingScope(weights + others + list(zip(layout.variables, zeros)))
        with scope:
            logs = model.train_step(data)
        deltas = [zero if scope.get_current_value(v) is None else scope.get_current_value(v)
                  for v, zero in zip(layout.variables, zeros)]
        for key in metric_ids:
            scope.updated.pop(key, None)
        _write_state(scope, {id(v): value for v, value in others}, atomic=True)
        self._updated.update(scope.updated)
        return logs, deltas

    def _replica_train_step(self, data: Any, stop: tf.Tensor, totals: tf.Tensor) -> tf.Tensor:
        if self.custom_train:
            return self._replica_custom_train_step(data, stop, totals)
        grads, deltas, examples = None, None, 0
        total = None
        if self.partial_last:
            *data, total = data  # The step's global example count (`inputs.train_arrays_fn`).
            data = tuple(data)
        for micro in self._micro_batches(data):
            x, y, sample_weight = _unpack(micro)
            g, d, _, b = self._forward_backward(x, y, sample_weight, total)
            grads = g if grads is None else [_add_grads(a, c) for a, c in zip(grads, g)]
            deltas = d if deltas is None else [a + c for a, c in zip(deltas, d)]
            examples += b
        variables = self.model.trainable_variables
        leaves = tf.nest.flatten(data)
        sparse = any(isinstance(t, tf.SparseTensor) for t in leaves)
        if any(isinstance(t, tf.RaggedTensor) for t in leaves) or (sparse and not self.row_sparse) or \
                (self.streamed and not self.row_sparse):  # A stream's batches vary in size within an execution.
            # A ragged input's gathers, a sparse input's kernel gradient (Keras' embedding_lookup_sparse):
            # each replica its own count of rows, which a collective all-reduce cannot take from step to step
            # of one execution. Summed dense it is one device's gradient.
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        # Else a sparse input's kernel gradient (each replica's own unique rows) is summed as unique rows: it
        # reaches the optimizer row-sparse, one device's gradient.
        grads = self.backend.finish_gradients(grads, distinct_rows=sparse and self.row_sparse)
        # Whether this step's all-reduced gradients are non-finite: the same on every replica, so
        # 1/replicas from each sums to one count per step (the loop's divergence guard counts steps).
        nonfinite = 1.0 - tf.cast(_all_finite(grads), tf.float32)
        with self._keras_optimizer_hooks():  # Entered while this is traced, left before it returns.
            # The update and the step count (parameter servers: only a step no earlier run claimed).
            self.backend.apply_step(lambda: self.optimizer.apply(grads, variables), self.step_counter, ready=grads)
        share = nonfinite / float(self.backend.num_replicas)
        return self.layout.add_step(totals, [examples, share, stop], deltas)

    @contextlib.contextmanager
    def _keras_optimizer_hooks(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(keras_hooks.no_gradient_sum(self.optimizer))
            stack.enter_context(sparse_updates.sparse_table_updates(self.model))
            if self.backend.asynchronous:
                stack.enter_context(keras_hooks.atomic_iterations(self.optimizer))
            yield

    def _distributed_train_step(self, data: Any, stop: tf.Tensor, totals: Any) -> Any:
        return self.backend.run(self._replica_train_step, (data, stop, totals))

    def _zeros(self) -> tf.Tensor:
        return tf.zeros([self.layout.size], tf.float32)

    def _eval_zeros(self) -> tf.Tensor:
        return tf.zeros([self.eval_layout.size], tf.float32)

    def _train_chunk(self, iterator: Any, num_steps: tf.Tensor, stop: Any) -> tf.Tensor:
        backend = self.backend
        totals = backend.run(self._zeros, ())
        for _ in tf.range(num_steps):
            # One step at a time: collectives of two steps in flight at once would
            # collide (Horovod names its all-reduces by graph node).
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            if self.streamed:  # A stream may end here: the execution then ends, its steps counted.
                element = iterator.get_next_as_optional()
                if not element.has_value():
                    break
                totals = self._train_step(element.get_value(), tf.convert_to_tensor(stop), totals)
                continue
            # Read each step: a stop requested on a worker mid-execution (a variable) travels
            # with this execution's reduction.
            totals = self._train_step(next(iterator), tf.convert_to_tensor(stop), totals)
        backend.sync_replica_state(self.synced)
        return backend.reduce_sum(totals)

    # Evaluation -------------------------------------------------------------
    def _eval_updates(self, x: Any, y: Any, y_pred: Any, weight: Any, unscaled: tf.Tensor, mask: tf.Tensor) -> None:
        """Keras' test_step updates; `y_pred` already masks the padding rows (`_mask_padding`).

        With the padding masked, ``compute_loss`` on a padded batch is Keras' loss of its
        real examples (each loss divides by what Keras divides by on those examples alone),
        so the tracker weighs it by the real examples, as Keras weighs a batch by its size.
        """
        model = self.model
        model._loss_tracker.update_state(unscaled, sample_weight=tf.reduce_sum(mask))
        if model._compile_metrics is not None:
            model._compile_metrics.update_state(y, y_pred, weight)

    def _replica_custom_eval_step(self, element: tuple, mask: tf.Tensor, totals: tf.Tensor) -> tf.Tensor:
        layout = self.eval_layout

        def update() -> tf.Tensor:
            data = custom_steps.keras_data(element)
            state = [tf_variable(v) for v in layout.variables]
            before = [v.read_value() for v in state]
            with keras_hooks.one_replica_losses():
                logs = self.model.test_step(data)
            deltas = [v.read_value() - b for v, b in zip(state, before)]
            examples = tf.reduce_sum(mask)
            tail = layout.logs.pack(examples, logs) if layout.logs is not None else None
            return layout.add_step(totals, [examples, 0.0, 0.0], deltas, tail)

        return tf.cond(tf.size(mask) > 0, update, lambda: totals)

    def _replica_eval_step(self, data: Any, totals: tf.Tensor) -> tf.Tensor:
        *element, mask = data  # (x, [y, [sample_weight,]] mask): `inputs.eval_arrays_fn`.
        if self.custom_test:
            return self._replica_custom_eval_step(tuple(element), mask, totals)
        x, y, weight = _unpack(tuple(element))

        def update() -> tf.Tensor:
            y_pred = self.model(x, training=False)
            if mask.shape[0] is not None:  # Static shapes (TPUs): batches may hold padding rows.
                y_pred = _mask_padding(y_pred, mask)
            _, _, deltas = self._tracked_loss(x, y, y_pred, weight, training=False,
                                              added=_forward_losses(self.model), mask=mask)
            return self.eval_layout.add_step(totals, [tf.reduce_sum(mask), 0.0, 0.0], deltas)

        # The last eval batches of some replicas may be empty (no collectives here).
        return tf.cond(tf.size(mask) > 0, update, lambda: totals)

    def _eval_chunk(self, iterator: Any, num_steps: tf.Tensor) -> tf.Tensor:
        backend = self.backend
        totals = backend.run_eval(self._eval_zeros, ())
        for _ in tf.range(num_steps):
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            totals = backend.run_eval(self._replica_eval_step, (next(iterator), totals))
        return backend.reduce_eval(totals)


def check_model(model: keras.Model, error: Callable[[str], Exception]) -> None:
    """Refuses models tfdist cannot train faithfully, before any step."""
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise error("The model is not compiled; call model.compile(optimizer=..., loss=..., metrics=...) under "
                    "the strategy's scope before tfdist.fit.")


def check_custom_steps(model: keras.Model, backend: Backend, *, grad_accum_steps: int,
                       error: Callable[[str], Exception]) -> None:
    """Refuses, before any step, what a custom ``train_step``/``test_step`` cannot be given on this backend."""
    custom = [name for name in ("train_step", "test_step") if custom_steps.overrides(model, name)]
    if not custom:
        return
    what = f"{type(model).__name__} overrides {' and '.join(n + '()' for n in custom)}"
    if "train_step" in custom and backend.asynchronous:
        scaled = [type(opt).__name__ for opt in custom_steps.optimizers_of(model)
                  if isinstance(opt, keras.optimizers.LossScaleOptimizer)]
        constrained = [v.path for v in model.trainable_variables if getattr(v, "constraint", None) is not None]
        if scaled or constrained:
            raise error(
                f"{what} with {'a LossScaleOptimizer' if scaled else 'a weight constraint (' + constrained[0] + ')'}; "
                "under parameter servers a custom step's updates are applied only if the step's claim holds, and "
                "the state those update alongside cannot be written there. Train in float32 without weight "
                "constraints, or with MultiWorkerMirroredStrategy or Horovod.")
    if "train_step" in custom and grad_accum_steps > 1:
        raise error(f"{what}; grad_accum_steps={grad_accum_steps} would have to split the user's step into "
                    "micro-batches, which tfdist cannot do inside code it does not own. Use grad_accum_steps=1 "
                    "(a larger batch over more replicas trains the same global batch).")


def check_metrics(model: keras.Model, error: Callable[[str], Exception]) -> None:
    """Refuses metrics whose state cannot be summed across replicas (call once the model is built).

    Summed state is exact: float sums and counts (Mean-, Sum- and confusion-count-based metrics)
    and integer counts (the IoU family's int64 confusion matrix), which travel in the float32
    totals and are exact while a count stays below 2**24 per execution.
    """
    for metric in model.metrics:
        for variable in metric.variables:
            summable = variable.dtype.startswith(("float", "int", "uint"))
            if not summable or variable.aggregation != "sum":
                raise error(
                    f"Metric {variable.path.split('/')[0]!r} keeps state ({variable.path}, {variable.dtype}, aggregation "
                    f"{variable.aggregation}) that cannot be summed across replicas; tfdist.fit supports metrics "
                    "whose state is sums or counts (aggregation 'sum': Keras' Mean-, Sum-, confusion-count- and "
                    "IoU-based metrics). Give the metric's add_variable(aggregation='sum') state that adds up "
                    "over batches, or compute it after training.")
