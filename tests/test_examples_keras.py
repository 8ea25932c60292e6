"""examples/ written as keras.io writes them (GAN, VAE, text, recommender, transformer), run as users run them.

Each runs in its own processes on 2 CPU replicas and on 2 MultiWorkerMirrored
workers (tfdist-launch). It must exit 0 and print one summary line per task;
the workers' lines (weights checksum included) must be identical, and the
result must be as good as plain Keras `model.fit` on one device, run here on
the same data, model and epochs (module-scoped: once per example). The GAN has
no such reference (its losses are a game, not a target): both losses finite.
"""

import importlib.util
import math
import os
import re
import subprocess
import sys

import keras
import pytest

from tests.conftest import REPO, subprocess_env

EPOCHS = {"gan": 1, "vae": 2, "text_classification": 3, "recommender": 2, "transformer": 2}
LAUNCHES = {"two-replicas": ((), ("--strategy=mirrored", "--num_cpu_replicas=2")),
            "two-workers": (("--num_workers=2",), ())}
# The two-worker launches are real multi-process jobs: the TF 2.21 lane runs them (tests/conftest.py).
HOWS = [pytest.param("two-replicas"), pytest.param("two-workers", marks=pytest.mark.jobs)]


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(name, how):
    """Runs examples/<name>.py as `how` says; returns the summaries ({key: value}) of every task."""
    launch, flags = LAUNCHES[how]
    command = [sys.executable, f"examples/{name}.py", f"--epochs={EPOCHS[name]}", *flags]
    if launch:
        command = [sys.executable, "-m", "tfdist.cli.launch", *launch, "--", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=subprocess_env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    lines = re.findall(r"^(?:\[\w+:\d+\] )?summary (.*)$", output, re.M)  # tfdist-launch prefixes "[worker:0] ".
    found = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]
    assert len(found) == (2 if launch else 1), output[-4000:]
    assert all(f == found[0] for f in found), found  # Workers end on the same logs and bit-identical weights.
    assert found[0]["epochs_run"] == str(EPOCHS[name]), found
    return found


def keras_fit(name, fit):
    """Plain Keras on one device: `fit(example_module, model)`'s last logs, the example's seed set first."""
    example = load_example(name)
    keras.utils.set_random_seed(0)
    return {k: v[-1] for k, v in fit(example).history.items()}


@pytest.fixture(scope="module")
def keras_vae():
    return keras_fit("vae", lambda ex: ex.build_vae().fit(ex.load_digits(), epochs=EPOCHS["vae"],
                                                          batch_size=ex.BATCH_SIZE, verbose=0))


@pytest.fixture(scope="module")
def keras_text():
    def fit(ex):
        train_ds, val_ds = ex.vectorized_datasets()
        return ex.build_model().fit(train_ds, validation_data=val_ds, epochs=EPOCHS["text_classification"],
                                    verbose=0)
    return keras_fit("text_classification", fit)


@pytest.fixture(scope="module")
def keras_recommender():
    def fit(ex):
        x_train, y_train, x_val, y_val = ex.make_ratings()
        return ex.build_model().fit(x_train, y_train, batch_size=ex.BATCH_SIZE, epochs=EPOCHS["recommender"],
                                    verbose=0, validation_data=(x_val, y_val))
    return keras_fit("recommender", fit)


@pytest.fixture(scope="module")
def keras_transformer():
    def fit(ex):
        x_train, y_train = ex.make_sequences(2000, seed=1)
        return ex.build_model().fit(x_train, y_train, batch_size=ex.BATCH_SIZE, epochs=EPOCHS["transformer"],
                                    verbose=0, validation_data=ex.make_sequences(500, seed=2))
    return keras_fit("transformer", fit)


@pytest.mark.parametrize("how", HOWS)
def test_gan_with_its_own_train_step_and_two_optimizers(how):
    summary, *_ = run_example("gan", how)
    assert all(math.isfinite(float(summary[k])) and float(summary[k]) > 0 for k in ("d_loss", "g_loss")), summary


@pytest.mark.parametrize("how", HOWS)
def test_vae_with_its_own_train_step_and_trackers(how, keras_vae):
    summary, *_ = run_example("vae", how)
    # The losses are sums over 784 pixels (about 300 after 2 epochs): within 3% of Keras' own.
    for key in ("loss", "reconstruction_loss"):
        assert abs(float(summary[key]) - keras_vae[key]) <= 0.03 * keras_vae[key], (summary, keras_vae)
    assert abs(float(summary["kl_loss"]) - keras_vae["kl_loss"]) <= 0.5, (summary, keras_vae)


@pytest.mark.parametrize("how", HOWS)
def test_text_classifier_with_text_vectorization_and_masking(how, keras_text):
    summary, *_ = run_example("text_classification", how)
    assert abs(float(summary["val_accuracy"]) - keras_text["val_accuracy"]) <= 0.03, (summary, keras_text)
    assert abs(float(summary["loss"]) - keras_text["loss"]) <= 0.05, (summary, keras_text)


@pytest.mark.parametrize("how", HOWS)
def test_recommender_with_large_embeddings(how, keras_recommender):
    summary, *_ = run_example("recommender", how)
    assert abs(float(summary["val_loss"]) - keras_recommender["val_loss"]) <= 0.01, (summary, keras_recommender)
    assert abs(float(summary["loss"]) - keras_recommender["loss"]) <= 0.01, (summary, keras_recommender)


@pytest.mark.parametrize("how", HOWS)
def test_transformer_block_classifier(how, keras_transformer):
    summary, *_ = run_example("transformer", how)
    assert abs(float(summary["val_accuracy"]) - keras_transformer["val_accuracy"]) <= 0.05, \
        (summary, keras_transformer)
