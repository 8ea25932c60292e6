"""tfdist.training.export: the SavedModel serves what the Keras model predicts; format names are checked."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tfdist.mnist import data, model
from tfdist.training import export
from tfdist.errors import UserError


def test_saved_model_serves_the_keras_predictions(tmp_path):
    cnn = model.build_cnn(seed=3)
    images = data.load_dataset("mnist").eval_images[:200]
    path = export.export_saved_model(cnn, str(tmp_path / "serving"))
    assert path == str(tmp_path / "serving") and os.path.exists(os.path.join(path, "saved_model.pb"))
    assert sorted(os.listdir(tmp_path)) == ["serving"]  # No staging directory left behind.
    serve = tf.saved_model.load(path).signatures["serving_default"]
    spec = serve.structured_input_signature[1]["image"]
    assert (spec.dtype, spec.shape.as_list()) == (tf.uint8, [None, 28, 28, 1])
    served = serve(image=tf.constant(images))["output_0"].numpy()
    np.testing.assert_allclose(served, cnn.predict(images, verbose=0), atol=1e-5)

    # A second export replaces the first, whole.
    other = model.build_cnn(seed=4)
    export.export_saved_model(other, path)
    assert sorted(os.listdir(tmp_path)) == ["serving"]
    served = tf.saved_model.load(path).signatures["serving_default"](image=tf.constant(images))["output_0"].numpy()
    np.testing.assert_allclose(served, other.predict(images, verbose=0), atol=1e-5)


def test_export_formats():
    assert export.parse_export_formats("keras") == ("keras",)
    assert export.parse_export_formats(" keras , saved_model") == ("keras", "saved_model")


@pytest.mark.parametrize("spec, expected", [
    ("onnx", "unknown format 'onnx'; valid formats are: keras, saved_model"),
    ("keras,,saved_model", "has an empty entry"),
    ("", "has an empty entry"),
    ("keras,keras", "names a format twice"),
])
def test_bad_export_formats(spec, expected):
    with pytest.raises(UserError, match=expected) as info:
        export.parse_export_formats(spec)
    assert "\n" not in str(info.value)


def test_tfdist_train_exports_both_formats_that_predict_the_same(tmp_path):
    import keras

    from tests.conftest import run_train

    workdir = tmp_path / "w"
    result = run_train([f"--workdir={workdir}", "--max_steps=5", "--epochs=1", "--precision=float32",
                        "--export=keras,saved_model"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    images = data.load_dataset("mnist").eval_images[:300]
    expected = keras.models.load_model(str(workdir / "model.keras"), compile=False).predict(images, verbose=0)
    served = tf.saved_model.load(str(workdir / "saved_model")).signatures["serving_default"]
    (output,) = served(image=tf.constant(images)).values()
    np.testing.assert_allclose(output.numpy(), expected, atol=1e-5)
    assert not [p for p in os.listdir(workdir) if "tmp" in p]


def test_tfdist_train_refuses_an_unknown_export_format(tmp_path):
    from tests.conftest import run_train

    result = run_train([f"--workdir={tmp_path / 'w'}", "--export=onnx"], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--export='onnx': unknown format 'onnx'; valid formats are: keras, saved_model" in result.stderr
    assert not (tmp_path / "w").exists()


# Exports from tfdist.fit ------------------------------------------------------------
def _dense_model(*extra):
    import keras

    init = keras.initializers.GlorotUniform(seed=2)
    model = keras.Sequential([keras.Input((4,), name="features"), keras.layers.Dense(3, kernel_initializer=init),
                              *extra])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _xy():
    x = np.random.RandomState(0).randn(64, 4).astype("float32")
    return x, np.stack([x.sum(1), x[:, 0], -x[:, 1]], 1)


def test_fit_exports_to_a_non_local_filesystem_through_gfile(tmp_path, monkeypatch):
    import uuid

    import tfdist

    monkeypatch.chdir(tmp_path)
    root = f"ram://tfdist-export-{uuid.uuid4().hex}/w"
    model = _dense_model()
    x, y = _xy()
    tfdist.fit(model, x, y, batch_size=16, epochs=1, verbose=0, workdir=root, export=("keras", "saved_model"))
    assert os.listdir(tmp_path) == []  # Nothing on the local disk (the old code wrote ./ram:/.../saved_model).
    assert tf.io.gfile.exists(f"{root}/model.keras")
    assert sorted(tf.io.gfile.listdir(f"{root}/saved_model")) == ["assets", "fingerprint.pb", "saved_model.pb",
                                                                   "variables"]
    assert not [p for p in tf.io.gfile.listdir(root) if "tmp" in p]
    served = tf.saved_model.load(f"{root}/saved_model").signatures["serving_default"]
    (output,) = served(features=tf.constant(x)).values()
    np.testing.assert_allclose(output.numpy(), model.predict(x, verbose=0), atol=1e-6)


class _Scale:
    """A constructor argument Keras cannot serialise."""

    factor = 2.0


def _unserialisable_layer():
    import keras

    class ScaleBy(keras.layers.Layer):
        def __init__(self, scale, **kwargs):
            super().__init__(**kwargs)
            self.scale = scale

        def call(self, inputs):
            return inputs * self.scale.factor

    return ScaleBy(_Scale(), name="scale_by")


def test_an_unserialisable_layer_is_refused_before_any_step(tmp_path):
    import tfdist

    model = _dense_model(_unserialisable_layer())
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UserError) as e:
        tfdist.fit(model, *_xy(), batch_size=16, epochs=1, verbose=0, workdir=str(tmp_path / "w"))
    assert str(e.value) == (
        "The model cannot be exported as model.keras after training (export includes 'keras'): layer 'scale_by' "
        "(ScaleBy): Object ScaleBy was created by passing non-serializable argument values in `__init__()`, and "
        "therefore the object must override `get_config()` in order to be serializable. Either give ScaleBy a "
        "get_config() that returns its constructor arguments (and a from_config() if they are not plain values), or "
        "pass export=() (tfdist-train: --export=saved_model) to skip it. No step was run.")
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert not (tmp_path / "w").exists()
    # Without the keras export the same model trains and exports its SavedModel.
    history = tfdist.fit(model, *_xy(), batch_size=16, epochs=1, verbose=0, workdir=str(tmp_path / "v"),
                         export=("saved_model",))
    assert len(history.history["loss"]) == 1 and (tmp_path / "v" / "saved_model" / "saved_model.pb").exists()


def test_an_export_that_fails_after_training_keeps_the_history_and_checkpoints(tmp_path, monkeypatch):
    import tfdist

    def broken(model, path):
        raise RuntimeError("the serving export broke. Details follow")

    monkeypatch.setattr(export, "export_saved_model", broken)
    model = _dense_model()
    workdir = tmp_path / "w"
    with pytest.raises(export.ExportError) as e:
        tfdist.fit(model, *_xy(), batch_size=16, epochs=2, verbose=0, workdir=str(workdir),
                   export=("keras", "saved_model"))
    assert str(e.value) == (
        f"Training finished at step 8 and checkpoint ckpt-8 in {workdir / 'checkpoints'} holds the trained model, "
        "but the saved_model export failed: RuntimeError: the serving export broke. The History is on "
        "model.history and on this error's .history. Fix the cause and rerun the same call (it resumes at the last "
        "checkpoint and exports again), or pass export=() to skip the export.")
    assert e.value.exit_code == 1
    assert len(e.value.history.history["loss"]) == 2 and model.history is e.value.history
    assert (workdir / "model.keras").exists() and (workdir / "checkpoints" / "ckpt-8.index").exists()
