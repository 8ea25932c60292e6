"""tfdist.distribute.adopting: a tf.distribute strategy the program built trains exactly as make_strategy's.

A model built under the program's own MirroredStrategy trains, evaluates and predicts through tfdist (with
and without ``strategy=``) as Keras on one device and as the same strategy from make_strategy; two real
MultiWorkerMirrored workers of a program that builds its own strategy end equal to each other and to Keras
(tests/programs/user_strategy.py, which also calls tfdist.train_on_batch). Kinds tfdist has no backend for are
refused, and the program's strategy object is left as it was.
"""

import importlib.util
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import REPO, subprocess_env
from tfdist.distribute import adopting, strategies

PROGRAM = os.path.join(REPO, "tests", "programs", "user_strategy.py")
# Collective all-reduces of different strategy instances collide in one process (tests/test_fitting.py).
REDUCE_TO_ONE = {"cross_device_ops": tf.distribute.ReductionToOneDevice()}
FIELDS = ("name", "device_kind", "num_replicas", "num_workers", "varying_shapes", "auto_pack", "all_tasks_save",
          "sharded_input", "asynchronous", "gradient_dtype", "cluster")


def _program():
    spec = importlib.util.spec_from_file_location("user_strategy", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


program = _program()


def data(n=80):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def close(a_weights, b_weights):
    for a, b in zip(a_weights, b_weights, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("pass_strategy", [False, True], ids=["the-models-strategy", "strategy="])
def test_the_programs_mirrored_strategy_trains_as_keras_and_as_make_strategys(pass_strategy):
    """2 CPU replicas of the program's own MirroredStrategy: fit, evaluate and predict equal Keras' on one device
    and make_strategy's mirrored run; tfdist's backend for it is make_strategy's, field for field."""
    x, y = data()
    mine = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"], **REDUCE_TO_ONE)
    attributes = dict(vars(mine))
    with mine.scope():
        model = program.build()
    reference = program.build()
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    history = tfdist.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                         **({"strategy": mine} if pass_strategy else {})).history
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], atol=1e-5, err_msg=key)
    close(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(tfdist.evaluate(model, x, y, verbose=0), reference.evaluate(x, y, verbose=0),
                               atol=1e-5)
    np.testing.assert_allclose(tfdist.predict(model, x, verbose=0), reference.predict(x, verbose=0), atol=1e-5)

    made = tfdist.make_strategy("mirrored", num_cpu_replicas=2, all_reduce="reduce_to_one", precision="float32")
    with made.scope():
        twin = program.build()
    tfdist.fit(twin, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, strategy=made)
    close(model.get_weights(), twin.get_weights())
    ours, theirs = adopting.known_backend(mine), strategies.backend_of(made)
    assert ours is not None and ours.strategy is mine
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(theirs, f) for f in FIELDS}
    assert vars(mine) == attributes  # The program's object: nothing set on it, nothing replaced.


def test_a_one_device_strategy_and_the_default_one_are_make_strategys():
    x, y = data(32)
    mine = tf.distribute.OneDeviceStrategy("/cpu:0")
    with mine.scope():
        model = program.build()
    reference = program.build()
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    tfdist.fit(model, x, y, batch_size=8, shuffle=False, verbose=0)
    close(model.get_weights(), reference.get_weights())
    assert adopting.known_backend(mine).name == "one_device"
    assert adopting.backend_for_strategy(tf.distribute.get_strategy()).name == "default"
    assert strategies._CURRENT == []  # Training under the program's strategy leaves make_strategy's as it was.


def test_a_tpu_strategy_gets_the_tpu_backend():
    """No TPU here: a TPUStrategy object without its TPU is classified as make_strategy("tpu")'s kind."""
    from tensorflow.python.distribute import tpu_strategy

    for cls in (tpu_strategy.TPUStrategyV2, tpu_strategy.TPUStrategy):
        backend = adopting.wrap(object.__new__(cls))
        assert (backend.name, backend.device_kind) == ("tpu", "tpu")


