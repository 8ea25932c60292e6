"""tfdist.training.evaluating: `tfdist.evaluate` and `tfdist.predict` equal Keras' `Model.evaluate` / `Model.predict`.

On one device and on 2 in-process CPU replicas (dynamic and padded static-shape
batches), and in real jobs: 2 MultiWorkerMirrored workers, a parameter-server
job (evaluated and predicted inline on the chief) and 2 Horovod ranks (TF 2.18
lane). 203 examples with batch 32: the last batch needs padding on every topology.

Validation inside tfdist.fit runs the same `Evaluator`, in the batches Keras' fit validates in; its val_ logs
are checked against Keras' own fit on masked sequence models (Embedding(mask_zero=True)), per-timestep and
per-example sample weights, several outputs, with the last batch smaller or padded to a static shape (the
TPU path, forced here).
"""

import functools
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
from tests.test_horovod import horovodrun, needs_horovod
from tfdist.training import inputs

MIRRORED = {"all_reduce": "reduce_to_one"}  # See tests/test_fitting.py.
STRATEGIES = {"default": ("default", {}), "mirrored2": ("mirrored", {"num_cpu_replicas": 2, **MIRRORED})}
PROGRAM = os.path.join(REPO, "tests", "programs", "evaluate_predict.py")


def _program():
    spec = importlib.util.spec_from_file_location("evaluate_predict", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


program = _program()  # The job's model and data, shared with the in-process tests.


def strategy_for(name):
    kind, options = STRATEGIES[name]
    return tfdist.make_strategy(kind, precision="float32", **options)


def under(strategy, build=program.build):
    with strategy.scope():
        return build()


def keras_twin(model, build=program.build):
    """The same model and weights, built outside any strategy: Keras' own reference."""
    twin = build()
    twin.set_weights(model.get_weights())
    return twin


@pytest.fixture(params=[False, True], ids=["dynamic", "static-shapes"])
def static_shapes(request, monkeypatch):
    """Forces the padded, static-shape eval batches (TPUs) where asked."""
    original = inputs.eval_arrays_fn
    monkeypatch.setattr(inputs, "eval_arrays_fn", functools.partial(original, static_shapes=request.param))
    return request.param


def metric_state(model):
    return [np.asarray(v) for m in model.metrics for v in m.variables]


@pytest.mark.parametrize("name", STRATEGIES)
def test_evaluate_equals_keras_with_a_padded_last_batch(name, static_shapes):
    model = under(strategy_for(name))
    x, y, weight = program.data()
    listed = tfdist.evaluate(model, x, y, sample_weight=weight, verbose=0, steps_per_execution=2)
    logs = tfdist.evaluate(model, x, y, sample_weight=weight, verbose=0, return_dict=True)
    twin = keras_twin(model)
    expected = twin.evaluate(x, y, sample_weight=weight, verbose=0, return_dict=True)
    assert sorted(logs) == sorted(expected) == ["a_accuracy", "a_loss", "b_loss", "b_mae", "loss"]
    np.testing.assert_allclose([logs[k] for k in sorted(logs)], [expected[k] for k in sorted(expected)], atol=1e-5)
    np.testing.assert_allclose(listed, twin.evaluate(x, y, sample_weight=weight, verbose=0), atol=1e-5)
    # The metrics hold the evaluation's state, as Keras' evaluate leaves them.
    assert len(metric_state(model)) == len(metric_state(twin)) > 0
    for a, b in zip(metric_state(model), metric_state(twin)):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_evaluate_of_a_loss_only_model_returns_the_loss_as_a_float():
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = under(strategy_for("mirrored2"), build)
    x, y, _ = program.data()
    loss = tfdist.evaluate(model, x, y["b"], verbose=0)
    assert isinstance(loss, float)
    assert loss == pytest.approx(keras_twin(model, build).evaluate(x, y["b"], verbose=0), abs=1e-5)


def test_a_masked_sequence_loss_equals_keras_on_two_replicas():
    """Keras divides a masked loss by each batch's unmasked entries: each replica must evaluate Keras' batches."""
    x, tags, _, _, _ = sequences(203, seed=4)
    model = under(strategy_for("mirrored2"), functools.partial(sequence_model, "dense"))
    got = tfdist.evaluate(model, x, tags, batch_size=16, verbose=0, return_dict=True)
    expected = keras_twin(model, functools.partial(sequence_model, "dense")).evaluate(
        x, tags, batch_size=16, verbose=0, return_dict=True)
    np.testing.assert_allclose([got[k] for k in sorted(got)], [expected[k] for k in sorted(expected)], atol=1e-5)


@pytest.mark.parametrize("name", STRATEGIES)
def test_predict_returns_every_row_once_in_order(name):
    model = under(strategy_for(name))
    x, _, _ = program.data()
    got = tfdist.predict(model, x, verbose=0, steps_per_execution=2)  # 4 executions, the last one partial.
    expected = keras_twin(model).predict(x, verbose=0)
    assert sorted(got) == ["a", "b"]
    for key in ("a", "b"):
        assert got[key].shape == expected[key].shape == (203, *expected[key].shape[1:])
        np.testing.assert_allclose(got[key], expected[key], atol=1e-5)


def test_evaluate_and_predict_read_a_dataset_with_a_partial_last_batch():
    model = under(strategy_for("mirrored2"))
    x, y, weight = program.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weight)).batch(32)  # No drop_remainder: 6 x 32 + 11.
    twin = keras_twin(model)
    np.testing.assert_allclose(tfdist.evaluate(model, dataset, verbose=0),
                               twin.evaluate(x, y, sample_weight=weight, verbose=0), atol=1e-5)
    got = tfdist.predict(model, dataset.map(lambda a, b, c: a), verbose=0)
    np.testing.assert_allclose(got["a"], twin.predict(x, verbose=0)["a"], atol=1e-5)
    assert len(got["a"]) == 203


