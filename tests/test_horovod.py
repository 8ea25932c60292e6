"""tfdist.distribute.horovod_support: the Horovod backend under a real horovodrun (Gloo).

These run in the TensorFlow 2.18 + horovod 0.28.1 nox session; in the TF 2.21
session Horovod cannot be built (it does not compile against TF >= 2.19), so
only the tests that need no Horovod run there. TFDIST_REQUIRE_HOROVOD=1 turns
a missing Horovod into a failure instead of a skip.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_train, subprocess_env
from tfdist.distribute import horovod_support

HAVE_HOROVOD = horovod_support.is_horovod_available()
if os.environ.get("TFDIST_REQUIRE_HOROVOD") == "1" and not HAVE_HOROVOD:
    raise RuntimeError("TFDIST_REQUIRE_HOROVOD=1 but horovod is not importable in this environment")
_skip_without_horovod = pytest.mark.skipif(
    not HAVE_HOROVOD,
    reason="horovod 0.28.1 does not build against this TensorFlow (>= 2.19); these tests run in the "
           "tests-tf2.18-horovod nox session",
)


def needs_horovod(test):
    """A test that runs Horovod for real: skipped where it is not installed, and marked `horovod`, which is
    what the tests-tf2.18-horovod session selects."""
    return pytest.mark.horovod(_skip_without_horovod(test))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
pytestmark = pytest.mark.horovod  # All of this module runs in the TF 2.18 session (tests/conftest.py).


def horovodrun(args, tmp_path, np_=2, timeout=400):
    env = subprocess_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run([HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def fingerprints(output):
    return dict(re.findall(r"^\[(\d)\]<stdout>:\[rank:\d\] done: .*weights_fingerprint=(\w+)$", output, re.M))


@needs_horovod
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_two_ranks_train_to_the_same_weights(tmp_path, compression):
    workdir = tmp_path / "w"
    result = horovodrun([sys.executable, "-m", "tfdist.cli.train", "--strategy=horovod", f"--workdir={workdir}",
                         f"--hvd_compression={compression}"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert (metrics["strategy"], metrics["num_replicas"], metrics["num_workers"]) == ("horovod", 2, 2)
    assert metrics["eval_accuracy"] >= 0.97 and metrics["steps"] == 310
    prints = fingerprints(result.stdout)
    assert set(prints) == {"0", "1"} and len(set(prints.values())) == 1, result.stdout[-2000:]
    assert prints["0"] == metrics["weights_fingerprint"]


@needs_horovod
def test_ranks_read_disjoint_data_and_start_from_identical_weights(tmp_path):
    result = horovodrun([sys.executable, os.path.join(REPO, "tests", "horovod_probe.py"), str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["size"] for r in ranks] == [2, 2]
    assert ranks[0]["before"] != ranks[1]["before"], "seeds did not give different initial weights"
    assert ranks[0]["after"] == ranks[1]["after"] == ranks[0]["before"], "rank 0's weights were not broadcast"
    assert ranks[0]["batch_sizes"] == ranks[1]["batch_sizes"] == [64]  # B/2 per rank.
    seen = [set(r["hashes"]) for r in ranks]
    assert len(seen[0]) == len(seen[1]) == 62 * 64
    assert not seen[0] & seen[1], "two ranks read the same digit"


@needs_horovod
def test_two_ranks_train_keras_forms_as_keras_with_synchronized_batch_norm(tmp_path):
    """List inputs, no y, BatchNormalization(synchronized=True) (through Horovod: no replica context),
    an Embedding and the script's own file (tfdist.task_path) on 2 ranks (tests/programs/keras_forms.py)."""
    from tests import keras_forms

    result = horovodrun([sys.executable, os.path.join(REPO, "tests", "programs", "keras_forms.py"), str(tmp_path),
                         "horovod"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    keras_forms.check_job(tmp_path)


@needs_horovod
def test_env_reports_horovod_build():
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.env", "--json"], capture_output=True, text=True,
                            env=subprocess_env(), cwd=REPO, timeout=120)
    report = json.loads(result.stdout)["horovod"]
    assert report["status"].startswith("importable") and report["tensorflow_built"] and report["gloo_built"]


@needs_horovod
def test_adasum_without_mpi_is_refused(tmp_path):
    result = horovodrun([sys.executable, "-m", "tfdist.cli.train", "--strategy=horovod", "--hvd_op=adasum",
                         f"--workdir={tmp_path / 'w'}"], tmp_path)
    assert result.returncode != 0
    assert "tfdist-train: error: --hvd_op=adasum needs Horovod built with MPI" in result.stdout + result.stderr


def test_horovod_outside_horovodrun_is_refused(tmp_path):
    result = run_train(["--strategy=horovod", f"--workdir={tmp_path / 'w'}"], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "must be started by horovodrun" in result.stderr


@pytest.mark.skipif(HAVE_HOROVOD, reason="checks the message users get when Horovod is not installed")
def test_missing_horovod_says_how_to_install(tmp_path):
    result = run_train(["--strategy=horovod", f"--workdir={tmp_path / 'w'}"], env={"HOROVOD_RANK": "0"},
                       timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "needs Horovod, which is not installed" in result.stderr and "HOROVOD_WITH_TENSORFLOW=1" in result.stderr


def test_launcher_detection():
    assert horovod_support.started_by_launcher({"HOROVOD_RANK": "1"})
    assert horovod_support.started_by_launcher({"OMPI_COMM_WORLD_SIZE": "1"})  # mpirun -np 1 may run Horovod.
    assert not horovod_support.started_by_launcher({})
    assert not horovod_support.started_by_launcher({"SLURM_PROCID": "0", "HOROVOD_CPU_OPERATIONS": "gloo"})


@pytest.mark.parametrize("environ, expected", [
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, True),                      # horovodrun --gloo
    ({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}, True),                    # horovodrun --gloo
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, True),       # mpirun -np 2 (horovodrun --mpi)
    ({"OMPI_COMM_WORLD_SIZE": "1"}, False),                                   # one rank: nothing to all-reduce
    ({"PMI_SIZE": "4", "PMI_RANK": "0", "SLURM_PROCID": "0"}, False),        # srun --mpi=pmi2, any program
    ({"PMI_SIZE": "4", "PMI_RANK": "0", "HOROVOD_CONTROLLER": "mpi"}, True),  # srun --mpi=pmi2 for Horovod
    ({"PMI_SIZE": "1", "HOROVOD_CONTROLLER": "mpi"}, False),
    ({"PMI_SIZE": "two", "HOROVOD_CONTROLLER": "mpi"}, False),
    ({"HOROVOD_RANK": ""}, False),
    ({}, False),
])
def test_auto_selects_horovod_only_for_a_horovod_launch(environ, expected):
    assert horovod_support.auto_selects_horovod(environ, available=True) is expected
    assert horovod_support.auto_selects_horovod(environ, available=False) is False


def test_auto_ignores_a_bare_pmi_size(monkeypatch):
    """srun --mpi=pmi2 sets PMI_SIZE for a TensorFlow job too; auto must not switch to Horovod."""
    from tfdist.distribute import strategies
    from tfdist.mnist.config import TrainConfig

    monkeypatch.setattr(horovod_support, "is_horovod_available", lambda: True)
    for key in ("TF_CONFIG", "TPU_NAME", *horovod_support.LAUNCHER_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PMI_SIZE", "2")
    assert strategies.resolve_auto(TrainConfig())[0] == "default"
    monkeypatch.setenv("HOROVOD_RANK", "0")
    assert strategies.resolve_auto(TrainConfig()) == (
        "horovod", "horovodrun or mpirun started this process and Horovod is installed")
