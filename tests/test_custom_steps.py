"""tfdist.training.custom_steps: models with their own train_step/test_step train as Keras trains them.

The reference is Keras' own `fit` on one device, same initial weights and batches, SGD,
float32. Keras 3's `fit` under MirroredStrategy sums the replicas' gradients of a loss
the step computes itself (N times the one-device gradient); tfdist hands every optimizer
the global batch's gradients on every backend.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests import custom_models
from tests.conftest import REPO, subprocess_env
from tests.test_horovod import horovodrun, needs_horovod

BATCH = 32


def batches(x, y=None):
    data = (x, y) if y is not None else x
    return tf.data.Dataset.from_tensor_slices(data).batch(BATCH, drop_remainder=True)


def mirrored2():
    return tfdist.make_strategy("mirrored", num_cpu_replicas=2, all_reduce="reduce_to_one")


def keras_reference(build, initial, x, y, epochs=2, validation=None):
    model = build()
    model.set_weights(initial)
    history = model.fit(batches(x, y), epochs=epochs, verbose=0, validation_data=validation)
    return model, history.history


def assert_close(a, b, atol=1e-5):
    for left, right in zip(a, b, strict=True):
        np.testing.assert_allclose(left, right, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def data():
    return custom_models.regression()


@pytest.mark.parametrize("build", [custom_models.custom_fit_model, custom_models.compute_loss_model],
                         ids=["own-loss", "compute_loss"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_custom_train_step_trains_to_keras_weights_and_history(build, replicas, data):
    x, y = data
    keras.utils.set_random_seed(0)
    initial = build().get_weights()
    reference, expected = keras_reference(build, initial, x, y, validation=(x[:96], y[:96]))
    strategy = mirrored2() if replicas == 2 else tfdist.make_strategy("default")
    with strategy.scope():
        model = build()
    model.set_weights(initial)
    history = tfdist.fit(model, batches(x, y), epochs=2, strategy=strategy, verbose=0, steps_per_execution=3,
                         validation_data=(x[:96], y[:96]))
    assert_close(model.get_weights(), reference.get_weights())
    assert sorted(history.history) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(history.history[key], values, atol=1e-5, err_msg=key)


def test_a_gan_with_two_optimizers_trains_on_two_replicas_and_leaves_them_as_they_were():
    x = custom_models.images()
    strategy = mirrored2()
    with strategy.scope():
        gan = custom_models.gan_model()
    optimizers = (gan.d_optimizer, gan.g_optimizer)
    before = [dict(vars(opt)) for opt in optimizers]
    history = tfdist.fit(gan, batches(x), epochs=2, strategy=strategy, verbose=0)
    steps = 2 * len(x) // BATCH
    assert [int(opt.iterations.numpy()) for opt in optimizers] == [steps, steps]
    assert sorted(history.history) == ["d_loss", "g_loss"] and len(history.history["d_loss"]) == 2
    assert all(np.isfinite(v) for values in history.history.values() for v in values)
    for opt, was in zip(optimizers, before):
        assert "apply" not in vars(opt) and "_all_reduce_sum_gradients" not in vars(opt)
        assert {k for k in vars(opt) if k in was} == set(was)  # Nothing of theirs removed or replaced...
        assert all(vars(opt)[k] is v for k, v in was.items() if not k.startswith("_") and k != "built")


def test_two_workers_train_a_custom_step_to_keras_weights_and_a_gan_to_identical_weights(tmp_path, data):
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
         "tests/programs/custom_steps.py", "multi_worker_mirrored", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_trained_as_keras(tmp_path, data)


def test_a_parameter_server_job_trains_a_custom_step_to_keras_loss_and_a_gan_exactly_once(tmp_path, data):
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--num_ps=1", "--", sys.executable,
         "tests/programs/custom_steps.py", "parameter_server", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    x, y = data
    chief = dict(np.load(os.path.join(tmp_path, "task0.npz")))
    initial = [chief[f"i{i}"] for i in range(len([k for k in chief if k.startswith("w")]))]
    _, expected = keras_reference(custom_models.custom_fit_model, initial, x, y, validation=(x[:100], y[:100]))
    history = json.loads(str(chief["history"]))
    assert sorted(history) == sorted(expected)
    # Asynchronous workers, each in its own order: the same loss within 20% (measured: 0.3%) after 2 epochs.
    assert history["val_loss"][-1] == pytest.approx(expected["val_loss"][-1], rel=0.2), (history, expected)
    # Each step's updates applied once: the two optimizers counted the 8 steps exactly.
    assert chief["gan_steps"].tolist() == [len(x) // BATCH] * 2


@needs_horovod
def test_two_horovod_ranks_train_a_custom_step_to_keras_weights(tmp_path, data):
    result = horovodrun([sys.executable, "tests/programs/custom_steps.py", "horovod", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_trained_as_keras(tmp_path, data)


def assert_trained_as_keras(out, data):
    x, y = data
    tasks = [dict(np.load(os.path.join(out, f"task{i}.npz"))) for i in (0, 1)]
    count = len([k for k in tasks[0] if k.startswith("w")])
    initial = [tasks[0][f"i{i}"] for i in range(count)]
    reference, expected = keras_reference(custom_models.custom_fit_model, initial, x, y,
                                          validation=(x[:100], y[:100]))
    for task in tasks:
        assert_close([task[f"w{i}"] for i in range(count)], reference.get_weights())
        history = json.loads(str(task["history"]))
        for key, values in expected.items():
            np.testing.assert_allclose(history[key], values, atol=1e-5, err_msg=key)
        assert task["gan_steps"].tolist() == [len(x) // BATCH] * 2
    gan_keys = sorted(k for k in tasks[0] if k.startswith("g") and k[1:].isdigit())
    for key in gan_keys:
        np.testing.assert_array_equal(tasks[0][key], tasks[1][key])
    assert_train_on_batch_as_keras(tasks)


def assert_train_on_batch_as_keras(tasks):
    """tfdist.train_on_batch on 2 tasks (a global batch of 7 rows, then 10 with sample_weight): both tasks end
    with Keras' own train_on_batch weights on one device, from the same initial weights, and got its logs."""
    count = len([k for k in tasks[0] if k.startswith("oi")])
    reference = custom_models.on_batch_model()
    reference.set_weights([tasks[0][f"oi{i}"] for i in range(count)])
    names, first, second = custom_models.train_on_batch_calls(
        lambda model, *args, **kwargs: model.train_on_batch(*args, **kwargs), reference)
    assert names == ["accuracy", "loss", "wacc"] and len(second) == 3
    for task in tasks:
        assert task["on_batch_names"].tolist() == names
        np.testing.assert_allclose(task["on_batch_first"], first, atol=1e-5, rtol=0)
        np.testing.assert_allclose(task["on_batch_second"], second, atol=1e-5, rtol=0)
        assert_close([task[f"o{i}"] for i in range(count)], reference.get_weights())
    for i in range(count):  # The tasks' own copies agree exactly.
        np.testing.assert_array_equal(tasks[0][f"o{i}"], tasks[1][f"o{i}"])


