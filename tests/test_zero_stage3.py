"""tfdist.training.zero.stage3 and gathering: `zero_stage=3`, the weights themselves in equal flat shards during
fit, each layer's gathered just before it runs and again in its backward pass, exact against the unsharded run
(bit for bit on 2 collective replicas) and against Keras' own one-device fit (1e-5); the user's model left as
it was on every exit path."""

import functools
import os
import re
import subprocess
import sys
import tempfile

import keras
import numpy as np
import pytest
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

import tfdist
from tfdist.distribute.backend import tf_variable
from tfdist.errors import UserError
from tfdist.training import zero
from tfdist.training.fitting import train
from tests.test_horovod import horovodrun, needs_horovod
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(None)
def strategy():
    """2 replicas on MirroredStrategy's collective ops (the all-gather of equal parts, the all-to-all
    reduce-scatter), one for the process: a new collective strategy counts TensorFlow's instance keys from 100
    again, and a key an earlier one used for another shape aborts its collectives."""
    return tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")


def fresh(body, *args):
    """Runs `body(*args)` (a function of this module) in a fresh process: this module's collective strategy is
    the process's first (another test's, under pytest-xdist, may have taken the instance keys)."""
    from tests.conftest import subprocess_env
    code = f"import tests.conftest; from tests.test_zero_stage3 import {body}; {body}(*{args!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


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
    """Records at each batch's end (inside the fit) what the callback sees: the replicas' buffers of the
    trainable variables, and the weights; and what the step left: the buffers just before stage 3 gathers
    the weights whole for the callback (`stage3.whole_weights`)."""

    def __init__(self, raise_at=None, error=RuntimeError):
        super().__init__()
        self.seen, self.weights, self.left, self.raise_at, self.error = [], [], [], raise_at, error

    def on_train_begin(self, logs=None):
        from tfdist.training.zero import stage3
        sharded = zero._SHARDED.get(self.model.optimizer)
        if isinstance(sharded, stage3.Stage3Optimizer):
            gather, net = sharded.gather_whole, self.model

            def spied():
                self.left.append(buffers(net))
                gather()
            sharded.gather_whole = spied

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(buffers(self.model))
        self.weights.append(self.model.get_weights())
        if batch == self.raise_at:
            raise self.error("stop here")

    def on_train_end(self, logs=None):
        sharded = zero._SHARDED.get(self.model.optimizer)
        if sharded is not None:
            sharded.__dict__.pop("gather_whole", None)


def assert_left_alone(net):
    """The model as the user made it: whole buffers, no call replaced."""
    whole = [[int(np.prod(v.shape))] * 2 for v in net.trainable_variables]
    assert buffers(net) == whole
    assert all("call" not in layer.__dict__ and "quantized_call" not in layer.__dict__
               for layer in net._flatten_layers())
    assert "_compute_loss" not in net.__dict__


