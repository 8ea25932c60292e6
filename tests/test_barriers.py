"""tfdist.distribute.barriers: where the tasks of a job wait for one another outside a step, and a failed task's
error ending the others' waits.

Real two-worker jobs under tfdist-launch (tests/programs/after_fit.py): a file a chief-only callback wrote is
there when every worker's fit returns; a task that raises after fit ends the job within seconds, naming its
error, instead of holding the others at the exit barrier for 10 minutes.
"""

import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, subprocess_env
from tfdist.distribute import barriers, cluster


def launch(*args: str, timeout: float = 150) -> tuple[int, str, float]:
    """(exit status, output, when it ended) of `tfdist-launch --num_workers=2 -- python after_fit.py args`;
    a job still running after `timeout` seconds fails the test."""
    proc = subprocess.Popen([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             "tests/programs/after_fit.py", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, env=subprocess_env())
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the job still ran after {timeout} s:\n{output[-4000:]}")
    return proc.returncode, output, time.time()


def fit_returned(output: str) -> float:
    """When the last worker's fit returned."""
    return max(float(t) for t in re.findall(r"fit returned at ([\d.]+)", output))


@pytest.mark.jobs
@pytest.mark.parametrize("save", ["slow", "plain"])
def test_every_worker_loads_the_file_the_chiefs_checkpoint_callback_wrote(tmp_path, save):
    """ModelCheckpoint(save_best_only=True) runs on the chief only; the script's next line after fit loads its file
    on every worker. Worker 1's fit used to return while the chief still saved: it loaded the epoch before's
    weights (or found the file locked or absent), every time when the save is slow ("slow": 3 s)."""
    code, output, _ = launch("load", str(tmp_path), *([save] if save == "slow" else []))
    assert code == 0, output[-4000:]
    loaded = dict(re.findall(r"^\[(worker:\d)\] loaded (\w+)$", output, re.M))
    assert sorted(loaded) == ["worker:0", "worker:1"] and len(set(loaded.values())) == 1, output[-4000:]


@pytest.mark.jobs
@pytest.mark.parametrize("failing", [0, 1])  # Worker 0 also hosts TensorFlow's coordination service.
def test_a_worker_that_raises_after_fit_ends_the_job_within_30_s_naming_its_error(failing):
    """The other worker waits in tfdist.evaluate's collectives for it; the failed worker used to wait 600 s at the
    exit barrier, and the job ended with "barrier timed out" instead of its error."""
    code, output, ended = launch("raise", str(failing))
    assert code != 0, output[-4000:]
    assert ended - fit_returned(output) < 30, output[-4000:]
    assert f"tfdist-launch: worker:{failing} exited with status 1: RuntimeError: task {failing} broke after fit. " \
           "Its last lines:" in output, output[-4000:]
    other = 1 - failing  # Its collectives ended with the failed task's error, not a timeout: as the coordination
    # service reported it, or as the collective it was in was aborted with it (which, is timing: CI run 7).
    assert re.search(rf"^\[worker:{other}\] .*(Error reported from /job:worker/task:{failing}|Collective ops is "
                     rf"aborted by): tfdist task worker:{failing} failed: RuntimeError: task {failing} broke after fit",
                     output, re.M), output[-4000:]
    assert "timed out" not in output, output[-4000:]


@pytest.mark.jobs
def test_a_chief_failing_in_its_last_callback_ends_the_others_wait_at_the_end_of_fit():
    """Worker 1 waits at the end of fit for the chief's callbacks; the chief's raises in on_train_end. Worker 1's
    wait ends at once with the chief's error (it would wait up to the barrier's hour otherwise)."""
    code, output, _ = launch("callback", "0")
    assert code != 0, output[-4000:]
    assert re.search(r"^\[worker:1\] tfdist\.distribute\.barriers\.PeerFailed: \[worker:1\] another task of the job "
                     r"failed before the end of fit: worker:0 failed: RuntimeError: the chief's callback broke$",
                     output, re.M), output[-4000:]
    assert "tfdist-launch: worker:0 exited with status 1: RuntimeError: the chief's callback broke." in output, \
        output[-4000:]


def test_a_failed_barrier_names_the_task_that_failed_and_its_error(monkeypatch):
    """What TensorFlow's coordination service says when a peer reported its error (TF 2.21's text)."""
    error = RuntimeError(
        "Barrier failed because: task is set to ERROR: UNKNOWN: tfdist task worker:1 failed: ValueError: bad shard "
        "7 [type.googleapis.com/tensorflow.CoordinationServiceError='\\x18\\x01\"'].\nBarrier Id: b::0, Task: "
        "/job:worker/replica:0/task:1\n\nRPC: /tensorflow.CoordinationService/Barrier")
    assert barriers.peer_error(error) == "worker:1 failed: ValueError: bad shard 7"
    lost = RuntimeError("Barrier failed because: task /job:worker/replica:0/task:1 heartbeat timeout.\nmore")
    assert barriers.peer_error(lost) == "Barrier failed because: task /job:worker/replica:0/task:1 heartbeat " \
                                        "timeout. more"
    # A task that took the job's error before it reached the barrier: the error is in the service's task states.
    monkeypatch.setattr(barriers, "_task_errors", lambda cluster: ["tfdist task worker:0 failed: OSError: disk full"])
    taken = RuntimeError("Agent must be in CONNECTED state. It is currently in ERROR.")
    assert barriers.peer_error(taken, cluster=cluster.LOCAL) == "worker:0 failed: OSError: disk full"


def test_the_failure_line_is_read_back_only_as_a_task_prints_it():
    line = cluster.failure_line("worker:1", "RuntimeError: task 1 broke after fit")
    assert cluster.failure_in(line) == "RuntimeError: task 1 broke after fit"
    assert cluster.failure_in("[worker:0] " + line) is None  # Quoted inside another task's output line.
    assert cluster.failure_in("tfdist: worker:1 trained") is None
