"""Refusals before any step: the model, its scope, custom steps, metrics, composite inputs, batches and XLA."""

from __future__ import annotations

import hashlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.errors import UserError
from tfdist.training import custom_steps, plan as plan_lib
from tfdist.training.plan import LoopPlan
from tfdist.training.sources import Source


def check_composite(source: Source, backend: Backend, grad_accum_steps: int) -> None:
    """Sparse and ragged inputs: not on a TPU (one static shape) nor cut into micro-batches."""
    leaves = tf.nest.flatten(source.arrays.structure) if source.arrays is not None else \
        tf.nest.flatten(source.spec) if source.spec is not None else []
    if not any(isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor, tf.SparseTensorSpec, tf.RaggedTensorSpec))
               for leaf in leaves):
        return
    if backend.device_kind == "tpu":
        raise UserError("The inputs hold a SparseTensor or RaggedTensor, and a TPU compiles one static shape for every "
                        "batch; pad them to dense arrays (tf.sparse.to_dense, RaggedTensor.to_tensor) for a TPU.")
    if grad_accum_steps > 1:
        raise UserError(f"The inputs hold a SparseTensor or RaggedTensor, which tfdist does not cut into "
                        f"grad_accum_steps={grad_accum_steps} micro-batches; use grad_accum_steps=1 (or dense inputs).")


def check_scope(model: keras.Model, backend: Backend) -> None:
    """The model's and its optimizer's variables are all the training strategy's (make_strategy's or the
    program's own: `tfdist.distribute.adopting`)."""
    extended = getattr(backend.strategy, "extended", None)
    if backend.strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        strategy_default = True
    else:
        strategy_default = False
    for variable in list(model.weights) + custom_steps.optimizer_variables(model):  # None for an uncompiled model.
        value = tf_variable(variable)
        if strategy_default or extended is None:
            if isinstance(value, tf.distribute.DistributedValues):
                owner = type(getattr(value, "_distribute_strategy", None)).__name__
                raise UserError(
                    f"The model's variable {variable.path} belongs to a {owner}, but this call trains under "
                    f"tfdist's {backend.name} strategy (strategy=, or the last tfdist.make_strategy), which cannot "
                    "update it. Pass the strategy the model was built under as strategy= (any tf.distribute "
                    "strategy is taken), or leave strategy= out (tfdist then takes the model's), or build and "
                    "compile the model under the scope of the strategy you train with.")
            continue
        if not extended.variable_created_in_scope(value):
            raise UserError(
                f"The model was not built under the strategy's scope (variable {variable.path} is not "
                f"{type(backend.strategy).__name__}'s). Build and compile it inside `with strategy.scope():` "
                "with the strategy you train with (the one passed as strategy=, else the one the model's "
                "first variables were made under).")


def why_even(backend: Backend, source: Source) -> str:
    """Why this run needs a global batch the replicas (and micro-batches) divide, or "" if it does not."""
    if backend.device_kind == "tpu":
        return "a TPU compiles one batch shape for every replica"
    if not backend.sharded_input:
        return "parameter-server workers each train whole per-replica batches"
    if source.kind == "dataset_fn":
        return "the dataset function batches per replica (input_context.get_per_replica_batch_size)"
    return ""


def check_short_custom_step(model: keras.Model, backend: Backend, plan: LoopPlan, examples: int) -> None:
    """A custom step on a replica with no example would average over nothing (NaN logs and layer state)."""
    if plan.global_batch < backend.num_replicas and custom_steps.overrides(model, "train_step"):
        raise UserError(
            f"batch_size={plan.global_batch} is smaller than the number of replicas ({backend.num_replicas}), so a "
            f"replica would run {type(model).__name__}.train_step() on no example at every step (its means, "
            "trackers and BatchNormalization statistics would become NaN). Use a batch_size of at least "
            f"{backend.num_replicas}.")
    left = examples % plan.global_batch
    if plan.partial_last and custom_steps.overrides(model, "train_step") and 0 < left < backend.num_replicas:
        raise UserError(
            f"The last batch of each epoch holds {left} example(s), fewer than the {backend.num_replicas} replicas, "
            f"so a replica would run {type(model).__name__}.train_step() on no example (its means, trackers and "
            "BatchNormalization statistics would become NaN). Use a batch_size that leaves at least one example "
            "per replica in the last batch (or none), or pass steps_per_epoch= (whole batches).")


