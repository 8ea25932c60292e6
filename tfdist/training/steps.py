"""The compiled executions: training and evaluation steps for any compiled Keras 3 model (docs/training.md).

`StepFunctions` owns what runs on the devices (Orbit's StandardTrainer/StandardEvaluator): `execution`
builds one ``tf.function`` of ``n`` replica steps for train, eval and predict alike, on every backend through
`tfdist.distribute.backend.Backend`. A training step runs the model's own ``compute_loss`` (each part of the
global batch its share of the one-device loss: `tfdist.training.losses`), all-reduces the gradients once
(`Backend.finish_gradients`) and applies the user's optimizer to the summed gradients
(`tfdist.training.updates`), with Keras' own sum turned off while it is traced (`tfdist.training.keras_hooks`). Loss and metric statistics travel as
one flat vector of metric-state deltas (`tfdist.training.metric_state`), reduced once an execution; the state
a forward pass writes (BatchNormalization's statistics) is recorded and averaged (`tfdist.training.layer_state`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import StatelessScope

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.layers.sharded_embedding import sharded_tables
from tfdist.training import columns, custom_steps, inputs as inputs_lib, keras_hooks, overwrites, sparse_updates, \
    updates
from tfdist.training.layer_state import RecordingScope, global_statistics, synced_state, where_present, write_state
from tfdist.training.losses import forward_losses, loss_kind, mask_padding, model_losses
from tfdist.training.metric_state import MetricLayout, LogLayout


def _batch_size(x: Any) -> tf.Tensor:
    return tf.shape(columns.first(x))[0]  # Not an optional input's None.


def _stand_in_rows(empty: tf.Tensor, data: Any) -> Any:
    """`data`, or one row of zeros per dense leaf where the part holds no example.

    A part with no example (a batch the replicas do not divide) still runs the
    forward pass, whose results are discarded (`where_present`, `write_state`'s
    ``keep``); some layers cannot run on no row (Equalization takes its histogram's
    first nonzero bin), so the part runs on a stand-in row instead.
    Sparse and ragged leaves are left as they are.
    """

    def one(t: Any) -> Any:
        if not isinstance(t, tf.Tensor):
            return t
        zeros = tf.zeros(tf.concat([[1], tf.shape(t)[1:]], 0), t.dtype)
        return tf.cond(empty, lambda: zeros, lambda: t)

    return tf.nest.map_structure(one, data)


def _unpack(data: Any) -> tuple:
    """(x, y, sample_weight), x as the model takes it (an optional input given none: None, `inputs.absent_as_none`)."""
    if isinstance(data, (tuple, list)):
        data = tuple(data) + (None,) * (3 - len(data))
        return inputs_lib.absent_as_none(data[0]), data[1], data[2]
    return inputs_lib.absent_as_none(data), None, None


def _add_grads(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):  # Embedding rows: stay sparse.
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0),
                                a.dense_shape)
    if isinstance(a, tf.IndexedSlices) or isinstance(b, tf.IndexedSlices):
        a, b = (tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in (a, b))
    return a + b


def _after(grads: list, data: Any) -> Any:
    """`data`, read only once `grads` exist: a micro-batch's forward pass waits for the previous ones'
    gradients (summed, or at stage 2 reduce-scattered), so one micro-batch's activations and whole gradient
    exist at a time. Without it the executor may run the micro-batches side by side (nothing else orders
    them), and every one's gradient waits for its collective at once: at stage 2 on 2 replicas with 2
    micro-batches the step's allocator peak was 448 MiB over its start, against 304 at stage 1."""
    done = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
    with tf.control_dependencies(done):
        return inputs_lib.map_present(tf.identity, data)


