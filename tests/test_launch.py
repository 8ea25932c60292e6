"""tfdist.launcher.launch / tfdist-launch: real multi-worker jobs on loopback ports.

Two MultiWorkerMirroredStrategy workers train the bundled digits through the
launcher; failures (a killed worker, SIGTERM to the launcher, a task that
exits with an error) are provoked for real and their outcome checked.
"""

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO, run_module, subprocess_env
from tfdist.distribute import cluster
from tfdist.launcher import launch
from tfdist.errors import UserError

pytestmark = pytest.mark.jobs  # Real multi-process jobs: the TF 2.21 lane runs them (tests/conftest.py).

TRAIN = [sys.executable, "-m", "tfdist.cli.train"]


class Job:
    """tfdist-launch in a subprocess, its output collected line by line."""

    def __init__(self, tmp_path, train_args, num_workers=2, launch_args=(), wrap=lambda command: command):
        self.scratch = tmp_path / "tmp"
        self.scratch.mkdir(exist_ok=True)
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            wrap([sys.executable, "-m", "tfdist.cli.launch", f"--num_workers={num_workers}", *launch_args, "--",
                  *TRAIN, *train_args]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env=subprocess_env({"TMPDIR": str(self.scratch)}),
        )
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout=300) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def wait_for(self, pattern, timeout=180, after=0):
        """The first match of `pattern` in the output from character `after` on, once it appears."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = re.compile(pattern).search(self.output, after)
            if match:
                return match
            assert self.proc.poll() is None, self.output[-4000:]
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} never appeared:\n{self.output[-4000:]}")

    def pids(self) -> dict:
        """The latest pid of each task: local ones, and remote ones as their hosts' watchdogs report them."""
        pids = {}
        for pattern in (r"started (\S+) \(pid (\d+)\)", r"^\[\S+\] tfdist-launch: (\S+) runs as pid (\d+) on"):
            pids.update({m.group(1): int(m.group(2)) for m in re.finditer(pattern, self.output, re.M)})
        return pids

    def kill_after_first_checkpoint(self, task: str) -> float:
        """SIGKILLs `task` once the chief has saved a checkpoint; returns when."""
        self.wait_for(r"Saved checkpoint \S+ckpt-\d+ at step")
        os.kill(self.pids()[task], signal.SIGKILL)
        return time.time()

    def preempt_after_first_checkpoint(self) -> int:
        """SIGTERMs the launcher after the first checkpoint; returns the step the job saved at."""
        self.wait_for(r"Saved checkpoint \S+ckpt-\d+ at step")
        self.proc.send_signal(signal.SIGTERM)
        assert self.wait(timeout=120) == 143, self.output[-4000:]
        match = re.search(r"stopped by a signal at step (\d+); checkpoint \S+ckpt-(\d+) was saved", self.output)
        assert match and match.group(1) == match.group(2), self.output[-4000:]
        return int(match.group(1))


