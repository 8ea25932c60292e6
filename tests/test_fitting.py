"""tfdist.training.fitting (tfdist.fit) and make_strategy: any compiled Keras 3 model, in this process.

Equivalence tests use plain SGD: Adam's update ignores a constant factor on
every gradient, so it would hide a wrong division by the replica count.
"""

import importlib.util
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import REPO
from tfdist.mnist import data
from tfdist.distribute import strategies

DIGITS = data.load_dataset("mnist")


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = load_example("dict_inputs")


def dense_model(seed=0, optimizer=None, **compile_args):
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(32, activation="relu",
                                                 kernel_initializer=keras.initializers.GlorotUniform(seed)),
                              keras.layers.Dense(10, kernel_initializer=keras.initializers.GlorotUniform(seed + 1))])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  **compile_args)
    return model


# Collective all-reduces of different strategy instances collide in one process (TensorFlow keys
# them per instance); real runs have one strategy, and the examples run the default all-reduce
# in their own processes (test_examples.py). In this process, mirrored runs reduce to one device.
MIRRORED = {"all_reduce": "reduce_to_one"}

X = DIGITS.train_images[:2048].astype("float32") / 255.0
Y = DIGITS.train_labels[:2048]


def sgd_weights(name, grad_accum_steps=1, **options):
    strategy = tfdist.make_strategy(name, precision="float32", **options)
    with strategy.scope():
        model = dense_model(optimizer=keras.optimizers.SGD(0.5, clipnorm=None))
    tfdist.fit(model, X, Y, batch_size=64, epochs=1, max_steps=8, grad_accum_steps=grad_accum_steps, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def test_replicas_and_accumulation_give_the_same_sgd_update():
    one = sgd_weights("default")
    two = sgd_weights("mirrored", num_cpu_replicas=2, **MIRRORED)
    # Collectives of different group sizes collide in one process; real runs have one strategy.
    four = sgd_weights("mirrored", num_cpu_replicas=4, **MIRRORED)
    accumulated = sgd_weights("default", grad_accum_steps=4)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(one, sgd_weights("default", grad_accum_steps=1)))
    assert moved == 0.0  # Deterministic on one device.
    for other in (two, four, accumulated):
        for a, b in zip(one, other):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # A wrong scale by the replica count would move SGD weights far more than this.
    start = dense_model().get_weights()
    assert max(float(np.max(np.abs(a - s))) for a, s in zip(one, start)) > 1e-2


