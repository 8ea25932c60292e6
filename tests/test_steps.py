"""tfdist.training.steps: what one compiled training step does, counted while it is traced.

Per step the only cross-replica reduction is the gradient all-reduce (one
grouped call, whatever the number of variables); loss and metric sums are
reduced once per execution. Keras' own gradient sum is off, so the gradients
are not summed twice, and the float16 finite check needs no extra collective:
it reads the already all-reduced gradients.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.training import checks, steps as steps_lib
from tests.conftest import REPO
from tests.test_horovod import horovodrun, needs_horovod
from tfdist.distribute import strategies
from tfdist.distribute.backend import tf_variable

MIRRORED = {"all_reduce": "reduce_to_one"}  # In-process strategies: see test_fitting.py.
pytestmark = pytest.mark.keras_internals  # The TF 2.18 session runs these too (tests/conftest.py).


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
        functions.train_execution.get_concrete_function(iter(dataset), tf.TensorSpec([], tf.int64),
                                                    tf.TensorSpec([], tf.float32))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    # The loop body is traced once and runs once per step: one all-reduce call per replica for the
    # gradients (all variables in one call); one cross-replica reduction for the execution's sums.
    assert counter.replica_all_reduce == 2, counter.replica_all_reduce
    assert counter.cross_replica_reduce == 1, counter.cross_replica_reduce


def test_uncompiled_models_are_refused_and_compute_loss_overrides_honoured():
    inputs = keras.Input((2,))
    with pytest.raises(tfdist.UserError, match="The model is not compiled"):
        checks.check_model(keras.Model(inputs, keras.layers.Dense(1)(inputs)))

    class ComputeLoss(keras.Model):  # Honoured: tfdist calls compute_loss.
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    fine = ComputeLoss(inputs, keras.layers.Dense(1)(inputs))
    fine.compile(optimizer="sgd", loss="mse")
    checks.check_model(fine)


# Exact scaling: every part's loss is Keras' one-device loss, scaled by tfdist alone ----------------
def regression_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def batches(x, y, batch=32):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


class MeanComputeLoss(keras.Model):
    """A compute_loss override that returns a plain mean (no division by replicas), as users write them."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred - y))


def small_model(cls=keras.Model, loss="mse", lr=0.1, **dense):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0),
                                **dense)(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))(hidden)
    model = cls(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
    return model


def keras_one_device(build, x, y, epochs=1):
    tfdist.make_strategy("default", precision="float32")
    model = build()
    history = model.fit(batches(x, y), epochs=epochs, shuffle=False, verbose=0).history
    return model.get_weights(), history


def tfdist_weights(build, x, y, strategy_name, grad_accum_steps=1, epochs=1, **options):
    strategy = tfdist.make_strategy(strategy_name, precision="float32", **options)
    with strategy.scope():
        model = build()
    history = tfdist.fit(model, batches(x, y), epochs=epochs, grad_accum_steps=grad_accum_steps, verbose=0).history
    return model.get_weights(), history


def assert_same_training(expected, got, start):
    (want, want_history), (have, have_history) = expected, got
    for a, b in zip(want, have):
        np.testing.assert_allclose(b, a, atol=1e-5)
    # SGD moved the weights far more than the tolerance: a wrong scale would show.
    assert max(float(np.max(np.abs(a - s))) for a, s in zip(want, start)) > 1e-2
    np.testing.assert_allclose(have_history["loss"], want_history["loss"], rtol=1e-5)


def test_a_compute_loss_override_returning_a_plain_mean_trains_as_on_one_device():
    x, y = regression_data()
    build = lambda: small_model(MeanComputeLoss)  # noqa: E731
    expected = keras_one_device(build, x, y)
    got = tfdist_weights(build, x, y, "mirrored", num_cpu_replicas=2, **MIRRORED)
    assert_same_training(expected, got, build().get_weights())


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_sum_loss_with_accumulation_trains_as_on_one_device(replicas):
    # reduction="sum" counts whole in every part; the weight regulariser once per step, the activity
    # regulariser (a batch mean in Keras 3) by each part's share of the examples.
    x, y = regression_data()
    build = lambda: small_model(loss=keras.losses.MeanSquaredError(reduction="sum"), lr=0.002,  # noqa: E731
                                kernel_regularizer=keras.regularizers.L2(0.5),
                                activity_regularizer=keras.regularizers.L2(0.5))
    expected = keras_one_device(build, x, y)
    options = {"num_cpu_replicas": 2, **MIRRORED} if replicas == 2 else {}
    got = tfdist_weights(build, x, y, "mirrored" if replicas == 2 else "default", grad_accum_steps=2, **options)
    assert_same_training(expected, got, build().get_weights())


class FirstRowScaled(keras.layers.Layer):
    """Reads the batch's first row, as Equalization does: a batch of no example fails (strided_slice)."""

    def call(self, x):
        return x - 0.5 * x[0]


def test_a_replica_with_no_example_runs_layers_that_need_a_row_and_trains_as_on_one_device():
    # Batches of one example on 2 replicas: the second replica's part is empty at every step.
    x, y = regression_data(n=6)

    def build():
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))(
            FirstRowScaled()(inputs))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    tfdist.make_strategy("default", precision="float32")
    model = build()
    want = model.fit(x, y, batch_size=1, shuffle=False, verbose=0).history, model.get_weights()
    strategy = tfdist.make_strategy("mirrored", precision="float32", num_cpu_replicas=2, **MIRRORED)
    with strategy.scope():
        model = build()
    got = tfdist.fit(model, x, y, batch_size=1, shuffle=False, verbose=0).history, model.get_weights()
    assert_same_training(want[::-1], got[::-1], build().get_weights())


