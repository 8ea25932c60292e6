"""tfdist.training.on_batch: `tfdist.train_on_batch` is Keras' `Model.train_on_batch`, call after call.

Against Keras' own train_on_batch on one device, from the same weights and batches (SGD, float32, 1e-5): the
weights, the returned loss / list / dict, the metrics' state after each call, on one device and on 2 CPU
replicas (a batch of 7 rows the replicas do not divide). The 2-worker MultiWorkerMirrored case runs in
tests/test_adopting.py (tests/programs/user_strategy.py); the 2-rank Horovod (and MultiWorkerMirrored) case in
tests/test_custom_steps.py's jobs (tests/programs/custom_steps.py, `assert_train_on_batch_as_keras`). Repeated
calls trace the step once, as Keras' own (its ``train_function`` kept until the model is compiled again), and
the kept steps let the model go.
"""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.distribute.backend import Backend
from tfdist.training import preparing

STRATEGIES = {"default": ("default", {}), "mirrored2": ("mirrored", {"num_cpu_replicas": 2,
                                                                     "all_reduce": "reduce_to_one"})}
ROWS = (19, 16, 7, 12)


def build(metrics=("accuracy",)):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="wacc")] if metrics else None)
    return model


def batches():
    rng = np.random.default_rng(1)
    for rows in ROWS:
        yield (rng.normal(size=(rows, 5)).astype("float32"), rng.integers(0, 3, rows).astype("int32"),
               rng.uniform(0.2, 2.0, rows).astype("float32"))


def pair(name, metrics=("accuracy",)):
    kind, options = STRATEGIES[name]
    strategy = tfdist.make_strategy(kind, precision="float32", **options)
    with strategy.scope():
        model = build(metrics)
    return model, build(metrics)


def metric_state(model):
    return [np.asarray(v) for m in model.metrics for v in m.variables]


@pytest.mark.parametrize("name", STRATEGIES)
def test_train_on_batch_is_keras_call_after_call(name):
    """Four calls in a row: plain, sample_weight, class_weight, as a dict and as a list; each call's logs
    (metrics reset first, as Keras' own), the weights, the metrics' state and the step count stay Keras'.
    model.history and model.stop_training stay as the program left them (Keras' call touches neither)."""
    model, reference = pair(name)
    model.stop_training = reference.stop_training = True
    for i, (x, y, weight) in enumerate(batches()):
        options = [{}, {"sample_weight": weight}, {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}}, {}][i]
        as_dict = i % 2 == 0
        got = tfdist.train_on_batch(model, x, y, return_dict=as_dict, **options)
        expected = reference.train_on_batch(x, y, return_dict=as_dict, **options)
        if as_dict:
            assert sorted(got) == sorted(expected) == ["accuracy", "loss", "wacc"]
            got, expected = [got[k] for k in sorted(got)], [expected[k] for k in sorted(expected)]
        assert isinstance(got, list) and len(got) == len(expected) == 3
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"call {i}")
        for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"call {i}")
        for a, b in zip(metric_state(model), metric_state(reference), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"call {i}")
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == len(ROWS)
    assert model.stop_training is True and not hasattr(model, "history")


def test_a_model_without_metrics_gets_the_loss_as_a_float():
    model, reference = pair("mirrored2", metrics=())
    for x, y, _ in batches():
        got, expected = tfdist.train_on_batch(model, x, y), reference.train_on_batch(x, y)
        assert isinstance(got, float) and got == pytest.approx(expected, abs=1e-5)


def test_what_train_on_batch_refuses(monkeypatch):
    model, _ = pair("default")
    x, y, weight = next(batches())
    with pytest.raises(tfdist.UserError, match=r"^train_on_batch takes sample_weight or class_weight, not both"):
        tfdist.train_on_batch(model, x, y, sample_weight=weight, class_weight={0: 1.0})
    ps = Backend("parameter_server", tf.distribute.get_strategy(), asynchronous=True)
    monkeypatch.setattr(preparing, "backend_for", lambda strategy, model=None: ps)
    before = model.get_weights()
    with pytest.raises(tfdist.UserError, match=r"^tfdist.train_on_batch is not available on parameter servers"):
        tfdist.train_on_batch(model, x, y)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


TRACED = []  # One entry each time a `Counting` layer's call runs in Python: a trace (or Keras' symbolic build).


class Counting(keras.layers.Layer):
    def call(self, x):
        TRACED.append(1)
        return x


def counting_model(optimizer):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), Counting(),
                              keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.parametrize("name", STRATEGIES)