def test_kinds_without_a_backend_and_a_model_of_another_strategy_are_refused():
    central = tf.distribute.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])
    with central.scope():
        model = program.build()
    x, y = data(16)
    with pytest.raises(tfdist.UserError, match=r"^The model was built under a CentralStorageStrategy, which tfdist "
                                               r"cannot train with: make_strategy has no such kind"):
        tfdist.fit(model, x, y, verbose=0)
    with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"], **REDUCE_TO_ONE).scope():
        other = program.build()
    mine = tf.distribute.MirroredStrategy(["CPU:2", "CPU:3"], **REDUCE_TO_ONE)
    with pytest.raises(tfdist.UserError, match=r"The model was not built under the strategy's scope .* with the "
                                               r"strategy you train with"):
        tfdist.fit(other, x, y, verbose=0, strategy=mine)


@pytest.mark.jobs
def test_two_workers_of_a_program_that_builds_its_own_multi_worker_strategy_train_as_keras(tmp_path):
    """tf.distribute.MultiWorkerMirroredStrategy() built by the program on 2 real workers: fit, then two
    train_on_batch calls; both workers end with the same weights, Keras' own on one device, and the logs
    Keras' train_on_batch returns."""
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             PROGRAM, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    x, y = program.data()
    reference = program.build()
    reference.fit(x[:48], y[:48], batch_size=program.FIT_BATCH, shuffle=False, verbose=0)
    (xa, ya), (xb, yb) = program.batches(x, y)
    first = reference.train_on_batch(xa, ya, return_dict=True)
    second = reference.train_on_batch(xb, yb)
    tasks = [np.load(os.path.join(tmp_path, f"worker{i}.npz")) for i in range(2)]
    for task in tasks:
        assert list(task["backend"]) == ["multi_worker_mirrored"] and int(task["workers"]) == 2
        close([task[f"w{i}"] for i in range(len(reference.get_weights()))], reference.get_weights())
        assert list(task["first_names"]) == sorted(first)
        np.testing.assert_allclose(task["first"], [first[k] for k in sorted(first)], atol=1e-5)
        np.testing.assert_allclose(task["second"], second, atol=1e-5)
    for key in tasks[0].files:
        np.testing.assert_array_equal(tasks[1][key], tasks[0][key], err_msg=key)


@pytest.mark.jobs
def test_a_program_that_builds_its_own_parameter_server_strategy_trains_on_its_chief(tmp_path):
    """tfdist-launch --num_workers=1 --num_ps=1 of tests/programs/user_ps.py: the program runs its own servers
    and builds tf.distribute.experimental.ParameterServerStrategy on the chief; tfdist.fit applies every step
    once (the weight is Keras' one-device fit's: the gradient is 1 a step), tfdist.evaluate is Keras', and
    tfdist.train_on_batch is refused there."""
    ps_program = os.path.join(REPO, "tests", "programs", "user_ps.py")
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=1", "--num_ps=1", "--",
                             sys.executable, ps_program, str(tmp_path)], capture_output=True, text=True, timeout=300,
                            cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    chief = np.load(os.path.join(tmp_path, "chief0.npz"))
    spec = importlib.util.spec_from_file_location("user_ps", ps_program)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inputs = keras.Input((1,))
    reference = keras.Model(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
    reference.compile(optimizer=keras.optimizers.SGD(module.LR), loss=lambda y, p: tf.reduce_mean(p, axis=-1))
    x = np.ones((module.STEPS * module.BATCH, 1), "float32")
    expected = reference.fit(x, np.zeros_like(x), batch_size=module.BATCH, verbose=0).history["loss"][-1]
    np.testing.assert_allclose(chief["kernel"], reference.get_weights()[0], atol=1e-5)
    assert int(chief["iterations"]) == module.STEPS
    assert float(chief["loss"]) == pytest.approx(expected, abs=1e-5)
    assert float(chief["evaluated"]) == pytest.approx(reference.evaluate(x[:10], np.zeros((10, 1)), verbose=0),
                                                      abs=1e-5)
    assert str(chief["refused"]).startswith("tfdist.train_on_batch is not available on parameter servers")
