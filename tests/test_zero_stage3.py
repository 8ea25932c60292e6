"""tfdist.training.zero.stage3 and gathering: `zero_stage=3`, the weights themselves in equal flat shards during
fit, each layer's gathered just before it runs and again in its backward pass, exact against the unsharded run
(bit for bit on 2 collective replicas) and against Keras' own one-device fit (1e-5); the user's model left as
it was on every exit path."""

import keras
import numpy as np
import pytest

import tfdist
from tfdist.distribute.backend import tf_variable
from tfdist.errors import UserError
from tfdist.training import zero
from tfdist.training.fitting import train
from tests.zero_model import BATCH, data

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def mlp(optimizer):
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                            keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(3)])
    net.compile(optimizer=optimizer(), loss="mse")
    return net


def strategy():
    """2 replicas on MirroredStrategy's collective ops (the all-gather of equal parts, the all-to-all
    reduce-scatter)."""
    return tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")


def keras_fit(build, x, y, steps=20, **kwargs):
    reference = build()
    reference.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, shuffle=False, verbose=0, **kwargs)
    return reference.get_weights()


def tfdist_fit(build, x, y, stage, callbacks=(), **kwargs):
    s = strategy()
    with s.scope():
        net = build()
    result = train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=s, zero_stage=stage,
                   export=(), callbacks=list(callbacks), **kwargs)
    return net, result


def buffers(net):
    """The elements each replica's buffer of each trainable variable holds now (read past Keras)."""
    return [[int(np.size(c.read_value())) for c in tf_variable(v).values] for v in net.trainable_variables]


class Watch(keras.callbacks.Callback):
    """Records the replicas' buffers of the trainable variables at each batch's end (inside the fit)."""

    def __init__(self, raise_at=None, error=RuntimeError):
        super().__init__()
        self.seen, self.raise_at, self.error = [], raise_at, error

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(buffers(self.model))
        if batch == self.raise_at:
            raise self.error("stop here")


def assert_left_alone(net):
    """The model as the user made it: whole buffers, no call replaced."""
    whole = [[int(np.prod(v.shape))] * 2 for v in net.trainable_variables]
    assert buffers(net) == whole
    assert all("call" not in layer.__dict__ for layer in net._flatten_layers())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_mlp_trains_as_unsharded_bit_for_bit_and_as_keras(name):
    x, y = data()
    build = lambda: mlp(OPTIMIZERS[name])  # noqa: E731
    expected = keras_fit(build, x, y)
    unsharded, _ = tfdist_fit(build, x, y, 0)
    watch = Watch()
    net, result = tfdist_fit(build, x, y, 3, callbacks=[watch])
    assert result.steps == 20 and int(np.asarray(net.optimizer.iterations)) == 20
    for a, b in zip(net.get_weights(), unsharded.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(net.get_weights(), expected):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # During the fit no replica held a whole trainable variable: each held its 1/2 of each layer's flat shard.
    assert len(watch.seen) == 20 and all(seen == [[0, 0]] * 6 for seen in watch.seen)
    sharded = zero._SHARDED[net.optimizer]
    assert [b.indices for b in sharded.layout] == [(0, 1), (2, 3), (4, 5)]  # One bucket a layer.
    assert_left_alone(net)
    assert not net.optimizer.built
    assert all(np.size(tf_variable(p).read_value()) == 0 for s in sharded.shards.values() for p in s.params)


def test_the_step_gathers_each_layer_and_reduce_scatters_its_gradient():
    """The traced step: one all-gather a layer in the forward pass and one again in the backward pass (the
    recomputation), one all-to-all (the reduce-scatter) a layer, and no all-reduce of the weights' gradient."""
    x, y = data()
    import tfdist.training.zero.gathering as gathering
    calls = {"gather": 0, "rs": 0}
    original = gathering.collectives
    counting = type("Counting", (), {
        "all_gather": staticmethod(lambda *a: calls.__setitem__("gather", calls["gather"] + 1) or
                                   original.all_gather(*a)),
        "reduce_scatter": staticmethod(lambda *a: calls.__setitem__("rs", calls["rs"] + 1) or
                                       original.reduce_scatter(*a))})
    gathering.collectives = counting
    try:
        tfdist_fit(lambda: mlp(OPTIMIZERS["sgd_momentum"]), x, y, 3, max_steps=2)
    finally:
        gathering.collectives = original
    # 3 layers, 2 replicas traced: forward + recomputation gathers, one reduce-scatter each.
    assert calls == {"gather": 3 * 2 * 2, "rs": 3 * 2}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_fit_that_stops_midway_leaves_the_model_whole_with_its_weights(error):
    x, y = data()
    build = lambda: mlp(OPTIMIZERS["adam"])  # noqa: E731
    stopped = Watch(raise_at=4, error=error)
    with pytest.raises(error):
        tfdist_fit(build, x, y, 0, callbacks=[stopped])
    unsharded = stopped.model
    watch = Watch(raise_at=4, error=error)
    with pytest.raises(error):
        tfdist_fit(build, x, y, 3, callbacks=[watch])
    net = watch.model
    assert watch.seen[-1] == [[0, 0]] * 6  # Sharded when it stopped.
    assert_left_alone(net)
    for a, b in zip(net.get_weights(), unsharded.get_weights()):  # The 5 steps it made.
        np.testing.assert_array_equal(a, b)
    # The model trains on as the user's own (one more unsharded step).
    more = Watch()
    train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=net.distribute_strategy
          if hasattr(net, "distribute_strategy") else None, export=(), max_steps=1, callbacks=[more])
    assert more.seen == [[[int(np.prod(v.shape))] * 2 for v in net.trainable_variables]]


def test_what_stage_3_cannot_gather_is_refused_before_any_step():
    x, y = data()

    def regularized():
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3, kernel_regularizer="l2")])
        net.compile(optimizer="sgd", loss="mse")
        return net
    with pytest.raises(UserError, match="regularizer reads the whole weight"):
        tfdist_fit(regularized, x, y, 3)
    for all_reduce in ("reduce_to_one",):
        s = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", all_reduce=all_reduce)
        with s.scope():
            net = mlp(OPTIMIZERS["adam"])
        with pytest.raises(UserError, match="collective ops"):
            train(net, x, y, batch_size=BATCH, verbose=0, strategy=s, zero_stage=3, export=())
