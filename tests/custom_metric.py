"""A custom Keras metric whose ``result()`` returns its own state variable (the keras.io guide's
``CategoricalTruePositives``), a model compiled with it, its data, and the checks of what
tests/programs/custom_metric.py writes: shared by tests/test_metric_state.py and that program."""

import json
import os

import keras
import numpy as np
from keras import ops

RNG = np.random.default_rng(40)
X = RNG.normal(size=(48, 4)).astype("float32")
Y = RNG.integers(0, 3, size=(48, 1))
BATCH_SIZE = 6


class CategoricalTruePositives(keras.metrics.Metric):
    """As the keras.io guide "Training & evaluation with the built-in methods" writes it."""

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(ops.cast(y_true, "int32") == ops.cast(y_pred, "int32"), "float32")
        if sample_weight is not None:
            values = ops.multiply(values, ops.cast(sample_weight, "float32"))
        self.true_positives.assign_add(ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


class RawVariableTruePositives(CategoricalTruePositives):
    """The same, returning the TensorFlow variable behind its Keras variable."""

    def __init__(self, name="raw_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)

    def result(self):
        return {"raw_true_positives": self.true_positives.value, "raw_doubled": self.true_positives * 2.0}


class BatchLogs(keras.callbacks.Callback):
    """Each training batch's logs."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append({k: float(v) for k, v in (logs or {}).items()})


def model_fn() -> keras.Model:
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[CategoricalTruePositives(), RawVariableTruePositives()])
    return model


def keras_run(model: keras.Model, fit, evaluate, **fit_kwargs) -> dict:
    """evaluate, fit (validating on X[:18]) and evaluate again, each as `fit`/`evaluate` (model first)."""
    before = evaluate(model, X, Y, batch_size=BATCH_SIZE, verbose=0, return_dict=True)
    history = fit(model, X, Y, batch_size=BATCH_SIZE, epochs=2, shuffle=False, validation_data=(X[:18], Y[:18]),
                  **fit_kwargs).history
    after = evaluate(model, X, Y, batch_size=BATCH_SIZE, verbose=0, return_dict=True)
    return {"before": before, "history": history, "after": after}


def keras_reference() -> tuple[dict, list[np.ndarray]]:
    """Keras' own fit and evaluate on one device.

    Keras' fit logs the Variable such a ``result()`` returns and reads it only after validation, which
    resets and refills it: its epoch logs show the validation count under the training name. Those
    entries are taken from Keras' fit of the same model without validation (the training count).
    """
    model = model_fn()
    fit, evaluate = (lambda m, *a, **k: m.fit(*a, **k)), (lambda m, *a, **k: m.evaluate(*a, **k))
    expected = keras_run(model, fit, evaluate, verbose=0)
    plain = model_fn().fit(X, Y, batch_size=BATCH_SIZE, epochs=2, shuffle=False, verbose=0).history
    expected["history"].update(plain)
    return expected, model.get_weights()


def check_same(got: dict, expected: dict) -> None:
    """Every log of `got` within 1e-5 of Keras' (and the counts not zero)."""
    assert expected["before"]["categorical_true_positives"] > 0
    for part in expected:
        assert set(got[part]) == set(expected[part]), (part, got[part], expected[part])
        for key, value in expected[part].items():
            np.testing.assert_allclose(got[part][key], value, atol=1e-5, err_msg=f"{part} {key}")


def check_job(out: str) -> None:
    """Both tasks of tests/programs/custom_metric.py: Keras' logs and weights."""
    expected, weights = keras_reference()
    for index in (0, 1):
        saved = np.load(os.path.join(out, f"task{index}.npz"))
        check_same(json.loads(str(saved["logs"])), expected)
        for i, wanted in enumerate(weights):
            np.testing.assert_allclose(saved[f"arr_{i}"], wanted, atol=1e-5)