def test_evaluate_and_predict_read_generators_and_py_datasets_as_keras_does():
    model = under(strategy_for("mirrored2"))
    x, y, weight = program.data()
    twin = keras_twin(model)

    def batches(with_targets=True):
        for i in range(0, len(x), 32):
            yield (x[i:i + 32], {k: v[i:i + 32] for k, v in y.items()}, weight[i:i + 32]) if with_targets \
                else x[i:i + 32]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-len(x) // 32)

        def __getitem__(self, i):
            return x[i * 32:(i + 1) * 32], {k: v[i * 32:(i + 1) * 32] for k, v in y.items()}

    expected = twin.evaluate(x, y, sample_weight=weight, verbose=0)
    np.testing.assert_allclose(tfdist.evaluate(model, batches(), verbose=0), expected, atol=1e-5)
    np.testing.assert_allclose(tfdist.evaluate(model, Batches(), steps=3, verbose=0),
                               twin.evaluate(Batches(), steps=3, verbose=0), atol=1e-5)
    for data in (batches(with_targets=False), Batches()):
        got = tfdist.predict(model, data, verbose=0)
        np.testing.assert_allclose(got["a"], twin.predict(x, verbose=0)["a"], atol=1e-5)
        assert len(got["a"]) == 203
    with pytest.raises(tfdist.UserError, match=r"x yields its own batches; drop batch_size=8"):
        tfdist.predict(model, Batches(), batch_size=8)


def test_steps_takes_the_first_batches_as_keras_does():
    model = under(strategy_for("mirrored2"))
    twin = keras_twin(model)
    x, y, _ = program.data()
    for batch in (32, None):  # None: Keras spreads the examples over the steps (batches of 68).
        got = tfdist.evaluate(model, x, y, batch_size=batch, steps=3, verbose=0)
        np.testing.assert_allclose(got, twin.evaluate(x, y, batch_size=batch, steps=3, verbose=0), atol=1e-5)
        predicted = tfdist.predict(model, x, batch_size=batch, steps=3, verbose=0)["a"]
        expected = twin.predict(x, batch_size=batch, steps=3, verbose=0)["a"]
        assert len(predicted) == len(expected) == (96 if batch else 203)
        np.testing.assert_allclose(predicted, expected, atol=1e-5)