def local_replicas(backend: Backend) -> int:
    try:
        return len(backend.strategy.extended.worker_devices) or 1
    except (AttributeError, RuntimeError):  # The default strategy has none: one device.
        return 1


def resolve_jit(jit_compile: Any, backend: Backend, model: keras.Model) -> bool:
    """XLA for the step: "auto" is what Keras' own ``fit`` would use, where tfdist can run it; refused clearly.

    "auto" takes the model's ``jit_compile``: the value given to ``compile`` or, for
    ``compile(jit_compile="auto")``, Keras' resolution of it (keras/src/trainers/trainer.py
    ``_resolve_auto_jit_compile``: off on CPU-only machines, off for a model built under a
    tf.distribute scope, off unless ``model_supports_jit``: every layer ``supports_jit``, op
    determinism off). tfdist then keeps it off where it cannot run XLA: several replicas in
    one process, Horovod, loss scaling, multi-worker CPU collectives, and TPUs (TPUStrategy
    compiles every step with XLA itself). ``True`` is refused in those cases, and for a model
    Keras would not compile (Keras warns and proceeds without XLA).
    """
    from keras.src.trainers.trainer import model_supports_jit
    from tensorflow.python.framework.config import is_op_determinism_enabled  # What Keras reads.

    if jit_compile not in ("auto", True, False):
        raise UserError(f"jit_compile={jit_compile!r} must be 'auto', True or False.")
    loss_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    single = local_replicas(backend) == 1 and backend.name != "horovod"
    # XLA-compiled cross-worker collectives on CPU abort the process (SIGABRT, double free; TF 2.21).
    cpu_workers = backend.device_kind == "cpu" and backend.num_workers > 1 and not backend.asynchronous
    supported = model_supports_jit(model)
    if jit_compile == "auto":
        return bool(model.jit_compile) and supported and single and not loss_scaled and not cpu_workers \
            and backend.device_kind != "tpu"
    if jit_compile and not single:
        raise UserError(
            f"XLA (jit_compile) is supported here with one replica per process; this {backend.name} backend has "
            f"{local_replicas(backend)} local replica(s){' (Horovod ops are not XLA ops)' if backend.name == 'horovod' else ''}"
            ". Use --jit_compile=auto/false, or one process per device (multi_worker_mirrored).")
    if jit_compile and cpu_workers:
        raise UserError(
            f"XLA (jit_compile=True) on a multi-worker CPU job ({backend.num_workers} workers) is refused: TensorFlow "
            "aborts the workers (SIGABRT, double free) in XLA-compiled collectives on CPUs. Use jit_compile='auto' "
            "or False on CPUs (XLA is also slower there), or XLA on GPU workers.")
    if jit_compile and loss_scaled and backend.num_replicas > 1:
        raise UserError("XLA (jit_compile) with loss scaling (mixed_float16) across several replicas hits an upstream "
                        "Keras bug (keras-team/keras#21366); use --precision=mixed_bfloat16 (no loss scaling), or "
                        "--jit_compile=false.")
    if jit_compile and not supported:
        layers = [f"{layer.name} ({type(layer).__name__})" for layer in model._flatten_layers()
                  if not layer.supports_jit]
        why = (f"layer(s) {', '.join(layers)} do not support XLA (supports_jit=False)" if layers else
               "TensorFlow op determinism is enabled (tf.config.experimental.enable_op_determinism), which XLA "
               "does not support" if is_op_determinism_enabled() else
               "Keras does not support XLA for it on this platform")
        raise UserError(f"jit_compile=True, but the model cannot be compiled with XLA: {why}. Keras' fit would warn "
                        "and train without XLA; pass jit_compile='auto' or False to tfdist.fit.")
    return bool(jit_compile)