# Bad input: one paragraph, before any step ---------------------------------------------------
class MakesVariables(custom_models.CustomFit):
    def train_step(self, data):
        self.extra = tf.Variable(0.0, name="made_in_step")
        return super().train_step(data)


class NotScalar(custom_models.CustomFit):
    def train_step(self, data):
        logs = super().train_step(data)
        return {**logs, "per_example": keras.ops.ones((BATCH,))}


def test_a_step_that_creates_variables_is_refused_before_any_step(data):
    x, y = data
    strategy = mirrored2()
    with strategy.scope():
        model = MakesVariables()
        model(x[:1])
        model.compile(optimizer=keras.optimizers.SGD(0.1))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(tfdist.UserError, match=r"MakesVariables.train_step\(\) creates variables that are not the "
                                               r"model's.*made_in_step.*Create them in __init__"):
        tfdist.fit(model, batches(x, y), strategy=strategy, verbose=0)
    assert_close(model.get_weights(), before, atol=0)


def test_a_log_that_is_not_a_scalar_is_refused(data):
    x, y = data
    model = NotScalar()
    model(x[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    with pytest.raises(tfdist.UserError, match=r"returns the log 'per_example' with shape \(32,\); every log value "
                                               r"must be a scalar"):
        tfdist.fit(model, batches(x, y), strategy=tfdist.make_strategy("default"), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_apply_on_variables_from_outside_the_scope_is_refused(data):
    x, y = data
    outside = keras.layers.Dense(1)
    outside.build((None, 4))

    class Outside(custom_models.CustomFit):
        def train_step(self, data):
            inputs, targets = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((outside(inputs) - targets) ** 2)
            grads = tape.gradient(loss, outside.trainable_variables)
            self.optimizer.apply(grads, outside.trainable_variables)
            return {"loss": loss}

    strategy = mirrored2()
    with strategy.scope():
        model = Outside()
        model(x[:1])
        model.compile(optimizer=keras.optimizers.SGD(0.1))
    with pytest.raises(tfdist.UserError, match=r"calls SGD.apply on variable .*kernel, which was not created under "
                                               r"the strategy's scope.* of the strategy the model was built under "
                                               r"\(the program's own tf.distribute strategy, or "
                                               r"tfdist.make_strategy's"):
        tfdist.fit(model, batches(x, y), strategy=strategy, verbose=0)


def test_grad_accumulation_is_refused_for_a_custom_train_step():
    model = custom_models.custom_fit_model()
    with pytest.raises(tfdist.UserError, match=r"CustomFit overrides train_step\(\) and test_step\(\); "
                                               r"grad_accum_steps=2 would have to split"):
        tfdist.fit(model, batches(*custom_models.regression()), grad_accum_steps=2, verbose=0,
                   strategy=tfdist.make_strategy("default"))



def test_a_custom_step_trains_a_partial_last_batch_and_validates_an_odd_one_as_keras():
    x, y = custom_models.regression(250)  # 7 x 32 + 26: 13 examples on each replica in the last step.
    vx, vy = custom_models.regression(97, seed=4)  # 3 x 32 + 1: each replica evaluates whole Keras batches.
    keras.utils.set_random_seed(0)
    initial = custom_models.custom_fit_model().get_weights()
    reference = custom_models.custom_fit_model()
    reference.set_weights(initial)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    expected = reference.fit(dataset, epochs=2, verbose=0, validation_data=(vx, vy)).history
    strategy = mirrored2()
    with strategy.scope():
        model = custom_models.custom_fit_model()
    model.set_weights(initial)
    history = tfdist.fit(model, dataset, epochs=2, strategy=strategy, verbose=0, validation_data=(vx, vy),
                         batch_size=BATCH).history
    assert_close(model.get_weights(), reference.get_weights())
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, atol=1e-5, err_msg=key)


def test_a_custom_step_whose_last_batch_leaves_a_replica_empty_is_refused():
    x, y = custom_models.regression(225)  # 7 x 32 + 1.
    strategy = mirrored2()
    with strategy.scope():
        model = custom_models.custom_fit_model()
    with pytest.raises(tfdist.UserError, match=r"The last batch of each epoch holds 1 example\(s\), fewer than the "
                                               r"2 replicas, so a replica would run CustomFit.train_step\(\) on no "
                                               r"example"):
        tfdist.fit(model, x, y, batch_size=BATCH, strategy=strategy, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_validation_of_a_model_without_call_or_test_step_is_refused():
    model = custom_models.gan_model()  # Keras' own fit fails on it after the first epoch, in Model.call.
    with pytest.raises(tfdist.UserError, match=r"GAN has neither call\(\) nor test_step\(\), so validation_data \(or "
                                               r"validation_split\) cannot be evaluated"):
        tfdist.fit(model, custom_models.images(), batch_size=BATCH, validation_split=0.25, verbose=0,
                   strategy=tfdist.make_strategy("default"))
