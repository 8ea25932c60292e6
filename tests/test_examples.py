"""examples/: the tfdist.fit programs, run as users run them, on every backend here.

Each runs in its own processes: 2 CPU replicas, 2 MultiWorkerMirrored workers
and a parameter-server job through tfdist-launch, and 2 Horovod ranks under
horovodrun (TF 2.18 session). Workers and ranks must end with identical weights.
"""

import os
import re
import subprocess
import sys

import keras
import pytest

from tests.conftest import REPO, subprocess_env
from tests.test_fitting import EXAMPLE, DIGITS
from tests.test_horovod import horovodrun, needs_horovod

DICT = [sys.executable, "examples/dict_inputs.py"]
FROM_FIT = [sys.executable, "examples/from_model_fit.py"]


def run(command, *, launch=(), env=None, timeout=600):
    if launch:
        command = [sys.executable, "-m", "tfdist.cli.launch", *launch, "--", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                            env=subprocess_env(env))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def keras_history():
    """Plain Keras model.fit on the same model, data and batch: val_accuracy after each of 3 epochs."""
    keras.utils.set_random_seed(0)
    model = EXAMPLE.build_model()
    model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(EXAMPLE.features(DIGITS.train_images), DIGITS.train_labels, batch_size=64, epochs=3,
                        verbose=0, validation_data=(EXAMPLE.features(DIGITS.eval_images), DIGITS.eval_labels))
    return history.history["val_accuracy"]


@pytest.fixture(scope="module")
def keras_accuracy(keras_history):
    """The bar every backend must meet after the examples' 3 epochs."""
    return keras_history[2]


def summaries(output):
    return re.findall(r"epochs_run=(\d+) val_accuracy=([\d.]+) keys=(\S+) weights=(\w+)", output)


def test_dict_example_on_two_cpu_replicas(keras_accuracy):
    (epochs, accuracy, keys, _), = summaries(run([*DICT, "--strategy=mirrored", "--num_cpu_replicas=2"]))
    assert (epochs, keys) == ("3", "accuracy,loss,val_accuracy,val_loss")
    assert abs(float(accuracy) - keras_accuracy) <= 0.02, (accuracy, keras_accuracy)


def test_dict_example_on_two_workers_ends_with_identical_weights(keras_accuracy):
    found = summaries(run(DICT, launch=["--num_workers=2"]))
    assert len(found) == 2 and found[0] == found[1], found
    assert abs(float(found[0][1]) - keras_accuracy) <= 0.02, (found, keras_accuracy)


def test_dict_example_parameter_server_job(keras_accuracy):
    # Asynchronous workers, each in a random order of its own; within 2 points of Keras after the
    # same 3 epochs. Before BatchNormalization's moving statistics were updated atomically this
    # reached only 0.90-0.94 (concurrent workers overwrote each other's updates).
    output = run(DICT, launch=["--num_workers=2", "--num_ps=1"])
    found = summaries(output)
    assert len(found) == 1, output[-3000:]  # Only the chief runs the loop; workers and ps exit 0.
    assert found[0][0] == "3" and abs(float(found[0][1]) - keras_accuracy) <= 0.02, (found, keras_accuracy)
    assert "job done" in output


def test_early_stopping_stops_every_worker_at_the_same_epoch():
    # No epoch gains min_delta=1.0 in val_accuracy, so patience 2 stops after epoch 3 of 5.
    found = summaries(run([*DICT, "--epochs=5", "--patience=2"], launch=["--num_workers=2"]))
    assert len(found) == 2 and found[0][0] == found[1][0] == "3", found
    assert found[0][3] == found[1][3]


@pytest.mark.parametrize("launch", [(), ("--num_workers=2",)], ids=["one-process", "two-workers"])
def test_from_model_fit_example(launch):
    output = run(FROM_FIT, launch=launch, env={"EPOCHS": "2"})
    found = re.findall(r"val_accuracy=([\d.]+) weights=([\d.]+)", output)
    assert len(found) == max(1, len(launch) * 2) and len(set(w for _, w in found)) == 1, output[-2000:]
    assert all(float(a) >= 0.9 for a, _ in found)