def _an_mlp_trains_as_unsharded_bit_for_bit_and_as_keras(name):
    x, y = data()
    build = lambda: mlp(OPTIMIZERS[name])  # noqa: E731
    expected = keras_fit(build, x, y)
    seen = Watch()
    unsharded, _ = tfdist_fit(build, x, y, 0, callbacks=[seen])
    watch = Watch()
    net, result = tfdist_fit(build, x, y, 3, callbacks=[watch])
    assert result.steps == 20 and int(np.asarray(net.optimizer.iterations)) == 20
    for a, b in zip(net.get_weights(), unsharded.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(net.get_weights(), expected):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # Between steps no replica held a whole trainable variable: each held its 1/2 of each layer's flat shard
    # (then the weights were gathered for the callback, which saw them whole: the unsharded run's, each batch).
    assert len(watch.left) > 20 and all(left == [[0, 0]] * 6 for left in watch.left)  # 20 batch ends, epoch ends.
    assert watch.seen == seen.seen
    for got, want in zip(watch.weights, seen.weights):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    sharded = zero._SHARDED[net.optimizer]
    assert [b.indices for b in sharded.layout] == [(0, 1), (2, 3), (4, 5)]  # One bucket a layer.
    assert_left_alone(net)
    assert not net.optimizer.built
    assert all(np.size(tf_variable(p).read_value()) == 0 for s in sharded.shards.values() for p in s.params)


class OldStyle(keras.callbacks.Callback):
    """Overrides only the legacy on_batch_end (Keras' on_train_batch_end calls it)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def on_batch_end(self, batch, logs=None):
        self.shapes.append(tuple(np.shape(self.model.layers[0].get_weights()[0])))


def _added_layers_and_callbacks_without_class_hooks_see_whole_weights():
    """A Sequential grown by add() (Keras calls every layer again at each add: a layer's nodes are not calls
    of one forward pass) trains; a LambdaCallback (hooks on the instance) and a callback overriding only the
    legacy on_batch_end see the whole weights (before: zero-size arrays)."""
    def build():
        keras.utils.set_random_seed(1)
        net = keras.Sequential()
        net.add(keras.Input((8,)))
        for units, activation in ((16, "tanh"), (12, "tanh"), (3, None)):
            net.add(keras.layers.Dense(units, activation=activation))
        net.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return net
    x, y = data()
    runs = {}
    for stage in (0, 3):
        epochs, old = [], OldStyle()
        lam = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs, seen=epochs: seen.append([w.shape for w in lam_model[0].get_weights()]))
        lam_model = []
        s = strategy()
        with s.scope():
            net = build()
        lam_model.append(net)
        train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=s, zero_stage=stage, export=(),
              callbacks=[lam, old], epochs=2)
        runs[stage] = (net.get_weights(), epochs, old.shapes)
    assert runs[3][1] == runs[0][1] == [[(8, 16), (16,), (16, 12), (12,), (12, 3), (3,)]] * 2
    assert runs[3][2] == runs[0][2] == [(8, 16)] * 40
    for a, b in zip(runs[3][0], runs[0][0]):
        np.testing.assert_array_equal(a, b)


def _the_step_gathers_each_layer_and_reduce_scatters_its_gradient():
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
        # The last two layers are kept gathered for the backward pass (never the first: it is recomputed).
        assert calls == {"gather": (3 + 1) * 2, "rs": 3 * 2}, calls
        calls.update(gather=0, rs=0)
        gathering.HOLD_FACTOR = 0  # None kept: every layer gathered again and recomputed.
        tfdist_fit(lambda: mlp(OPTIMIZERS["sgd_momentum"]), x, y, 3, max_steps=2)
    finally:
        gathering.collectives = original
    # 3 layers, 2 replicas traced: forward + recomputation gathers, one reduce-scatter each.
    assert calls == {"gather": 3 * 2 * 2, "rs": 3 * 2}


def _a_fit_that_stops_midway_leaves_the_model_whole_with_its_weights(error):
    error = {"RuntimeError": RuntimeError, "KeyboardInterrupt": KeyboardInterrupt}[error]
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
    assert watch.left[-1] == [[0, 0]] * 6  # Sharded when it stopped.
    assert_left_alone(net)
    for a, b in zip(net.get_weights(), unsharded.get_weights()):  # The 5 steps it made.
        np.testing.assert_array_equal(a, b)
    # The model trains on as the user's own (one more unsharded step).
    more = Watch()
    train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=net.distribute_strategy
          if hasattr(net, "distribute_strategy") else None, export=(), max_steps=1, callbacks=[more])
    assert more.seen == [[[int(np.prod(v.shape))] * 2 for v in net.trainable_variables]]


def _what_stage_3_cannot_gather_is_refused_before_any_step():
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


# Non-trainable state under the recomputed backward pass -----------------------------------------------------
def _batch_norm_statistics_are_updated_once_as_unsharded_and_keras():
    """A CNN with BatchNormalization at top level and in a nested model: each norm layer is recomputed in the
    backward pass, whose own statistics writes are dropped (written twice, the moving statistics would move
    twice as far); or kept gathered from the forward pass (every unit but the first, at the default
    `HOLD_FACTOR`: the model's layers are small), its statistics written by the forward pass alone. Per-replica
    statistics: as unsharded, bit for bit; synchronized: as Keras (1e-5)."""
    from tests.batchnorm_model import TRAIN, X, Y, cnn
    from tfdist.training.zero import gathering

    def fit(stage, **kwargs):
        s = strategy()
        with s.scope():
            net = cnn()
        train(net, X[TRAIN], Y[TRAIN], batch_size=8, shuffle=False, verbose=0, strategy=s, zero_stage=stage,
              export=(), **kwargs)
        return net
    reference = cnn()
    reference.fit(X[TRAIN], Y[TRAIN], batch_size=8, shuffle=False, verbose=0)
    unsharded = {}
    for hold in (gathering.HOLD_FACTOR, 0):  # 0: every layer recomputed (none kept gathered).
        gathering.HOLD_FACTOR = hold
        for kwargs in ({}, {"sync_batchnorm": True}):
            key = tuple(kwargs)
            unsharded[key] = unsharded.get(key) or fit(0, **kwargs)
            sharded = fit(3, **kwargs)
            kept = gathering.held(gathering.units(sharded)) if hold else set()
            assert len(kept) == (4 if hold else 0)  # Both norm layers among them.
            assert len(sharded.non_trainable_weights) == 4  # Two norm layers' moving mean and variance.
            for a, b in zip(sharded.get_weights(), unsharded[key].get_weights()):
                np.testing.assert_array_equal(a, b)
            assert_left_alone(sharded)
    for a, b in zip(sharded.get_weights(), reference.get_weights()):  # Moving statistics included.
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


class Block(keras.layers.Layer):
    """Dense, Dropout, Dense in one layer: stage 3 gathers and recomputes them together, Dropout included."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(3))
        self.drop = keras.layers.Dropout(0.5, seed=7)
        self.out = keras.layers.Dense(8, kernel_initializer=keras.initializers.GlorotUniform(4))

    def call(self, x, training=None):
        return x + self.out(self.drop(self.inner(x), training=training))


def dropout_model():
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((8,)), Block(), keras.layers.Dropout(0.25, seed=5), keras.layers.Dense(3)])
    net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return net


