"""tfdist.training.updates: optimizers that wrap optimizers (Keras' MultiOptimizer, a user's own wrapper) apply
the global batch's gradient once, as Keras' own fit on one device does."""

import keras
import numpy as np
import pytest

import tfdist

MIRRORED = {"all_reduce": "reduce_to_one"}  # Collective all-reduces of several strategies collide in one process.
RNG = np.random.default_rng(6)
X = RNG.normal(size=(40, 4)).astype("float32")
Y = RNG.normal(size=(40, 1)).astype("float32")


class Split(keras.optimizers.Optimizer):
    """A user's wrapper: the first layer's variables to one optimizer, the rest to another."""

    def __init__(self, first, rest, name="split"):
        super().__init__(learning_rate=0.0, name=name)
        self.first, self.rest = first, rest

    def build(self, var_list):
        if self.built:
            return
        self.first.build(var_list[:2])
        self.rest.build(var_list[2:])
        super().build(var_list)

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        self.first.apply(list(grads[:2]), variables[:2])
        self.rest.apply(list(grads[2:]), variables[2:])
        self._iterations.assign_add(1)


def multi_optimizer():
    return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
        keras.optimizers.SGD(0.1), {"(.*/)?first/.*": keras.optimizers.SGD(0.05, momentum=0.5)}))


def split_optimizer():
    return Split(keras.optimizers.SGD(0.05, momentum=0.5), keras.optimizers.SGD(0.1))


def model_fn(make_optimizer):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="first"),
                              keras.layers.Dense(1, name="second")])
    model.compile(make_optimizer(), "mse")
    return model


def inner(optimizer):
    return optimizer.optimizers if isinstance(optimizer, keras.optimizers.MultiOptimizer) else \
        [optimizer.first, optimizer.rest]


@pytest.mark.parametrize("make_optimizer", [multi_optimizer, split_optimizer], ids=["MultiOptimizer", "wrapper"])
def test_an_optimizer_of_optimizers_trains_as_keras_on_two_replicas(make_optimizer):
    """Each inner optimizer gets the global batch's gradient once (it used to sum it across the replicas
    again: twice the step on 2 replicas); the user's optimizers are left without tfdist's hooks."""
    reference = model_fn(make_optimizer)
    reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    start = model_fn(make_optimizer).get_weights()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn(make_optimizer)
    tfdist.fit(model, X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for got, wanted, first in zip(model.get_weights(), reference.get_weights(), start):
        assert np.abs(wanted - first).max() > 1e-2  # Trained.
        np.testing.assert_allclose(got, wanted, atol=1e-5)
    ours, theirs = inner(model.optimizer), inner(reference.optimizer)
    assert [int(o.iterations) for o in ours] == [int(o.iterations) for o in theirs] == [10, 10]
    for opt in [model.optimizer, *ours]:
        assert not {"_all_reduce_sum_gradients", "assign_add", "assign_sub"} & set(vars(opt))


def test_zero_stage_refuses_an_optimizer_of_optimizers():
    """Sharding copies one optimizer per replica: a MultiOptimizer is refused before any step (it used to fail
    inside the traced step with a bare AssertionError)."""
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn(multi_optimizer)
    start = model.get_weights()
    with pytest.raises(tfdist.UserError, match="an optimizer of optimizers, such as MultiOptimizer, is not sharded"):
        tfdist.fit(model, X, Y, batch_size=8, epochs=1, verbose=0, zero_stage=1)
    for a, b in zip(model.get_weights(), start):
        np.testing.assert_array_equal(a, b)


def test_a_multi_optimizer_run_resumes_on_keras_trajectory(tmp_path):
    """The workdir's checkpoint holds the inner optimizers' state (momentum, step counts), which TensorFlow's
    checkpoint of a MultiOptimizer leaves out: a run stopped at step 6 and resumed ends on Keras' weights."""
    reference = model_fn(multi_optimizer)
    reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    for max_steps in (6, None):
        with strategy.scope():
            model = model_fn(multi_optimizer)
        tfdist.fit(model, X, Y, batch_size=8, epochs=2, max_steps=max_steps, shuffle=False, verbose=0,
                   workdir=str(tmp_path / "w"))
    for got, wanted in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, wanted, atol=1e-5)
    assert [int(o.iterations) for o in model.optimizer.optimizers] == [10, 10]
