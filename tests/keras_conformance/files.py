"""Which of the installed Keras package's test files the conformance run uses, and which it leaves out.

Two sets, paths relative to the keras package's directory:
  FILES   the trainer, the callbacks fit drives and tf_dataset_adapter_test.py (its fit test of a distributed
          tf.data input): every test of them runs in CI.
  broad   (`broad_files()`) every other test file under BROAD_DIRS (and BROAD_EXTRA) whose text calls `fit`,
          `evaluate`, `predict`, a `*_on_batch` method or `run_layer_test` (Keras' layer test, which fits a model
          on the layer), less LEFT_OUT: models, layers, optimizers, metrics, losses, saving, distillation and the
          TensorFlow backend's own tests. CI runs one test of each (sample.txt: the file's quickest that calls
          one of those methods; plugin.py, --keras-conformance-sample); the nox session `keras-conformance`
          runs them all.
"""

from __future__ import annotations

import importlib.util
import os
import re

FILES = (
    "src/trainers/trainer_test.py",
    "src/callbacks/backup_and_restore_test.py",
    "src/callbacks/callback_test.py",
    "src/callbacks/csv_logger_test.py",
    "src/callbacks/early_stopping_test.py",
    "src/callbacks/lambda_callback_test.py",
    "src/callbacks/learning_rate_scheduler_test.py",
    "src/callbacks/model_checkpoint_test.py",
    "src/callbacks/monitor_callback_test.py",
    "src/callbacks/reduce_lr_on_plateau_test.py",
    "src/callbacks/swap_ema_weights_test.py",
    "src/callbacks/tensorboard_test.py",
    "src/callbacks/terminate_on_nan_test.py",
    "src/trainers/data_adapters/tf_dataset_adapter_test.py",
)
BROAD_DIRS = (
    "src/models",
    "src/layers",
    "src/optimizers",
    "src/metrics",
    "src/losses",
    "src/saving",
    "src/legacy/saving",
    "src/distillation",
    "src/backend/tensorflow",
    "src/backend/common",
)
BROAD_EXTRA = (
    "src/utils/rng_utils_test.py",
    "src/utils/summary_utils_test.py",
)
# What a broad file must call to be used (the grep the files were chosen by).
CALLS = re.compile(r"\.fit\(|\.evaluate\(|\.predict\(|_on_batch\(|run_layer_test\(")
# Left out, and why (keras/src/... paths). None of the files the run uses needs the network.
LEFT_OUT = {
    "src/callbacks/orbax_checkpoint_test.py": "needs orbax (a checkpoint service), not installed with tfdist",
    "src/callbacks/remote_monitor_test.py": "needs an HTTP monitoring server (the network)",
    "src/trainers/data_adapters/grain_dataset_adapter_test.py": "needs grain",
    "src/trainers/data_adapters/torch_data_loader_adapter_test.py": "needs torch",
    "src/trainers/epoch_iterator_test.py": "tests Keras' EpochIterator directly; no fit/evaluate/predict call",
    "src/trainers/data_adapters/array_data_adapter_test.py": "tests the adapter directly; no fit/evaluate/predict",
    "src/trainers/data_adapters/generator_data_adapter_test.py": "tests the adapter directly; no fit/evaluate/predict",
    "src/trainers/data_adapters/py_dataset_adapter_test.py": "tests the adapter directly; no fit/evaluate/predict",
    "src/trainers/data_adapters/data_adapter_utils_test.py": "tests helpers directly; no fit/evaluate/predict",
    "src/trainers/compile_utils_test.py": "tests compile's loss/metric containers; no fit/evaluate/predict",
    "src/applications/applications_test.py": "slow: builds every Keras application (ImageNet-sized models)",
    "src/applications/imagenet_utils_test.py": "an application helper's tests; the applications are left out",
    "src/layers/preprocessing/stft_spectrogram_test.py": "imports scipy.signal, not installed with tfdist",
    "src/backend/jax": "the JAX backend's tests",
    "src/utils/jax_layer_test.py": "needs jax",
    "src/utils/torch_utils_test.py": "needs torch",
    "src/wrappers/sklearn_test.py": "needs scikit-learn",
    "src/export/litert_test.py": "needs LiteRT (ai-edge-litert)",
    "src/export/saved_model_test.py": "its one fit call is in a JAX-only test",
    "src/ops": "five fit/evaluate/predict calls among thousands of op tests (collection alone takes minutes)",
    "src/quantizers": "GPTQ/AWQ calibration tests; their predict calls only compare quantized with float outputs",
}
# Broad files whose grep match never fits under TensorFlow (run_layer_test(run_training_check=False), a predict of
# another backend's test, a skipped test): none of their tests calls fit/evaluate/predict in baseline.
NO_FIT = (
    "src/layers/attention/additive_attention_test.py",
    "src/layers/attention/attention_test.py",
    "src/layers/attention/grouped_query_attention_test.py",
    "src/layers/pooling/adaptive_pooling1d_test.py",
    "src/layers/pooling/adaptive_pooling2d_test.py",
    "src/layers/pooling/adaptive_pooling3d_test.py",
    "src/layers/preprocessing/hashed_crossing_test.py",
    "src/layers/preprocessing/hashing_test.py",
    "src/layers/preprocessing/image_preprocessing/max_num_bounding_box_test.py",
    "src/layers/preprocessing/image_preprocessing/random_crop_test.py",
    "src/layers/preprocessing/image_preprocessing/random_elastic_transform_test.py",
    "src/layers/preprocessing/image_preprocessing/random_rotation_test.py",
    "src/layers/preprocessing/image_preprocessing/random_translation_test.py",
    "src/layers/preprocessing/image_preprocessing/resizing_test.py",
)
LEFT_OUT.update({path: "no test of it calls fit/evaluate/predict under TensorFlow (measured)" for path in NO_FIT})


def keras_dir() -> str:
    spec = importlib.util.find_spec("keras")
    if spec is None or not spec.origin:
        raise RuntimeError("keras is not installed")
    return os.path.dirname(spec.origin)


def _left_out(relative: str) -> bool:
    return any(relative == path or relative.startswith(path + "/") for path in LEFT_OUT)


def broad_files() -> list[str]:
    """The broad set's files, relative to the keras package, sorted: found by CALLS under BROAD_DIRS."""
    root, found = keras_dir(), set()
    for directory in BROAD_DIRS:
        for dirpath, _, names in os.walk(os.path.join(root, directory)):
            for name in names:
                if name.endswith("_test.py"):
                    found.add(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    found.update(BROAD_EXTRA)
    chosen = []
    for relative in sorted(found):
        if relative in FILES or _left_out(relative):
            continue
        path = os.path.join(root, relative)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if CALLS.search(f.read()):
                    chosen.append(relative)
    return chosen


def keras_test_files(broad: bool = True) -> list[str]:
    """Absolute paths: FILES, then (broad) the broad set."""
    relative = list(FILES) + (broad_files() if broad else [])
    return [os.path.join(keras_dir(), f) for f in relative]