class AddsLoss(keras.layers.Layer):
    """A layer that calls add_loss, as custom layers do."""

    def call(self, inputs):
        self.add_loss(0.2 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def regularised_model():
    init = keras.initializers.GlorotUniform
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(32, activation="relu", kernel_initializer=init(0),
                                                 activity_regularizer=keras.regularizers.L2(0.05),
                                                 kernel_regularizer=keras.regularizers.L2(1e-3)),
                              AddsLoss(), keras.layers.Dense(10, kernel_initializer=init(1))])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_activity_regularisers_and_add_loss_count_as_in_keras():
    # One full-batch SGD step, so the order of examples cannot matter.
    x, y = X[:256], Y[:256]
    reference = regularised_model()
    cross_entropy = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, reference(x)))
    expected = reference.fit(x, y, batch_size=256, epochs=1, shuffle=False, verbose=0,
                             validation_data=(x, y)).history
    assert expected["loss"][0] - cross_entropy > 0.05  # The extra terms matter, so dropping them shows.
    runs = (("default", {}, False), ("mirrored", {"num_cpu_replicas": 2, **MIRRORED}, False),
            ("default", {}, True))  # Last: the parameter-server forward path (asynchronous), in this process.
    for name, options, asynchronous in runs:
        strategy = tfdist.make_strategy(name, precision="float32", **options)
        backend = strategies.backend_of(strategy)
        with strategy.scope():
            model = regularised_model()
        backend.asynchronous = asynchronous
        try:
            history = tfdist.fit(model, x, y, batch_size=256, epochs=1, verbose=0, validation_data=(x, y)).history
        finally:
            backend.asynchronous = False
        for key in ("loss", "val_loss"):
            assert abs(history[key][0] - expected[key][0]) < 1e-4, (name, asynchronous, key, history, expected)
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_dict_model_matches_keras_fit_and_reports_keras_keys():
    """BatchNormalization, Dropout, an Embedding and L2 on dict inputs: plain SGD, the same global batches.

    One device: Keras' model.fit exactly. Two replicas: Keras' own model.fit under a 2-replica
    MirroredStrategy (per-replica batch statistics and Dropout masks are then the same), for the
    trainable weights and the training logs; the BatchNormalization moving statistics, which tfdist
    averages over the replicas once per execution, differ from Keras' per-replica updates (measured
    8e-3), and with them the validation figures.
    """
    features = EXAMPLE.features
    train = tf.data.Dataset.from_tensor_slices((features(DIGITS.train_images[:2048]), DIGITS.train_labels[:2048]))
    train = train.batch(64, drop_remainder=True)
    val = tf.data.Dataset.from_tensor_slices((features(DIGITS.eval_images[:512]), DIGITS.eval_labels[:512])).batch(64)

    def compiled(strategy):
        with strategy.scope():
            model = EXAMPLE.build_model()
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        return model

    keras_mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                                    cross_device_ops=tf.distribute.ReductionToOneDevice())
    for name, options, keras_strategy in (("default", {}, tf.distribute.get_strategy()),
                                          ("mirrored", {"num_cpu_replicas": 2, **MIRRORED}, keras_mirrored)):
        reference = compiled(keras_strategy)
        expected = reference.fit(train, epochs=2, verbose=0, validation_data=val, shuffle=False).history
        strategy = tfdist.make_strategy(name, precision="float32", **options)
        model = compiled(strategy)
        history = tfdist.fit(model, train, epochs=2, verbose=0, validation_data=val, strategy=strategy).history
        assert set(history) == set(expected) == {"loss", "accuracy", "val_loss", "val_accuracy"}
        same = list(expected) if name == "default" else ["loss", "accuracy"]
        for key in same:
            np.testing.assert_allclose(history[key], expected[key], atol=1e-5, err_msg=f"{name} {key}")
        pairs = zip(model.weights, reference.weights) if name == "default" else \
            zip(model.trainable_weights, reference.trainable_weights)
        for a, b in pairs:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"{name} {a.path}")


def test_validation_metrics_count_every_example_once():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=3, precision="float32", **MIRRORED)
    with strategy.scope():
        model = dense_model()
    val_x, val_y = DIGITS.eval_images[:1001].astype("float32") / 255.0, DIGITS.eval_labels[:1001]
    history = tfdist.fit(model, X, Y, batch_size=96, epochs=1, validation_data=(val_x, val_y), verbose=0)
    logits = model.predict(val_x, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, -1) == val_y))
    assert history.history["val_accuracy"][-1] == pytest.approx(accuracy, abs=1e-6)
    loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(val_y, logits))
    assert history.history["val_loss"][-1] == pytest.approx(loss, rel=1e-4)


