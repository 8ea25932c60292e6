"""tfdist.launcher.ssh / tfdist-launch --hosts: real jobs over a real OpenSSH server.

Each test runs tfdist-launch in a fresh network namespace whose loopback
carries an sshd listening on 127.0.0.2 and 127.0.0.3, two "hosts", with a host
key and a client key made for the test (tests/sshd_setup.py). They need root
and Debian's openssh-server (the nox sessions install it when run as root);
elsewhere they skip with that reason.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import sshd_setup
from tests.conftest import REPO, free_port, subprocess_env
from tests.test_elastic import SGD
from tests.test_launch import Job, alive, fingerprints
from tfdist.launcher import ssh

pytestmark = pytest.mark.jobs  # Real multi-process jobs: the TF 2.21 lane runs them (tests/conftest.py).

REASON = sshd_setup.skip_reason()
needs_sshd = pytest.mark.skipif(REASON is not None, reason=REASON or "")
HOSTS = "--hosts=127.0.0.2:1,127.0.0.3:1"
TASK_ENV = ["--env=PYTHONPATH", "--env=TMPDIR", "--env=TF_CPP_MIN_LOG_LEVEL"]


@pytest.fixture
def sshd(tmp_path):
    return sshd_setup.make_sshd(str(tmp_path / "sshd"), free_port())


def leftovers(marker: str) -> list[str]:
    """Processes whose command line contains `marker` (on this machine, which is both "hosts")."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in args and int(pid) != os.getpid() and alive(int(pid)):
            found.append(f"{pid} {args}")
    return found


def assert_no_leftovers(marker: str, context: str = "") -> None:
    """Within 20 s no process of the job is left on either "host" (processes take a moment to exit)."""
    deadline = time.time() + 20
    while leftovers(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert leftovers(marker) == [], f"a remote task or its ssh session outlived the launcher\n{context[-3000:]}"


def test_remote_command_quotes_and_watchdog_compiles():
    config = ssh.SshConfig(port=2200, identity="/k", options=("A=b",), python="/venv/bin/python", cwd="/w d")
    argv = config.task_command("node1", "worker:0", ["prog", "it's", "$HOME"], {"TF_CONFIG": '{"a": 1}'})
    assert argv[argv.index("--") + 1] == "node1" and ["-p", "2200"] == argv[argv.index("-p"):argv.index("-p") + 2]
    assert "BatchMode=yes" in argv and "A=b" in argv
    remote = argv[-1]
    assert remote.startswith("cd '/w d' && exec env PATH=/venv/bin:\"$PATH\" 'TF_CONFIG={\"a\": 1}' /venv/bin/python")
    assert remote.endswith("worker:0 prog 'it'\"'\"'s' '$HOME'")
    compile(ssh.REMOTE_WATCHDOG, "watchdog", "exec")
    compile(ssh.PORT_PROBE, "probe", "exec")


@needs_sshd
def test_two_hosts_train_mwms_over_ssh(tmp_path, sshd):
    workdir = tmp_path / "w"
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", f"--workdir={workdir}"], num_workers=2,
              launch_args=[HOSTS, *sshd.ssh_args(), *TASK_ENV], wrap=sshd.wrap)
    assert job.wait(timeout=400) == 0, job.output[-4000:] + sshd.log()
    cluster = json.loads(re.search(r"tfdist-launch: cluster (.*)", job.output).group(1))
    assert [a.split(":")[0] for a in cluster["worker"]] == ["127.0.0.2", "127.0.0.3"]
    assert re.search(r"^\[worker:0\] tfdist-launch: worker:0 runs as pid \d+ on \S+ \(127\.0\.0\.2\)$", job.output, re.M)
    assert re.search(r"^\[worker:1\] tfdist-launch: worker:1 runs as pid \d+ on \S+ \(127\.0\.0\.3\)$", job.output, re.M)
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert (metrics["num_workers"], metrics["steps"]) == (2, 310) and metrics["eval_accuracy"] >= 0.97
    prints = fingerprints(job.output)
    assert set(prints) == {"worker:0", "worker:1"} and len(set(prints.values())) == 1
    assert "the tasks share a private network namespace" not in job.output  # --hosts: the host's network.


@needs_sshd
def test_a_killed_remote_task_ends_the_job_and_leaves_no_process(tmp_path, sshd):
    workdir = tmp_path / "w"
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", "--steps_per_execution=1",
                         "--checkpoint_every_steps=20", f"--workdir={workdir}"], num_workers=2,
              launch_args=[HOSTS, *sshd.ssh_args(), *TASK_ENV, "--grace_s=5"], wrap=sshd.wrap)
    killed_at = job.kill_after_first_checkpoint("worker:1")
    code = job.wait(timeout=120)
    assert code == 137 and time.time() - killed_at < 60, job.output[-4000:]
    assert "tfdist-launch: worker:1 was killed by SIGKILL on 127.0.0.3" in job.output
    assert_no_leftovers(str(workdir), job.output)


@needs_sshd
def test_closing_the_ssh_session_kills_the_remote_task(tmp_path, sshd):
    """SIGKILL to the launcher itself: the sessions close, and each host's watchdog kills its task."""
    marker = f"tfdist-test-sleeper-{os.getpid()}-{time.time()}"
    command = sshd.wrap([sys.executable, "-m", "tfdist.cli.launch", HOSTS, *sshd.ssh_args(), "--",
                         sys.executable, "-c", f"import time; time.sleep(600)  # {marker}"])
    harness = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env=subprocess_env())
    lines = []
    for line in harness.stdout:
        lines.append(line)
        if sum("runs as pid" in x for x in lines) == 2:
            break
    assert len(leftovers(marker)) >= 2, "".join(lines)
    launcher = [int(line.split()[0]) for line in leftovers("tfdist.cli.launch") if marker in line and "netns" not in line]
    os.kill(launcher[0], signal.SIGKILL)
    harness.wait(timeout=60)
    assert_no_leftovers(marker, "".join(lines))