def _dropout_in_a_recomputed_layer_draws_the_forward_passes_mask():
    """A redrawn mask in the recomputation would give gradients of another network than the loss's (and move
    the seed generator twice): the weights would differ from the unsharded run's."""
    from tfdist.training.zero import gathering
    x, y = data()
    unsharded, _ = tfdist_fit(dropout_model, x, y, 0)
    held, _ = tfdist_fit(dropout_model, x, y, 3)  # The last layer kept gathered, the block recomputed.
    gathering.HOLD_FACTOR = 0  # Both recomputed.
    sharded, _ = tfdist_fit(dropout_model, x, y, 3)
    assert [b.indices for b in zero._SHARDED[sharded.optimizer].layout] == [(0, 1, 2, 3), (4, 5)]
    for a, b, c in zip(sharded.get_weights(), unsharded.get_weights(), held.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)
    seeds = [v for v in sharded.variables if "seed_generator" in v.path]
    assert seeds and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                         zip(seeds, [v for v in unsharded.variables if "seed_generator" in v.path]))
    assert_left_alone(sharded)



def _a_fit_at_another_stage_goes_on_from_the_moments_the_one_before_left():
    """Adam, 4 steps a fit: tfdist.fit at stage 1, then at stage 3, unsharded, at stage 2 and at stage 3 again,
    the user's optimizer not built before the first (the first fit's state in its shards alone, in a layout
    stage 3 does not use): each fit goes on from the moments and step count the one before left, as Keras' five
    fits of 4 steps (1e-5; without the carry-over, fresh moments at stage 3 ended 3.6e-2 away)."""
    from tests.zero_model import model
    x, y = data()
    reference = model(OPTIMIZERS["adam"])
    s = strategy()
    with s.scope():
        net = model(OPTIMIZERS["adam"])
    for k, stage in enumerate((1, 3, 0, 2, 3)):
        part = slice(4 * k * BATCH, 4 * (k + 1) * BATCH)
        reference.fit(x[part], y[part], batch_size=BATCH, shuffle=False, verbose=0)
        train(net, x[part], y[part], batch_size=BATCH, shuffle=False, verbose=0, strategy=s, zero_stage=stage,
              export=())
        for a, b in zip(net.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"fit {k} (stage {stage})")
        assert int(net.optimizer.iterations) == 4 * (k + 1)
    assert_left_alone(net)
    # The user's optimizer, built by the carry-over, holds Keras' state after the last fit.
    assert len(net.optimizer.variables) == len(reference.optimizer.variables)
    for a, b in zip(net.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=a.path)
    # A fit that resumes a checkpoint goes on from the checkpoint's state instead (saved at stage 1 with the
    # optimizer unbuilt: a carry-over would build slots the checkpoint does not hold, and the restore refuse).
    with s.scope():
        resumed = model(OPTIMIZERS["adam"])
    workdir = os.path.join(tempfile.mkdtemp(), "run")
    train(resumed, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=s, zero_stage=1, export=(),
          workdir=workdir, checkpoint_every_steps=5, max_steps=10)
    train(resumed, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=s, zero_stage=3, export=(),
          workdir=workdir)
    assert int(resumed.optimizer.iterations) == 20
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