def example_of_replica_1(size=64):
    """The example that the topology-independent order puts first in replica 1's half of global batch 0.

    Keras alone takes replica 0's skip decision for every replica: an overflow there would be skipped
    even without tfdist's all-reduce-first order, so the test overflows replica 1.
    """
    position = tf.constant([size // 2], tf.int64)
    return int(tf.random.experimental.index_shuffle(position, seed=tf.constant([0, 0], tf.int64),
                                                    max_index=size - 1)[0])


def test_loss_scaling_skips_an_overflow_on_one_replica_everywhere():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="mixed_float16", **MIRRORED)
    try:
        with strategy.scope():
            model = dense_model(optimizer=keras.optimizers.SGD(0.1))
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        x = X[:64].copy()
        x[example_of_replica_1()] = 1e5  # Global batch 0, replica 1's half only: float16 overflows there.
        before = [np.asarray(w) for w in model.get_weights()]
        scale = float(model.optimizer.initial_scale)
        tfdist.fit(model, x, Y[:64], batch_size=64, epochs=1, max_steps=1, seed=0, verbose=0)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert float(model.optimizer.dynamic_scale.numpy()) == scale / 2
    backend = strategies.backend_of(strategy)
    for variable, start in zip(model.weights, before):
        replicas = backend.local_replica_values(variable)
        assert all(np.isfinite(r).all() for r in replicas)
        np.testing.assert_array_equal(replicas[0], replicas[1])
        np.testing.assert_array_equal(replicas[0], start)  # The step was skipped, not half-applied.


def test_batch_norm_statistics_stay_identical_across_replicas():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = EXAMPLE.build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    tfdist.fit(model, EXAMPLE.features(DIGITS.train_images[:640]), DIGITS.train_labels[:640], batch_size=64,
               epochs=1, verbose=0)
    backend = strategies.backend_of(strategy)
    moving = [v for v in model.non_trainable_variables if "moving" in v.path]
    assert moving
    for variable in moving:
        first, second = backend.local_replica_values(variable)
        np.testing.assert_array_equal(first, second)
        assert np.abs(first).sum() > 0


def bad(match, *args, **kwargs):
    with pytest.raises(tfdist.UserError, match=match) as error:  # UserError: the documented type (a ValueError).
        tfdist.fit(*args, **kwargs)
    assert "\n" not in str(error.value)


def test_bad_input_is_refused_before_training():
    tfdist.make_strategy("default", precision="float32")
    uncompiled = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    bad("not compiled", uncompiled, np.zeros((8, 2)), np.zeros(8), batch_size=4)
    model = dense_model()
    bad(r"disagree on the number of examples \(x: 64, y: 63\)", model, X[:64], Y[:63], batch_size=32)
    bad(r"batch_size=0", model, X[:64], Y[:64], batch_size=0)
    bad(r"validation_data must be \(x_val,\), \(x_val, y_val\) or \(x_val, y_val, sample_weight_val\), not a tuple of "
        r"length 4", model, X[:64], Y[:64], batch_size=32, validation_data=(X[:10],) * 4)
    dict_model = EXAMPLE.build_model()
    dict_model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    bad(r"keys of x/y \(image, pixels\) do not match the model's inputs: it was built with a dict of inputs keyed "
        r"image, rows", dict_model,
        {"image": DIGITS.train_images[:8], "pixels": np.zeros((8, 28), "int32")}, DIGITS.train_labels[:8],
        batch_size=4)

    class Custom(keras.Model):
        def train_step(self, data):
            return [0.0]

    inputs = keras.Input((2,))
    custom = Custom(inputs, keras.layers.Dense(1)(inputs))
    custom.compile(optimizer="sgd", loss="mse")
    bad(r"Custom.train_step\(\) returned list, not a dict of logs", custom, np.zeros((8, 2)), np.zeros(8),
        batch_size=4)


def test_model_built_outside_the_scope_is_refused():
    outside = dense_model()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    bad("not built under the strategy's scope", outside, X[:64], Y[:64], batch_size=64, strategy=strategy)
    with strategy.scope():
        inside = dense_model()

    def per_replica_batches(context):
        return tf.data.Dataset.from_tensor_slices((X[:64], Y[:64])).batch(1)

    bad(r"batch_size=3 does not divide evenly across 2 replica\(s\) x 1 accumulation step\(s\), and the dataset "
        r"function batches per replica", inside, per_replica_batches, batch_size=3, steps_per_epoch=2)


def test_make_strategy_returns_the_tf_strategy_and_refuses_unknown_options():
    assert isinstance(tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED),
                      tf.distribute.MirroredStrategy)
    with pytest.raises(tfdist.UserError, match="unknown option"):
        tfdist.make_strategy("mirrored", replicas=2)
    with pytest.raises(tfdist.UserError, match="not a known strategy"):
        tfdist.make_strategy("mirror")


