"""tfdist.launcher.elastic / tfdist-launch --min_workers: a job that loses a worker goes on with the rest.

The slot bookkeeping is checked directly and through the launcher with tiny
tasks that fail on cue; then a real 3-worker MultiWorkerMirrored job loses a
worker to SIGKILL after its first checkpoint, finishes on 2, and must end
within 1e-4 of undisturbed runs on 3 and on 2 replicas (float32, plain SGD:
the global batch and data order do not depend on the worker count).
"""

import fcntl
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, load_weights, subprocess_env
from tests.test_launch import TRAIN, Job
from tfdist.errors import UserError
from tfdist.launcher import elastic, launch


def test_a_slot_is_dropped_after_its_allowed_failures_and_a_host_with_all_its_slots():
    local = elastic.Membership.local(3, min_workers=2, blacklist_after=2)
    assert not local.charge("slot 1") and local.slots == ["slot 0", "slot 1", "slot 2"]
    assert local.verdict("slot 1", False) == "slot 1 has failed 1 of the 2 time(s) allowed and is kept"
    assert local.charge("slot 1") and local.slots == ["slot 0", "slot 2"] and local.enough
    assert local.verdict("slot 1", True) == "slot 1 is dropped after 2 failure(s) (--blacklist_after=2)"
    hosts = elastic.Membership(["a", "a", "b"], min_workers=2)
    assert hosts.charge("a") and hosts.slots == ["b"] and not hosts.enough


def test_the_global_batch_must_divide_by_every_count_the_job_may_shrink_to():
    elastic.check_global_batch(["tfdist-train", "--global_batch_size=48"], 4, 2)
    elastic.check_global_batch(["tfdist-train", "--global_batch_size", "60"], 5, 3)
    elastic.check_global_batch(["tfdist-train", "--global_batch_size=96", "--grad_accum_steps=4"], 3, 2)
    elastic.check_global_batch(["tfdist-train"], 4, 4)  # Its default 128 divides by 4.
    elastic.check_global_batch(["my_program.py"], 4, 2)  # Not given: the program itself checks each launch.
    elastic.check_global_batch(["my_program.py", "--per_replica_batch_size=8", "--lr_scaling=linear"], 4, 2)
    with pytest.raises(UserError, match=r"--global_batch_size=20 does not divide by 3 worker\(s\).*multiple of 12"):
        elastic.check_global_batch(["tfdist-train", "--global_batch_size", "20"], 4, 2)
    with pytest.raises(UserError, match=r"^--global_batch_size=128 \(tfdist-train's default\) does not divide by 3 "
                                        r"worker\(s\), .*multiple of 6,"):
        elastic.check_global_batch(["python", "-m", "tfdist.cli.train", "--epochs=1"], 3, 2)
    with pytest.raises(UserError, match=r"^--global_batch_size=40 does not divide by 3 worker\(s\) x "
                                        r"--grad_accum_steps=4, .*multiple of 24,"):
        elastic.check_global_batch(["tfdist-train", "--global_batch_size=40", "--grad_accum_steps", "4"], 3, 2)
    with pytest.raises(UserError, match=r"^--per_replica_batch_size makes the global batch per-replica batch x "
                                        r"replicas, so it would change when an elastic job"):
        elastic.check_global_batch(["tfdist-train", "--per_replica_batch_size=16"], 3, 2)
    with pytest.raises(UserError, match=r"^--lr_scaling=sqrt scales the learning rate with the replica count"):
        elastic.check_global_batch(["tfdist-train", "--global_batch_size=48", "--lr_scaling", "sqrt"], 3, 2)
    elastic.check_global_batch(["tfdist-train", "--global_batch_size=48", "--lr_scaling=none"], 3, 2)


def test_a_workdir_that_is_not_shared_by_the_hosts_is_refused(tmp_path):
    """Two machines with separate disks cannot run here: each "host" gets its own directory tree."""
    roots = {"node1": tmp_path / "node1", "node2": tmp_path / "node2"}
    shared = tmp_path / "shared"

    def run_on(host, shell):  # What `SshConfig.run` does, with /shared mounted on both and /local per host.
        shell = shell.replace("/local", str(roots[host])).replace("/shared", str(shared))
        return subprocess.run(["sh", "-c", shell], capture_output=True, text=True)

    def unreachable_first(host, shell):  # node0 does not answer: the marker is made on node1 instead.
        return subprocess.CompletedProcess([], 255, "", "") if host == "node0" else run_on(host, shell)

    with pytest.raises(UserError, match=r"a file made there on node1 is not there on node2"):
        elastic.check_shared_workdir(unreachable_first, ["node0", "node1", "node2"], "/local/w")
    elastic.check_shared_workdir(unreachable_first, ["node0", "node1", "node2"], "/shared/w")
    elastic.check_shared_workdir(run_on, ["node1", "node1", "node2"], "/shared/w")
    elastic.check_shared_workdir(run_on, ["node1", "node2"], "gs://bucket/w")
    elastic.check_shared_workdir(run_on, ["node1", "node1"], "/local/w")  # One host: nothing to share.
    with pytest.raises(UserError) as error:
        elastic.check_shared_workdir(run_on, ["node1", "node2"], "/local/w")
    assert str(error.value) == (
        "--min_workers relaunches the job on the hosts left, which resume from --workdir's last checkpoint, but "
        "--workdir=/local/w is not shared: a file made there on node1 is not there on node2 (a per-host local "
        "path). Put --workdir on storage every host mounts (NFS, a cluster file system, gs://...).")
    assert os.listdir(shared / "w") == [] and os.listdir(roots["node1"] / "w") == []  # The marker is removed.


