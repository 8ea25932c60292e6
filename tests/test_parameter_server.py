"""tfdist.distribute.parameter_server: Keras 3 training under ParameterServerStrategy, for real.

Chief, workers and parameter servers are real TensorFlow processes on loopback
ports started by tfdist-launch; failures (a worker or the parameter server
killed, SIGTERM to the launcher) are provoked for real.
"""

import json
import os
import re
import signal
import sys
import time

import pytest
import tensorflow as tf
from tensorflow.python.distribute.coordinator import values as coordinator_values

from tests.conftest import run_module
from tests.test_launch import Job, alive, latest_checkpoint_step
from tfdist.distribute import cluster, parameter_server
from tfdist.errors import UserError

pytestmark = pytest.mark.jobs  # Real multi-process jobs: the TF 2.21 lane runs them (tests/conftest.py).


def info(value):
    return cluster.parse_tf_config(json.dumps(value))


FULL = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4", "h:5"]}


@pytest.mark.parametrize("spec, shards, expected", [
    ({"worker": ["h:2"], "ps": ["h:4"]}, None, "needs chief, worker and ps tasks, but TF_CONFIG has no chief"),
    ({"chief": ["h:1"], "worker": ["h:2"]}, None, "has no ps (it has chief, worker). With tfdist-launch give --num_ps"),
    (FULL, 0, "--ps_shards=0: give 1 or more (how many row shards each tfdist.layers.ShardedEmbedding table is "
              "split into over the 2 ps task(s); by default one per ps task)."),
])
def test_cluster_checks(spec, shards, expected):
    task = {"type": "worker", "index": 0}
    with pytest.raises(UserError) as e:
        parameter_server.check_cluster(info({"cluster": spec, "task": task}), ps_shards=shards)
    assert expected in str(e.value)


def test_without_a_cluster():
    with pytest.raises(UserError, match="needs a cluster with a chief, workers and ps tasks"):
        parameter_server.check_cluster(cluster.LOCAL, ps_shards=None)


def test_launcher_refuses_parameter_server_without_ps():
    result = run_module("tfdist.cli.launch", ["--num_workers=2", "--", "tfdist-train", "--strategy=parameter_server"],
                        timeout=60)
    assert result.returncode == 2
    assert "tfdist-launch: error: --strategy=parameter_server needs parameter servers: give --num_ps=1" in result.stderr