def test_losses_no_scaling_can_make_exact_are_refused_when_the_batch_is_split():
    x, y = regression_data()
    strategy = tfdist.make_strategy("default", precision="float32")
    with strategy.scope():
        model = small_model(loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    with pytest.raises(tfdist.UserError, match=r"reduction mean_with_sample_weight, which divides by each part's "
                                               r"own sample-weight sum .* split over 2 parts"):
        tfdist.fit(model, batches(x, y), grad_accum_steps=2, verbose=0)
    tfdist.fit(model, batches(x, y), verbose=0)  # One part: exact, so accepted.

    inputs = keras.Input((4,))
    two = keras.Model(inputs, [keras.layers.Dense(1, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)])
    two.compile(optimizer="sgd", loss=["mse", keras.losses.MeanAbsoluteError(reduction="sum")])
    with pytest.raises(tfdist.UserError, match=r"The compiled losses mix reductions \(sum, sum_over_batch_size\)"):
        tfdist.fit(two, tf.data.Dataset.from_tensor_slices((x, (y, y))).batch(32, drop_remainder=True),
                   grad_accum_steps=2, verbose=0)

    class Extends(keras.Model):  # Calls the compiled (sum) loss and adds to it: the sum cannot be found.
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs) + 1.0

    with strategy.scope():
        override = small_model(Extends, loss=keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(tfdist.UserError, match="overrides compute_loss.. and compiles a reduction='sum' loss"):
        tfdist.fit(override, batches(x, y), grad_accum_steps=2, verbose=0)


# The user's optimizer and Keras' module state are left as they were ------------------------------
def loss_module_functions():
    from keras.src.losses import loss as loss_module

    return loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution


def attributes(obj):
    return {k: v for k, v in vars(obj).items()}


def assert_unchanged(obj, before):
    now = vars(obj)
    assert set(now) == set(before), set(now) ^ set(before)
    changed = [k for k, v in before.items() if now[k] is not v and not (isinstance(v, (bool, int, float, str))
                                                                          and now[k] == v)]
    assert not changed, changed


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_optimizer_is_unchanged_after_fit_and_trains_on_with_keras_like_a_fresh_one(asynchronous):
    x, y = regression_data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    backend = strategies.backend_of(strategy)
    with strategy.scope():
        model = small_model()
        model.optimizer.build(model.trainable_variables)
    optimizer, counter = model.optimizer, model.optimizer._iterations
    before, counter_before, functions = attributes(optimizer), attributes(counter), loss_module_functions()
    backend.asynchronous = asynchronous  # The parameter-server path's hooks (atomic counters), in this process.
    try:
        tfdist.fit(model, batches(x, y), verbose=0)
    finally:
        backend.asynchronous = False
    assert type(optimizer) is keras.optimizers.SGD and int(counter.numpy()) == 2
    assert_unchanged(optimizer, before)
    assert_unchanged(counter, counter_before)
    assert loss_module_functions() == functions
    # Keras' own fit on 2 replicas goes on from there exactly as with a fresh model and optimizer.
    with strategy.scope():
        fresh = small_model()
        fresh.set_weights(model.get_weights())
        for net in (model, fresh):
            net.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(fresh.get_weights(), small_model().get_weights()))
    assert moved > 1e-2
    for a, b in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def failing_constraint(weights):
    raise RuntimeError("constraint failed while the optimizer applied the update")


def test_a_failing_fit_leaves_keras_and_the_optimizer_as_they_were():
    x, y = regression_data()
    functions = loss_module_functions()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():  # Fails inside optimizer.apply, i.e. with every hook of tfdist's step entered.
        model = small_model(kernel_constraint=failing_constraint)
        model.optimizer.build(model.trainable_variables)
    before = attributes(model.optimizer)
    with pytest.raises(RuntimeError, match="constraint failed"):
        tfdist.fit(model, batches(x, y), verbose=0)
    assert loss_module_functions() == functions
    assert_unchanged(model.optimizer, before)


