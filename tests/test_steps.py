"""tfdist.training.steps: what one compiled training step does, counted while it is traced.

Per step the only cross-replica reduction is the gradient all-reduce (one
grouped call, whatever the number of variables); loss and metric sums are
reduced once per execution. Keras' own gradient sum is off, so the gradients
are not summed twice, and the float16 finite check needs no extra collective:
it reads the already all-reduced gradients.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.training import steps as steps_lib
from tfdist.distribute import strategies

MIRRORED = {"all_reduce": "reduce_to_one"}  # In-process strategies: see test_fitting.py.


class Counter:
    def __init__(self, monkeypatch):
        self.replica_all_reduce = 0
        self.cross_replica_reduce = 0
        original_all_reduce = tf.distribute.ReplicaContext.all_reduce
        original_reduce = tf.distribute.MirroredStrategy.reduce

        def all_reduce(context, op, value, options=None):
            self.replica_all_reduce += 1
            return original_all_reduce(context, op, value, options)

        def reduce(strategy, op, value, axis):
            self.cross_replica_reduce += 1
            return original_reduce(strategy, op, value, axis)

        monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", all_reduce)
        monkeypatch.setattr(tf.distribute.MirroredStrategy, "reduce", reduce)


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_one_gradient_all_reduce_per_step_and_one_reduction_per_execution(monkeypatch, precision):
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision=precision, **MIRRORED)
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(3, dtype="float32")])
            model.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=1.0),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2)])
        x, y = np.random.default_rng(0).random((64, 4), np.float32), np.arange(64) % 3
        model._symbolic_build(data_batch=(x[:2], y[:2], None))
        backend = strategies.backend_of(strategy)
        with strategy.scope():
            counter_var = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        functions = steps_lib.StepFunctions(model, backend, grad_accum_steps=1, step_counter=counter_var)
        dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
        counter = Counter(monkeypatch)
        functions.train_chunk.get_concrete_function(iter(dataset), tf.TensorSpec([], tf.int64),
                                                    tf.TensorSpec([], tf.float32))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    # The loop body is traced once and runs once per step: one all-reduce call per replica for the
    # gradients (all variables in one call); one cross-replica reduction for the execution's sums.
    assert counter.replica_all_reduce == 2, counter.replica_all_reduce
    assert counter.cross_replica_reduce == 1, counter.cross_replica_reduce


def test_models_with_custom_train_step_or_unsummable_metrics_are_refused():
    class Custom(keras.Model):
        def train_step(self, data):
            return {}

    inputs = keras.Input((2,))
    model = Custom(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tfdist.UserError, match="overrides train_step"):
        steps_lib.check_model(model, tfdist.UserError)

    class ComputeLoss(keras.Model):  # Honoured: tfdist calls compute_loss.
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    fine = ComputeLoss(inputs, keras.layers.Dense(1)(inputs))
    fine.compile(optimizer="sgd", loss="mse")
    steps_lib.check_model(fine, tfdist.UserError)