def test_concurrent_workers_lose_no_update():
    # Keras updates its step counter and layer state (BatchNormalization's moving statistics) by
    # read-modify-write; two workers stepping at once lost about a quarter of them (iterations 228,
    # calls 219 of 300) before tfdist made them atomic increments.
    result = run_module("tfdist.cli.launch", ["--num_workers=2", "--num_ps=1", "--", sys.executable,
                                              "tests/programs/ps_counts.py"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[chief:0] applied=300 iterations=300 calls=300 expected=300" in result.stdout, result.stdout[-3000:]
    # tfdist.fit(zero_stage=1) was refused before any step (the counts above start from zero).
    assert "[chief:0] refused: zero_stage=1 is not supported on parameter servers (the optimizer state already " \
           "lives on the ps tasks" in result.stdout, result.stdout[-3000:]


def test_killed_worker_applies_each_step_once_and_the_counter_never_goes_back(tmp_path):
    # The coordinator re-runs an execution whose worker died from its first step, while the steps the dead
    # worker finished are already on the ps: 2037 steps were applied against 2000 counted, and each save
    # assigned the chief's count into the on-ps counter, backwards. Worker 1's input (tests/programs/ps_kill.py)
    # gives two batches, writes a marker and stalls, so the kill lands with exactly two steps of its execution
    # claimed: a kill timed from the chief's progress lines missed on a loaded machine.
    marker = tmp_path / "stalled"
    program = [sys.executable, "tests/programs/ps_kill.py", str(tmp_path / "w"), str(marker)]
    job = Job(tmp_path, [], launch_args=["--num_ps=1"], wrap=lambda command: command[:command.index("--") + 1] + program)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output[-4000:]
        time.sleep(0.1)
    time.sleep(5)  # The second step's claim and updates (a few ps round trips) after its batch was taken.
    os.kill(job.pids()["worker:1"], signal.SIGKILL)
    assert job.wait(timeout=120) == 0, job.output[-4000:]
    assert "worker:1 was killed by SIGKILL" in job.output
    # The re-run on worker 0 skipped the two steps the dead worker had claimed and applied.
    assert "the 2 step(s) that worker had claimed were not applied again" in job.output, job.output[-4000:]
    assert "applied=40 counter=40 iterations=40 expected=40 drops=0" in job.output, job.output[-4000:]
    assert latest_checkpoint_step(tmp_path / "w") == 40


def ps_job(tmp_path, *args, num_ps=1, launch_args=()):
    return Job(tmp_path, ["--strategy=parameter_server", f"--workdir={tmp_path / 'w'}", *args],
               launch_args=[f"--num_ps={num_ps}", *launch_args])


def metrics(tmp_path):
    return json.loads((tmp_path / "w" / "metrics.json").read_text())


def applied_steps(tmp_path) -> tuple:
    """Counts the steps themselves produced: the on-ps step counter at the end, and the optimizer's
    iterations in the last checkpoint (incremented by each optimizer update, atomically on this path)."""
    reader = tf.train.load_checkpoint(str(tmp_path / "w" / "checkpoints"))
    return metrics(tmp_path)["step_counter"], int(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"))


def assert_applied_after_one_kill(tmp_path, output: str) -> None:
    """310 steps counted; each applied once, but for the documented window of one killed worker.

    A worker killed between its step's claim on the ps and the end of that step's updates leaves
    that one step unapplied (README, "Parameter servers"); the chief then says so
    at the next checkpoint. A step applied twice, or two lost, fails here.
    """
    applied = applied_steps(tmp_path)
    assert applied == (310, 310) or (min(applied) == 309 and max(applied) <= 310 and
                                     "step(s) applied to the variables against" in output), (applied, output[-3000:])


def test_two_workers_one_ps_train_and_every_task_exits_cleanly(tmp_path):
    job = ps_job(tmp_path)
    assert job.wait() == 0, job.output[-4000:]
    m = metrics(tmp_path)
    assert (m["strategy"], m["num_workers"], m["steps"]) == ("parameter_server", 2, 310)
    assert applied_steps(tmp_path) == (310, 310)  # What the steps counted equals what was scheduled and finished.
    assert m["eval_accuracy"] >= 0.97 and m["eval_examples"] == 2000
    for task in ("worker:0", "worker:1", "ps:0"):
        assert f"[{task}] [{task}] served until the chief finished" in job.output
    assert "tfdist-launch: the chief finished; job done." in job.output
    # Steps go to whichever worker is free: each reads the whole set in its own order.
    assert "all 8000 training examples, per-replica batch 128, in a random order of its own" in job.output


def test_variables_spread_over_two_parameter_servers(tmp_path):
    job = ps_job(tmp_path, "--epochs=1", num_ps=2)
    assert job.wait() == 0, job.output[-4000:]
    match = re.search(r"Variables per parameter server: /job:ps/replica:0/task:0: (\d+), "
                      r"/job:ps/replica:0/task:1: (\d+)", job.output)
    assert match and int(match.group(1)) > 0 and int(match.group(2)) > 0, job.output[-3000:]


SLOW = ["--steps_per_execution=2", "--checkpoint_every_steps=20"]


def test_killed_worker_does_not_stop_training(tmp_path):
    job = ps_job(tmp_path, *SLOW)
    job.kill_after_first_checkpoint("worker:1")
    assert job.wait() == 0, job.output[-4000:]
    assert "tfdist-launch: worker:1 was killed by SIGKILL; the chief carries on with the other workers." in job.output
    m = metrics(tmp_path)
    assert m["steps"] == 310 and m["eval_accuracy"] >= 0.97
    assert_applied_after_one_kill(tmp_path, job.output)  # The re-run applied only what the dead worker had not.


def test_restarted_worker_rejoins(tmp_path):
    job = ps_job(tmp_path, *SLOW, launch_args=["--restart_workers=1"])
    job.kill_after_first_checkpoint("worker:0")
    assert job.wait() == 0, job.output[-4000:]
    assert "worker:0 was killed by SIGKILL; restarting it (1 of 1)" in job.output
    assert len(re.findall(r"started worker:0 \(pid", job.output)) == 2
    assert "[worker:0] [worker:0] served until the chief finished" in job.output
    assert metrics(tmp_path)["steps"] == 310
    assert_applied_after_one_kill(tmp_path, job.output)


def test_lost_parameter_server_fails_the_job_then_relaunch_resumes(tmp_path):
    job = ps_job(tmp_path, *SLOW)
    killed = job.kill_after_first_checkpoint("ps:0")
    pids = job.pids()
    code = job.wait(timeout=200)
    assert code != 0 and time.time() - killed < 120, job.output[-4000:]
    chief = "\n".join(line for line in job.output.splitlines() if line.startswith("[chief:0]"))
    # Not anchored at the line's start: TensorFlow may be writing "Exception ignored in: ..." (a function it could
    # not remove from the dead ps) on the same stream as the error line starts.
    assert re.search(r"\[chief:0\] .*tfdist-train: error: lost contact with task /job:ps/replica:0/task:0", chief), \
        chief[-4000:]
    assert not any(alive(pid) for pid in pids.values())
    step = latest_checkpoint_step(tmp_path / "w")
    again = ps_job(tmp_path, *SLOW)
    assert again.wait() == 0, again.output[-4000:]
    assert "Resuming from checkpoint" in again.output and f"at step {step}." in again.output
    m = metrics(tmp_path)
    assert (m["resumed_from_step"], m["steps"]) == (step, 310) and m["eval_accuracy"] >= 0.97
    assert applied_steps(tmp_path) == (310, 310)


def test_sigterm_checkpoints_on_the_chief(tmp_path):
    job = ps_job(tmp_path, *SLOW)
    step = job.preempt_after_first_checkpoint()
    assert 0 < step < 310 and latest_checkpoint_step(tmp_path / "w") == step
    assert "forwarding SIGTERM to chief:0 (checkpoint, then exit)" in job.output


def test_gradients_are_staged_on_their_variables_devices_before_the_claim():
    # A lowered cond's Switch sits with its input: a gradient left on the worker waits for the claim's answer
    # before it travels. Staged, each (dense or row-sparse) is already on its variable's ps; None stays None.
    devices = ["/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"]
    tf.config.set_soft_device_placement(True)
    variables = []
    for device in devices:
        with tf.device(device):
            variables.append(tf.Variable(tf.zeros([4, 2])))
    seen = {}

    @tf.function
    def stage(dense):
        rows = tf.IndexedSlices(dense[:1], tf.constant([3]), tf.constant([4, 2]))
        staged = parameter_server._staged([dense, rows, None], [variables[0], variables[1], variables[0]])
        seen["devices"] = [staged[0].device, staged[1].values.device, staged[1].indices.device]
        seen["kinds"] = [type(s).__name__ for s in staged]
        return staged[0]

    stage.get_concrete_function(tf.TensorSpec([4, 2], tf.float32))
    assert seen["devices"] == [devices[0], devices[1], devices[1]]
    assert seen["kinds"] == ["SymbolicTensor", "IndexedSlices", "NoneType"]


class _ClearedWhileFetched(coordinator_values.RemoteValueImpl):
    """TensorFlow's RemoteValue, its worker thread failing to copy the finished result back (`_set_error`)
    between the chief's wait and its read: the interleaving that handed the chief no value (CI, a relaunch)."""

    def __init__(self, error):
        super().__init__(None, None)
        self._set_values(tf.zeros([3]))
        self.late_error = error

    def _wait_and_maybe_error(self):
        super()._wait_and_maybe_error()
        self._set_error(self.late_error)


def _chief_backend():
    backend = object.__new__(parameter_server.ParameterServerBackend)
    backend._in_flight = {}
    return backend


def test_a_result_lost_after_the_function_finished_counts_its_steps_or_fails_as_its_error():
    worker_lost = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:1: Socket closed")
    handle = _ClearedWhileFetched(worker_lost)
    assert handle.fetch() is None  # TensorFlow's own fetch: no value, no error.
    backend, released = _chief_backend(), []
    slots = type("Slots", (), {"release": lambda self, slot: released.append(slot) or 0})()
    handle = _ClearedWhileFetched(worker_lost)
    backend._in_flight[id(handle)] = (handle, slots, 2)
    assert backend.fetch(handle) is None and released == [2]  # The controller counts the steps, no sums.
    no_error = type("Cleared", (), {"fetch": lambda self: None, "_get_error": lambda self: None})()
    assert backend.fetch(no_error) is None  # Read between clearing the value and setting the error: the same.
    for error in (tf.errors.UnavailableError(None, None, "/job:ps/replica:0/task:0: Connection reset"),
                  tf.errors.InvalidArgumentError(None, None, "/job:worker/replica:0/task:0: bad input")):
        with pytest.raises(type(error), match="task:0"):
            backend.fetch(_ClearedWhileFetched(error))