@needs_horovod
def test_dict_example_under_horovodrun(tmp_path, keras_accuracy):
    result = horovodrun(DICT, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = summaries(result.stdout)
    assert len(found) == 2 and found[0] == found[1], result.stdout[-3000:]
    assert abs(float(found[0][1]) - keras_accuracy) <= 0.02, (found, keras_accuracy)


MEMORY_CGROUP = "/sys/fs/cgroup/memory"  # cgroup v1's memory controller (what this machine has).
BIG_MLP = {"CPU_REPLICAS": "4", "WIDTH": "3072", "STEPS": "4"}  # 28.4M weights; Adam's moments 227 MB a copy.


def _in_memory_cgroup(limit_bytes, env, name):
    """Runs examples/big_mlp.py in a new memory cgroup of `limit_bytes` (the kernel kills it past the limit);
    returns the process, how often it hit the limit and the cgroup's peak usage (what the limit counts: not
    the shared libraries already cached, which ru_maxrss counts)."""
    path = os.path.join(MEMORY_CGROUP, f"tfdist-test-{os.getpid()}-{name}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
        result = subprocess.run(["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh", sys.executable,
                                 "examples/big_mlp.py"], capture_output=True, text=True, timeout=600, cwd=REPO,
                                env=subprocess_env(env))
        with open(os.path.join(path, "memory.failcnt")) as f, \
                open(os.path.join(path, "memory.max_usage_in_bytes")) as g:
            return result, int(f.read()), int(g.read())
    finally:
        os.rmdir(path)


@pytest.mark.skipif(not os.access(MEMORY_CGROUP, os.W_OK),
                    reason="needs a writable cgroup-v1 memory controller (root) to give a process a memory limit")
def test_big_mlp_is_killed_unsharded_and_trains_sharded_under_one_memory_limit():
    """One process of 4 CPU replicas (one host's 4 devices): unsharded each holds Adam's whole state (4 x 227
    MB), sharded 1/4 of it. The limit: the sharded run's own peak plus half of the 3 x 227 MB it saves."""
    sharded = {**BIG_MLP, "ZERO_STAGE": "2"}
    measured, _, peak = _in_memory_cgroup(2 ** 62, sharded, "measure")
    assert measured.returncode == 0, measured.stderr[-3000:]
    limit = peak + 3 * 2 * 4 * 28351498 // 2
    unsharded, hits, _ = _in_memory_cgroup(limit, {**BIG_MLP, "ZERO_STAGE": "0"}, "unsharded")
    assert unsharded.returncode == -9 and hits > 0, (limit, unsharded.returncode, unsharded.stderr[-2000:])
    assert "zero_stage=0" not in unsharded.stdout  # Killed before it finished.
    trained, _, used = _in_memory_cgroup(limit, sharded, "sharded")
    assert trained.returncode == 0, (limit, used, trained.stderr[-3000:])
    assert re.search(r"zero_stage=2 params=28351498 loss=\d", trained.stdout)


# Stage 3 (issue 41, "a model that does not fit"): 16 layers, so that one layer's gather is a small part of the
# model. 62,965,770 weights at width 2048; at width 1440 31,140,010, less than half of them.
BIG_MLP_STAGE3 = {"CPU_REPLICAS": "4", "DEPTH": "16", "WIDTH": "2048", "STEPS": "2", "ZERO_STAGE": "3"}
HALF_UNSHARDED = {**BIG_MLP_STAGE3, "WIDTH": "1440", "ZERO_STAGE": "0"}


@pytest.mark.skipif(not os.access(MEMORY_CGROUP, os.W_OK),
                    reason="needs a writable cgroup-v1 memory controller (root) to give a process a memory limit")
def test_big_mlp_stage3_trains_twice_the_largest_model_that_trains_unsharded_under_one_memory_limit():
    """One process of 4 CPU replicas. The limit: the stage-3 run's own cgroup peak plus 192 MB. Under it the
    unsharded run of a model with less than half the weights is killed, so the largest model that trains
    unsharded under it has less than half the weights of the stage-3 model, which trains. Measured
    (scripts/zero3_fit_limit.py): stage 3 peaks at ~2490 MB, the half model unsharded at ~2980 MB. Were stage 3
    to keep whole weights (4 copies, and the gradient of each), it would peak above the half model unsharded and
    the limit would let that run train."""
    measured, _, peak = _in_memory_cgroup(2 ** 62, BIG_MLP_STAGE3, "stage3-measure")
    assert measured.returncode == 0, measured.stderr[-3000:]
    limit = peak + 192 * 2 ** 20
    unsharded, hits, _ = _in_memory_cgroup(limit, HALF_UNSHARDED, "half-unsharded")
    assert unsharded.returncode == -9 and hits > 0, (peak, unsharded.returncode, unsharded.stderr[-2000:])
    assert "zero_stage=0" not in unsharded.stdout  # Killed before it finished.
    trained, _, used = _in_memory_cgroup(limit, BIG_MLP_STAGE3, "stage3")
    assert trained.returncode == 0, (limit, used, trained.stderr[-3000:])
    assert re.search(r"zero_stage=3 params=62965770 loss=\d", trained.stdout), trained.stdout