class TwiceCalled(keras.Model):
    """A subclassed model that calls one Dense layer twice (a shared layer no graph shows)."""

    def __init__(self):
        super().__init__()
        self.square = keras.layers.Dense(8)
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.square(self.square(x)))


class TiedOutput(keras.Model):
    """A subclassed model reading its first layer's kernel in its own call (tied input and output weights)."""

    def __init__(self):
        super().__init__()
        self.inner = keras.layers.Dense(8, use_bias=False)
        self.bias = keras.layers.Dense(8)

    def call(self, x):
        return keras.ops.matmul(self.bias(self.inner(x)), keras.ops.transpose(self.inner.kernel))[:, :3]


class Holder(keras.layers.Layer):
    """A layer that holds another layer's Dense (its weights are then held by both)."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return self.dense(x)


class KernelPenalty(keras.Sequential):
    """A compute_loss override that reads a layer's weight (outside that layer's call)."""

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        return loss + 0.1 * keras.ops.sum(keras.ops.square(self.layers[0].kernel))


class CustomStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


class Branchy(keras.Model):
    """Calls a layer in each branch of a keras.ops.cond (a graph of its own, where no gather can run)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = keras.layers.Dense(8), keras.layers.Dense(8), keras.layers.Dense(3)

    def build(self, shape):  # Every layer (an eager call runs one branch only).
        for layer in (self.a, self.b, self.c):
            layer.build((None, 8))

    def call(self, x):
        h = self.a(x)
        return self.c(keras.ops.cond(keras.ops.max(h) > 100.0, lambda: self.b(h), lambda: h))


def relative_error(y_true, y_pred):
    """A loss not finite on a row of zeros (the stand-in row a replica with no example runs)."""
    return keras.ops.mean(keras.ops.square(y_pred - y_true) / keras.ops.abs(y_true))


def _a_short_batch_that_leaves_a_replica_without_an_example_trains_as_keras():
    """13 examples in batches of 12: the last batch's one example on one replica, the other's part empty. Its
    gradient adds nothing, and the other replica's owned slices are still updated (the reduce-scatter runs in
    the backward pass, before the step zeroes an empty part at stages 0-2); with a loss that is not finite on
    the empty part's stand-in row too: 2 epochs = Keras' fit (1e-5)."""
    x, y = data()
    x, y = x[:13], y[:13]
    for loss in ("mse", relative_error):
        def build():
            keras.utils.set_random_seed(1)
            net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                    keras.layers.Dense(3)])
            net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
            return net
        net, _ = tfdist_fit(build, x, y, 3, epochs=2)
        for a, b in zip(net.get_weights(), keras_fit(build, x, y, epochs=2)):
            assert np.isfinite(b).all()
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=str(loss))


def _a_masked_sequence_trains_as_keras():
    """A Masking layer's mask reaches the GRU as a boolean tensor in its call's arguments: taken as it is by
    the recomputation, which differentiates the unit's other inputs (before: a TypeError tracing the
    gradient of a boolean). 20 steps = Keras' fit (1e-5)."""
    x, y = data()
    x = x.reshape(-1, 4, 2)
    x[::3, 2:] = 0.0  # Every third sequence ends in 2 masked steps.

    def build():
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((4, 2)), keras.layers.Masking(0.0), keras.layers.GRU(5),
                                keras.layers.Dense(3)])
        net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        return net
    net, _ = tfdist_fit(build, x, y, 3)
    for a, b in zip(net.get_weights(), keras_fit(build, x, y)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def _quantized_layers_with_lora_train_as_keras():
    """Dense layers quantized to int8 and int4 with LoRA (Keras' own way to fine-tune a quantized model): Keras
    calls their quantized_call instead of call, which stage 3 gathers for as well (before: refused as 'Sequential.call
    reads lora_kernel_a outside the layer that holds it'). The trainable LoRA kernels and biases are sharded,
    the quantized kernels are not trainable. 20 steps = Keras' fit (1e-5)."""
    x, y = data()
    for mode in ("int8", "int4"):
        def build():
            keras.utils.set_random_seed(1)
            net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                    keras.layers.Dense(3)])
            for layer in net.layers:
                layer.enable_lora(2)
                layer.quantize(mode)
            net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
            return net
        net, _ = tfdist_fit(build, x, y, 3)
        assert_left_alone(net)
        assert [v.path.rsplit("/", 1)[1] for v in net.trainable_variables] == ["bias", "lora_kernel_a",
                                                                               "lora_kernel_b"] * 2
        for a, b in zip(net.get_weights(), keras_fit(build, x, y)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=mode)