def test_a_dataset_of_global_batches_trains_the_same_on_one_and_two_replicas():
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(64, drop_remainder=True)
    weights = []
    for name, options in (("default", {}), ("mirrored", {"num_cpu_replicas": 2, **MIRRORED})):
        strategy = tfdist.make_strategy(name, precision="float32", **options)
        with strategy.scope():
            model = dense_model()
        history = tfdist.fit(model, dataset, epochs=2, verbose=0, validation_data=dataset.take(4))
        assert len(history.history["loss"]) == 2 and set(history.history) == {"loss", "accuracy", "val_loss",
                                                                                "val_accuracy"}
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_dataset_function_of_per_replica_batches():
    def dataset_fn(context):
        batch = context.get_per_replica_batch_size(64)
        return tf.data.Dataset.from_tensor_slices((X, Y)).shard(context.num_input_pipelines,
                                                                context.input_pipeline_id).batch(batch)

    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = dense_model()
    history = tfdist.fit(model, dataset_fn, batch_size=64, steps_per_epoch=16, epochs=2, verbose=0)
    # Keras on one device, fed the same global batches in the same order (epoch 2 continues the pass).
    reference = dense_model()
    expected = reference.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(64), steps_per_epoch=16, epochs=2,
                             shuffle=False, verbose=0).history
    assert history.history.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(history.history[key], expected[key], atol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)  # Measured 2e-7 apart; training moved them 0.44.
    with strategy.scope():
        other = dense_model()
    bad(r"returns batches of 64 examples, but batch_size=64 over 2 replica\(s\) means 32 per replica", other,
        lambda context: tf.data.Dataset.from_tensor_slices((X, Y)).batch(64, drop_remainder=True),
        batch_size=64, steps_per_epoch=4)
    # Every dataset is batched, as Keras takes it: one of single examples reads as batches of their first dimension.
    bad(r"returns batches of 28 examples, but batch_size=64 over 2 replica\(s\) means 32 per replica", other,
        lambda context: tf.data.Dataset.from_tensor_slices((X, Y)),
        batch_size=64, steps_per_epoch=4)
    bad("pass batch_size= \\(the global batch\\) and steps_per_epoch=", other, dataset_fn)


def test_bfloat16_all_reduce_is_close_to_float32_but_really_compressed():
    exact = sgd_weights("mirrored", num_cpu_replicas=2, **MIRRORED)
    compressed = sgd_weights("mirrored", num_cpu_replicas=2, all_reduce_dtype="bfloat16", **MIRRORED)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(exact, compressed))
    assert 0 < difference < 2e-2, difference  # bfloat16 keeps ~3 significant digits; SGD at lr 0.5, 8 steps.
    with pytest.raises(tfdist.UserError, match="--all_reduce_dtype=bfloat16 applies to strategies that all-reduce"):
        tfdist.make_strategy("default", all_reduce_dtype="bfloat16")


def test_a_diverging_run_stops_with_one_paragraph_counting_steps_when_asked():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = dense_model(optimizer=keras.optimizers.SGD(1e12))
    with pytest.raises(tfdist.UserError) as error:
        tfdist.fit(model, X, Y, batch_size=64, epochs=1, steps_per_execution=4, verbose=0, stop_on_nonfinite=True)
    message = str(error.value)
    count, step = re.search(r"non-finite \(NaN or inf\) in (\d+) of the steps up to step (\d+)", message).groups()
    assert 1 <= int(count) <= 4 and int(step) % 4 == 0, message  # Steps, not replica-steps.


