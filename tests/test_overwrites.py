"""tfdist.training.overwrites: variables Keras overwrites with their gradient (float8 training's scales and
amax histories) take the largest over the replicas and micro-batches, as one device's batch gives, never the
sum; zero_stage refuses them."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.errors import UserError

MIRRORED = {"all_reduce": "reduce_to_one"}
BATCH = 16


class CustomStep(keras.Sequential):
    """keras.io's custom train_step: the gradients of compute_loss applied by the model's optimizer."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def float8_model(kind=keras.Sequential, use_bias=True):
    keras.utils.set_random_seed(0)
    model = kind([keras.Input((8,)), keras.layers.Dense(16, use_bias=use_bias),
                  keras.layers.Dense(4, use_bias=use_bias)])
    for layer in model.layers:
        layer.quantize("float8")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def data(steps=1):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(steps * BATCH, 8)).astype("float32"),
            rng.normal(size=(steps * BATCH, 4)).astype("float32"))


@pytest.mark.parametrize("use_bias,steps,accum", [(False, 3, 1), (False, 3, 2), (True, 1, 1)],
                         ids=["3 steps", "3 steps, grad_accum_steps=2", "biases, 1 step"])
def test_float8_scales_on_two_replicas_are_keras_one_device_ones(use_bias, steps, accum):
    """A float8 MLP on 2 replicas (and in 2 micro-batches each): the scales and amax histories Keras overwrites
    equal its one-device fit's after 3 steps (the later scales computed from the combined histories; summed,
    each history would read about twice the batch's amax), the kernels to 1e-5. With biases, one step: the
    biases to 2e-4, as Keras' float8 Dense rounds its bias through bfloat16, so the bias gradient is rounded
    to bfloat16 on each replica's part, not once for the batch (measured 4.9e-5 after one step; the same
    0.5 + 0.5 split on one device without tfdist differs as much; over more steps the bias difference reaches
    the kernels through fp8 rounding)."""
    x, y = data(steps)
    reference = float8_model(use_bias=use_bias)
    start = [v.numpy() for v in reference.variables]
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = float8_model(use_bias=use_bias)
    for v, value in zip(model.variables, start):
        v.assign(value)
    tfdist.fit(model, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=strategy, grad_accum_steps=accum)
    assert len([v for v in model.trainable_variables if v.overwrite_with_gradient]) == 12
    for ours, keras_own in zip(model.trainable_variables, reference.trainable_variables):
        if ours.overwrite_with_gradient:
            tolerance = dict(rtol=1e-6, atol=1e-7)
        else:
            tolerance = dict(rtol=0, atol=2e-4 if ours.path.endswith("bias") else 1e-5)
        np.testing.assert_allclose(ours.numpy(), keras_own.numpy(), err_msg=ours.path, **tolerance)
    assert reference.layers[0].inputs_amax_history.numpy()[0] == pytest.approx(np.abs(x[-BATCH:]).max())
    if steps > 1:  # The scale of the last step, from the histories of those before it.
        assert model.layers[0].inputs_scale.numpy() != 1.0


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_stage_refuses_a_variable_keras_overwrites_with_its_gradient(stage):
    x, y = data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    with strategy.scope():
        model = float8_model()
    before = [v.numpy() for v in model.variables]
    with pytest.raises(UserError, match=rf"zero_stage={stage} cannot shard .*/dense\w*/inputs_scale: Keras overwrites it "
                                        "with its gradient"):
        tfdist.fit(model, x, y, batch_size=BATCH, verbose=0, strategy=strategy, zero_stage=stage)
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), value)


def test_a_custom_train_step_applying_float8_scales_on_two_replicas_is_refused_before_any_step():
    """Its loss is each replica's own mean: the output gradient's amax would be twice one device's (0.198
    against 0.099 here before this refusal)."""
    x, y = data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = float8_model(CustomStep)
    before = [v.numpy() for v in model.variables]
    with pytest.raises(UserError, match=r"The custom train_step calls SGD.apply on .*/dense\w*/inputs_scale, which "
                                        "Keras overwrites with its gradient"):
        tfdist.fit(model, x, y, batch_size=BATCH, verbose=0, strategy=strategy)
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), value)
    assert int(model.optimizer.iterations.numpy()) == 0