def check_model(model: keras.Model) -> None:
    """Refuses models tfdist cannot train faithfully, before any step."""
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise UserError("The model is not compiled; call model.compile(optimizer=..., loss=..., metrics=...) under "
                        "the strategy's scope before tfdist.fit.")


def check_ema_overwrite(model: keras.Model, backend: Backend) -> None:
    """Refuses `ema_overwrite_frequency` under several tf.distribute replicas, before any step.

    Keras' optimizer overwrites the weights with their averages inside a `tf.cond` that holds a `merge_call`,
    which TensorFlow refuses in a replica context: Keras' own `fit` under the same strategy fails mid-trace.
    """
    from tfdist.training.keras_hooks import wrapped_optimizers

    strategy = getattr(backend, "strategy", None)
    if strategy is None or int(strategy.num_replicas_in_sync) < 2:
        return
    for opt in wrapped_optimizers(model.optimizer):
        if getattr(opt, "use_ema", False) and getattr(opt, "ema_overwrite_frequency", None):
            raise UserError(
                f"{type(opt).__name__}(use_ema=True, ema_overwrite_frequency={opt.ema_overwrite_frequency}) cannot "
                f"run on {strategy.num_replicas_in_sync} replicas of a tf.distribute strategy: Keras overwrites the "
                "weights with their averages inside a tf.cond that holds a merge_call, which TensorFlow refuses "
                "in a replica context (Keras' own fit fails the same way). Leave ema_overwrite_frequency=None "
                "(fit ends on the averages, as Keras' does), add keras.callbacks.SwapEMAWeights, or train under "
                "Horovod.")


def check_custom_steps(model: keras.Model, backend: Backend, *, grad_accum_steps: int) -> None:
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
            raise UserError(
                f"{what} with {'a LossScaleOptimizer' if scaled else 'a weight constraint (' + constrained[0] + ')'}; "
                "under parameter servers a custom step's updates are applied only if the step's claim holds, and "
                "the state those update alongside cannot be written there. Train in float32 without weight "
                "constraints, or with MultiWorkerMirroredStrategy or Horovod.")
    if "train_step" in custom and grad_accum_steps > 1:
        raise UserError(f"{what}; grad_accum_steps={grad_accum_steps} would have to split the user's step into "
                        "micro-batches, which tfdist cannot do inside code it does not own. Use grad_accum_steps=1 "
                        "(a larger batch over more replicas trains the same global batch).")


def check_metrics(model: keras.Model) -> None:
    """Refuses metrics whose state cannot be summed across replicas (call once the model is built).

    Summed state is exact: float sums and counts (Mean-, Sum- and confusion-count-based metrics)
    and integer counts (the IoU family's int64 confusion matrix), which travel in the float32
    totals and are exact while a count stays below 2**24 per execution.
    """
    for metric in model.metrics:
        for variable in metric.variables:
            summable = variable.dtype.startswith(("float", "int", "uint"))
            if not summable or variable.aggregation != "sum":
                raise UserError(
                    f"Metric {variable.path.split('/')[0]!r} keeps state ({variable.path}, {variable.dtype}, aggregation "
                    f"{variable.aggregation}) that cannot be summed across replicas; tfdist.fit supports metrics "
                    "whose state is sums or counts (aggregation 'sum': Keras' Mean-, Sum-, confusion-count- and "
                    "IoU-based metrics). Give the metric's add_variable(aggregation='sum') state that adds up "
                    "over batches, or compute it after training.")