def test_metrics_that_cannot_be_summed_are_refused():
    class Last(keras.metrics.Metric):
        def __init__(self):
            super().__init__(name="last")
            self.value = self.add_variable((), "zeros", aggregation="mean", name="value")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.value.assign(keras.ops.mean(y_pred))

        def result(self):
            return self.value

    tfdist.make_strategy("default", precision="float32")
    inputs = keras.Input((28, 28, 1))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(inputs)))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[Last()])
    bad(r"Metric 'last' keeps state .*aggregation mean\) that cannot be summed across replicas", model, X[:64],
        Y[:64], batch_size=32)


def test_execution_k_plus_1_is_dispatched_before_k_is_fetched(monkeypatch):
    from tfdist.distribute.backend import Backend

    events = []
    dispatch, fetch = Backend.dispatch, Backend.fetch

    def recording_dispatch(self, compiled, *args):
        handle = dispatch(self, compiled, *args)
        events.append(("dispatch", int(args[1])))
        return handle

    def recording_fetch(self, handle):
        result = fetch(self, handle)
        events.append(("fetch", int(round(float(result[0])))))  # The execution's example count.
        return result

    monkeypatch.setattr(Backend, "dispatch", recording_dispatch)
    monkeypatch.setattr(Backend, "fetch", recording_fetch)
    strategy = tfdist.make_strategy("default", precision="float32")
    with strategy.scope():
        model = dense_model()
    # 7 steps an epoch in executions of 3, 3, 1; no execution crosses the epoch end.
    history = tfdist.fit(model, X[:448], Y[:448], batch_size=64, epochs=2, steps_per_execution=3, verbose=0)
    epoch = [("dispatch", 3), ("dispatch", 3), ("fetch", 192), ("dispatch", 1), ("fetch", 192), ("fetch", 64)]
    assert events == epoch + epoch
    assert len(history.history["loss"]) == 2


