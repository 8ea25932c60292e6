"""tfdist.training.keras_hooks: Keras internals replaced only while entered, restored exactly, per thread."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.losses import loss as loss_module

import tfdist
from tfdist.training import keras_hooks

MIRRORED = {"all_reduce": "reduce_to_one"}
pytestmark = pytest.mark.keras_internals  # The TF 2.18 session runs these too (tests/conftest.py).


def test_the_optimizer_is_patched_only_while_entered_and_restored_exactly():
    optimizer = keras.optimizers.SGD(0.1)
    assert "_all_reduce_sum_gradients" not in vars(optimizer)
    with keras_hooks.no_gradient_sum(optimizer):
        with keras_hooks.no_gradient_sum(optimizer):  # Nested entries: restored once, by the last.
            assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]
        assert "_all_reduce_sum_gradients" in vars(optimizer)
    assert "_all_reduce_sum_gradients" not in vars(optimizer)

    def failing(before, key):  # A replacement that cannot be made leaves no entry behind: the next installs.
        raise KeyError("cannot make it")

    with pytest.raises(KeyError):
        with keras_hooks._replaced(optimizer, "_all_reduce_sum_gradients", failing):
            pass
    assert "_all_reduce_sum_gradients" not in vars(optimizer)
    with keras_hooks.no_gradient_sum(optimizer):
        assert "_all_reduce_sum_gradients" in vars(optimizer)  # Installed (a stale entry would skip it).
        assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]

    own = lambda grads_and_vars: "the user's own"  # noqa: E731  An attribute the user set is put back.
    optimizer._all_reduce_sum_gradients = own
    with pytest.raises(ZeroDivisionError):
        with keras_hooks.no_gradient_sum(optimizer):
            1 / 0
    assert vars(optimizer)["_all_reduce_sum_gradients"] is own


def test_losses_see_one_replica_on_the_entering_thread_only():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    original = loss_module.scale_loss_for_distribution
    seen = {}

    def other_thread():
        with strategy.scope():
            seen["other"] = float(loss_module.scale_loss_for_distribution(tf.constant(1.0)))

    with strategy.scope(), keras_hooks.one_replica_losses(tf.constant(4.0)):
        seen["here"] = float(loss_module.scale_loss_for_distribution(tf.constant(1.0)))
        seen["unscaled"] = float(loss_module.unscale_loss_for_distribution(tf.constant(1.0)))
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == {"here": 1.0, "unscaled": 4.0, "other": 0.5}
    assert loss_module.scale_loss_for_distribution is original


def test_a_missing_keras_internal_is_named(monkeypatch):
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    keras_hooks.check_internals(model, asynchronous=True)
    monkeypatch.delattr(loss_module, "unscale_loss_for_distribution")
    with pytest.raises(tfdist.UserError, match=r"does not have: keras.src.losses.loss.unscale_loss_for_distribution\. "
                                               r"Install a Keras 3 release"):
        keras_hooks.check_internals(model)


def test_a_replacement_that_fails_to_build_leaves_nothing_behind():
    owner = type("Owner", (), {})()

    def broken(before, key):
        raise RuntimeError("cannot build")

    with pytest.raises(RuntimeError):
        with keras_hooks._replaced(owner, "method", broken):
            pass
    assert not any(entry[0] is owner for entry in keras_hooks._installed.values())
    with keras_hooks._replaced(owner, "method", lambda before, key: "installed"):  # The next entry installs.
        assert owner.method == "installed"
    assert "method" not in vars(owner)


def test_sparse_increments_add_each_row_once_in_a_fixed_order():
    """The optimizer's scatter gets one row per index: the same sum, added in input order."""
    optimizer = keras.optimizers.SGD(0.1)
    variable = keras.Variable(tf.zeros((4, 2)))
    optimizer.build([variable])
    sent = []
    kind = type(variable.value)  # The tf.Variable class Keras' optimizer scatters into.
    original = kind.scatter_add

    def recording(self, sparse_delta, *args, **kwargs):
        sent.append(sparse_delta)
        return original(self, sparse_delta, *args, **kwargs)

    increment = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), tf.constant([2, 0, 2]),
                                 tf.constant([4, 2]))
    kind.scatter_add = recording
    try:
        with keras_hooks.no_gradient_sum(optimizer):
            optimizer.assign_add(variable, increment)
    finally:
        kind.scatter_add = original
    assert [list(s.indices.numpy()) for s in sent] == [[2, 0]]
    assert sent[0].values.numpy().tolist() == [[6.0, 8.0], [3.0, 4.0]]
    assert variable.numpy().tolist() == [[3.0, 4.0], [0.0, 0.0], [6.0, 8.0], [0.0, 0.0]]
    assert "assign_add" not in vars(optimizer)


def test_synchronized_moments_sum_through_the_given_replica_sum():
    """Under Horovod (no replica context) synchronized BatchNormalization's sums go through `replica_sum`:
    here a stand-in for two ranks whose other half is the same batch, so the moments are those of it twice."""
    from keras.src.backend.tensorflow import nn as tf_nn

    calls = []

    def two_ranks(tensors):
        calls.append(len(tensors))
        return [2.0 * t for t in tensors]

    x = tf.constant([[1.0, 2.0], [3.0, 8.0], [5.0, 2.0]])
    expected = [t.numpy() for t in tf.nn.moments(x, [0])]
    original = tf_nn._compute_moments_sync
    with keras_hooks.synchronized_moments(two_ranks):
        mean, variance = keras.ops.moments(x, [0], synchronized=True)
    assert calls == [3]  # Sum, squared sum and count, in one call.
    np.testing.assert_allclose(mean.numpy(), expected[0], rtol=1e-6)
    np.testing.assert_allclose(variance.numpy(), expected[1], rtol=1e-6)
    assert tf_nn._compute_moments_sync is original
    with keras_hooks.synchronized_moments(None):  # tf.distribute's replica context does it: nothing replaced.
        assert tf_nn._compute_moments_sync is original


def _custom_gradients() -> int:
    from tensorflow.python.framework import ops

    return sum(1 for name in ops._gradient_registry._registry if str(name).startswith("CustomGradient-"))


def test_fits_of_new_models_leave_no_traced_graph_behind():
    # Issue 40: each traced replica all-reduce (tf.custom_gradient in graph mode) stayed in TensorFlow's
    # gradient registry, holding its whole step graph and the eager context's copies of its functions:
    # ~190 MB a fit of a new stacked-LSTM model on 2 replicas, for good.
    import gc

    from tensorflow.python.eager import context

    x = np.random.default_rng(0).normal(size=(16, 3, 4)).astype("float32")
    y = np.zeros((16, 5), "float32")
    strategy = tfdist.make_strategy("mirrored", precision="float32", num_cpu_replicas=2, **MIRRORED)

    def fit_a_new_model():
        with strategy.scope():
            model = keras.Sequential([keras.Input((3, 4)), keras.layers.LSTM(5)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        tfdist.fit(model, x, y, batch_size=8, epochs=1, verbose=0)
        gc.collect()
        return _custom_gradients(), len(context.context().list_function_names())

    fit_a_new_model()  # Warms what is traced once a process.
    gradients, functions = fit_a_new_model()
    assert fit_a_new_model() == (gradients, functions)