class LayerModel(TensorFlowTrainer, keras.layers.Dense):
    """A layer given Keras' trainer as a model, as Keras' own trainer tests build theirs: no `layers`; its
    weights are its own."""

    def __init__(self):
        keras.layers.Dense.__init__(self, 3)
        TensorFlowTrainer.__init__(self)


class LayerOfLayers(TensorFlowTrainer, keras.layers.Layer):
    """A layer given Keras' trainer, its weights in two sublayers (no `layers` attribute to list them)."""

    def __init__(self):
        keras.layers.Layer.__init__(self)
        TensorFlowTrainer.__init__(self)
        self.a = keras.layers.Dense(16, activation="tanh")
        self.b = keras.layers.Dense(3)

    def call(self, x):
        return self.b(self.a(x))


def _a_layer_given_keras_trainer_trains_as_keras():
    """Its sublayers are the units (as `Model.layers` lists a model's): 20 steps = Keras' fit (1e-5)."""
    x, y = data()

    def build():
        keras.utils.set_random_seed(1)
        net = LayerOfLayers()
        net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        return net
    net, _ = tfdist_fit(build, x, y, 3)
    want = keras_fit(build, x, y)
    assert len(want) == 4
    for a, b in zip(net.get_weights(), want):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert_left_alone(net)


def _tied_and_shared_layers_and_a_custom_step_are_refused_with_the_model_left_alone():
    x, y = data()
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8)
    dense = keras.layers.Dense(8)

    def compiled(build):
        def make():
            keras.utils.set_random_seed(1)
            net = build()
            net.compile(optimizer="sgd", loss="mse")
            return net
        return make
    cases = [
        (compiled(lambda: keras.Model(inputs, keras.layers.Dense(3)(shared(shared(inputs))))),
         r"layer 'dense\w*': the model calls it more than once in a forward pass \(a shared layer\)"),
        (compiled(lambda: TwiceCalled()), r"calls it more than once in a forward pass \(a shared layer\)"),
        (compiled(lambda: TiedOutput()), r"TiedOutput.call reads it outside the layer that holds it"),
        (compiled(lambda: keras.Sequential([keras.Input((8,)), dense, Holder(dense), keras.layers.Dense(3)])),
         r"both hold it \(a tied or shared weight\)"),
        (compiled(lambda: CustomStep([keras.Input((8,)), keras.layers.Dense(3)])),
         r"custom train_step calls its optimizer itself"),
        (compiled(lambda: KernelPenalty([keras.Input((8,)), keras.layers.Dense(3)])),
         r"KernelPenalty.compute_loss reads it outside the layer that holds it"),
        (compiled(lambda: Branchy()), r"calls it inside a conditional or a loop of its own"),
        (compiled(lambda: keras.Sequential([keras.Input((8,)), keras.layers.SpectralNormalization(
            keras.layers.Dense(3))])), r"its call assigns the trainable weight \S*kernel \(as SpectralNormalization"),
    ]
    for build, match in cases:
        s = strategy()
        with s.scope():
            net = build()
            net(x[:2])  # Built (a subclassed model's layers too).
        before = net.get_weights()
        with pytest.raises(UserError, match=match) as raised:
            train(net, x, y, batch_size=BATCH, verbose=0, strategy=s, zero_stage=3, export=())
        assert "\n" not in str(raised.value)  # One paragraph, as raised (not as Keras rewrites a call's error).
        assert [w.shape for w in net.get_weights()] == [w.shape for w in before]
        assert_left_alone(net)
        for a, b in zip(net.get_weights(), before):
            np.testing.assert_array_equal(a, b)
        assert int(np.asarray(net.optimizer.iterations)) == 0
    with strategy().scope():
        net = compiled(lambda: LayerModel())()  # Unbuilt, as Keras' trainer tests fit theirs.
    with pytest.raises(UserError, match=r"LayerModel owns trainable weights itself \(layer_model/kernel\)"):
        train(net, x, y, batch_size=BATCH, verbose=0, strategy=strategy(), zero_stage=3, export=())
    assert int(np.asarray(net.optimizer.iterations)) == 0
    assert_left_alone(net)



