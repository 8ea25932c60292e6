"""tfdist.training.fit_args: shuffle, class_weight, validation_split, validation_freq, initial_epoch,
PyDataset and generator inputs, and the IoU metrics, each against Keras' own model.fit on one device.

Plain SGD (a wrong gradient scale shows), float32, the same initial weights and the same batches
(``shuffle=False`` on both sides, unless the test is about shuffling); weights within 1e-5.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

MIRRORED = {"num_cpu_replicas": 2, "all_reduce": "reduce_to_one"}
RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 8)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int64") + (X[:, 2] > 0.5).astype("int64")  # Classes 0, 1, 2.


def model_fn(outputs=3, activation=None, loss=None, metrics=("accuracy",), lr=0.1):
    init = keras.initializers.GlorotUniform
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", kernel_initializer=init(0)),
                              keras.layers.Dense(outputs, activation=activation, kernel_initializer=init(1))])
    model.compile(optimizer=keras.optimizers.SGD(lr),
                  loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics))
    return model


def strategies():
    return (("default", {}), ("mirrored", MIRRORED))


def tfdist_model(name, options, **kwargs):
    strategy = tfdist.make_strategy(name, precision="float32", **options)
    with strategy.scope():
        return model_fn(**kwargs), strategy


def assert_same_weights(a, b, atol=1e-5):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, atol=atol)


def assert_same_history(got, expected, atol=1e-5):
    assert set(got) == set(expected), (got, expected)
    for key in expected:
        assert len(got[key]) == len(expected[key]), (key, got, expected)
        np.testing.assert_allclose(got[key], expected[key], atol=atol, err_msg=key)


# shuffle ------------------------------------------------------------------------------
def test_shuffle_false_trains_in_input_order_as_keras():
    reference = model_fn()
    expected = reference.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        history = tfdist.fit(model, X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0, strategy=strategy)
        assert_same_history(history.history, expected)
        assert_same_weights(model, reference)


def test_shuffle_true_is_seeded_the_same_on_every_topology_and_not_input_order():
    weights = []
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        tfdist.fit(model, X, Y, batch_size=32, epochs=1, verbose=0, strategy=strategy, seed=3, shuffle=True)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    in_order = model_fn()
    in_order.fit(X, Y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(weights[0], in_order.get_weights())) > 1e-3


def keras_warnings(fit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in caught if "shuffle" in str(w.message)]


def test_shuffle_is_ignored_for_datasets_with_keras_warning():
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32, drop_remainder=True)
    expected = keras_warnings(lambda: model_fn().fit(dataset, epochs=1, verbose=0))
    assert len(expected) == 1
    model, strategy = tfdist_model("default", {})
    assert keras_warnings(lambda: tfdist.fit(model, dataset, epochs=1, verbose=0, strategy=strategy)) == expected
    model, strategy = tfdist_model("default", {})
    assert keras_warnings(lambda: tfdist.fit(model, dataset, epochs=1, verbose=0, strategy=strategy,
                                             shuffle=False)) == []


def test_shuffle_false_is_refused_under_parameter_servers():
    model, strategy = tfdist_model("default", {})
    backend = tfdist.distribute.strategies.backend_of(strategy)
    backend.sharded_input = False  # What a parameter-server backend says; refused before any step.
    try:
        with pytest.raises(tfdist.UserError, match="shuffle=False cannot be honoured under parameter servers"):
            tfdist.fit(model, X, Y, batch_size=32, shuffle=False, verbose=0, strategy=strategy)
    finally:
        backend.sharded_input = True
    with pytest.raises(tfdist.UserError, match="shuffle='batch'"):
        tfdist.fit(model, X, Y, batch_size=32, shuffle="batch", verbose=0, strategy=strategy)


# class_weight ---------------------------------------------------------------------------
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 4.0}


def test_class_weight_matches_keras_for_sparse_and_one_hot_targets_and_datasets():
    one_hot = np.eye(3, dtype="float32")[Y]
    cce = keras.losses.CategoricalCrossentropy(from_logits=True)
    for targets, loss in ((Y, None), (one_hot, cce)):
        reference = model_fn(loss=loss)
        expected = reference.fit(X, targets, batch_size=32, epochs=2, shuffle=False, verbose=0,
                                 class_weight=CLASS_WEIGHT).history
        unweighted = model_fn(loss=loss)
        unweighted.fit(X, targets, batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert max(float(np.max(np.abs(a - b))) for a, b in
                   zip(unweighted.get_weights(), reference.get_weights())) > 1e-2  # The weights matter.
        for name, options in strategies():
            model, strategy = tfdist_model(name, options, loss=loss)
            history = tfdist.fit(model, X, targets, batch_size=32, epochs=2, shuffle=False, verbose=0,
                                 class_weight=CLASS_WEIGHT, strategy=strategy)
            assert_same_history(history.history, expected)
            assert_same_weights(model, reference)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32, drop_remainder=True)
    reference = model_fn()
    reference.fit(dataset, epochs=1, verbose=0, class_weight=CLASS_WEIGHT)
    model, strategy = tfdist_model("mirrored", MIRRORED)
    tfdist.fit(model, dataset, epochs=1, verbose=0, class_weight=CLASS_WEIGHT, strategy=strategy, shuffle=False)
    assert_same_weights(model, reference)
    per_replica = lambda ctx: tf.data.Dataset.from_tensor_slices((X, Y)).batch(16, drop_remainder=True)  # noqa: E731
    model, strategy = tfdist_model("mirrored", MIRRORED)
    tfdist.fit(model, per_replica, batch_size=32, steps_per_epoch=8, verbose=0, class_weight=CLASS_WEIGHT,
               strategy=strategy)
    assert_same_weights(model, reference)


def test_class_weight_is_refused_where_keras_refuses_it():
    model, strategy = tfdist_model("default", {})
    with pytest.raises(tfdist.UserError, match="class_weight and sample_weight were both given"):
        tfdist.fit(model, X, Y, batch_size=32, sample_weight=np.ones(256), class_weight=CLASS_WEIGHT, verbose=0,
                   strategy=strategy)
    weighted = tf.data.Dataset.from_tensor_slices((X, Y, np.ones(256, "float32"))).batch(32)
    with pytest.raises(tfdist.UserError, match="class_weight and sample_weight were both given"):
        tfdist.fit(model, weighted, class_weight=CLASS_WEIGHT, verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match="only supported for models with a single output"):
        tfdist.fit(model, X, [Y, Y], batch_size=32, class_weight=CLASS_WEIGHT, verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match="not supported for a Python generator"):
        tfdist.fit(model, ((X[:32], Y[:32]) for _ in range(4)), steps_per_epoch=4, class_weight=CLASS_WEIGHT,
                   verbose=0, strategy=strategy)


# validation_split, validation_freq --------------------------------------------------------
def test_validation_split_holds_out_the_last_fraction_as_keras():
    sample_weight = np.linspace(0.5, 1.5, 256).astype("float32")
    reference = model_fn()
    expected = reference.fit(X, Y, sample_weight=sample_weight, batch_size=32, epochs=2, shuffle=False, verbose=0,
                             validation_split=0.25).history
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        history = tfdist.fit(model, X, Y, sample_weight=sample_weight, batch_size=32, epochs=2, shuffle=False,
                             verbose=0, validation_split=0.25, strategy=strategy)
        assert_same_history(history.history, expected)
        assert_same_weights(model, reference)


def test_validation_split_is_refused_for_datasets_and_too_few_examples():
    model, strategy = tfdist_model("default", {})
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32)
    with pytest.raises(tfdist.UserError, match="validation_split is only supported for arrays"):
        tfdist.fit(model, dataset, validation_split=0.2, verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match="not sufficient to split"):
        tfdist.fit(model, X[:1], Y[:1], batch_size=1, validation_split=0.1, verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match=r"validation_split=1\.5 must be a float in \[0, 1\)"):
        tfdist.fit(model, X, Y, batch_size=32, validation_split=1.5, verbose=0, strategy=strategy)


def test_validation_freq_validates_on_keras_epochs():
    val = (X[:64], Y[:64])
    for freq in (2, [1, 3]):
        reference = model_fn()
        expected = reference.fit(X, Y, batch_size=64, epochs=4, shuffle=False, verbose=0, validation_data=val,
                                 validation_freq=freq).history
        seen = []
        record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(
            (epoch, "val_loss" in logs)))
        model, strategy = tfdist_model("mirrored", MIRRORED)
        history = tfdist.fit(model, X, Y, batch_size=64, epochs=4, shuffle=False, verbose=0, validation_data=val,
                             validation_freq=freq, strategy=strategy, callbacks=[record])
        assert len(expected["val_loss"]) == 2
        assert_same_history(history.history, expected)
        assert seen == [(e, (e + 1) % 2 == 0 if freq == 2 else e + 1 in freq) for e in range(4)]


# initial_epoch ------------------------------------------------------------------------
def epochs_seen():
    seen = []
    return seen, keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: seen.append(epoch))


def test_initial_epoch_starts_there_as_keras():
    reference = model_fn()
    keras_epochs, keras_callback = epochs_seen()
    expected = reference.fit(X, Y, batch_size=32, epochs=3, initial_epoch=1, shuffle=False, verbose=0,
                             callbacks=[keras_callback]).history
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        seen, callback = epochs_seen()
        history = tfdist.fit(model, X, Y, batch_size=32, epochs=3, initial_epoch=1, shuffle=False, verbose=0,
                             callbacks=[callback], strategy=strategy)
        assert seen == keras_epochs == [1, 2]
        assert len(history.history["loss"]) == 2
        assert_same_history(history.history, expected)
        assert_same_weights(model, reference)
        assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 16


def test_initial_epoch_with_a_workdir_resumes_at_the_checkpoint(tmp_path):
    reference = model_fn()
    reference.fit(X, Y, batch_size=32, epochs=3, initial_epoch=1, shuffle=False, verbose=0)
    workdir = str(tmp_path / "run")
    model, strategy = tfdist_model("mirrored", MIRRORED)
    first = tfdist.fit(model, X, Y, batch_size=32, epochs=3, initial_epoch=1, shuffle=False, verbose=0,
                       strategy=strategy, workdir=workdir, max_steps=16, export=())
    assert len(first.history["loss"]) == 1  # Epoch 1 only (steps 8-16).
    model, strategy = tfdist_model("mirrored", MIRRORED)
    seen, callback = epochs_seen()
    second = tfdist.fit(model, X, Y, batch_size=32, epochs=3, initial_epoch=1, shuffle=False, verbose=0,
                        strategy=strategy, workdir=workdir, callbacks=[callback], export=())
    assert seen == [2] and len(second.history["loss"]) == 1  # The checkpoint (step 16) wins over epoch 1.
    assert_same_weights(model, reference)


def test_initial_epoch_and_validation_freq_are_checked():
    model, strategy = tfdist_model("default", {})
    with pytest.raises(tfdist.UserError, match="initial_epoch=-1 must be an int of 0 or more"):
        tfdist.fit(model, X, Y, batch_size=32, initial_epoch=-1, verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match="validation_freq=0 must be a positive int"):
        tfdist.fit(model, X, Y, batch_size=32, validation_freq=0, verbose=0, strategy=strategy)


# PyDataset and generators -------------------------------------------------------------
class Batches(keras.utils.PyDataset):
    def __init__(self, size=32, count=None, **kwargs):
        super().__init__(**kwargs)
        self.size, self.count, self.ends = size, count, 0

    def __len__(self):
        return self.count if self.count is not None else -(-len(X) // self.size)

    def __getitem__(self, index):
        part = slice(index * self.size, (index + 1) * self.size)
        return X[part], Y[part]

    def on_epoch_end(self):
        self.ends += 1


def test_py_dataset_trains_as_keras_and_calls_on_epoch_end():
    reference = model_fn()
    expected = reference.fit(Batches(), epochs=2, shuffle=False, verbose=0,
                             validation_data=Batches(64, count=1)).history
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        data = Batches()
        history = tfdist.fit(model, data, epochs=2, shuffle=False, verbose=0, strategy=strategy,
                             validation_data=Batches(64, count=1))
        assert data.ends >= 1
        assert_same_history(history.history, expected)
        assert_same_weights(model, reference)
    reference = model_fn()
    reference.fit(Batches(), epochs=1, shuffle=False, verbose=0, class_weight=CLASS_WEIGHT)
    model, strategy = tfdist_model("mirrored", MIRRORED)
    tfdist.fit(model, Batches(), epochs=1, shuffle=False, verbose=0, strategy=strategy, class_weight=CLASS_WEIGHT)
    assert_same_weights(model, reference)


def test_py_dataset_shuffle_is_a_seeded_batch_order_the_same_on_every_topology():
    weights = []
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        tfdist.fit(model, Batches(), epochs=1, verbose=0, strategy=strategy, seed=5)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    in_order = model_fn()
    in_order.fit(Batches(), epochs=1, shuffle=False, verbose=0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(weights[0], in_order.get_weights())) > 1e-3


def test_generator_trains_as_keras_with_or_without_steps_per_epoch():
    def batches():
        for epoch in range(2):
            for i in range(8):
                yield X[i * 32:(i + 1) * 32], Y[i * 32:(i + 1) * 32]

    reference = model_fn()
    expected = reference.fit(batches(), epochs=2, steps_per_epoch=8, verbose=0).history
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        history = tfdist.fit(model, batches(), epochs=2, steps_per_epoch=8, verbose=0, strategy=strategy,
                             shuffle=False)
        assert_same_history(history.history, expected)
        assert_same_weights(model, reference)
    def one_pass():  # No steps_per_epoch: Keras trains one pass, its last batch short (7 x 32 + 16).
        for i in range(8):
            yield X[i * 32:(i + 1) * 32 - (16 if i == 7 else 0)], Y[i * 32:(i + 1) * 32 - (16 if i == 7 else 0)]

    reference = model_fn()
    expected = reference.fit(one_pass(), verbose=0).history
    for name, options in strategies():
        model, strategy = tfdist_model(name, options)
        history = tfdist.fit(model, one_pass(), verbose=0, strategy=strategy, shuffle=False)
        assert_same_history(history.history, expected)
        assert_same_weights(model, reference)
    model, strategy = tfdist_model("default", {})
    with pytest.warns(UserWarning, match=r"its one pass is epoch 2, and your input ran out of data, so epochs 3-4 "
                                         r"are not trained"):  # Keras trains that pass, then has no data.
        history = tfdist.fit(model, one_pass(), epochs=4, initial_epoch=1, verbose=0, strategy=strategy,
                             shuffle=False)
    assert history.epoch == [1]
    assert int(model.optimizer.iterations.numpy()) == 8
    with pytest.raises(tfdist.UserError, match="x is a Python generator, so y must not be passed"):
        tfdist.fit(model, batches(), Y, steps_per_epoch=8, verbose=0, strategy=strategy)


def test_infinite_py_dataset_needs_steps_per_epoch():
    class Forever(Batches):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, index):
            return super().__getitem__(index % 8)

    model, strategy = tfdist_model("default", {})
    with pytest.raises(tfdist.UserError, match="infinite.*pass steps_per_epoch"):
        tfdist.fit(model, Forever(), shuffle=False, verbose=0, strategy=strategy)
    reference = model_fn()
    reference.fit(Forever(), epochs=2, steps_per_epoch=8, shuffle=False, verbose=0)
    model, strategy = tfdist_model("mirrored", MIRRORED)
    tfdist.fit(model, Forever(), epochs=2, steps_per_epoch=8, shuffle=False, verbose=0, strategy=strategy)
    assert_same_weights(model, reference)


# IoU metrics --------------------------------------------------------------------------
def iou_cases():
    one_hot = np.eye(3, dtype="float32")[Y]
    binary = (Y > 0).astype("float32")[:, None]
    sparse = dict(outputs=3, activation="softmax", loss="sparse_categorical_crossentropy",
                  metrics=[keras.metrics.MeanIoU(3, sparse_y_pred=False),
                           keras.metrics.IoU(3, [0, 2], sparse_y_pred=False, name="iou_02")])
    dense = dict(outputs=3, activation="softmax", loss="categorical_crossentropy",
                 metrics=[keras.metrics.OneHotIoU(3, [1], name="one_hot_iou_1"), keras.metrics.OneHotMeanIoU(3)])
    binary_case = dict(outputs=1, activation="sigmoid", loss="binary_crossentropy",
                       metrics=[keras.metrics.BinaryIoU([0, 1], threshold=0.5)])
    return ((sparse, Y), (dense, one_hot), (binary_case, binary))


def test_iou_metrics_reduce_exactly_across_replicas_as_keras():
    for kwargs, targets in iou_cases():
        val = (X[:100], targets[:100])  # 100: the last validation batch splits unevenly over the replicas.
        reference = model_fn(**{**kwargs, "metrics": [m.__class__.from_config(m.get_config())
                                                      for m in kwargs["metrics"]]})
        expected = reference.fit(X, targets, batch_size=32, epochs=1, shuffle=False, verbose=0,
                                 validation_data=val).history
        for name, options in strategies():
            model, strategy = tfdist_model(name, options, **{**kwargs, "metrics": [
                m.__class__.from_config(m.get_config()) for m in kwargs["metrics"]]})
            history = tfdist.fit(model, X, targets, batch_size=32, epochs=1, shuffle=False, verbose=0,
                                 validation_data=val, strategy=strategy)
            assert len(expected) == 2 * (1 + len(kwargs["metrics"]))
            assert_same_history(history.history, expected, atol=1e-6)
            assert_same_weights(model, reference)


# Two real workers ---------------------------------------------------------------------
def test_two_workers_train_as_keras_with_the_extra_arguments(tmp_path):
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env

    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             "tests/programs/fit_args_workers.py", str(tmp_path)], capture_output=True, text=True,
                            timeout=240, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    arrays, py_dataset = model_fn(), model_fn()
    expected = arrays.fit(X, Y, batch_size=32, epochs=4, initial_epoch=1, shuffle=False, class_weight=CLASS_WEIGHT,
                          validation_split=0.25, validation_freq=2, verbose=0).history
    py_dataset.fit(Batches(), epochs=2, shuffle=False, verbose=0)
    wanted = arrays.get_weights() + py_dataset.get_weights()
    for task in (0, 1):
        saved = np.load(tmp_path / f"task{task}.npz")
        got = [saved[f"arr_{i}"] for i in range(len(wanted))]
        for a, b in zip(got, wanted):
            np.testing.assert_allclose(a, b, atol=1e-5)
        assert_same_history(json.loads(str(saved["history"])), expected)


def test_a_distributed_dataset_is_refused_naming_what_to_pass():
    strategy = tfdist.make_strategy("mirrored", precision="float32", **MIRRORED)
    with strategy.scope():
        model = model_fn()
    distributed = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.from_tensor_slices((X[:8], Y[:8])).batch(2))
    for call in (lambda: tfdist.fit(model, distributed, steps_per_epoch=2, verbose=0),
                 lambda: tfdist.evaluate(model, distributed, verbose=0)):
        with pytest.raises(tfdist.UserError, match="x is a tf.distribute DistributedDataset .*; tfdist distributes "
                                                   "the input itself"):
            call()


def test_validation_steps_and_batch_size_validate_what_keras_validates():
    """validation_steps: the first batches of validation_batch_size (arrays), of a dataset, of an endless
    generator; val_ logs equal Keras' own fit on one device."""
    x, y = RNG.normal(size=(64, 8)).astype("float32"), RNG.integers(0, 3, size=64)
    xv, yv = RNG.normal(size=(40, 8)).astype("float32"), RNG.integers(0, 3, size=40)

    def endless():
        while True:
            for i in range(0, 40, 8):
                yield xv[i:i + 8], yv[i:i + 8]

    forms = [dict(validation_data=(xv, yv), validation_steps=3, validation_batch_size=6),
             dict(validation_data=tf.data.Dataset.from_tensor_slices((xv, yv)).batch(8), validation_steps=2),
             dict(validation_data=endless, validation_steps=4)]
    for form in forms:
        # An endless generator: one epoch (Keras reads its next batches at the next epoch; tfdist reads them once).
        epochs = 1 if callable(form["validation_data"]) else 2
        given = dict(form, validation_data=form["validation_data"]() if callable(form["validation_data"])
                     else form["validation_data"])
        reference = model_fn()
        expected = reference.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, **given).history
        given = dict(form, validation_data=form["validation_data"]() if callable(form["validation_data"])
                     else form["validation_data"])
        model, strategy = tfdist_model("mirrored", MIRRORED)
        history = tfdist.fit(model, x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                             strategy=strategy, **given).history
        assert_same_history(history, expected)
    with pytest.raises(tfdist.UserError, match="validation_steps=0 must be a positive number of batches"):
        tfdist.fit(model, x, y, validation_data=(xv, yv), validation_steps=0, verbose=0, strategy=strategy)