def partial_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("examples", [250, 225], ids=["last-26", "last-1-one-replica-empty"])
@pytest.mark.parametrize("replicas,accum", [(1, 1), (2, 1), (2, 2)])
def test_a_dataset_batched_without_drop_remainder_trains_its_partial_last_batch_as_keras(examples, replicas, accum):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # As keras.io batches: the last one short.
    keras.utils.set_random_seed(1)
    reference = partial_model()
    initial = reference.get_weights()
    expected = reference.fit(dataset, epochs=2, verbose=0).history
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, **MIRRORED) if replicas == 2 else \
        tfdist.make_strategy("default")
    with strategy.scope():
        model = partial_model()
    model.set_weights(initial)
    history = tfdist.fit(model, dataset, epochs=2, strategy=strategy, verbose=0, grad_accum_steps=accum,
                         steps_per_execution=3)
    assert int(model.optimizer.iterations.numpy()) == 2 * -(-examples // 32)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for key in expected:
        np.testing.assert_allclose(history.history[key], expected[key], atol=1e-5, err_msg=key)


def test_arrays_train_every_example_each_epoch_with_a_partial_last_batch():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, **MIRRORED)
    seen = []

    class Count(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(int(self.model.optimizer.iterations.numpy()))

    with strategy.scope():
        model = partial_model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype("float32")
    history = tfdist.fit(model, x, x[:, :1], batch_size=64, epochs=2, verbose=0, strategy=strategy,
                         callbacks=[Count()])
    assert seen == [4, 8]  # 64 + 64 + 64 + 8 examples an epoch, as Keras' fit batches 200.
    assert len(history.history["loss"]) == 2


def test_a_partial_last_step_with_sparse_gradients_trains_as_keras_on_two_replicas():
    """An Embedding's sparse gradients in a short last step, executions of 3 steps, input order (shuffle=False).

    (An epoch's short step runs as an execution of its own: examples/transformer.py, tested in
    tests/test_examples_keras.py, failed with a CollectiveGatherV2 shape mismatch when it shared a
    compiled loop with full steps; this smaller model did not show that.)"""
    def build():
        inputs = keras.Input((6,), dtype="int32")
        pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(200, 6)).astype("int32")
    y = (x[:, :1] % 7).astype("float32") / 7.0
    keras.utils.set_random_seed(2)
    reference = build()
    initial = reference.get_weights()
    reference.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)  # 6 x 32 + 8.
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, **MIRRORED)
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    tfdist.fit(model, x, y, batch_size=32, epochs=2, strategy=strategy, verbose=0, steps_per_execution=3,
               shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 14
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# Keras forms that earlier versions broke (issue 29) ---------------------------------------
def test_list_inputs_no_y_and_synchronized_batch_norm_match_keras_on_two_replicas():
    """x=[left, right] stays two inputs; y=None trains on add_loss; synchronized BatchNormalization takes
    the global batch's statistics: each as Keras' own fit on one device (SGD, float32, 1e-5)."""
    from tests import keras_forms as forms

    siamese_ref, endpoint_ref = forms.siamese(), forms.endpoint()
    expected = forms.fit_siamese(forms.keras_fit, siamese_ref).history
    expected_endpoint = forms.fit_endpoint(forms.keras_fit, endpoint_ref, validation_split=0.25).history
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        siamese, unsynchronized, endpoint = forms.siamese(), forms.siamese(synchronized=False), forms.endpoint()
    history = forms.fit_siamese(tfdist.fit, siamese).history
    forms.fit_siamese(tfdist.fit, unsynchronized)
    history_endpoint = forms.fit_endpoint(tfdist.fit, endpoint, validation_split=0.25).history
    for got, wanted, model, reference in ((history, expected, siamese, siamese_ref),
                                          (history_endpoint, expected_endpoint, endpoint, endpoint_ref)):
        assert set(got) == set(wanted)
        for key in wanted:
            np.testing.assert_allclose(got[key], wanted[key], atol=1e-5, err_msg=key)
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # Per-replica statistics (the default) train differently: the synchronized match is not a given.
    assert max(float(np.abs(a - b).max()) for a, b in zip(unsynchronized.get_weights(),
                                                           siamese_ref.get_weights())) > 1e-3
    np.testing.assert_allclose(tfdist.evaluate(siamese, forms.SIAMESE_X, forms.SIAMESE_Y, verbose=0),
                               siamese_ref.evaluate(forms.SIAMESE_X, forms.SIAMESE_Y, verbose=0), atol=1e-5)
    np.testing.assert_allclose(tfdist.predict(siamese, forms.SIAMESE_X, verbose=0),
                               siamese_ref.predict(forms.SIAMESE_X, verbose=0), atol=1e-5)
    np.testing.assert_allclose(tfdist.evaluate(endpoint, forms.ENDPOINT_X, verbose=0),
                               endpoint_ref.evaluate(forms.ENDPOINT_X, verbose=0), atol=1e-5)


def test_sample_weight_without_targets_is_refused():
    from tests import keras_forms as forms

    tfdist.make_strategy("default", precision="float32")
    bad(r"x/y has sample weights but no targets", forms.endpoint(), forms.ENDPOINT_X,
        sample_weight=np.ones(128), batch_size=32)
    bad(r"class_weight was given without y: it weights each example by its target's class", forms.endpoint(),
        forms.ENDPOINT_X, class_weight={0: 1.0, 1: 2.0}, batch_size=32)


@pytest.mark.jobs
def test_two_workers_train_keras_forms_as_keras_with_bit_identical_embeddings(tmp_path):
    """List inputs, no y, synchronized BatchNormalization, an Embedding's sparse updates and the script's
    own file (tfdist.task_path) on 2 MultiWorkerMirrored workers (tests/programs/keras_forms.py)."""
    import subprocess
    import sys

    from tests import keras_forms as forms
    from tests.conftest import subprocess_env

    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             "tests/programs/keras_forms.py", str(tmp_path), "multi_worker_mirrored"],
                            capture_output=True, text=True, timeout=240, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    forms.check_job(tmp_path)