# Whole weights for what reads the model between steps, and checkpoints -------------------------------------
def _validation_evaluate_and_predict_see_the_whole_trained_weights():
    """2 epochs validating on held-out data (Keras' evaluate inside the fit reads the whole weights, gathered
    for it, then sharded again), then Keras' own evaluate and predict: all as the unsharded run's."""
    x, y = data()
    xv, yv = x[:36] * 0.5, y[:36]
    build = lambda: mlp(OPTIMIZERS["adam"])  # noqa: E731
    runs = [tfdist_fit(build, x, y, stage, epochs=2, validation_data=(xv, yv))[0] for stage in (0, 3)]
    unsharded, sharded = runs
    assert sharded.history.history["val_loss"] == unsharded.history.history["val_loss"]
    assert len(set(sharded.history.history["val_loss"])) == 2
    for a, b in zip(sharded.get_weights(), unsharded.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert sharded.evaluate(xv, yv, verbose=0) == unsharded.evaluate(xv, yv, verbose=0)
    np.testing.assert_array_equal(sharded.predict(xv, verbose=0), unsharded.predict(xv, verbose=0))
    assert_left_alone(sharded)


def _a_checkpoint_holds_the_whole_weights_and_the_shards_and_resumes_exactly(tmp_path):
    """10 steps with checkpoints every 5 (AdamW with weight decay and global_clipnorm: the norm from the
    replicas' partial sums), resumed at stage 3 and at stage 1 to step 20: the uninterrupted run's weights."""
    import tensorflow as tf
    from tests.zero_model import keras_weights, model
    x, y = data()
    expected = keras_weights()
    whole, _ = tfdist_fit(model, x, y, 3)
    first, _ = tfdist_fit(model, x, y, 3, max_steps=10, workdir=f"{tmp_path}/run", checkpoint_every_steps=5)
    checkpoints = f"{tmp_path}/run/checkpoints"
    assert sorted(p for p in os.listdir(checkpoints) if p.startswith("zero-")) == ["zero-10", "zero-5"]
    saved = dict(tf.train.list_variables(tf.train.latest_checkpoint(checkpoints)))
    kernels = [shape for name, shape in saved.items() if "kernel" in name and "optimizer" not in name]
    assert sorted(map(tuple, kernels)) == [(8, 16), (12, 3), (16, 12)]  # Whole, not a freed buffer's [0].
    for stage in (3, 1):
        subprocess.run(["cp", "-r", f"{tmp_path}/run", f"{tmp_path}/run{stage}"], check=True)
        net, result = tfdist_fit(model, x, y, stage, workdir=f"{tmp_path}/run{stage}")
        assert (result.resumed_from, result.steps) == (10, 20)
        for a, b, c in zip(net.get_weights(), whole.get_weights(), expected):
            np.testing.assert_allclose(a, b, atol=0 if stage == 3 else 1e-6, rtol=0)
            np.testing.assert_allclose(a, c, atol=1e-5, rtol=0)
        assert_left_alone(net)



class HalfUsed(keras.layers.Layer):
    """A layer with a weight its call never reads (no gradient: Keras' optimizer leaves it alone, AdamW's decay
    included)."""

    def build(self, shape):
        self.used = self.add_weight(shape=(shape[-1],), initializer="ones")
        self.unused = self.add_weight(shape=(7,), initializer="ones")

    def call(self, x):
        return x * self.used


def _optimizers_and_a_second_fit_train_as_keras():
    """The optimizers stages 1 and 2 support, at stage 3 on 2 collective replicas (per-variable rules over a
    layer's shard cut in two: AdamW's weight decay, clipnorm, global_clipnorm, Lamb's trust ratio; EMA's
    averages put into the weights at the end; a loss scale's finite check), a weight without a gradient, and a
    second fit going on from the first's sharded state: Keras' own fit (1e-5)."""
    from tests.test_zero import OPTIMIZERS as ALL
    from tests.zero_model import keras_weights, model
    x, y = data()
    cases = {**ALL, "lamb": lambda: keras.optimizers.Lamb(0.01),
             "clipnorm": lambda: keras.optimizers.SGD(0.2, clipnorm=0.05)}
    for name, make in sorted(cases.items()):
        net, _ = tfdist_fit(lambda: model(make), x, y, 3)
        for a, b in zip(net.get_weights(), keras_weights(make)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)

    def half_used():
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((8,)), HalfUsed(), keras.layers.Dense(3)])
        net.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.5), loss="mse")
        return net
    net, _ = tfdist_fit(half_used, x, y, 3)
    for a, b in zip(net.get_weights(), keras_fit(half_used, x, y)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(net.get_weights()[1], np.ones(7))  # Never decayed.

    reference = model(OPTIMIZERS["adam"])
    s = strategy()
    with s.scope():
        twice = model(OPTIMIZERS["adam"])
    for _ in range(2):  # The first 10 batches, twice: Adam's moments go on from the first fit's.
        reference.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
        train(twice, x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0, strategy=s,
              zero_stage=3, export=())
    for a, b in zip(twice.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)



def _an_embedding_trains_with_sgd_and_is_refused_with_adam():
    """An Embedding's row-sparse gradient goes dense through the reduce-scatter: exact for SGD (momentum
    too); Keras' Adam moves only the touched rows' moments (dense, every row's: 0.04 apart after 20 steps), and
    a clip that triggers counts a repeated id's rows apart in Keras (SGD with clipnorm=0.01: 4e-5 off), so
    both refused."""
    rng = np.random.default_rng(0)
    ids, y = rng.integers(0, 50, size=(240, 4)), data()[1]

    def build(optimizer):
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(50, 6),
                                keras.layers.Flatten(), keras.layers.Dense(3)])
        net.compile(optimizer=optimizer(), loss="mse")
        return net
    exact = lambda: build(lambda: keras.optimizers.SGD(0.1, momentum=0.9))  # noqa: E731
    net, _ = tfdist_fit(exact, ids, y, 3)
    for a, b in zip(net.get_weights(), keras_fit(exact, ids, y)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for optimizer in (OPTIMIZERS["adam"], lambda: keras.optimizers.SGD(0.1, clipnorm=0.01)):
        with pytest.raises(UserError, match=r"embeddings with (Adam|SGD): its gradient is row-sparse"):
            tfdist_fit(lambda: build(optimizer), ids, y, 3)


# Each in a fresh process (`fresh`) ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_mlp_trains_as_unsharded_bit_for_bit_and_as_keras(name):
    fresh("_an_mlp_trains_as_unsharded_bit_for_bit_and_as_keras", name)


def test_added_layers_and_callbacks_without_class_hooks_see_whole_weights():
    fresh("_added_layers_and_callbacks_without_class_hooks_see_whole_weights")


def test_the_step_gathers_each_layer_and_reduce_scatters_its_gradient():
    fresh("_the_step_gathers_each_layer_and_reduce_scatters_its_gradient")


@pytest.mark.parametrize("error", ["RuntimeError", "KeyboardInterrupt"])
def test_a_fit_that_stops_midway_leaves_the_model_whole_with_its_weights(error):
    fresh("_a_fit_that_stops_midway_leaves_the_model_whole_with_its_weights", error)


def test_what_stage_3_cannot_gather_is_refused_before_any_step():
    fresh("_what_stage_3_cannot_gather_is_refused_before_any_step")


def test_batch_norm_statistics_are_updated_once_as_unsharded_and_keras():
    fresh("_batch_norm_statistics_are_updated_once_as_unsharded_and_keras")


def test_dropout_in_a_recomputed_layer_draws_the_forward_passes_mask():
    fresh("_dropout_in_a_recomputed_layer_draws_the_forward_passes_mask")


def test_tied_and_shared_layers_and_a_custom_step_are_refused_with_the_model_left_alone():
    fresh("_tied_and_shared_layers_and_a_custom_step_are_refused_with_the_model_left_alone")


def test_a_layer_given_keras_trainer_trains_as_keras():
    fresh("_a_layer_given_keras_trainer_trains_as_keras")


def test_a_masked_sequence_trains_as_keras():
    fresh("_a_masked_sequence_trains_as_keras")


def test_quantized_layers_with_lora_train_as_keras():
    fresh("_quantized_layers_with_lora_train_as_keras")


def test_a_short_batch_that_leaves_a_replica_without_an_example_trains_as_keras():
    fresh("_a_short_batch_that_leaves_a_replica_without_an_example_trains_as_keras")


def test_validation_evaluate_and_predict_see_the_whole_trained_weights():
    fresh("_validation_evaluate_and_predict_see_the_whole_trained_weights")


def test_a_checkpoint_holds_the_whole_weights_and_the_shards_and_resumes_exactly(tmp_path):
    fresh("_a_checkpoint_holds_the_whole_weights_and_the_shards_and_resumes_exactly", str(tmp_path))



def test_optimizers_and_a_second_fit_train_as_keras():
    fresh("_optimizers_and_a_second_fit_train_as_keras")


def test_a_fit_at_another_stage_goes_on_from_the_moments_the_one_before_left():
    fresh("_a_fit_at_another_stage_goes_on_from_the_moments_the_one_before_left")


def test_an_embedding_trains_with_sgd_and_is_refused_with_adam():
    fresh("_an_embedding_trains_with_sgd_and_is_refused_with_adam")



def test_tfdist_train_under_mixed_bfloat16_ends_on_the_unsharded_runs_weights(tmp_path):
    """`tfdist-train --zero_stage=3`: its CNN under the mixed_bfloat16 policy (the layers read bfloat16 casts of
    the gathered float32 weights, and the recomputation must cast as the forward pass did), with its checkpoint
    and model.keras export: the unsharded run's weights, bit for bit (their fingerprints)."""
    from tests.conftest import run_module
    prints = []
    for stage in (0, 3):
        result = run_module("tfdist.cli.train", ["--strategy=mirrored", "--num_cpu_replicas=2", "--max_steps=20",
                                                 "--precision=mixed_bfloat16", f"--zero_stage={stage}", "--seed=1",
                                                 f"--workdir={tmp_path}/stage{stage}"], timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        prints.append(re.findall(r"weights_fingerprint=(\w+)", result.stdout + result.stderr)[-1])
        assert os.path.exists(f"{tmp_path}/stage{stage}/model.keras")
    assert prints[0] == prints[1]


@pytest.mark.jobs
def test_two_workers_train_as_unsharded_and_as_keras(tmp_path):
    """2 MultiWorkerMirrored worker processes: each layer gathered across the workers, its gradient
    reduce-scattered by all-to-all over gRPC, the whole weights gathered back at the end by a collective (no
    process holds the other's shards); AdamW with weight decay and global_clipnorm (the norm summed from the
    workers' partial sums: not the unsharded run's bits, 6e-8 apart), one micro-batch and two. Before it, a
    fit whose worker 1 alone has a callback with a batch hook (a gather only it would start) fails on both."""
    from tests.conftest import subprocess_env
    from tests.zero_model import keras_weights

    def job(stage, accum):
        out = tmp_path / f"stage{stage}_accum{accum}"
        os.makedirs(out)
        uneven = {"TFDIST_TEST_UNEVEN_HOOKS": "1"} if (stage, accum) == (3, 1) else {}
        result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                                 "tests/programs/zero_job.py", str(out), "multi_worker_mirrored", str(stage), "20"],
                                capture_output=True, text=True, timeout=600, cwd=REPO,
                                env=subprocess_env({"TFDIST_TEST_ACCUM": str(accum), **uneven}))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        tasks = [np.load(os.path.join(out, f"task{i}.npz")) for i in range(2)]
        weights = [[t[f"arr_{k}"] for k in range(6)] for t in tasks]
        if uneven:
            for i in range(2):
                assert "and the workers were given callbacks with different hooks (worker 0: none; worker 1: " \
                    "on_train_batch_end)" in (out / f"refused{i}.txt").read_text()
        for a, b in zip(*weights):  # Both workers end with the same whole model.
            np.testing.assert_array_equal(a, b)
        return weights[0]
    unsharded, sharded, accumulated = job(0, 1), job(3, 1), job(3, 2)
    for a, b, c, d in zip(sharded, unsharded, accumulated, keras_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
        np.testing.assert_allclose(c, b, atol=1e-6, rtol=0)
        np.testing.assert_allclose(a, d, atol=1e-5, rtol=0)


@needs_horovod
def test_two_horovod_ranks_gather_and_train_as_keras(tmp_path):
    """hvd.allgather of each layer's equal parts (forward and recomputation), hvd.reducescatter of its gradient,
    two micro-batches: Keras' 20 steps."""
    from tests.zero_model import keras_weights
    result = horovodrun([sys.executable, os.path.join(REPO, "tests", "programs", "zero_job.py"), str(tmp_path),
                         "horovod", "3", "20"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tasks = [np.load(os.path.join(tmp_path, f"task{i}.npz")) for i in range(2)]
    for a, b, c in zip(*[[t[f"arr_{k}"] for k in range(6)] for t in tasks], keras_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, atol=1e-5, rtol=0)