def check_agreement(backend: Backend, plan: LoopPlan, step: int, precision: str, every_secs: float) -> None:
    """All tasks compare (step, plan, precision) before the first step; a mismatch fails all of them."""
    if backend.single_controller:
        return
    # Time-based checkpoints gather once at a step every task must reach alike: on or off everywhere.
    mine = np.array([backend.worker_index, step, plan.digest(),
                     int(hashlib.sha256(precision.encode()).hexdigest()[:7], 16), int(every_secs > 0)], np.int64)
    table = backend.gather_from_tasks(mine)
    rows = sorted({tuple(int(v) for v in row) for row in table})
    if len({row[1:] for row in rows}) == 1:
        return
    steps = ", ".join(f"worker {r[0]} step {r[1]}" for r in rows)
    if len({r[1] for r in rows}) > 1:
        raise UserError(
            f"The workers restored different checkpoints ({steps}): is --workdir on storage every machine "
            "shares? Point every worker at the same shared --workdir, and a BackupAndRestore at a backup_dir they "
            "all share (or start them all from scratch in a new one).")
    if len({r[2] for r in rows}) > 1:  # Every task sees the same table: all gather the plans together.
        raise UserError(
            f"The workers disagree about the plan (batch sizes, steps, seed, learning rate, dataset): tasks "
            f"{', '.join(f'worker {r[0]}' for r in rows)} resolved different values: "
            f"{plan_lib.plan_differences(plan_lib.task_plans(backend, plan))}. Start every worker with the same "
            "command, flags and software on the same kind of machine; where num_train or the steps differ, the "
            "workers read different training data (files still being written, or a path that differs by machine).")
    what = f"precision policy (this task: {precision})" if len({r[3] for r in rows}) > 1 \
        else f"time-based checkpoints (checkpoint_every_secs: {every_secs:g} on this task)"
    raise UserError(
        f"The workers disagree about the {what}: tasks {', '.join(f'worker {r[0]}' for r in rows)} resolved "
        "different values. Start every worker with the same command, flags and software on the same kind of "
        "machine.")


def _check_row_sparse(model: keras.Model, inner: Any, stage: int) -> None:
    """Stages 1 and 2 reduce-scatter an Embedding's row-sparse gradient dense: exact where Keras' optimizer
    also updates from it as from its dense form (SGD, with or without momentum, unclipped; measured 3e-8 from
    Keras). Keras' Adam, RMSprop and the other slots otherwise move only the rows a batch touches (stage 1
    ended 0.029 from Keras after 20 steps with Adam, 0.066 with RMSprop), and Keras clips the rows as they
    come, a repeated id's apart, where the dense gradient has summed them (a norm or value clip that triggers:
    4e-5 to 2e-3 from Keras). Stage 3 checks each gradient as its step is traced (`gathering`)."""
    if sparse_exact(inner):
        return
    tables = [layer.name for layer in model._flatten_layers()
              if isinstance(layer, keras.layers.Embedding) and layer.trainable]
    if tables:
        raise UserError(f"zero_stage={stage} cannot shard {type(inner).__name__} for the Embedding layer "
                        f"{tables[0]!r}: {SPARSE_WHY} Use keras.optimizers.SGD (momentum too) without clipping, "
                        "freeze the table, or use zero_stage=0 for this model.")


SPARSE_WHY = ("its gradient is row-sparse, and Keras updates from the rows a batch touches (an optimizer's slots "
              "move for those rows only; a clip counts a repeated id's rows apart), while the reduce-scatter of "
              "flat shards carries the gradient dense (repeated ids summed, every row's state moved).")


def sparse_exact(inner: Any) -> bool:
    """Whether Keras' optimizer updates from a row-sparse gradient as from its dense form (`_check_row_sparse`):
    keras.optimizers.SGD itself (momentum too), unclipped."""
    return type(inner) is keras.optimizers.SGD and not (inner.clipnorm or inner.global_clipnorm or inner.clipvalue)