@pytest.mark.parametrize("replicas,batch_size,accum", [(4, 10, 1), (4, 3, 1), (2, 7, 2)])
def test_a_batch_the_replicas_do_not_divide_trains_as_keras(replicas, batch_size, accum):
    """Some replicas (and micro-batches) take one example fewer, or none; the gradient is still the global
    batch's: Keras' own fit on one device, for arrays and for a dataset of global batches."""
    from tests.test_fit_args import RNG, model_fn

    x, y = RNG.normal(size=(50, 8)).astype("float32"), RNG.integers(0, 3, size=50)
    reference = model_fn()
    expected = reference.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x[:20], y[:20])).history
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32", **MIRRORED)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    for data in ((x, y), (dataset,)):
        with strategy.scope():
            model = model_fn()
        history = tfdist.fit(model, *data, batch_size=batch_size if len(data) == 2 else None, epochs=2,
                             shuffle=False, verbose=0, grad_accum_steps=accum,
                             validation_data=(x[:20], y[:20])).history
        assert set(history) == set(expected)
        for key in expected:
            np.testing.assert_allclose(history[key], expected[key], atol=1e-5, err_msg=key)
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_custom_step_with_fewer_examples_than_replicas_is_refused():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        inputs = keras.Input((2,))
        custom = Custom(inputs, keras.layers.Dense(1)(inputs))
        custom.compile(optimizer="sgd", loss="mse")
    bad(r"batch_size=1 is smaller than the number of replicas \(2\), so a replica would run Custom.train_step\(\) "
        r"on no example", custom, np.zeros((8, 2)), np.zeros(8), batch_size=1)