# worker:2 of a 3-worker job fails on cue; the others wait to be stopped. On 2 workers all finish.
_FAILING_THIRD = r"""
import json, os, sys, time
config = json.loads(os.environ["TF_CONFIG"])
if len(config["cluster"]["worker"]) == 3:
    if config["task"]["index"] == 2:
        sys.exit(5)
    time.sleep(60)
time.sleep(0.5)
"""


def elastic_launcher(out, **options):
    program = options.pop("program", _FAILING_THIRD)
    return launch.Launcher([sys.executable, "-c", program, *options.pop("args", [])],
                           launch.ClusterLayout(num_workers=3), grace_s=3.0, restart_backoff_s=0.0, settle_s=1.0,
                           out=out, **options)


def run_elastic(**options):
    """Runs an elastic launcher of tiny tasks to success; its output, and its elastic event lines."""
    out = io.StringIO()
    code = elastic_launcher(out, **options).run()
    text = out.getvalue()
    assert code == 0, text
    return text, [line for line in text.splitlines() if line.startswith("tfdist-launch: elastic:")]


def test_a_slot_that_keeps_failing_is_dropped_and_the_job_finishes_on_the_rest():
    text, events = run_elastic(min_workers=2, blacklist_after=2, max_restarts=3)
    assert events == [
        "tfdist-launch: elastic: worker:2 exited with status 5; slot 2 has failed 1 of the 2 time(s) allowed and is "
        "kept; restart 1 of 3: relaunching on 3 worker(s) in 0 s (tfdist-train resumes from its --workdir's last "
        "checkpoint, with the same global batch).",
        "tfdist-launch: elastic: worker:2 exited with status 5; slot 2 is dropped after 2 failure(s) "
        "(--blacklist_after=2); restart 2 of 3: relaunching on 2 worker(s) in 0 s (tfdist-train resumes from its "
        "--workdir's last checkpoint, with the same global batch)."], text
    assert text.count("tfdist-launch: cluster ") == 3
    assert text.splitlines()[-1] == "tfdist-launch: all 2 task(s) finished.", text


def test_the_job_gives_up_when_fewer_than_min_workers_are_left():
    out = io.StringIO()
    code = elastic_launcher(out, min_workers=3, max_restarts=3).run()
    text = out.getvalue()
    assert code == 5, text
    assert ("tfdist-launch: elastic: worker:2 exited with status 5; slot 2 is dropped after 1 failure(s) "
            "(--blacklist_after=1), leaving 2 worker(s), fewer than --min_workers=3; giving up.") in text
    assert text.count("tfdist-launch: cluster ") == 1


# Each task fails once with status 2 (a program error, alike on every worker), then succeeds.
_EVERY_ONE_FAILS_ONCE = r"""
import json, os, sys, time
marker = os.path.join(sys.argv[1], str(json.loads(os.environ["TF_CONFIG"])["task"]["index"]))
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(2)
"""


def test_workers_that_all_fail_alike_charge_no_slot(tmp_path):
    text, events = run_elastic(program=_EVERY_ONE_FAILS_ONCE, args=[str(tmp_path)], min_workers=2, max_restarts=1)
    assert events == [
        "tfdist-launch: elastic: every worker failed alike (exited with status 2), so the program failed, not one "
        "slot or host; none is charged; restart 1 of 1: relaunching on 3 worker(s) in 0 s (tfdist-train resumes "
        "from its --workdir's last checkpoint, with the same global batch)."], text
    assert text.splitlines()[-1] == "tfdist-launch: all 3 task(s) finished.", text


# On 3 workers, worker:1 stops answering (it ignores SIGTERM, as a task on a host that is gone cannot take
# one), and its peers fail alike, having lost it. On 2 workers all finish.
_SILENT_SECOND = r"""
import json, os, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
if len(config["cluster"]["worker"]) == 3:
    if config["task"]["index"] == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    time.sleep(1.0)
    sys.exit(1)
"""


