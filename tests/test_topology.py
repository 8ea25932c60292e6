"""Training that does not depend on topology: the same weights on every backend (issue acceptance).

Plain SGD: a wrong scale by the replica count changes its weights (Adam would hide it), and it
does not turn float summation noise into jumps of the learning rate's size the way Adam's
first steps can (measured: 2 vs 4 replicas differed by 4e-3 after 40 Adam steps, 3e-6 after 10).

40 float32 steps of tfdist-train, a checkpoint at step 20, on 2 and 4 CPU replicas in one
process, 2 MultiWorkerMirrored workers, 2 Horovod ranks (TF 2.18 session), and a run stopped
at step 20 on 2 workers and resumed on 4 CPU replicas. Every one must end within 1e-4 of the
2-replica run: the examples of each step depend only on (seed, epoch, step).
"""

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, load_weights, subprocess_env
from tests.test_horovod import HOROVODRUN, needs_horovod

TRAIN = [sys.executable, "-m", "tfdist.cli.train"]
LAUNCH2 = [sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--"]
COMMON = ["--precision=float32", "--global_batch_size=64", "--epochs=1", "--checkpoint_every_steps=20",
          "--optimizer=sgd", "--learning_rate=0.1",
          "--steps_per_execution=5"]


def start(command, workdir, steps=40, env=None):
    return subprocess.Popen([*command, *COMMON, f"--max_steps={steps}", f"--workdir={workdir}"], cwd=REPO,
                            env=subprocess_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process):
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("topology")
    jobs = {
        "2 replicas": start([*TRAIN, "--strategy=mirrored", "--num_cpu_replicas=2"], root / "m2"),
        "4 replicas": start([*TRAIN, "--strategy=mirrored", "--num_cpu_replicas=4"], root / "m4"),
        "2 workers": start([*LAUNCH2, *TRAIN, "--strategy=multi_worker_mirrored"], root / "w2"),
        "stopped": start([*LAUNCH2, *TRAIN, "--strategy=multi_worker_mirrored"], root / "resumed", steps=20),
    }
    outputs = {name: finish(job) for name, job in jobs.items()}
    resumed = finish(start([*TRAIN, "--strategy=mirrored", "--num_cpu_replicas=4"], root / "resumed"))
    assert "Resuming from checkpoint" in resumed and "at step 20" in resumed, resumed[-2000:]
    assert "Resuming on another topology (2 replica(s) before, 4 now)" in resumed, resumed[-2000:]
    outputs["2 workers, resumed on 4 replicas"] = resumed
    weights = {name: load_weights(str(root / d / "model.keras")) for name, d in
               [("2 replicas", "m2"), ("4 replicas", "m4"), ("2 workers", "w2"),
                ("2 workers, resumed on 4 replicas", "resumed")]}
    return root, weights


def max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("other", ["4 replicas", "2 workers", "2 workers, resumed on 4 replicas"])
def test_same_weights_whatever_the_topology(runs, other):
    _, weights = runs
    difference = max_difference(weights["2 replicas"], weights[other])
    print(f"max |2 replicas - {other}| = {difference:.3g}")
    assert difference <= 1e-4


@needs_horovod
def test_horovod_ranks_match_the_one_process_run(tmp_path):
    # Its own 2-replica run, beside the ranks (the TF 2.18 session runs this test alone, not `runs`).
    two_replicas = start([*TRAIN, "--strategy=mirrored", "--num_cpu_replicas=2"], tmp_path / "m2")
    env = subprocess_env()
    env["PATH"] = sys.exec_prefix + "/bin:" + env.get("PATH", "")
    result = subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", *TRAIN, "--strategy=horovod",
                             *COMMON, "--max_steps=40", f"--workdir={tmp_path / 'h'}"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    finish(two_replicas)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    difference = max_difference(load_weights(str(tmp_path / "m2" / "model.keras")),
                                load_weights(str(tmp_path / "h" / "model.keras")))
    print(f"max |2 replicas - 2 Horovod ranks| = {difference:.3g}")
    assert difference <= 1e-4