@needs_sshd
@pytest.mark.parametrize("hosts, key, expected", [
    ("127.0.0.2:1,127.0.0.9:1", None, "cannot reach 127.0.0.9 (ssh port"),
    (HOSTS.split("=")[1], "wrong", "refused the SSH key"),
])
def test_unreachable_host_or_refused_key_fails_before_any_task_starts(tmp_path, sshd, hosts, key, expected):
    command = sshd.wrap([sys.executable, "-m", "tfdist.cli.launch", f"--hosts={hosts}",
                         *sshd.ssh_args(sshd.wrong_key if key else None), "--", "true"])
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=subprocess_env(), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr + sshd.log()
    assert result.stderr.startswith("tfdist-launch: error: ") and expected in result.stderr, result.stderr
    assert "No task was started." in result.stderr and "Traceback" not in result.stderr
    assert "started worker" not in result.stdout


@needs_sshd
def test_parameter_server_job_over_ssh(tmp_path, sshd):
    workdir = tmp_path / "w"
    job = Job(tmp_path, ["--strategy=parameter_server", "--epochs=1", "--max_steps=30", f"--workdir={workdir}"],
              num_workers=2, launch_args=["--hosts=127.0.0.2:2,127.0.0.3:2", "--num_ps=1", *sshd.ssh_args(),
                                          *TASK_ENV], wrap=sshd.wrap)
    assert job.wait(timeout=300) == 0, job.output[-4000:] + sshd.log()
    cluster = json.loads(re.search(r"tfdist-launch: cluster (.*)", job.output).group(1))
    hosts = {role: [a.split(":")[0] for a in addresses] for role, addresses in cluster.items()}
    assert hosts == {"chief": ["127.0.0.2"], "worker": ["127.0.0.2", "127.0.0.3"], "ps": ["127.0.0.3"]}
    assert json.loads((workdir / "metrics.json").read_text())["steps"] == 30
    assert "tfdist-launch: the chief finished; job done." in job.output


@needs_sshd
def test_sigterm_to_the_launcher_reaches_the_remote_tasks(tmp_path, sshd):
    """A preemption: SIGTERM travels through each SSH session; the workers checkpoint and exit 143."""
    workdir = tmp_path / "w"
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", "--steps_per_execution=1",
                         "--checkpoint_every_steps=20", f"--workdir={workdir}"], num_workers=2,
              launch_args=[HOSTS, *sshd.ssh_args(), *TASK_ENV], wrap=sshd.wrap)
    step = job.preempt_after_first_checkpoint()
    assert 0 < step < 310 and f"ckpt-{step}.index" in os.listdir(workdir / "checkpoints")
    assert_no_leftovers(str(workdir), job.output)


@needs_sshd
def test_elastic_job_over_ssh_drops_a_silent_host_then_a_failed_one(tmp_path, sshd):
    """127.0.0.9 has no sshd: the job starts on the other 3 slots; the task on 127.0.0.3 is then killed, and
    the job finishes on the 2 workers of 127.0.0.2, resuming from the last checkpoint."""
    workdir = tmp_path / "w"
    # Time-based checkpoints too: the chief's step time sets the interval every worker uses (one collective).
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", *SGD, "--checkpoint_every_secs=1",
                         f"--workdir={workdir}"], num_workers=4,
              launch_args=["--hosts=127.0.0.2:2,127.0.0.3:1,127.0.0.9:1", "--min_workers=2", "--max_restarts=2",
                           "--restart_backoff_s=0.5", "--grace_s=5", *sshd.ssh_args(), *TASK_ENV], wrap=sshd.wrap)
    job.wait_for(r"tfdist-launch: elastic: 127\.0\.0\.9 does not answer \(cannot reach 127\.0\.0\.9 .*\); it is "
                 r"dropped, and the job starts on 3 worker\(s\)\.")
    job.kill_after_first_checkpoint("worker:2")
    assert job.wait(timeout=400) == 0, job.output[-4000:] + sshd.log()
    assert ("tfdist-launch: elastic: worker:2 was killed by SIGKILL on 127.0.0.3; 127.0.0.3 is dropped after 1 "
            "failure(s) (--blacklist_after=1); restart 1 of 2: relaunching on 2 worker(s)") in job.output
    clusters = [json.loads(c) for c in re.findall(r"tfdist-launch: cluster (.*)", job.output)]
    assert [[a.split(":")[0] for a in c["worker"]] for c in clusters] == [
        ["127.0.0.2", "127.0.0.2", "127.0.0.3"], ["127.0.0.2", "127.0.0.2"]]
    metrics = json.loads((workdir / "metrics.json").read_text())
    resumed = metrics["resumed_from_step"]
    assert (metrics["steps"], metrics["num_workers"]) == (40, 2) and 0 < resumed < 40
    membership = json.loads((workdir / "membership.json").read_text())
    assert [(m["step"], m["num_workers"]) for m in membership] == [(0, 3), (resumed, 2)]
    assert re.search(r"^\[worker:0\] .*Checkpointing every \d+ step\(s\): about every 1 s", job.output, re.M)
    assert_no_leftovers(str(workdir), job.output)