def latest_checkpoint_step(workdir) -> int:
    text = (workdir / "checkpoints" / "checkpoint").read_text()
    return int(re.search(r'model_checkpoint_path: "ckpt-(\d+)"', text).group(1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not "left behind" once its parent reaped it; check the state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def fingerprints(output: str) -> dict:
    return dict(re.findall(r"^\[(worker:\d)\] .*weights_fingerprint=(\w+)$", output, re.M))


def assert_evaluated(metrics, examples):
    """metrics.json: the evaluation counted `examples`, and its accuracy is a whole number of them right."""
    assert metrics["eval_examples"] == examples, metrics
    correct = metrics["eval_accuracy"] * examples
    assert abs(correct - round(correct)) < 1e-3, (correct, examples)


def test_layout_and_tf_configs():
    layout = launch.ClusterLayout(2, 1, chief=True)
    assert layout.roles() == [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
    spec = launch.cluster_spec(layout, ["a:1", "b:2", "c:3", "d:4"])
    info = cluster.parse_tf_config(launch.tf_config(spec, "worker", 1))
    assert (info.num_workers, info.num_ps, info.worker_index) == (3, 1, 2)
    with pytest.raises(UserError, match=r"3 address\(es\) given for 4 task\(s\)"):
        launch.cluster_spec(layout, ["a:1", "b:2", "c:3"])
    ports = launch.free_ports(4)
    assert len(set(ports)) == 4 and all(1 <= p <= 65535 for p in ports)


def test_isolated_network_has_only_loopback():
    code = ("from tfdist.launcher.launch import isolate_network; isolate_network(); "
            "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['lo']"


def test_print_tf_config_for_job_files():
    result = run_module("tfdist.cli.launch", ["--print_tf_config", "--hosts=node1,node2", "--port=2222"], timeout=60)
    assert result.returncode == 0, result.stderr
    configs = re.findall(r"^TF_CONFIG='(.*)'$", result.stdout, re.M)
    assert [json.loads(c)["task"] for c in configs] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    assert json.loads(configs[0])["cluster"] == {"worker": ["node1:2222", "node2:2222"]}
    # Slots: tasks fill each host in order, ports count up per host; the worker count follows the slots.
    result = run_module("tfdist.cli.launch", ["--print_tf_config", "--hosts=node1:2,node2", "--num_ps=1"], timeout=60)
    assert result.returncode == 0, result.stderr
    cluster_ = json.loads(re.findall(r"^TF_CONFIG='(.*)'$", result.stdout, re.M)[0])["cluster"]
    assert cluster_ == {"chief": ["node1:2222"], "worker": ["node1:2223"], "ps": ["node2:2222"]}
    # user@host: ssh logs in as user; the other tasks reach the host by its name.
    result = run_module("tfdist.cli.launch", ["--print_tf_config", "--hosts=alice@node1,node2"], timeout=60)
    assert '"worker":["node1:2222","node2:2222"]' in result.stdout, result.stderr


def test_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# DeepSpeed/MPI style\nnode1 slots=2\n\nnode2   slots = 1  # comment\nnode3\n")
    from tfdist.launcher import hosts

    assert hosts.parse_hostfile(str(hostfile)) == [hosts.Host("node1", 2), hosts.Host("node2", 1),
                                                   hosts.Host("node3", 1)]
    result = run_module("tfdist.cli.launch", ["--print_tf_config", f"--hostfile={hostfile}"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert '"worker":["node1:2222","node1:2223","node2:2222","node3:2222"]' in result.stdout


@pytest.mark.parametrize("args, expected", [
    (["--num_workers=2"], "No command to launch"),
    (["--num_workers=0", "--", "true"], "--num_workers=0 must be 1 or more"),
    (["--print_tf_config", "--num_workers=2", "--hosts=a:1"], "The job has 2 task(s) but the hosts offer only 1 slot(s)"),
    (["--print_tf_config", "--hosts=a:1,a:1"], "lists 'a' twice"),
    (["--print_tf_config", "--hosts=a,,b"], "has an empty entry (number 2)"),
    (["--print_tf_config", "--hosts=a:x"], "bad slot count 'x'"),
    (["--print_tf_config", "--hosts=a:0"], "bad slot count '0'"),
    (["--print_tf_config", "--hosts=node1:2222,node1:2223,node2:2222"],
     "The same cluster in the new form: --hosts=node1:2,node2 --port=2222."),
    (["--hostfile=/nonexistent/hosts", "--", "true"], "--hostfile='/nonexistent/hosts' does not exist"),
    (["--max_restarts=-1", "--", "true"], "--max_restarts=-1 must be 0 or more"),
    (["--max_restarts=1", "--", "tfdist-train"], "give tfdist-train --workdir=DIR"),
    (["--print_tfjob", "--num_workers=2", "--", "tfdist-train"], "--print_tfjob needs --image=IMAGE"),
    (["--env=1X=2", "--", "true"], "is not a variable name"),
    (["--hosts=a", "--network=isolated", "--", "true"], "--network=isolated cannot be used with --hosts"),
    (["--num_workers=3", "--min_workers=4", "--max_restarts=1", "--", "true"],
     "--min_workers=4 must be from 1 to --num_workers=3"),
    (["--min_workers=0", "--max_restarts=1", "--", "true"], "--min_workers=0 must be from 1 to --num_workers=2"),
    (["--num_ps=1", "--min_workers=1", "--max_restarts=1", "--", "true"], "--min_workers is for synchronous jobs"),
    (["--num_workers=3", "--min_workers=2", "--", "true"], "--max_restarts=0 allows no relaunch"),
    (["--num_workers=3", "--min_workers=2", "--max_restarts=1", "--", "tfdist-train", "--workdir=w",
      "--global_batch_size=64"], "--global_batch_size=64 does not divide by 3 worker(s), which --min_workers=2 and "
                                 "--num_workers=3 let the job shrink to; the global batch stays fixed when the job "
                                 "shrinks, so every count must divide it. Use a multiple of 6"),
    (["--blacklist_after=2", "--", "true"], "--blacklist_after applies to elastic jobs only"),
    (["--min_workers=1", "--max_restarts=1", "--blacklist_after=0", "--", "true"], "--blacklist_after=0 must be 1"),
])
def test_launcher_bad_input(args, expected):
    result = run_module("tfdist.cli.launch", args, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("tfdist-launch: error: ") and expected in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1  # One paragraph.


def test_bad_hostfiles(tmp_path):
    for text, expected in [("node1 slots=two\n", "line 1 ('node1 slots=two') does not parse"),
                           ("node1 slots=1\nnode1 slots=2\n", "lists 'node1' twice"),
                           ("# nothing\n", "lists no host")]:
        (tmp_path / "hosts").write_text(text)
        result = run_module("tfdist.cli.launch", ["--print_tf_config", f"--hostfile={tmp_path / 'hosts'}"],
                            timeout=60)
        assert result.returncode == 2 and expected in result.stderr, result.stderr


def test_print_tfjob_manifest():
    yaml = pytest.importorskip("yaml")
    command = ["tfdist-train", "--strategy=parameter_server", "--workdir=/mnt/runs/ps", "--note=it's \"quoted\""]
    result = run_module("tfdist.cli.launch", ["--print_tfjob", "--image=registry.example.com/tfdist:0.1",
                                              "--num_workers=3", "--num_ps=2", "--job_name=mnist-ps", "--",
                                              *command], timeout=60)
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "TFJob", "mnist-ps")
    specs = job["spec"]["tfReplicaSpecs"]
    assert {name: spec["replicas"] for name, spec in specs.items()} == {"Chief": 1, "Worker": 3, "PS": 2}
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        assert container["name"] == "tensorflow" and container["image"] == "registry.example.com/tfdist:0.1"
        assert container["command"] == command
        mount = container["volumeMounts"][0]
        assert mount["mountPath"] == "/mnt/runs" and pod["volumes"][0]["name"] == mount["name"]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    # A synchronous job: workers only (worker 0 is the chief); TFJob sets TF_CONFIG itself.
    result = run_module("tfdist.cli.launch", ["--print_tfjob", "--image=img", "--num_workers=2", "--",
                                              "tfdist-train", "--strategy=multi_worker_mirrored"], timeout=60)
    job = yaml.safe_load(result.stdout)
    assert list(job["spec"]["tfReplicaSpecs"]) == ["Worker"] and "TF_CONFIG" not in result.stdout.split("#")[-1]


def test_two_workers_train_to_the_same_weights(tmp_path):
    workdir = tmp_path / "w"
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", f"--workdir={workdir}"])
    assert job.wait() == 0, job.output[-4000:]
    assert "the tasks share a private network namespace" in job.output
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert (metrics["num_workers"], metrics["num_replicas"], metrics["steps"]) == (2, 2, 310)
    assert metrics["eval_accuracy"] >= 0.97
    assert_evaluated(metrics, 2000)
    prints = fingerprints(job.output)
    assert set(prints) == {"worker:0", "worker:1"} and len(set(prints.values())) == 1
    assert prints["worker:0"] == metrics["weights_fingerprint"]
    # Each worker feeds its own replica: half of every global batch, in the order every topology shares.
    for i in (0, 1):
        assert re.search(rf"^\[worker:{i}\] .*Input pipeline {i} of 2: replicas {i}-{i} of 2, per-replica batch 64, "
                         r"global batch 128, order seeded by 0 \(the same on every topology\)", job.output, re.M)
    # Only the chief wrote into the workdir; the other worker's private saves are gone.
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json", "flags.txt", "membership.json", "metrics.json",
                                           "model.keras", "plan.json", "tensorboard"]
    assert not [p for p in os.listdir(job.scratch) if p.startswith("tfdist-worker-ckpt-")]


LINGERING_EXIT = """
import atexit, json, os, runpy, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
def last():  # Registered first, so it runs after every other exit hook of the process.
    if index == 1:
        time.sleep(4)  # A slow interpreter shutdown on a loaded machine.
    print(f"exit hook of worker:{index} at {time.time():.3f}", flush=True)
atexit.register(last)
sys.argv = ["tfdist-train", *sys.argv[1:]]
try:
    runpy.run_module("tfdist.cli.train", run_name="__main__", alter_sys=True)
finally:
    if index == 0:
        time.sleep(20)  # The chief's own work after training (past the coordination heartbeat timeout, 10 s).
        print(f"worker:0 finished its own work at {time.time():.3f}", flush=True)
"""


def test_the_coordination_service_leader_exits_after_the_other_workers(tmp_path):
    """Worker 0 hosts TensorFlow's coordination service; a worker still exiting when it has gone sees its
    heartbeats fail and TensorFlow aborts its collectives mid-teardown (SIGABRT, 1 run in 7 under load).
    And the other way round: a worker that exits while the leader still works (here 20 s after training) is
    flagged unhealthy after the heartbeat timeout, and the leader aborts its collectives, and at times its own
    exit (SIGABRT, seen in CI when worker 0's evaluation and export ran long). So every task waits for the
    others at exit."""
    program = tmp_path / "lingering_exit.py"
    program.write_text(LINGERING_EXIT)
    result = run_module("tfdist.cli.launch", [
        "--num_workers=2", "--", sys.executable, str(program), "--strategy=multi_worker_mirrored", "--max_steps=2",
        "--steps_per_execution=1", "--precision=float32", f"--workdir={tmp_path / 'w'}"], timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    exits = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"exit hook of worker:(\d) at ([\d.]+)", output)}
    assert sorted(exits) == [0, 1], output[-3000:]
    assert exits[0] > exits[1], exits  # The leader waited for worker 1's process to end.
    finished = float(re.search(r"worker:0 finished its own work at ([\d.]+)", output).group(1))
    assert exits[1] > finished, (exits, finished)  # Worker 1 waited for the leader's work to end.
    assert "unhealthy" not in output and "StartAbort" not in output, output[-3000:]


SLOW = ["--strategy=multi_worker_mirrored", "--steps_per_execution=1", "--checkpoint_every_steps=20"]


def test_killed_worker_stops_the_job_and_relaunch_resumes(tmp_path):
    workdir = tmp_path / "w"
    job = Job(tmp_path, [*SLOW, f"--workdir={workdir}"], launch_args=["--grace_s=10"])
    killed_at = job.kill_after_first_checkpoint("worker:1")
    pids = job.pids()
    code = job.wait(timeout=90)
    assert code != 0 and time.time() - killed_at < 60, job.output[-4000:]
    assert "tfdist-launch: worker:1 was killed by SIGKILL" in job.output
    assert not any(alive(pid) for pid in pids.values()), "a task outlived the launcher"
    step = latest_checkpoint_step(workdir)
    assert 0 < step < 310
    again = Job(tmp_path, [*SLOW, f"--workdir={workdir}"])
    assert again.wait() == 0, again.output[-4000:]
    assert re.search(rf"\[worker:0\] .*Resuming from checkpoint \S+ckpt-{step} at step {step}\.", again.output)
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert (metrics["resumed_from_step"], metrics["steps"], metrics["num_workers"]) == (step, 310, 2)
    assert metrics["eval_accuracy"] >= 0.97
    assert len(set(fingerprints(again.output).values())) == 1


def test_sigterm_to_the_launcher_checkpoints_then_resumes(tmp_path):
    workdir = tmp_path / "w"
    step = Job(tmp_path, [*SLOW, f"--workdir={workdir}"]).preempt_after_first_checkpoint()
    # Preempted, the non-chief worker still removed its private checkpoint scratch, and the chief its lock.
    assert not [p for p in os.listdir(tmp_path / "tmp") if p.startswith("tfdist-worker-ckpt-")]
    assert not (workdir / ".lock").exists()
    again = Job(tmp_path, [*SLOW, f"--workdir={workdir}"])
    assert again.wait() == 0, again.output[-4000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert (metrics["resumed_from_step"], metrics["steps"]) == (step, 310)


def test_a_failing_task_fails_the_launch_with_its_status_and_last_lines(tmp_path):
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", "--global_batch_size=3", f"--workdir={tmp_path / 'w'}"])
    code = job.wait(timeout=120)
    assert code == 2, job.output[-4000:]
    assert re.search(r"tfdist-launch: worker:\d exited with status 2\. Its last lines:\n.*"
                     r"tfdist-train: error: --global_batch_size=3 does not divide evenly across 2 replica", job.output,
                     re.S)


RESTARTABLE = ["--strategy=multi_worker_mirrored", "--steps_per_execution=1", "--checkpoint_every_steps=10",
               "--epochs=2"]


def test_max_restarts_relaunches_after_a_killed_worker_and_finishes(tmp_path):
    workdir = tmp_path / "w"
    job = Job(tmp_path, [*RESTARTABLE, f"--workdir={workdir}"],
              launch_args=["--max_restarts=1", "--restart_backoff_s=0.5", "--grace_s=5"])
    job.kill_after_first_checkpoint("worker:1")
    assert job.wait(timeout=240) == 0, job.output[-4000:]
    restart = job.wait_for(r"tfdist-launch: restart 1 of 1: relaunching all 2 task\(s\)")
    resumed = job.wait_for(r"\[worker:0\] .*Resuming from checkpoint \S+ckpt-(\d+) at step (\d+)\.", after=restart.end())
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["steps"] == 124 and metrics["resumed_from_step"] == int(resumed.group(2)) > 0
    assert "all 2 task(s) finished" in job.output


def test_max_restarts_gives_up_after_the_second_failure(tmp_path):
    job = Job(tmp_path, [*RESTARTABLE, f"--workdir={tmp_path / 'w'}"],
              launch_args=["--max_restarts=1", "--restart_backoff_s=0.5", "--grace_s=5"])
    job.kill_after_first_checkpoint("worker:1")
    restart = job.wait_for(r"tfdist-launch: restart 1 of 1")
    again = job.wait_for(r"started worker:1 \(pid (\d+)\)", after=restart.end())
    os.kill(int(again.group(1)), signal.SIGKILL)
    code = job.wait(timeout=120)
    assert code != 0, job.output[-4000:]
    assert "tfdist-launch: the job failed again after 1 restart(s); giving up (--max_restarts=1)." in job.output
    assert "restart 2" not in job.output


# Each task of a chief-led job plays a part, read from its TF_CONFIG: worker:0 fails while the chief
# trains, worker:1 ignores SIGTERM (the launcher must stop it), ps:0 fails once the chief has gone.
_PARTS = r"""
import json, os, signal, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
label = f"{task['type']}:{task['index']}"
if label == "chief:0":
    time.sleep(1.5)
elif label == "worker:0":
    sys.exit(3)
elif label == "worker:1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
else:
    time.sleep(2.5)
    sys.exit(4)
"""


def test_chief_led_closing_line_tells_lost_workers_from_late_failures_and_stragglers():
    out = io.StringIO()
    launcher = launch.Launcher([sys.executable, "-c", _PARTS], launch.ClusterLayout(num_workers=2, num_ps=1, chief=True),
                               grace_s=3.0, out=out)
    assert launcher.run() == 0, out.getvalue()
    line = out.getvalue().splitlines()[-1]
    assert line == ("tfdist-launch: the chief finished; job done (lost along the way: worker:0; after the chief "
                    "finished, ps:0 exited with status 4; stopped worker:1, still running 3 s after the chief "
                    "finished)."), out.getvalue()


def test_chief_led_closing_line_is_plain_when_every_task_leaves_cleanly():
    out = io.StringIO()
    quiet = "import time; time.sleep(0.5)"
    launcher = launch.Launcher([sys.executable, "-c", quiet], launch.ClusterLayout(num_workers=2, num_ps=1, chief=True),
                               grace_s=5.0, out=out)
    assert launcher.run() == 0, out.getvalue()
    assert out.getvalue().splitlines()[-1] == "tfdist-launch: the chief finished; job done.", out.getvalue()


def test_ctrl_c_while_the_ports_are_chosen_starts_no_task(monkeypatch):
    out = io.StringIO()
    launcher = launch.Launcher([sys.executable, "-c", "import time; time.sleep(60)"], launch.ClusterLayout(2),
                               out=out)
    choose = launcher._addresses

    def interrupted():  # Ctrl-C while the ports are chosen (over SSH, a probe of each host can take seconds).
        os.kill(os.getpid(), signal.SIGINT)
        return choose()

    monkeypatch.setattr(launcher, "_addresses", interrupted)
    assert launcher.run() == 130
    assert "tfdist-launch: started" not in out.getvalue(), out.getvalue()
    assert out.getvalue().splitlines()[-1] == "tfdist-launch: got SIGINT before any task started; none was started."


def test_a_relaunch_that_cannot_start_ends_with_the_failed_runs_status(monkeypatch):
    out = io.StringIO()
    launcher = launch.Launcher([sys.executable, "-c", "import sys; sys.exit(5)"], launch.ClusterLayout(2),
                               out=out, max_restarts=2, restart_backoff_s=0.0)
    choose, calls = launcher._addresses, []

    def host_gone():  # The second start finds a host gone (over SSH: HostUnreachable from the port probe).
        calls.append(1)
        if len(calls) == 2:
            raise launch.HostUnreachable("node2", "cannot reach node2 over SSH (timed out). No task was started.")
        return choose()

    monkeypatch.setattr(launcher, "_addresses", host_gone)
    assert launcher.run() == 5
    assert out.getvalue().splitlines()[-1] == (
        "tfdist-launch: restart 1 could not start the job: cannot reach node2 over SSH (timed out). No task was "
        "started. Giving up with the last run's status (5)."), out.getvalue()


def test_the_error_a_tasks_output_names_is_its_last_tracebacks_unless_it_told_the_others():
    watch = launch.ErrorWatch()
    for line in ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "ValueError: first",
                 "", "During handling of the above exception, another exception occurred:", "",
                 "Traceback (most recent call last):", '  File "a.py", line 3, in <module>',
                 "tensorflow.python.framework.errors_impl.UnknownError: second", "W0000 a log line"]:
        watch.feed(line)
    assert watch.error == "tensorflow.python.framework.errors_impl.UnknownError: second" and watch.told_at is None
    watch.feed(cluster.failure_line("worker:1", "RuntimeError: its own"))
    for line in ["Traceback (most recent call last):", "  File ...", "OSError: later, at exit"]:
        watch.feed(line)
    assert (watch.error, watch.said) == ("RuntimeError: its own", ": RuntimeError: its own") and watch.told_at


TOLD = """
import json, os, sys, time
from tfdist.distribute.cluster import failure_line
if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
    print(failure_line("worker:1", "RuntimeError: its own error"), file=sys.stderr, flush=True)
    time.sleep(1.5)  # The coordination service's leader lets the others take its error first.
    sys.exit(1)
time.sleep(0.3)
raise RuntimeError("Collective ops is aborted by: Error reported from /job:worker/task:1")
"""


def test_the_task_that_told_the_others_of_its_error_is_named_though_another_exits_first():
    """Worker 0 failed of worker 1's error and exited first; the launcher used to name worker 0 and SIGTERM
    worker 1 (then "killed by SIGTERM")."""
    out = io.StringIO()
    launcher = launch.Launcher([sys.executable, "-c", TOLD], launch.ClusterLayout(2), out=out, env=subprocess_env())
    assert launcher.run() == 1, out.getvalue()
    assert "tfdist-launch: worker:1 exited with status 1; stopping the other tasks." in out.getvalue(), out.getvalue()
    assert "tfdist-launch: worker:1 exited with status 1: RuntimeError: its own error. Its last lines:" in \
        out.getvalue(), out.getvalue()
