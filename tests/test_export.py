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
