"""tfdist.launcher.threads / tfdist-launch --threads_per_task: several tasks on one machine split its cores.

Real launches of tiny programs that print the three variables their environment
holds (no TensorFlow, but for one test that reads the inter-op pool TensorFlow
actually made), through the CLI, the `Launcher` (chief-led and elastic relaunches)
and, where an sshd can run (tests/test_ssh.py), over ssh.
"""

import io
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env
from tests.test_ssh import needs_sshd, sshd  # noqa: F401 (the fixture)
from tfdist.errors import UserError
from tfdist.launcher import hosts, launch, threads

pytestmark = pytest.mark.jobs  # Real multi-process jobs: the TF 2.21 lane runs them (tests/conftest.py).

NAMES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
CORES = len(os.sched_getaffinity(0))
PRINT_ENV = ("import json, os; task = json.loads(os.environ['TF_CONFIG'])['task']; "
             f"print('env', *(os.environ.get(n, '-') for n in {NAMES!r}), flush=True)")


def clean_env(extra=None) -> dict:
    """The test's environment without any of the three variables (a CI machine may set one), plus `extra`."""
    env = {k: v for k, v in subprocess_env().items() if k not in NAMES}
    env.update(extra or {})
    return env


def launch_cli(args, program=PRINT_ENV, env=None, timeout=120) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", *args, "--", sys.executable, "-c", program],
                            capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean_env(env))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def seen(output: str) -> dict:
    """{task: (OMP, intra, inter)} as each task printed them ('-': not set)."""
    return {m.group(1): tuple(m.group(2).split()) for m in re.finditer(r"^\[(\S+)\] env (.*)$", output, re.M)}