def test_repeated_calls_trace_once_until_the_model_is_compiled_again(name):
    """Six calls with batches of one signature trace the step once (each call used to run, and trace, a whole
    fit: 0.6-2 s a call); compiling again (a new optimizer) traces anew and trains with the new optimizer,
    as Keras' own (its train_function is reset by compile). Logs and weights stay Keras', call after call; the
    model is freed once the program drops it."""
    kind, options = STRATEGIES[name]
    strategy = tfdist.make_strategy(kind, precision="float32", **options)
    with strategy.scope():
        model = counting_model(keras.optimizers.SGD(0.2))
    reference = counting_model(keras.optimizers.SGD(0.2))
    rng = np.random.default_rng(3)
    data = [(rng.normal(size=(16, 5)).astype("float32"), rng.integers(0, 3, 16).astype("int32")) for _ in range(6)]

    def check(i):
        x, y = data[i]
        np.testing.assert_allclose(tfdist.train_on_batch(model, x, y), reference.train_on_batch(x, y), atol=1e-5)
        for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"call {i}")

    check(0)
    after_first = len(TRACED)
    for i in range(1, 6):
        check(i)
    assert len(TRACED) == after_first, f"{len(TRACED) - after_first} traces in 5 calls after the first"
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=model.loss, metrics=["accuracy"])
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss=reference.loss, metrics=["accuracy"])
    before = len(TRACED)
    for i in range(3):
        check(i)
    assert len(TRACED) > before  # The new compile's step, traced with the new optimizer.
    after_recompile = len(TRACED)
    check(4)
    assert len(TRACED) == after_recompile
    gone = weakref.ref(model)  # The steps are kept per model, weakly: a model the program drops is freed.
    del model
    gc.collect()
    assert gone() is None


def ema_model(frequency):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9,
                                                 ema_overwrite_frequency=frequency),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


# ema_overwrite_frequency on replicas: Keras' optimizer overwrites in a cond holding a merge_call, which fails in
# a replica context (Keras' own fit under MirroredStrategy fails alike), so it is checked on one device only.
@pytest.mark.parametrize("name, frequency", [("default", None), ("default", 3), ("mirrored2", None)])
def test_an_ema_optimizer_is_not_finalized_after_each_call(name, frequency):
    """With ``use_ema`` Keras' fit overwrites the weights by their moving averages at its end
    (``finalize_variable_values``); Keras' train_on_batch does not, nor its test_on_batch or predict_on_batch:
    after each call the weights, the logs, the EMA slots and ``optimizer.iterations`` stay Keras' (every 3rd step
    overwritten in the step itself with ``ema_overwrite_frequency=3``), and evaluating or predicting the batch
    after it gives Keras' results and leaves the weights as they were."""
    kind, options = STRATEGIES[name]
    strategy = tfdist.make_strategy(kind, precision="float32", **options)
    with strategy.scope():
        model = ema_model(frequency)
    reference = ema_model(frequency)
    for i, (x, y, _) in enumerate(batches()):
        got, expected = tfdist.train_on_batch(model, x, y), reference.train_on_batch(x, y)
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"call {i}")
        for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"weights after call {i}")
        ema, ema_reference = model.optimizer._model_variables_moving_average, \
            reference.optimizer._model_variables_moving_average
        for a, b in zip(ema, ema_reference, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"EMA after call {i}")
        assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == i + 1
        np.testing.assert_allclose(tfdist.test_on_batch(model, x, y), reference.test_on_batch(x, y), atol=1e-5)
        np.testing.assert_allclose(tfdist.predict_on_batch(model, x), reference.predict_on_batch(x), atol=1e-5)
        for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"weights after evaluating batch {i}")


def test_a_non_finite_loss_is_warned_of_once_a_model_not_once_a_call():
    """Keras' train_on_batch goes on after a NaN loss; tfdist's does too, and says so once for the model (a GAN's
    loop of thousands of calls used to log it at every call, with a run-directory warning that has no run
    directory to speak of)."""
    import logging

    from absl import logging as absl_logging

    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Keep()
    absl_logging.get_absl_logger().addHandler(handler)
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        x, y = np.array([[np.nan, 1.0]] * 4, "float32"), np.zeros((4, 1), "float32")
        for _ in range(3):
            assert np.isnan(tfdist.train_on_batch(model, x, y))
    finally:
        absl_logging.get_absl_logger().removeHandler(handler)
    warnings = [s for s in said if "non-finite" in s]
    assert len(warnings) == 1 and "Training goes on, as Keras' fit does" in warnings[0], warnings