class Hooks(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_test_begin(self, logs=None):
        self.calls.append(("test_begin",))

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test_batch_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_batch_end", batch, sorted(logs)))

    def on_test_end(self, logs=None):
        self.calls.append(("test_end", round(logs["loss"], 5)))

    def on_predict_begin(self, logs=None):
        self.calls.append(("predict_begin",))

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("predict_batch_begin", batch))

    def on_predict_batch_end(self, batch, logs=None):
        # Keras passes {"outputs": ...}; its CallbackList flattens a dict of outputs into the logs.
        self.calls.append(("predict_batch_end", batch, sorted(logs), len(logs["a"])))

    def on_predict_end(self, logs=None):
        self.calls.append(("predict_end",))


def test_callbacks_are_called_once_per_execution_as_keras_calls_them():
    model = under(strategy_for("mirrored2"))
    x, y, _ = program.data()
    hooks = Hooks()
    loss = tfdist.evaluate(model, x, y, verbose=0, callbacks=[hooks], steps_per_execution=2)[0]
    names = ["a_accuracy", "a_loss", "b_loss", "b_mae", "loss"]
    # 203 examples, Keras' batch 32: 7 batches (with per-batch hooks each split over the 2 replicas), 2 per
    # execution: Keras' indices, the last end index past the last batch as Keras gives it.
    assert hooks.calls == [("test_begin",)] + [
        call for first in (0, 2, 4, 6) for call in (("test_batch_begin", first), ("test_batch_end", first + 1, names))
    ] + [("test_end", round(loss, 5))]
    hooks.calls.clear()
    tfdist.predict(model, x, verbose=0, callbacks=[hooks], steps_per_execution=2)
    assert hooks.calls == [("predict_begin",)] + [
        call for first, rows in ((0, 64), (2, 64), (4, 64), (6, 11))
        for call in (("predict_batch_begin", first), ("predict_batch_end", first + 1, ["a", "b"], rows))
    ] + [("predict_end",)]


def test_predict_input_that_does_not_match_the_model_is_refused_before_any_step():
    model = under(strategy_for("default"))
    fix = ("The model takes 1 input(s): x (None, 5). Pass x as one array with one row per example.")
    x = np.zeros((10, 5), "float32")
    cases = [
        (np.zeros((10, 4), "float32"),
         f"predict: an array of shape (10, 4) was given for input x, which takes (examples, 5). {fix}"),
        ([x, x], f"predict: x holds 2 array(s), but the model takes 1. {fix}"),
        ({"y": x}, f"predict: the keys of x (y) do not match the model's inputs. {fix}"),
    ]
    for bad, message in cases:
        with pytest.raises(tfdist.UserError) as raised:
            tfdist.predict(model, bad, verbose=0)
        assert str(raised.value) == message
    assert tfdist.predict(model, {"x": x}, verbose=0)["a"].shape == (10, 3)


def test_an_uncompiled_model_cannot_be_evaluated_but_predicts():
    def build():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])

    model = under(strategy_for("mirrored2"), build)
    x = program.data()[0]
    with pytest.raises(tfdist.UserError) as raised:
        tfdist.evaluate(model, x, x[:, :2], verbose=0)
    assert str(raised.value) == (
        "The model is not compiled, so it has no loss or metrics to evaluate; call model.compile(loss=..., "
        "metrics=[...]) under the strategy's scope before tfdist.evaluate (as Keras' evaluate needs).")
    np.testing.assert_allclose(tfdist.predict(model, x, verbose=0), keras_twin(model, build).predict(x, verbose=0),
                               atol=1e-5)


# Real jobs -------------------------------------------------------------------------------------
def run_job(command, timeout=300):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=subprocess_env())


