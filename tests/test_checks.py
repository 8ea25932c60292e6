"""tfdist.training.checks: what is refused before any step, and what the refusal says."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist


def test_a_model_of_another_strategy_is_refused_naming_it_and_the_fix():
    """A model built under the program's own MirroredStrategy, trained with strategy= TensorFlow's default: the
    refusal names the model's strategy and says that strategy (or none: the model's) is taken, now that any
    tf.distribute strategy the model was built under is (the message used to say only "another strategy")."""
    mine = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
    with mine.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    before = [np.asarray(w) for w in model.get_weights()]
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    with pytest.raises(tfdist.UserError, match=r"belongs to a MirroredStrategy, but this call trains under "
                                               r"tfdist's default strategy .* leave strategy= out"):
        tfdist.fit(model, x, y, verbose=0, strategy=tf.distribute.get_strategy())
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_ema_overwrite_frequency_on_several_replicas_is_refused_before_any_step():
    """Keras' optimizer overwrites the weights inside a tf.cond holding a merge_call, which TensorFlow refuses in a
    replica context (Keras' own fit under the strategy fails mid-trace): tfdist refuses it before any step, with
    the weights and the optimizer's step count untouched (without the check: a RuntimeError mid-trace)."""
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, use_ema=True, ema_overwrite_frequency=3), loss="mse")
    before = [np.asarray(w) for w in model.get_weights()]
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    with pytest.raises(tfdist.UserError, match=r"ema_overwrite_frequency=3\) cannot run on 2 replicas .* "
                                               r"Leave ema_overwrite_frequency=None"):
        tfdist.fit(model, x, y, verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0