def split(tasks: int) -> tuple:
    share = max(1, CORES // tasks)
    return str(share), str(share), str(max(2, share))


def test_the_tasks_on_this_machine_split_its_cores():
    result = launch_cli(["--num_workers=2"])
    assert seen(result.stdout) == {"worker:0": split(2), "worker:1": split(2)}, result.stdout
    omp, intra, inter = split(2)
    line = (f"tfdist-launch: 2 tasks on this host, {CORES} core{'s' if CORES != 1 else ''}: each task gets "
            f"OMP_NUM_THREADS={omp} TF_NUM_INTRAOP_THREADS={intra} TF_NUM_INTEROP_THREADS={inter} "
            "(--threads_per_task=off keeps TensorFlow's defaults).")
    assert result.stdout.count("each task gets") == 1 and line in result.stdout.splitlines(), result.stdout
    # A parameter-server job: chief, 2 workers and a ps, 4 tasks on this host.
    result = launch_cli(["--num_workers=2", "--num_ps=1"])
    assert seen(result.stdout) == dict.fromkeys(["chief:0", "worker:0", "worker:1", "ps:0"], split(4)), result.stdout


TF_POOLS = """
import collections, os
import tensorflow as tf
(tf.ones([64, 64]) @ tf.ones([64, 64])).numpy()  # The eager context and its thread pools exist now.
names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print("pools inter_op", names["tf_Compute"], "env", os.environ["TF_NUM_INTEROP_THREADS"], flush=True)
"""


def test_tensorflow_in_a_task_sizes_its_inter_op_pool_from_the_budget():
    """TensorFlow names its inter-op threads tf_Compute: 5 of them, where its own default is the core count."""
    result = launch_cli(["--num_workers=2", "--threads_per_task=5"], program=TF_POOLS, timeout=240)
    assert re.findall(r"^\[worker:\d\] pools (.*)$", result.stdout, re.M) == ["inter_op 5 env 5"] * 2, result.stdout


def test_a_count_and_the_users_own_variables_win():
    result = launch_cli(["--num_workers=2", "--threads_per_task=3"])
    assert seen(result.stdout) == dict.fromkeys(["worker:0", "worker:1"], ("3", "3", "3")), result.stdout
    assert ("tfdist-launch: --threads_per_task=3: each task gets OMP_NUM_THREADS=3 TF_NUM_INTRAOP_THREADS=3 "
            "TF_NUM_INTEROP_THREADS=3 (--threads_per_task=off keeps TensorFlow's defaults).") in result.stdout
    # One set in the launcher's environment, one with --env: both kept, the third split as usual.
    result = launch_cli(["--num_workers=2", "--env=TF_NUM_INTEROP_THREADS=9"], env={"OMP_NUM_THREADS": "7"})
    assert seen(result.stdout) == dict.fromkeys(["worker:0", "worker:1"], ("7", split(2)[1], "9")), result.stdout
    assert (f"each task gets TF_NUM_INTRAOP_THREADS={split(2)[1]} (OMP_NUM_THREADS, TF_NUM_INTEROP_THREADS are "
            "yours and kept; --threads_per_task=off keeps TensorFlow's defaults).") in result.stdout
    # All three the user's: nothing to add, nothing to say.
    result = launch_cli(["--num_workers=2", "--threads_per_task=4", "--env=OMP_NUM_THREADS=5"],
                        env={"TF_NUM_INTRAOP_THREADS": "6", "TF_NUM_INTEROP_THREADS": "8"})
    assert seen(result.stdout) == dict.fromkeys(["worker:0", "worker:1"], ("5", "6", "8")), result.stdout
    assert "each task gets" not in result.stdout
    # off: TensorFlow's defaults.
    result = launch_cli(["--num_workers=2", "--threads_per_task=off"])
    assert seen(result.stdout) == dict.fromkeys(["worker:0", "worker:1"], ("-", "-", "-")), result.stdout
    assert "each task gets" not in result.stdout


def test_a_one_task_job_is_untouched_unless_a_count_is_given():
    result = launch_cli(["--num_workers=1"])
    assert seen(result.stdout) == {"worker:0": ("-", "-", "-")}, result.stdout
    assert not any(name in result.stdout + result.stderr for name in NAMES), result.stdout
    result = launch_cli(["--num_workers=1", "--threads_per_task=2"])
    assert seen(result.stdout) == {"worker:0": ("2", "2", "2")}, result.stdout


@pytest.mark.parametrize("value", ["0", "abc", "-1", "", "1.5"])
def test_a_bad_budget_is_refused(value):
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", f"--threads_per_task={value}", "--", "true"],
                            capture_output=True, text=True, timeout=60, cwd=REPO, env=clean_env())
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == (
        f"tfdist-launch: error: --threads_per_task={value!r} is not a thread budget: give auto (the default: split "
        "this machine's cores between the tasks started on it), off (set nothing: TensorFlow's defaults) or a whole "
        "number of threads per task, 1 or more, e.g. --threads_per_task=2.\n")
    with pytest.raises(UserError, match="is not a thread budget"):
        launch.Launcher(["true"], launch.ClusterLayout(2), threads_per_task=value)


def test_the_budget_itself():
    assert threads.local("auto", 3, set(), cores=8).env == {"OMP_NUM_THREADS": "2", "TF_NUM_INTRAOP_THREADS": "2",
                                                            "TF_NUM_INTEROP_THREADS": "2"}
    assert threads.local("auto", 2, set(), cores=64).env["TF_NUM_INTEROP_THREADS"] == "32"
    assert threads.local("auto", 5, set(), cores=2).env == {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                                                            "TF_NUM_INTEROP_THREADS": "2"}  # Never fewer than 2.
    assert threads.local("auto", 1, set(), cores=8) == threads.Budget({})
    assert threads.local(1, 1, set(), cores=8).env["TF_NUM_INTEROP_THREADS"] == "2"
    assert threads.local("off", 4, set(), cores=8) == threads.Budget({})
    assert threads.parse(" AUTO ") == "auto" and threads.parse(4) == 4
    # Over ssh: the launcher does not know the hosts' cores. auto sets nothing and names the shared hosts.
    assert threads.remote("auto", ["a", "b"], set()) == threads.Budget({})
    budget = threads.remote("auto", ["a", "a", "b", "c", "c", "c"], set())
    assert budget.env == {} and budget.line.startswith("tfdist-launch: 2 tasks on a, 3 tasks on c: tfdist-launch "
                                                       "does not know the cores of hosts it reaches over ssh"), budget
    assert threads.remote(2, ["a", "b"], {"OMP_NUM_THREADS"}).env == {"TF_NUM_INTRAOP_THREADS": "2",
                                                                      "TF_NUM_INTEROP_THREADS": "2"}