# State sync: only what the forward pass updates ------------------------------------------------
def test_frozen_weights_are_not_all_reduced_and_batch_norm_statistics_agree():
    x, y = regression_data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    backend = strategies.backend_of(strategy)
    with strategy.scope():
        inputs = keras.Input((4,))
        frozen = keras.layers.Dense(8, name="frozen")
        normalised = keras.layers.BatchNormalization(name="bn")(frozen(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(normalised))
        frozen.trainable = False
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    # Give each replica's copy of the frozen kernel its own values: an all-reduce would average them.
    copies = tf_variable(frozen.kernel).values
    copies[1].assign(copies[0] * 2.0)
    set_to = [np.asarray(c) for c in copies]
    tfdist.fit(model, batches(x, y), epochs=2, verbose=0)
    for copy, value in zip(copies, set_to):
        np.testing.assert_array_equal(np.asarray(copy), value)
    moving = [v for v in model.non_trainable_variables if "moving" in v.path]
    assert len(moving) == 2
    for variable in moving:
        first, second = backend.local_replica_values(variable)
        np.testing.assert_array_equal(first, second)
        assert np.abs(first).sum() > 0


@needs_horovod
def test_horovod_ranks_scale_losses_as_one_device(tmp_path):
    result = horovodrun([sys.executable, os.path.join(REPO, "tests", "scaling_probe.py"), str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case in ("compute_loss_mean", "sum_accumulated"):
            assert report[case]["max_diff"] < 1e-5 and report[case]["moved"] > 1e-2, (rank, case, report)


class KeptMeanSquaredError(keras.metrics.MeanSquaredError):
    """A metric whose reset_state keeps its state (Keras' trainer_test.py has one): epochs add up."""

    def reset_state(self):
        pass


def test_metric_states_open_and_close_each_epoch_and_evaluation_as_keras():
    """Keras' reset_metrics at each epoch and evaluation: a metric's own reset_state decides where it starts
    (one that keeps its state goes on adding, across fit's validation too), and after fit and evaluate the
    metrics hold what Keras' would; 2 replicas against Keras' own fit on one device."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.normal(size=(24, 1)).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                      metrics=[KeptMeanSquaredError(name="kept"), "mae"])
        return model

    def state(model):
        return [np.asarray(v) for m in model.metrics for v in m.variables]

    reference = build()
    expected = reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                             validation_data=(x[:8], y[:8])).history
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = build()
    history = tfdist.fit(model, x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                         validation_data=(x[:8], y[:8])).history
    assert sorted(history) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5, err_msg=key)
    assert abs(expected["kept"][2] - expected["loss"][2]) > 1e-3  # The kept state really spans the epochs.
    for a, b in zip(state(model), state(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    np.testing.assert_allclose(tfdist.evaluate(model, x, y, batch_size=8, verbose=0),
                               reference.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
    for a, b in zip(state(model), state(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def _top_level_loops(function) -> list:
    """The While ops at the top of each graph `function` (a tf.function) traced."""
    return [op.type for concrete in function._list_all_concrete_functions()
            for op in concrete.graph.get_operations() if op.type in ("While", "StatelessWhile")]


@pytest.mark.parametrize("source", ["arrays", "generator", "ending generator"])
def test_a_one_step_execution_is_traced_once_without_the_step_loop_and_trains_as_on_one_device(monkeypatch, source):
    # Issue 40: a fit whose executions each run one step (steps_per_epoch=1, as Keras' run_layer_test) traced
    # its step inside a tf.range loop; around a step with loops of its own (an RNN) that loop cost 2-3x
    # Keras' tracing and graph optimisation time and ~3x its memory, never returned, on every fit of a new model.
    x, y = regression_data()
    built = []
    original = steps_lib.StepFunctions.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(steps_lib.StepFunctions, "__init__", recording)

    def generator():
        while True:
            yield x, y
            if source == "ending generator":  # Ends in the second epoch's one-step execution.
                return

    def run(fit, model):
        if source == "arrays":  # One batch of all the examples: one step an epoch.
            return fit(model, x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
        return fit(model, generator(), steps_per_epoch=1, epochs=2, verbose=0)  # A stream.

    tfdist.make_strategy("default", precision="float32")
    reference = small_model()
    start = reference.get_weights()
    want = run(lambda m, *a, **k: m.fit(*a, **k), reference).history
    strategy = tfdist.make_strategy("mirrored", precision="float32", num_cpu_replicas=2, **MIRRORED)
    with strategy.scope():
        model = small_model()
    have = run(tfdist.fit, model).history
    assert_same_training((reference.get_weights(), want), (model.get_weights(), have), start)
    (steps,) = built
    assert steps.train_execution.experimental_get_tracing_count() == 1
    assert _top_level_loops(steps.train_execution) == []