def test_the_worker_that_stops_answering_is_blamed_not_the_peers_that_lost_it():
    text, events = run_elastic(program=_SILENT_SECOND, min_workers=2, max_restarts=1)
    assert events == [
        "tfdist-launch: elastic: worker:1 was killed by SIGKILL after not ending within 3 s of SIGTERM, once its "
        "peers had failed: its process or host stopped answering; slot 1 is dropped after 1 failure(s) "
        "(--blacklist_after=1); restart 1 of 1: relaunching on 2 worker(s) in 0 s (tfdist-train resumes from its "
        "--workdir's last checkpoint, with the same global batch)."], text
    assert text.splitlines()[-1] == "tfdist-launch: all 2 task(s) finished.", text


# 40 steps at 0.05: undisturbed runs on 1, 2 and 3 replicas agree to 3e-8 (at 0.1 for 60 steps this CNN
# turns float noise into 4e-3 .. 2e-2, whatever the launcher does).
SGD = ["--precision=float32", "--global_batch_size=48", "--epochs=1", "--optimizer=sgd", "--learning_rate=0.05",
       "--steps_per_execution=2", "--checkpoint_every_steps=10", "--max_steps=40"]


class References:
    """The undisturbed runs of the SGD job on 3 and on 2 mirrored replicas, made once per pytest run for every
    test that compares a shrunk job with them (this module's, and the sharded one in
    tests/test_zero_checkpoint.py), across xdist workers: the first to ask starts both, which then run meanwhile;
    `weights` waits for a run's exit status file."""

    def __init__(self, tmp_path_factory):
        base = tmp_path_factory.getbasetemp()
        self.root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "elastic_references"
        self.processes = []
        with open(f"{self.root}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.root.exists():
                self.root.mkdir()
                self.processes = [self._start(replicas) for replicas in (3, 2)]

    def _start(self, replicas):
        run = self.root / f"r{replicas}"
        command = [*TRAIN, "--strategy=mirrored", f"--num_cpu_replicas={replicas}", *SGD, f"--workdir={run}"]
        with open(f"{run}.log", "w") as log:  # The status file appears whole (mv), once the run has ended.
            return subprocess.Popen(["sh", "-c", f'"$@"; echo $? > {run}.tmp && mv {run}.tmp {run}.rc', "sh",
                                     *command], cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)

    def weights(self, replicas, timeout=400):
        """The final weights of the run on `replicas` replicas, once it has ended."""
        run, deadline = self.root / f"r{replicas}", time.time() + timeout
        while not os.path.exists(f"{run}.rc"):
            assert time.time() < deadline, f"The undisturbed run on {replicas} replicas did not end in {timeout} s."
            time.sleep(0.2)
        with open(f"{run}.rc") as status, open(f"{run}.log") as log:
            assert status.read().strip() == "0", log.read()[-3000:]
        return load_weights(str(run / "model.keras"))


@pytest.fixture(scope="session")
def elastic_references(tmp_path_factory):
    references = References(tmp_path_factory)
    yield references
    for process in references.processes:  # Ended by now, unless the test that started them failed early.
        process.wait(timeout=400)


def assert_shrunk_to_the_same_weights(job, workdir, references):
    """`job` lost worker:2 after its first checkpoint, went on with 2 workers from that checkpoint, and ended
    within 1e-4 of the undisturbed runs on 3 and on 2 replicas. Returns the step it resumed from."""
    assert job.wait(timeout=400) == 0, job.output[-4000:]
    assert ("tfdist-launch: elastic: worker:2 was killed by SIGKILL; slot 2 is dropped after 1 failure(s) "
            "(--blacklist_after=1); restart 1 of 2: relaunching on 2 worker(s)") in job.output, job.output[-4000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    resumed = metrics["resumed_from_step"]
    assert (metrics["steps"], metrics["num_workers"], metrics["num_replicas"]) == (40, 2, 2) and 0 < resumed < 40
    membership = json.loads((workdir / "membership.json").read_text())
    assert [(m["step"], m["num_workers"], m["num_replicas"]) for m in membership] == [(0, 3, 3), (resumed, 2, 2)]
    shrunk = load_weights(str(workdir / "model.keras"))
    for replicas in (3, 2):
        undisturbed = references.weights(replicas)
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(shrunk, undisturbed))
        print(f"max |shrunk 3->2 workers - {replicas} replicas| = {difference:.3g}")
        assert difference <= 1e-4
    return resumed


def shrinking_job(tmp_path, *train_args):
    """The SGD run (and `train_args`) as a 3-worker job that may shrink to 2, worker:2 SIGKILLed once the first
    checkpoint is saved."""
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", *SGD, *train_args, f"--workdir={tmp_path / 'w'}"],
              num_workers=3, launch_args=["--min_workers=2", "--max_restarts=2", "--restart_backoff_s=0.5",
                                          "--grace_s=5"])
    job.kill_after_first_checkpoint("worker:2")
    return job


@pytest.mark.jobs
def test_a_worker_killed_mid_epoch_shrinks_the_job_to_the_same_weights(tmp_path, elastic_references):
    assert_shrunk_to_the_same_weights(shrinking_job(tmp_path), tmp_path / "w", elastic_references)