class StepFunctions:
    """The compiled training and evaluation executions for one model under one backend."""

    def __init__(self, model: keras.Model, backend: Backend, *, grad_accum_steps: int, step_counter: tf.Variable,
                 jit_compile: bool = False, train_example: Any = None, eval_example: Any = None,
                 partial_last: bool = False, training: bool = True, row_sparse: bool = True,
                 streamed: bool = False, zero: Any = None, one_step: bool = False):
        """``train_example``/``eval_example``: a batch's element structure (`custom_steps.keras_data`),
        for models with a custom ``train_step``/``test_step`` (traced once, `custom_steps.probe`).
        ``training=False``: evaluation only (`tfdist.evaluate`). ``row_sparse``: a sparse input's kernel
        gradient may reach the optimizer row-sparse (`Backend.sum_rows_each_step`). ``streamed``: the input
        may end in an execution (a stream: `execution`). ``zero``: the sharded optimizer state
        (`tfdist.training.zero`) that updates the variables, or None. ``one_step``: every training
        execution runs one step (`one_step_executions`), traced without the step loop."""
        self.model = model
        self.zero = zero
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
        self.gradients = custom_steps.GlobalGradients(custom_steps.optimizers_of(model), backend)
        self.layout = self._custom_layout("train_step", train_example) if self.custom_train else MetricLayout(model)
        self.eval_layout = self._custom_layout("test_step", eval_example) if self.custom_test and \
            eval_example is not None else \
            (MetricLayout(model) if self.custom_train else self.layout)
        self.updated_state: dict[int, Any] = {}  # State the traced forward passes write (ids), for `synced`.
        self._all_shards = {id(shard) for table in sharded_tables(model) for shard in table.shards}
        self._shards = {id(shard) for table in sharded_tables(model) for shard in table.shards
                        if table.embeddings_regularizer is None}
        self.jit_compile = jit_compile
        # XLA compiles one step (as Keras does); the loop around it reads the iterator.
        self._train_step = tf.function(self._distributed_train_step, jit_compile=True) if jit_compile \
            else self._distributed_train_step
        # Bound methods, not lambdas: autograph converts them (and logs no warning holding them).
        self.train_execution = execution(backend, self._train_one, zeros=self._train_totals,
                                         reduce=backend.reduce_sum, streamed=streamed, finish=self._sync_state,
                                         single=one_step)
        self.eval_execution = execution(backend, self._eval_one, zeros=self._eval_totals, reduce=backend.reduce_eval)

    # What `execution` runs: the totals to start from, one step, the state replicas average at the end.
    def _train_totals(self) -> Any:
        return self.backend.run(self._zeros, ())

    def _eval_totals(self) -> Any:
        return self.backend.run_eval(self._eval_zeros, ())

    def _zeros(self) -> tf.Tensor:
        return tf.zeros([self.layout.size], tf.float32)

    def _eval_zeros(self) -> tf.Tensor:
        return tf.zeros([self.eval_layout.size], tf.float32)

    def _train_one(self, data: Any, totals: Any, stop: Any) -> Any:
        return self._train_step(data, tf.convert_to_tensor(stop), totals)

    def _eval_one(self, data: Any, totals: Any) -> Any:
        return self.backend.run_eval(self._replica_eval_step, (data, totals))

    def _sync_state(self) -> None:
        self.backend.sync_replica_state(self.synced)

    def _custom_layout(self, name: str, example: Any) -> MetricLayout:
        plain = MetricLayout(self.model)
        if example is None:
            raise ValueError(f"A model with a custom {name} needs an example batch to trace it.")
        keys = custom_steps.probe(self.model, self.backend, name, example, self.gradients)
        names = set(plain.results(np.zeros(plain.size)))
        return MetricLayout(self.model, keys=keys, logs=LogLayout([k for k in keys if k not in names]))

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
        return synced_state(self.model, self.updated_state)

    # Training ---------------------------------------------------------------
    def _tracked_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool, added: list,
                      mask: Any = None, share: Optional[tf.Tensor] = None):
        """Runs the model's compute_loss and its metric updates; returns (loss, unscaled, metric deltas).

        ``added`` holds the forward pass's ``add_loss`` values (`forward_losses`).
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
                model_losses(model, added), keras_hooks.one_replica_losses(factor):
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
        variables = model.trainable_variables if self.zero is None else self.zero.gradient_sources()
        # The forward pass records what state it updates (written back below).
        # (A frozen ShardedEmbedding table is never written by the forward pass: not read whole here.)
        mapping = [(v, tf_variable(v).read_value()) for v in model.non_trainable_variables
                   if id(v) not in self._all_shards]
        before = {id(v): value for v, value in mapping}
        size = _batch_size(x)
        empty = None if total is None else tf.equal(size, 0)  # A part of a short batch: it adds nothing.
        if self.zero is not None:  # (Stage 3 zeroes its gradient in the backward pass, before the gathers' sums.)
            self.zero.before_backward(empty)
        if total is not None and not global_statistics(model):  # (A synchronized statistic would count the row.)
            x, y, sample_weight = _stand_in_rows(empty, (x, y, sample_weight))
        # This part's fraction of the global batch (without `total` all parts hold as many examples).
        share = tf.cast(size, tf.float32) / (tf.cast(size * self.parts, tf.float32) if total is None else total)
        with tf.GradientTape() as tape:
            forward = RecordingScope(mapping)
            with forward, keras_hooks.synchronized_moments(self.backend.replica_sum()):
                y_pred = model(x, training=True)
                added = forward_losses(model)
            loss, unscaled, deltas = self._tracked_loss(x, y, y_pred, sample_weight, training=True, added=added,
                                                        share=share)
            scaled = self.zero.scale_loss(loss) if self.zero is not None else self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        if empty is not None and (self.zero is None or not self.zero.reduced_in_backward):
            grads = [where_present(empty, g) for g in grads]
        write_state(forward, before, atomic=self.backend.asynchronous, keep=empty,
                    global_state=global_statistics(model))
        self.updated_state.update(forward.updated)
        finite = tf.math.is_finite(unscaled)
        # A part with no example adds nothing (a summed loss divides by its zero share); a non-finite loss counts,
        # as in Keras' metrics (NaN logs after a NaN loss).
        deltas = [tf.where(size > 0, d, tf.zeros_like(d)) for d in deltas]
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

    def _replica_train_step(self, data: Any, stop: tf.Tensor, totals: tf.Tensor) -> tf.Tensor:
        if self.custom_train:
            return custom_steps.train_step(self, data, stop, totals)
        grads, deltas, examples = None, None, 0
        total = None
        if self.partial_last:
            *data, total = data  # The step's global example count (`inputs.train_arrays_fn`).
            data = tuple(data)
        # Sharded at stage 2, each micro-batch is reduced as it ends and only the owned part accumulates.
        reduce_each = self.zero is not None and self.zero.stage >= 2 and self.accum > 1
        overwritten = overwrites.indices(self.model.trainable_variables) if self.zero is None else set()
        present: list[int] = []
        for m, micro in enumerate(self._micro_batches(data)):
            if grads is not None:  # One micro-batch at a time (`_after`).
                micro = _after(grads, micro)
            x, y, sample_weight = _unpack(micro)
            g, d, _, b = self._forward_backward(x, y, sample_weight, total)
            present = [i for i, v in enumerate(g) if v is not None]
            if reduce_each:  # This replica's slices of the micro-batch's summed gradient.
                g = self.zero.reduce(g, tag=f"_m{m}")
            grads = g if grads is None else overwrites.accumulate(grads, g, overwritten, _add_grads)
            deltas = d if deltas is None else [a + c for a, c in zip(deltas, d)]
            examples += b
        # The gradient all-reduce and the user's optimizer applied to the sums (`updates`).
        nonfinite = updates.apply(self.model, self.backend, grads, self.step_counter, data=data,
                                  row_sparse=self.row_sparse, streamed=self.streamed, zero=self.zero,
                                  present=present, reduced=reduce_each, fresh=self.accum == 1)
        share = nonfinite / float(self.backend.num_replicas)
        return self.layout.add_step(totals, [examples, share, stop], deltas)

    def _distributed_train_step(self, data: Any, stop: tf.Tensor, totals: Any) -> Any:
        return self.backend.run(self._replica_train_step, (data, stop, totals))

    # Evaluation -------------------------------------------------------------
    def _eval_updates(self, x: Any, y: Any, y_pred: Any, weight: Any, unscaled: tf.Tensor, mask: tf.Tensor) -> None:
        """Keras' test_step updates; `y_pred` already masks the padding rows (`mask_padding`).

        With the padding masked, ``compute_loss`` on a padded batch is Keras' loss of its
        real examples (each loss divides by what Keras divides by on those examples alone),
        so the tracker weighs it by the real examples, as Keras weighs a batch by its size.
        """
        model = self.model
        model._loss_tracker.update_state(unscaled, sample_weight=tf.reduce_sum(mask))
        if model._compile_metrics is not None:
            model._compile_metrics.update_state(y, y_pred, weight)

    def _replica_eval_step(self, data: Any, totals: tf.Tensor) -> tf.Tensor:
        *element, mask = data  # (x, [y, [sample_weight,]] mask): `inputs.eval_arrays_fn`.
        if self.custom_test:
            return custom_steps.eval_step(self, tuple(element), mask, totals)
        x, y, weight = _unpack(tuple(element))

        def update() -> tf.Tensor:
            y_pred = self.model(x, training=False)
            if mask.shape[0] is not None:  # Static shapes (TPUs): batches may hold padding rows.
                y_pred = mask_padding(y_pred, mask)
            _, _, deltas = self._tracked_loss(x, y, y_pred, weight, training=False,
                                              added=forward_losses(self.model), mask=mask)
            return self.eval_layout.add_step(totals, [tf.reduce_sum(mask), 0.0, 0.0], deltas)

        # The last eval batches of some replicas may be empty (no collectives here).
        return tf.cond(tf.size(mask) > 0, update, lambda: totals)


def one_step_executions(plan: Any) -> bool:
    """Whether every training execution of `plan` (a `LoopPlan`) runs one step (the controller's ``num``)."""
    return plan.steps_per_execution == 1 or (not plan.epoch_steps and plan.steps_per_epoch == 1)


def execution(backend: Backend, step: Callable[..., Any], *, zeros: Callable[[], Any], reduce: Callable[[Any], Any],
              streamed: bool = False, finish: Optional[Callable[[], None]] = None,
              single: bool = False) -> Callable[..., Any]:
    """One compiled execution of ``num_steps`` steps (train, eval and predict alike): ``state = zeros()``, then
    ``state = step(next(iterator), state, *args)`` a step, then ``finish()`` and ``reduce(state)``.

    Steps run one at a time: collectives of two steps in flight at once would collide (Horovod names its
    all-reduces by graph node). ``streamed``: the input may end inside the execution, which then ends there,
    its steps counted (a stream). ``single``: every call runs one step (``num_steps`` 1, checked), traced
    without the step loop, as Keras' one-step ``train_function``: a ``tf.range`` loop around a step holding
    loops of its own (an RNN's) costs several times the step's tracing, graph optimisation and memory (issue
    40). The trace's custom gradients are forgotten after it (`keras_hooks.forgetting_traced_gradients`).
    """
    def run_one(iterator: Any, num_steps: tf.Tensor, *args: Any) -> Any:
        with keras_hooks.forgetting_traced_gradients():
            tf.debugging.assert_equal(num_steps, tf.constant(1, num_steps.dtype), message="a one-step execution")
            state = zeros()
            if streamed:
                element = iterator.get_next_as_optional()
                if element.has_value():
                    state = step(element.get_value(), state, *args)
            else:
                state = step(next(iterator), state, *args)
            if finish is not None:
                finish()
            result = reduce(state)
        return result

    def run(iterator: Any, num_steps: tf.Tensor, *args: Any) -> Any:
        with keras_hooks.forgetting_traced_gradients():
            state = zeros()
            for _ in tf.range(num_steps):
                tf.autograph.experimental.set_loop_options(parallel_iterations=1)
                if streamed:
                    element = iterator.get_next_as_optional()
                    if not element.has_value():
                        break
                    state = step(element.get_value(), state, *args)
                    continue
                # Read each step: a stop requested on a worker mid-execution (a variable) travels with this
                # execution's reduction.
                state = step(next(iterator), state, *args)
            if finish is not None:
                finish()
            result = reduce(state)
        return result

    return backend.compile(run_one if single else run)