def test_the_ssh_launcher_passes_a_count_and_leaves_auto_alone():
    out = io.StringIO()
    launcher = launch.Launcher(["true"], launch.ClusterLayout(3), hosts=[hosts.Host("node1", 2), hosts.Host("node2")],
                               out=out, env={"OMP_NUM_THREADS": "7"}, task_env={"TF_NUM_INTEROP_THREADS": "9"})
    launcher._budget_threads()
    assert launcher.thread_env == {} and "2 tasks on node1:" in out.getvalue(), out.getvalue()
    launcher = launch.Launcher(["true"], launch.ClusterLayout(3), hosts=[hosts.Host("node1", 2), hosts.Host("node2")],
                               out=out, env={"OMP_NUM_THREADS": "7"}, task_env={"TF_NUM_INTEROP_THREADS": "9"},
                               threads_per_task=4)
    launcher._budget_threads()  # This machine's OMP_NUM_THREADS does not reach the hosts; --env's does.
    assert launcher.thread_env == {"OMP_NUM_THREADS": "4", "TF_NUM_INTRAOP_THREADS": "4"}


# worker:0 of a chief-led job fails the first time (the launcher restarts it); the chief waits for it.
_RESTARTED = PRINT_ENV + r"""
import sys, time
if task == {"type": "worker", "index": 0} and not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    sys.exit(3)
time.sleep(2.0 if task["type"] == "chief" else 0.2)
"""


def test_a_restarted_worker_and_an_elastic_relaunch_get_their_launchs_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "machine_cores", lambda: 12)
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    out = io.StringIO()
    launcher = launch.Launcher([sys.executable, "-c", _RESTARTED, str(tmp_path / "failed")],
                               launch.ClusterLayout(2, 1, chief=True), restart_workers=1, grace_s=3.0, out=out)
    assert launcher.run() == 0, out.getvalue()
    runs = re.findall(r"^\[worker:0\] env (.*)$", out.getvalue(), re.M)
    assert runs == ["3 3 3", "3 3 3"], out.getvalue()  # 12 cores, 4 tasks; the restarted worker alike.
    # Elastic: 3 workers, worker:2 fails; the relaunch on 2 workers gets 6 threads each, and says so.
    program = PRINT_ENV + "\nimport sys, time\nn = len(json.loads(os.environ['TF_CONFIG'])['cluster']['worker'])\n" \
                          "sys.exit(5) if n == 3 and task['index'] == 2 else time.sleep(60 if n == 3 else 0.2)\n"
    out = io.StringIO()
    launcher = launch.Launcher([sys.executable, "-c", program], launch.ClusterLayout(3), min_workers=2,
                               max_restarts=1, grace_s=3.0, restart_backoff_s=0.0, settle_s=1.0, out=out)
    assert launcher.run() == 0, out.getvalue()
    text = out.getvalue()
    assert sorted(set(re.findall(r"^\[worker:\d\] env (.*)$", text, re.M))) == ["4 4 4", "6 6 6"], text
    assert re.findall(r"^tfdist-launch: (\d) tasks on this host, 12 cores", text, re.M) == ["3", "2"], text


@needs_sshd
def test_over_ssh_auto_leaves_the_hosts_alone_and_a_count_reaches_them(tmp_path, sshd):  # noqa: F811
    hosts_arg = "--hosts=127.0.0.2:2,127.0.0.3:1"
    common = [hosts_arg, *sshd.ssh_args(), "--env=PYTHONPATH", "--env=TF_CPP_MIN_LOG_LEVEL"]
    for extra, expected in (([], ("-", "-", "-")), (["--threads_per_task=2"], ("2", "2", "2"))):
        result = subprocess.run(sshd.wrap([sys.executable, "-m", "tfdist.cli.launch", *common, *extra, "--",
                                           sys.executable, "-c", PRINT_ENV]),
                                capture_output=True, text=True, timeout=120, cwd=REPO, env=clean_env())
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert seen(result.stdout) == dict.fromkeys(["worker:0", "worker:1", "worker:2"], expected), result.stdout
        hint = "tfdist-launch: 2 tasks on 127.0.0.2: tfdist-launch does not know the cores of hosts it reaches"
        assert (hint in result.stdout) == (not extra), result.stdout