def test_validation_steps_without_batch_size_and_steps_per_epoch_of_every_batch_as_keras():
    """No batch_size: Keras validates ceil(n / validation_steps) per batch, so every example; steps_per_epoch
    equal to the batch count (the last one short) trains each batch, as Keras does."""
    x, y = RNG.normal(size=(10, 8)).astype("float32"), RNG.integers(0, 3, size=10)
    xv, yv = RNG.normal(size=(45, 8)).astype("float32"), RNG.integers(0, 3, size=45)
    reference = model_fn()
    expected = reference.fit(x, y, epochs=2, steps_per_epoch=1, validation_data=(xv, yv), validation_steps=2,
                             shuffle=False, verbose=0).history
    model, strategy = tfdist_model("mirrored", MIRRORED)
    history = tfdist.fit(model, x, y, epochs=2, steps_per_epoch=1, validation_data=(xv, yv), validation_steps=2,
                         shuffle=False, verbose=0, strategy=strategy).history
    assert_same_history(history, expected)
    reference = model_fn()
    reference.fit(x, y, batch_size=4, steps_per_epoch=3, epochs=2, shuffle=False, verbose=0)
    model, strategy = tfdist_model("mirrored", MIRRORED)
    tfdist.fit(model, x, y, batch_size=4, steps_per_epoch=3, epochs=2, shuffle=False, verbose=0, strategy=strategy)
    assert_same_weights(model, reference)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 6


def test_epoch_saving_keras_callbacks_keep_tfdists_steps_per_execution():
    """ModelCheckpoint/BackupAndRestore saving per epoch and an epoch-writing TensorBoard do nothing in their
    batch hooks: they do not force one step an execution (Keras' default with batch hooks); per-batch ones do."""
    from tfdist.distribute import strategies as strategies_lib
    from tfdist.training import callbacks, plan

    model, strategy = tfdist_model("mirrored", MIRRORED)
    backend = strategies_lib.backend_of(strategy)
    inert = [keras.callbacks.ModelCheckpoint("/tmp/unused.keras"), keras.callbacks.BackupAndRestore("/tmp/unused"),
             keras.callbacks.TensorBoard("/tmp/unused")]
    assert plan.resolve_steps_per_execution(None, model, inert, backend, callbacks.BATCH_HOOKS) == 10
    acting = [keras.callbacks.ModelCheckpoint("/tmp/unused.keras", save_freq=5)]
    assert plan.resolve_steps_per_execution(None, model, acting, backend, callbacks.BATCH_HOOKS) == 1
