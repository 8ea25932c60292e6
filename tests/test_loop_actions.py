"""tfdist.training.loop_actions: the non-finite guard. A non-finite loss is trained on, as Keras' own fit does
(one warning); `fit(stop_on_nonfinite=True)` stops with a UserError; loss scaling skips overflowing steps."""

import logging

import keras
import numpy as np
import pytest

import tfdist
from tfdist.training.loop_actions import MAX_NONFINITE_STEPS, NonFiniteGuard

MIRRORED = {"all_reduce": "reduce_to_one"}  # Collective all-reduces of several strategies collide in one process.
RNG = np.random.default_rng(11)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = (X @ RNG.normal(size=(6, 1))).astype("float32")
NAN_X = X.copy()
NAN_X[3 * 8 + 2, 1] = np.nan  # Batch 3 (of 8 examples) has a NaN input: its loss is NaN.


def model_fn(optimizer=None):
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer or keras.optimizers.SGD(0.05), "mse")
    return model


class BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def warnings_about_nonfinite(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "became non-finite" in r.getMessage()]


def test_the_guard_warns_once_by_default_and_raises_only_when_asked(caplog):
    guard = NonFiniteGuard(loss_scaling=False)
    for step in range(1, 2 * MAX_NONFINITE_STEPS):  # Never divergence: Keras' fit goes on.
        guard.note(1)
        guard.check(1, 1, step, stopping=False)
    assert len(warnings_about_nonfinite(caplog)) == 1
    assert "TerminateOnNaN" in warnings_about_nonfinite(caplog)[0].getMessage()
    assert guard.logs({"loss": 1.5}, "batch") == {"loss": 1.5}  # The running loss, as Keras logs it.
    stopping = NonFiniteGuard(loss_scaling=False, stop=True)
    stopping.note(2)
    assert np.isnan(stopping.logs({"loss": 1.5}, "batch")["loss"])  # What TerminateOnNaN then sees.
    with pytest.raises(tfdist.UserError, match=r"non-finite \(NaN or inf\) in 2 of the steps up to step 10"):
        stopping.check(2, 10, 10, stopping=False)
    stopping.check(2, 10, 10, stopping=True)  # A callback stopped training: no error.


@pytest.mark.parametrize("stop", [False, True])
def test_loss_scaling_skips_steps_and_only_a_long_run_of_them_is_divergence(stop):
    guard = NonFiniteGuard(loss_scaling=True, stop=stop)
    for step in range(1, MAX_NONFINITE_STEPS):
        guard.check(1, 1, step, stopping=False)
    guard.check(0, 1, MAX_NONFINITE_STEPS, stopping=False)  # A finite step: the run starts again.
    for step in range(MAX_NONFINITE_STEPS + 1, 2 * MAX_NONFINITE_STEPS):
        guard.check(1, 1, step, stopping=False)
    with pytest.raises(tfdist.UserError, match="stayed non-finite for 50 consecutive steps"):
        guard.check(1, 1, 2 * MAX_NONFINITE_STEPS, stopping=False)


def test_a_non_finite_loss_trains_on_as_keras_fit_does(tmp_path, caplog):
    """2 replicas: the same logs (NaN from batch 3 on), NaN weights where Keras' are, every step taken,
    one warning; the workdir keeps its last finite checkpoint and gets no export."""
    reference, keras_losses = model_fn(), BatchLosses()
    expected = reference.fit(NAN_X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                             callbacks=[keras_losses]).history
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn()
    losses = BatchLosses()
    got = tfdist.fit(model, NAN_X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[losses],
                     workdir=str(tmp_path / "w"), checkpoint_every_steps=2).history
    assert np.isnan(expected["loss"]).all() and np.isnan(got["loss"]).all()
    np.testing.assert_allclose(losses.losses, keras_losses.losses, atol=1e-5)  # Finite ones equal, NaN alike.
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 16
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    assert any(np.isnan(w).any() for w in model.get_weights())
    assert len(warnings_about_nonfinite(caplog)) == 1
    indexes = (tmp_path / "w" / "checkpoints").glob("ckpt-*.index")
    saved = sorted(int(p.name.split("-")[1].split(".")[0]) for p in indexes)
    assert saved and max(saved) <= 2, saved  # Step 4 (past the NaN batch) on: not finite, not saved.
    assert not (tmp_path / "w" / "model.keras").exists()


def test_stop_on_nonfinite_stops_fit_with_a_user_error():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn()
    with pytest.raises(tfdist.UserError, match=r"non-finite \(NaN or inf\) in 1 of the steps up to step 4"):
        tfdist.fit(model, NAN_X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, steps_per_execution=1,
                   stop_on_nonfinite=True)


def test_loss_scaling_still_skips_and_stops_a_run_that_stays_non_finite():
    """A LossScaleOptimizer skips each overflowing step (the weights stay); 50 in a row stop fit, by default too."""
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)))
    start = model.get_weights()
    every = np.full_like(X, np.nan)
    with pytest.raises(tfdist.UserError, match="stayed non-finite for 50 consecutive steps"):
        tfdist.fit(model, every, Y, batch_size=8, epochs=10, shuffle=False, verbose=0, steps_per_execution=1)
    for a, b in zip(model.get_weights(), start):
        np.testing.assert_array_equal(a, b)