def assert_tasks_equal_keras(out, tasks):
    """Every task's evaluate and predict results equal Keras' on the task's weights, and each other's."""
    results = {t: np.load(os.path.join(out, f"{t}.npz")) for t in tasks}
    first = results[tasks[0]]
    model = program.build()
    model.set_weights([first[f"w{i}"] for i in range(len(model.get_weights()))])
    x, y, weight = program.data()
    expected = model.evaluate(x, y, sample_weight=weight, verbose=0, return_dict=True)
    predicted = model.predict(x, verbose=0)
    for task, result in results.items():
        for key in first.files:
            np.testing.assert_array_equal(result[key], first[key], err_msg=f"{task} differs from {tasks[0]}: {key}")
        assert list(result["names"]) == sorted(expected)
        np.testing.assert_allclose(result["values"], [expected[k] for k in sorted(expected)], atol=1e-5)
        np.testing.assert_allclose(result["listed"], model.evaluate(x, y, sample_weight=weight, verbose=0),
                                   atol=1e-5)
        for key in ("a", "b"):
            assert result[key].shape[0] == 203
            np.testing.assert_allclose(result[key], predicted[key], atol=1e-5)


def test_two_multi_worker_mirrored_workers_evaluate_and_predict_as_keras(tmp_path):
    result = run_job([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable, PROGRAM,
                      str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_tasks_equal_keras(str(tmp_path), ["worker0", "worker1"])


def test_a_parameter_server_job_evaluates_and_predicts_on_the_chief(tmp_path):
    result = run_job([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=1", "--num_ps=1", "--",
                      sys.executable, PROGRAM, str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["chief0.npz"]
    assert_tasks_equal_keras(str(tmp_path), ["chief0"])


@needs_horovod
def test_two_horovod_ranks_evaluate_and_predict_as_keras(tmp_path):
    result = horovodrun([sys.executable, PROGRAM, str(tmp_path)], tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_tasks_equal_keras(str(tmp_path), ["rank0", "rank1"])


@pytest.mark.parametrize("name", ["default", "mirrored2"])
def test_a_custom_test_step_evaluates_as_keras(name):
    from tests import custom_models

    x, y = custom_models.regression(203)
    keras.utils.set_random_seed(0)
    reference = custom_models.custom_fit_model()
    strategy = strategy_for(name)
    with strategy.scope():
        model = custom_models.custom_fit_model()
    model.set_weights(reference.get_weights())
    expected = reference.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    got = tfdist.evaluate(model, x, y, batch_size=32, verbose=0, return_dict=True, strategy=strategy)
    assert sorted(got) == sorted(expected) == ["loss", "mae"]
    for key in expected:  # Its tracker averages batch means: each replica evaluates whole Keras batches.
        assert got[key] == pytest.approx(expected[key], abs=1e-5), (key, got, expected)


def test_a_custom_predict_step_is_refused():
    class Argmax(keras.Sequential):
        def predict_step(self, data):
            return keras.ops.argmax(self(data), -1)

    with strategy_for("default").scope():
        model = Argmax([keras.Input((5,)), keras.layers.Dense(3)])
    with pytest.raises(tfdist.UserError, match=r"Argmax overrides predict_step\(\); tfdist.predict gathers"):
        tfdist.predict(model, program.data()[0], verbose=0)


def test_test_on_batch_and_predict_on_batch_are_keras_for_one_batch_on_two_replicas():
    """One batch of 7 rows over 2 replicas: the logs and one prediction a row, as Keras' own on one device
    (Keras' own predict_on_batch under a strategy returns each replica's rows: 14)."""
    model = under(strategy_for("mirrored2"))
    x, y, weight = program.data()
    x, y, weight = x[:7], {k: v[:7] for k, v in y.items()}, weight[:7]
    twin = keras_twin(model)
    logs = tfdist.test_on_batch(model, x, y, sample_weight=weight, return_dict=True)
    expected = twin.test_on_batch(x, y, sample_weight=weight, return_dict=True)
    assert sorted(logs) == sorted(expected)
    np.testing.assert_allclose([logs[k] for k in sorted(logs)], [expected[k] for k in sorted(expected)], atol=1e-5)
    np.testing.assert_allclose(tfdist.test_on_batch(model, x, y), twin.test_on_batch(x, y), atol=1e-5)
    predicted, wanted = tfdist.predict_on_batch(model, x), twin.predict_on_batch(x)
    assert sorted(predicted) == ["a", "b"] and predicted["a"].shape == (7, 3)
    for key in wanted:
        np.testing.assert_allclose(predicted[key], wanted[key], atol=1e-5)
    with pytest.raises(tfdist.UserError, match="x must be a batch"):
        tfdist.predict_on_batch(model, 3.0)


# Validation in tfdist.fit: the same evaluation, in Keras' validation batches -------------------------------
T, VOCAB, CLASSES = 6, 12, 3


def sequences(n, seed):
    """Token ids padded with 0 after a random length (1..T), per-timestep tags and per-example labels."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, T + 1, n)
    x = np.where(np.arange(T)[None, :] < lengths[:, None], rng.randint(1, VOCAB, (n, T)), 0).astype("int32")
    tags = rng.randint(0, CLASSES, (n, T)).astype("int32")
    labels = rng.randint(0, 2, n).astype("int32")
    return x, tags, labels, rng.uniform(0.1, 2.0, (n, T)).astype("float32"), rng.uniform(0.1, 2.0, n).astype("float32")


def sequence_model(kind):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((T,), dtype="int32"), keras.layers.Embedding(VOCAB, 8, mask_zero=True)]
    if kind == "lstm":
        layers += [keras.layers.LSTM(8, return_sequences=True), keras.layers.Dense(CLASSES)]
    elif kind == "gru":
        layers += [keras.layers.GRU(8, return_sequences=True), keras.layers.Dense(CLASSES)]
    else:
        layers += [keras.layers.TimeDistributed(keras.layers.Dense(CLASSES))]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")])
    return model


def two_output_model():
    """A masked per-timestep output and a per-example output (the mask consumed by the pooling)."""
    keras.utils.set_random_seed(2)
    tokens = keras.Input((T,), dtype="int32", name="tokens")
    hidden = keras.layers.LSTM(8, return_sequences=True)(keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens))
    tags = keras.layers.Dense(CLASSES, name="tags")(hidden)
    label = keras.layers.Dense(2, name="label")(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(tokens, {"tags": tags, "label": label})
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss={"tags": loss, "label": loss},
                  loss_weights={"tags": 1.0, "label": 0.5},
                  metrics={"tags": ["accuracy"], "label": ["accuracy"]},
                  weighted_metrics={"tags": [keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")],
                                    "label": [keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")]})
    return model


def assert_validation_equals_keras(build, train, validation, strategy_name, batch_size=32):
    """tfdist.fit's val_* logs against Keras' own fit's: same initial weights, one step of the same batch,
    float32. Keras validates by its evaluate in batches of batch_size (a dataset: its own batches), which a
    masked loss depends on; tfdist validated in batches of its own size before (64 a replica here). The step
    has a learning rate of 0: a masked training loss split over replicas is not Keras' (README, "What differs
    from Keras"), and these tests are about validation."""
    name, options = STRATEGIES[strategy_name]
    strategy = tfdist.make_strategy(name, precision="float32", **options)
    with strategy.scope():
        model = build()
    reference = build()
    reference.set_weights(model.get_weights())
    model.optimizer.learning_rate = reference.optimizer.learning_rate = 0.0
    x, y, *weights = train
    arguments = dict(sample_weight=weights[0] if weights else None, batch_size=batch_size, steps_per_epoch=1,
                     shuffle=False, verbose=0, validation_data=validation)
    history = tfdist.fit(model, x, y, **arguments).history
    expected = {key[4:]: values[-1] for key, values in reference.fit(x, y, **arguments).history.items()
                if key.startswith("val_")}
    got = {key[4:]: values[-1] for key, values in history.items() if key.startswith("val_")}
    assert set(got) == set(expected), (got, expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-5), (key, got, expected)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_masked_lstm_with_per_timestep_weights_validates_as_keras(strategy_name, static_shapes):
    x, tags, _, timestep_weights, _ = sequences(256, 0)
    vx, vtags, _, vweights, _ = sequences(150, 1)  # 150 = 4 x 32 + 22: the last batch is partial.
    assert_validation_equals_keras(lambda: sequence_model("lstm"), (x, tags, timestep_weights),
                                   (vx, vtags, vweights), strategy_name)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_a_validation_dataset_is_validated_in_its_own_batches_as_keras(strategy_name):
    x, tags, *_ = sequences(256, 0)
    vx, vtags, *_ = sequences(150, 1)
    validation = tf.data.Dataset.from_tensor_slices((vx, vtags)).batch(50)  # Keras evaluates its batches of 50.
    assert_validation_equals_keras(lambda: sequence_model("lstm"), (x, tags), validation, strategy_name)


@pytest.mark.parametrize("kind, strategy_name", [("gru", "default"), ("time_distributed", "mirrored2")])
def test_masked_per_timestep_models_validate_as_keras(kind, strategy_name, static_shapes):
    x, tags, *_ = sequences(256, 0)
    vx, vtags, *_ = sequences(150, 1)
    assert_validation_equals_keras(lambda: sequence_model(kind), (x, tags), (vx, vtags), strategy_name)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_two_outputs_with_per_example_and_per_timestep_weights_validate_as_keras(strategy_name, static_shapes):
    x, tags, labels, timestep_weights, example_weights = sequences(256, 0)
    vx, vtags, vlabels, vtimestep, vexample = sequences(150, 1)
    weights = {"tags": vtimestep, "label": vexample}
    assert_validation_equals_keras(
        two_output_model, ({"tokens": x}, {"tags": tags, "label": labels},
                           {"tags": timestep_weights, "label": example_weights}),
        ({"tokens": vx}, {"tags": vtags, "label": vlabels}, weights), strategy_name)


def test_eval_batches_keep_the_shape_of_each_sample_weight_and_zero_the_padding():
    x, tags, labels, timestep_weights, example_weights = sequences(70, 3)
    arrays = inputs.Arrays(x, {"tags": tags, "label": labels}, {"tags": timestep_weights, "label": example_weights})
    batches = list(inputs.eval_arrays_fn(arrays, per_replica_batch=64, steps=2, static_shapes=True)(
        tf.distribute.InputContext()))
    _, _, weight, mask = batches[1]  # Positions 64..127: 6 real examples, 58 padding rows.
    assert weight["tags"].shape == (64, T) and weight["label"].shape == (64,)
    np.testing.assert_array_equal(mask.numpy(), np.arange(64) < 6)
    np.testing.assert_array_equal(weight["tags"].numpy()[:6], timestep_weights[64:])
    np.testing.assert_array_equal(weight["label"].numpy()[:6], example_weights[64:])
    assert not weight["tags"].numpy()[6:].any() and not weight["label"].numpy()[6:].any()
    unweighted = list(inputs.eval_arrays_fn(inputs.Arrays(x, tags), per_replica_batch=64, steps=2)(
        tf.distribute.InputContext()))
    assert [len(b) for b in unweighted] == [3, 3]  # (x, y, mask): no weight, so Keras sees sample_weight=None.


def test_a_masked_model_with_per_timestep_weights_trains_as_keras_fit():
    x, tags, _, timestep_weights, _ = sequences(128, 4)
    dataset = tf.data.Dataset.from_tensor_slices((x, tags, timestep_weights)).batch(32, drop_remainder=True)
    reference = sequence_model("lstm")
    start = reference.get_weights()
    reference.fit(dataset, epochs=1, verbose=0)
    strategy = tfdist.make_strategy("default", precision="float32")
    with strategy.scope():
        model = sequence_model("lstm")
    tfdist.fit(model, dataset, epochs=1, verbose=0)
    assert model.optimizer.iterations.numpy() == 4
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(start, reference.get_weights())) > 1e-2


def per_sequence_loss(y_true, y_pred):
    """A loss of one value per example over a [n, T, C] output (a mean over steps and classes)."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=(1, 2))


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_a_loss_of_one_value_per_example_on_a_sequence_output_validates_as_keras(strategy_name):
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(128, 5, 3)).astype("float32"), rng.normal(size=(128, 5, 3)).astype("float32")
    vx, vy = rng.normal(size=(150, 5, 3)).astype("float32"), rng.normal(size=(150, 5, 3)).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(
            3, kernel_initializer=keras.initializers.GlorotUniform(0))])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=per_sequence_loss, metrics=["mae"])
        return model

    assert_validation_equals_keras(build, (x, y), (vx, vy), strategy_name)
