"""tfdist.training.sync_batchnorm: `fit(sync_batchnorm=True)` trains BatchNormalization on the global batch's
statistics, as Keras' one-device fit, leaves the user's layers as they were, and the small-batch warning.

Plain SGD, float32, batch 8 on 2 replicas (4 examples each), against Keras' own one-device `fit`.
"""

import os
import subprocess
import sys
import types

import keras
import numpy as np
import pytest

import tfdist
from tests.batchnorm_model import X, Y, TRAIN, cnn, fit, keras_fit, norms
from tests.conftest import REPO, subprocess_env
from tests.test_horovod import horovodrun, needs_horovod
from tfdist.training import sync_batchnorm

MIRRORED = {"all_reduce": "reduce_to_one"}  # As test_fitting: one strategy's collectives per process.


def two_replicas():
    return tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)


def test_the_option_trains_batch_norm_as_one_device_and_the_default_does_not():
    """8 steps of batch 8 on 2 replicas: with sync_batchnorm the weights, moving statistics and logs equal Keras'
    one-device fit (1e-5); without it each replica's 4 examples give other statistics, and other weights."""
    reference = cnn()
    expected = fit(keras_fit, reference)
    with two_replicas().scope():
        synced, default = cnn(), cnn()
    history = fit(tfdist.fit, synced, sync_batchnorm=True)
    fit(tfdist.fit, default)
    assert len(norms(synced)) == 2 and reference.get_weights()[2].shape == (4,)
    for got, want in zip(synced.get_weights(), reference.get_weights()):  # Moving mean and variance included.
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], atol=1e-5, err_msg=key)
    assert max(float(np.abs(a - b).max()) for a, b in zip(default.get_weights(), reference.get_weights())) > 1e-3
    assert [layer.synchronized for layer in norms(synced)] == [False, False]


def check_job(out):
    """Both tasks of tests/programs/sync_batchnorm.py ended with Keras' one-device weights (1e-5) and their
    layers given back."""
    reference = cnn()
    fit(keras_fit, reference)
    wanted = reference.get_weights()
    for task in (0, 1):
        saved = np.load(os.path.join(out, f"task{task}.npz"))
        for i, want in enumerate(wanted):
            np.testing.assert_allclose(saved[f"arr_{i}"], want, atol=1e-5, rtol=0, err_msg=f"task {task}, {i}")
        assert not saved["synchronized"].any()


@pytest.mark.jobs
def test_two_workers_with_the_option_train_as_one_device(tmp_path):
    """2 MultiWorkerMirrored workers of 4 examples each: the statistics are the global batch's."""
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             "tests/programs/sync_batchnorm.py", str(tmp_path), "multi_worker_mirrored"],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_job(tmp_path)


@needs_horovod
def test_two_horovod_ranks_with_the_option_train_as_one_device(tmp_path):
    """2 Horovod ranks (no replica context: the statistics' sums go through Horovod)."""
    result = horovodrun([sys.executable, os.path.join(REPO, "tests", "programs", "sync_batchnorm.py"),
                         str(tmp_path), "horovod"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_job(tmp_path)


class Failing(keras.callbacks.Callback):
    """Records each BatchNormalization's `synchronized` and config value at the first batch's end, then raises."""

    def __init__(self, error):
        super().__init__()
        self.error, self.seen = error, None

    def on_train_batch_end(self, batch, logs=None):
        layers = norms(self.model)
        self.seen = ([layer.synchronized for layer in layers], [layer.get_config()["synchronized"] for layer in layers],
                     [c["config"]["synchronized"] for c in self.model.get_config()["layers"]
                      if c["class_name"] == "BatchNormalization"])
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "interrupt"])
def test_a_failing_fit_leaves_the_users_layers_as_they_were(error):
    """During fit every layer is synchronized while get_config reports the user's own values (a model saved
    then is the user's); a fit that raises, KeyboardInterrupt included, gives each layer its own value back."""
    with two_replicas().scope():
        model = cnn(user_synchronized=True)  # The nested layer: the user's own True, kept.
    callback = Failing(error)
    with pytest.raises(type(error)):
        fit(tfdist.fit, model, sync_batchnorm=True, callbacks=[callback])
    assert callback.seen == ([True, True], [False, True], [False])
    layers = norms(model)
    assert [layer.synchronized for layer in layers] == [False, True]
    assert [layer.get_config()["synchronized"] for layer in layers] == [False, True]
    assert not any("get_config" in vars(layer) for layer in layers)


