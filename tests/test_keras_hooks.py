"""tfdist.training.keras_hooks: Keras internals replaced only while entered, restored exactly, per thread."""

import threading

import keras
import pytest
import tensorflow as tf
from keras.src.losses import loss as loss_module

import tfdist
from tfdist.training import keras_hooks

MIRRORED = {"all_reduce": "reduce_to_one"}


def test_the_optimizer_is_patched_only_while_entered_and_restored_exactly():
    optimizer = keras.optimizers.SGD(0.1)
    assert "_all_reduce_sum_gradients" not in vars(optimizer)
    with keras_hooks.no_gradient_sum(optimizer):
        with keras_hooks.no_gradient_sum(optimizer):  # Nested entries: restored once, by the last.
            assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]
        assert "_all_reduce_sum_gradients" in vars(optimizer)
    assert "_all_reduce_sum_gradients" not in vars(optimizer)

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