def check_zero(model: keras.Model, backend: Backend, stage: Any, callbacks: Any = None,
               grad_accum_steps: int = 1) -> None:
    """What a sharded optimizer state (`zero_stage`, `tfdist.training.zero`) cannot do, refused before any step."""
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise UserError(f"zero_stage={stage!r} must be 0 (every replica holds the whole optimizer state), 1 "
                        "(the optimizer state sharded over the replicas), 2 (the gradients too) or 3 (the weights "
                        "too); see docs/sharding.md.")
    if stage == 0:
        return
    where = "parameter servers (the optimizer state already lives on the ps tasks, sharded by variable)" \
        if backend.asynchronous else "a TPU (its step is traced once for every core, so a core cannot keep its " \
        "own part)" if backend.device_kind == "tpu" else ""
    if where:
        raise UserError(f"zero_stage={stage} is not supported on {where}. Use zero_stage=0 there, or a "
                        "synchronous strategy (mirrored, multi_worker_mirrored, horovod).")
    if custom_steps.overrides(model, "train_step"):
        raise UserError(f"zero_stage={stage} cannot shard the optimizer of {type(model).__name__}, whose custom "
                        "train_step calls its optimizer itself (tfdist cannot give it a part of the variables). "
                        "Use zero_stage=0, or move the update into compile()'s loss and Keras' own train_step.")
    optimizer = model.optimizer
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    from tfdist.training.keras_hooks import wrapped_optimizers

    if not isinstance(inner, keras.optimizers.Optimizer) or \
            isinstance(inner, keras.optimizers.LossScaleOptimizer) or len(wrapped_optimizers(inner)) > 1:
        raise UserError(f"zero_stage={stage} shards a Keras optimizer (keras.optimizers.*, or one loss scale "
                        f"around one); {type(inner).__name__} is not one (an optimizer of optimizers, such as "
                        "MultiOptimizer, is not sharded). Use zero_stage=0.")
    from tfdist.layers.sharded_embedding import sharded_tables

    if sharded_tables(model):
        raise UserError(f"zero_stage={stage} cannot shard a model with ShardedEmbedding tables: their row-sparse "
                        "updates are the user's optimizer's, patched per table, which the sharded copies do not "
                        "carry. Use zero_stage=0 (the tables are already sharded over parameter servers).")
    swap = [c for c in callbacks or () if isinstance(c, keras.callbacks.SwapEMAWeights)]
    if swap:
        raise UserError(f"zero_stage={stage} cannot run keras.callbacks.SwapEMAWeights: it swaps the model's weights "
                        "with the averages in model.optimizer, and a sharded run keeps them in each replica's part "
                        "instead (the user's optimizer holds none during the fit). Drop the callback (fit ends on "
                        "the averages with use_ema=True, as Keras' does), or use zero_stage=0.")
    if stage >= 2 and grad_accum_steps > 1 and getattr(backend, "op", None) == "adasum":
        raise UserError(f"zero_stage={stage} with grad_accum_steps={grad_accum_steps} would combine each "
                        "micro-batch's gradients by Adasum, which is not the Adasum of their sum. Use zero_stage=1 "
                        "(one Adasum a step) or --hvd_op=average.")
    from tfdist.training.zero.optimizer import check_supported, check_variables

    check_supported(inner)
    check_variables(model.trainable_variables, stage)
    if stage in (1, 2):
        _check_row_sparse(model, inner, stage)
    if stage == 3:
        from tfdist.training.zero import collectives, gathering

        gathering.check(model)
        if collectives.path(backend) == "all_reduce":
            raise UserError("zero_stage=3 gathers each layer's weights with collective ops inside the backward "
                            "pass, which MirroredStrategy with all_reduce='reduce_to_one' (or NCCL) does not "
                            "offer. Use its default collective all-reduce, MultiWorkerMirroredStrategy or "
                            "Horovod, or zero_stage=2.")
    if (inner.global_clipnorm or inner.clipnorm) and inner.gradient_accumulation_steps:
        which = "global_clipnorm" if inner.global_clipnorm else "clipnorm"
        raise UserError(f"zero_stage={stage} cannot apply {type(inner).__name__}({which}=..., "
                        "gradient_accumulation_steps=...): the norm is of the gradients the optimizer "
                        "accumulates, which no replica holds whole. Use tfdist.fit(grad_accum_steps=...) instead "
                        "of the optimizer's accumulation, or zero_stage=0.")
