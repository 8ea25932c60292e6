"""tfdist.training.loop: what the outer loop guarantees across real worker processes.

Workers that disagree fail fast with a message naming them; SIGTERM to one
worker stops every worker at the same step; a worker whose execution fails
exits, so the job ends, although its next execution was already dispatched; a
float16 overflow on one worker is skipped by all of them.
"""

import re
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, subprocess_env
from tests.test_launch import Job

TRAIN = [sys.executable, "-m", "tfdist.cli.train"]


def launch(command, timeout=300):
    return subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", *command],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=subprocess_env())


def per_worker(flag_for_worker_1):
    """A shell command giving worker 1 one extra flag (as a machine with other settings would)."""
    train = " ".join(TRAIN + ["--strategy=multi_worker_mirrored", "--max_steps=20", "--epochs=1"])
    index = "$(python3 -c 'import json,os; print(json.loads(os.environ[\"TF_CONFIG\"])[\"task\"][\"index\"])')"
    return ["sh", "-c", f'if [ {index} = 1 ]; then exec {train} "$@" {flag_for_worker_1}; '
                        f'else exec {train} "$@"; fi', "sh"]


def test_workers_with_different_plans_fail_fast_naming_them(tmp_path):
    start = time.time()
    result = launch([*per_worker("--global_batch_size=64"), f"--workdir={tmp_path / 'w'}"])
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert time.time() - start < 120
    assert re.search(r"The workers disagree about the plan \(batch sizes, steps, seed, learning rate, dataset\): "
                     r"tasks worker 0, worker 1 resolved different values", output), output[-3000:]
    assert "Traceback" not in output


def test_workers_that_restored_different_steps_fail_fast(tmp_path):
    # Worker 1 is pointed at a workdir of its own that holds a checkpoint: an unshared workdir.
    own = tmp_path / "own"
    first = subprocess.run([*TRAIN, "--strategy=default", "--max_steps=10", "--epochs=1", "--global_batch_size=128",
                            f"--workdir={own}"], capture_output=True, text=True, cwd=REPO, env=subprocess_env(),
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    result = launch([*per_worker(f"--workdir={own}"), f"--workdir={tmp_path / 'w'}"])
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "The workers restored different checkpoints (worker 0 step 0, worker 1 step 10): is --workdir on " \
           "storage every machine shares?" in output, output[-3000:]


def test_sigterm_to_one_worker_stops_both_at_the_same_step(tmp_path):
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", f"--workdir={tmp_path / 'w'}",
                         "--checkpoint_every_steps=20", "--epochs=3"])
    job.wait_for(r"Saved checkpoint \S+ckpt-\d+ at step")
    job.pids()  # Both started.
    import os

    os.kill(job.pids()["worker:1"], signal.SIGTERM)
    assert job.wait(timeout=180) == 143, job.output[-4000:]
    steps = re.findall(r"^\[(worker:\d)\] .*stopped by a signal at step (\d+)", job.output, re.M)
    assert {w for w, _ in steps} == {"worker:0", "worker:1"} and len({s for _, s in steps}) == 1, job.output[-4000:]


def test_a_worker_whose_input_fails_ends_the_job():
    result = launch([sys.executable, "tests/programs/worker_fails.py"], timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "corrupt record in shard 1" in output, output[-3000:]
    assert "tfdist-launch: worker:1 exited with status 1; stopping the other tasks." in output, output[-3000:]
    assert "trained" not in result.stdout


def test_float16_overflow_on_one_worker_is_skipped_by_both():
    result = launch([sys.executable, "tests/programs/fp16_overflow.py", "multi_worker_mirrored"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = re.findall(r"^\[worker:\d\] (scale .*)$", result.stdout, re.M)
    assert len(lines) == 2 and lines[0] == lines[1], result.stdout[-3000:]
    assert lines[0].startswith("scale 32768 -> 16384 unchanged=True finite=True"), lines


def test_float16_overflow_on_one_of_two_cpu_replicas():
    result = subprocess.run([sys.executable, "tests/programs/fp16_overflow.py", "mirrored"], capture_output=True,
                            text=True, timeout=240, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scale 32768 -> 16384 unchanged=True finite=True" in result.stdout, result.stdout
