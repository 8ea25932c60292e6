"""Shared test set-up: four logical CPU devices, float32 policy, subprocess helpers, a prepared tfds dataset.

TensorFlow can split the CPU into logical devices only before it initialises,
so it is done here, once, before any test imports tfdist's training code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)
assert len(tf.config.list_logical_devices("CPU")) == NUM_LOGICAL_CPUS  # Initialises the runtime: fixed from here on.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.mixed_precision.set_dtype_policy("float32")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _no_current_strategy():
    """Each test starts as a fresh program: `tfdist.fit` without `strategy=` uses TensorFlow's default
    strategy until the test calls `make_strategy` (a mirrored one an earlier test made on the same
    xdist worker would otherwise be taken)."""
    from tfdist.distribute import strategies

    strategies._CURRENT.clear()
    yield
    strategies._CURRENT.clear()


@pytest.fixture(scope="session")
def tiny_digits_dir(tmp_path_factory) -> str:
    """A tfds data_dir holding the prepared `tiny_digits` dataset (tests/tiny_digits.py), made once per session."""
    from tests import tiny_digits  # Imports tensorflow-datasets: only the tests that use it pay for it.

    return tiny_digits.prepare(str(tmp_path_factory.mktemp("tfds")))


def free_port() -> int:
    from tfdist.launcher.launch import free_ports

    return free_ports(1)[0]


def subprocess_env(extra: Optional[dict] = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def run_module(module: str, args: Sequence[str], *, env: Optional[dict] = None, timeout: float = 300,
               cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Runs `python -m module args...` and returns the completed process (text output)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
        env=subprocess_env(env), cwd=cwd or REPO,
    )


def run_train(args: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    return run_module("tfdist.cli.train", args, **kwargs)


def load_weights(path: str) -> list[np.ndarray]:
    return [np.asarray(w) for w in keras.models.load_model(path, compile=False).get_weights()]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "jobs: a real multi-process job (tfdist-launch, parameter servers, SSH). The tests-tf2.21 nox "
                   "session runs them; tests-tf2.18-horovod runs only `horovod or (keras_internals and not jobs)`.")
    config.addinivalue_line(
        "markers", "horovod: runs Horovod for real (tests.test_horovod.needs_horovod): the tests-tf2.18-horovod "
                   "nox session selects these, where Horovod builds; elsewhere they skip.")
    config.addinivalue_line(
        "markers", "keras_internals: checks the TensorFlow/Keras internals tfdist's step relies on; the "
                   "tests-tf2.18-horovod session runs these too, on its older TensorFlow.")