class _Hooks(keras.callbacks.Callback):
    """Every hook Keras calls during fit (names and batch indices), and the model's logs at each."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("train_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("train_end", batch, float(logs["loss"])))

    def on_test_begin(self, logs=None):
        self.calls.append(("test_begin",))

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test_batch_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_batch_end", batch, float(logs["loss"])))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict_batch_end", batch, np.asarray(logs["outputs"])))

    def on_test_end(self, logs=None):
        self.calls.append(("test_end", sorted(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch))


def assert_same_calls(seen, expected):
    """The same hooks with the same batch indices, in order; their logs and outputs within 1e-5."""
    assert [(c[0],) + tuple(v for v in c[1:] if isinstance(v, (int, str, list))) for c in seen] == \
        [(c[0],) + tuple(v for v in c[1:] if isinstance(v, (int, str, list))) for c in expected]
    for got, wanted in zip(seen, expected):
        for a, b in zip(got[1:], wanted[1:]):
            if isinstance(b, (float, np.ndarray)):
                np.testing.assert_allclose(a, b, atol=1e-5, err_msg=str(wanted[:2]))


@pytest.mark.parametrize("compiled_steps", [1, 3])
def test_batch_hooks_follow_compiled_steps_per_execution_as_keras(compiled_steps):
    """compile(steps_per_execution=) is read: hooks at Keras' batches (a short last execution's end index
    included), with Keras' logs; on_test_begin/end around fit's validation; a batch of 1 on 2 replicas
    (one replica empty) shuffled; weights equal to Keras' own fit on one device."""
    from tests.test_fit_args import RNG, model_fn

    x, y = RNG.normal(size=(15, 8)).astype("float32"), RNG.integers(0, 3, size=15)
    reference = model_fn()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, steps_per_execution=compiled_steps)
    expected = _Hooks()
    reference.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0, validation_data=(x[:4], y[:4]),
                  callbacks=[expected])
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, steps_per_execution=compiled_steps)
    seen = _Hooks()
    tfdist.fit(model, x, y, batch_size=2, epochs=2, shuffle=False, verbose=0, validation_data=(x[:4], y[:4]),
               callbacks=[seen])
    assert_same_calls(seen.calls, expected.calls)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # evaluate and predict: their hooks per Keras batch too (each batch split over the replicas).
    expected, seen = _Hooks(), _Hooks()
    reference.evaluate(x, y, batch_size=3, verbose=0, callbacks=[expected])
    reference.predict(x, batch_size=4, verbose=0, callbacks=[expected])
    tfdist.evaluate(model, x, y, batch_size=3, verbose=0, callbacks=[seen])
    tfdist.predict(model, x, batch_size=4, verbose=0, callbacks=[seen])
    assert_same_calls(seen.calls, expected.calls)
    with strategy.scope():
        model = model_fn()
    tfdist.fit(model, x, y, batch_size=1, epochs=1, shuffle=True, verbose=0)  # Shuffles an empty share.
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_tfdist_scalars_stay_out_of_the_users_tensorboard_and_per_class_metrics_are_logged(tmp_path):
    """A TensorBoard callback's logs hold Keras' tags only (tfdist's own go to its run directory), and a
    metric with one value per class reaches History as Keras logs it (an array)."""
    from tests.test_fit_args import RNG, model_fn

    x, y = RNG.normal(size=(16, 8)).astype("float32"), RNG.integers(0, 3, size=16)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=[keras.metrics.F1Score(average=None)])
    onehot = np.eye(3, dtype="float32")[y]
    history = tfdist.fit(model, x, onehot, epochs=1, batch_size=8, verbose=0, workdir=str(tmp_path / "f1"))
    assert np.shape(history.history["f1_score"][0]) == (3,)
    with strategy.scope():
        model = model_fn()
    tfdist.fit(model, x, y, epochs=1, batch_size=8, verbose=0, workdir=str(tmp_path / "run"),
               callbacks=[keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq="batch")])
    tags = set()
    for path in tf.io.gfile.glob(str(tmp_path / "tb" / "*" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(value.tag for value in event.summary.value)
    assert tags and not any(tag.startswith(("train/", "eval/")) for tag in tags), tags
    own = set()
    for path in tf.io.gfile.glob(str(tmp_path / "run" / "tensorboard" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            own.update(value.tag for value in event.summary.value)
    assert "train/loss" in own, own


def test_a_finite_dataset_with_steps_per_epoch_and_an_uneven_split_trains_the_same_on_every_topology():
    """A stream of whole global batches (the pass's short batch is not a step boundary): 1 replica and 4
    replicas (batch 6 split 2/2/1/1) take the same examples at every step."""
    from tests.test_fit_args import model_fn

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(20, 8)).astype("float32"), rng.integers(0, 3, size=20)
    weights = []
    for replicas in (1, 4):
        strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32", **MIRRORED)
        with strategy.scope():
            model = model_fn()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
        tfdist.fit(model, dataset, steps_per_epoch=3, epochs=2, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_dataset_of_x_alone_trains_an_endpoint_model_as_keras():
    """A dataset yielding x only (a dict of inputs, or (x,)), for a model whose loss comes from an endpoint
    layer: trained as Keras' own fit on one device trains it."""
    from tests import keras_forms as forms

    def batches(form):
        dataset = tf.data.Dataset.from_tensor_slices(forms.ENDPOINT_X)
        return (dataset if form == "bare" else dataset.map(lambda x: (x,))).batch(16)

    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    for form in ("bare", "tuple"):
        reference = forms.endpoint()
        expected = reference.fit(batches(form), epochs=2, verbose=0).history
        with strategy.scope():
            model = forms.endpoint()
        history = tfdist.fit(model, batches(form), epochs=2, verbose=0).history
        np.testing.assert_allclose(history["loss"], expected["loss"], atol=1e-5)
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_synchronized_batch_norm_with_an_empty_replica_keeps_keras_moving_statistics():
    """A last batch of one example on 2 replicas: the empty replica's synchronized statistics are the global
    batch's, so the moving mean and variance stay Keras' (kept stale, they would lag by half an update)."""
    from tests import keras_forms as forms

    x, y = [a[:65] for a in forms.SIAMESE_X], forms.SIAMESE_Y[:65]  # 2 batches of 32 and one of 1.
    reference = forms.siamese()
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = forms.siamese()
    tfdist.fit(model, x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