def test_fit_warns_once_when_replicas_normalize_small_batches(caplog, monkeypatch):
    """Batch 8 on 2 replicas with unsynchronized layers: one warning naming the option, not repeated by the next
    fit; not given with the option, nor with 32 examples a replica."""
    monkeypatch.setattr(sync_batchnorm, "_warned", False)
    with two_replicas().scope():
        model = cnn()
    with caplog.at_level("WARNING"):
        tfdist.fit(model, X[TRAIN], Y[TRAIN], batch_size=8, max_steps=1, verbose=0)
        tfdist.fit(model, X[TRAIN], Y[TRAIN], batch_size=8, max_steps=1, verbose=0)
    assert caplog.text.count("sync_batchnorm=True") == 1
    assert "2 BatchNormalization layer(s)" in caplog.text and "each of the 2 replicas takes 4 example(s)" in caplog.text
    for arguments in ({"batch_size": 8, "sync_batchnorm": True}, {"batch_size": 64}):
        caplog.clear()
        monkeypatch.setattr(sync_batchnorm, "_warned", False)
        with caplog.at_level("WARNING"):
            tfdist.fit(model, X[TRAIN], Y[TRAIN], max_steps=1, verbose=0, **arguments)
        assert "sync_batchnorm" not in caplog.text, arguments


def backend(replicas=2, asynchronous=False):
    return types.SimpleNamespace(num_replicas=replicas, asynchronous=asynchronous, is_chief=True)


def during(model, stand_in, enabled, micro_batch=4):
    """`apply` inside a fit's restoring scope: each layer's `synchronized` while that fit would run."""
    def body():
        sync_batchnorm.apply(model, stand_in, micro_batch, enabled)
        return [layer.synchronized for layer in norms(model)]
    return sync_batchnorm.restoring(body)()


def test_the_warning_threshold_is_32_examples_a_replica(caplog, monkeypatch):
    for micro_batch, warned in ((32, False), (31, True)):
        caplog.clear()
        monkeypatch.setattr(sync_batchnorm, "_warned", False)
        with caplog.at_level("WARNING"):
            assert during(cnn(), backend(), False, micro_batch) == [False, False]
        assert ("sync_batchnorm=True" in caplog.text) == warned, micro_batch


@pytest.mark.parametrize("case", ["one replica", "parameter servers", "synchronized by the user", "no layer"])
def test_where_each_step_already_normalizes_the_global_batch_nothing_changes_or_warns(case, caplog, monkeypatch):
    """One replica; a parameter-server worker's step (the whole global batch); layers the user synchronized; a
    model without BatchNormalization: no warning, and the option leaves every layer alone."""
    monkeypatch.setattr(sync_batchnorm, "_warned", False)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]) if case == "no layer" else cnn()
    if case == "synchronized by the user":
        norms(model)[0].synchronized = norms(model)[1].synchronized = True
    stand_in = backend(replicas=1) if case == "one replica" else \
        backend(asynchronous=True) if case == "parameter servers" else backend()
    before = [layer.synchronized for layer in norms(model)]
    with caplog.at_level("WARNING"):
        for enabled in (False, True):
            assert during(model, stand_in, enabled) == before
    assert "sync_batchnorm" not in caplog.text
    assert during(cnn(), backend(), True) == [True, True]  # The same call where it applies.


def test_a_value_other_than_a_bool_is_refused():
    with pytest.raises(tfdist.UserError, match=r"sync_batchnorm='yes' must be True or False"):
        sync_batchnorm.apply(cnn(), backend(), 4, "yes")
