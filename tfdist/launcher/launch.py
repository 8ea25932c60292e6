"""A launcher for multi-process jobs: TF_CONFIG per task, on this machine or over SSH.

`Launcher` starts one process per task of a `ClusterLayout` with the TF_CONFIG
that task needs -- on free loopback ports of this machine, or, given hosts, on
each task's host through `ssh` (`tfdist.launcher.ssh`) on ports checked free there --
prefixes every line each one prints with its role and index, forwards
SIGINT/SIGTERM to all of them, and, when one fails, stops the others (SIGTERM,
then SIGKILL after a grace period) and reports the failing task's exit status
and last lines. With `max_restarts`, a failed job is torn down and relaunched
whole, with the same command, up to that many times; with `min_workers` too
(elastic), each relaunch drops the slots or hosts that failed too often and
runs on the workers left (`tfdist.launcher.elastic`). Several tasks on this
machine split its cores (`tfdist.launcher.threads`), counted again at every start.
It never changes its own environment: each child gets its own copy.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence, TextIO

from tfdist.launcher import elastic, threads
from tfdist.launcher import hosts as hosts_lib
from tfdist.errors import UserError, one_paragraph
from tfdist.launcher.chief_led import ChiefLedWaiting
from tfdist.launcher.layout import ClusterLayout, cluster_spec, free_ports, isolate_network, tf_config
from tfdist.launcher.ssh import HostUnreachable, SshConfig
from tfdist.launcher.tasks import ErrorWatch, _Task, first_told, telling

__all__ = ["ClusterLayout", "HostUnreachable", "Launcher", "cluster_spec", "free_ports", "isolate_network", "tf_config"]


class Launcher(ChiefLedWaiting):
    """Runs `command` once per task of `layout` and supervises the processes."""

    def __init__(
        self,
        command: Sequence[str],
        layout: ClusterLayout,
        *,
        host: str = "127.0.0.1",
        grace_s: float = 15.0,
        restart_workers: int = 0,
        ps_loss_timeout_s: float = 120.0,
        tail_lines: int = 20,
        out: TextIO = sys.stdout,
        env: Optional[dict[str, str]] = None,
        task_env: Optional[dict[str, str]] = None,
        hosts: Optional[Sequence[hosts_lib.Host]] = None,
        ssh: Optional[SshConfig] = None,
        base_port: int = 0,
        max_restarts: int = 0,
        restart_backoff_s: float = 10.0,
        min_workers: Optional[int] = None,
        blacklist_after: int = 1,
        settle_s: float = 3.0,
        threads_per_task: threads.Setting = "auto",
    ):
        if not command:
            raise UserError("No command to launch; put it after --, e.g. tfdist-launch --num_workers=2 -- tfdist-train.")
        self.command = list(command)
        self.layout = layout.validate()
        self.host = host
        self.grace_s = grace_s
        self.restart_workers = restart_workers
        self.ps_loss_timeout_s = ps_loss_timeout_s
        self.restarts: dict[str, int] = {}
        self.cluster: dict[str, list[str]] = {}
        self.tail_lines = tail_lines
        self.out = out
        self.env = dict(os.environ if env is None else env)
        self.task_env = dict(task_env or {})  # What --env adds; over ssh, all that is passed besides TF_CONFIG.
        self.placement = hosts_lib.place(hosts, len(self.layout.roles())) if hosts else None
        self.ssh = ssh or SshConfig()
        self.base_port = base_port
        self.threads_per_task = threads.parse(threads_per_task)
        self.thread_env: dict[str, str] = {}  # This launch's thread budget per task (`_budget_threads`).
        self._threads_line: Optional[str] = None
        if max_restarts < 0:
            raise UserError(f"--max_restarts={max_restarts} must be 0 or more (0: no restarts).")
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        elastic.validate(self.layout.num_workers, min_workers, num_ps=self.layout.num_ps,
                         max_restarts=max_restarts, blacklist_after=blacklist_after)
        self.membership: Optional[elastic.Membership] = None
        if min_workers is not None:
            self.membership = elastic.Membership(self.placement, min_workers, blacklist_after) if self.placement \
                else elastic.Membership.local(self.layout.num_workers, min_workers, blacklist_after)
        self._culprit: Optional[_Task] = None
        self.settle_s = settle_s
        self._stopping = False
        self._signalled: set[_Task] = set()  # The tasks a forwarded Ctrl-C reached.
        self.tasks: list[_Task] = []
        self._lock = threading.Lock()
        self._signal: Optional[int] = None

    def _print(self, text: str) -> None:
        with self._lock:
            self.out.write(text)
            self.out.flush()

    def _pump(self, task_label: str, stream: TextIO, tail: collections.deque, watch: ErrorWatch) -> None:
        for line in stream:
            tail.append(line.rstrip("\n"))
            watch.feed(line.rstrip("\n"))
            self._print(f"[{task_label}] {line if line.endswith(chr(10)) else line + chr(10)}")

    def _addresses(self) -> list[str]:
        """host:port per task: free loopback ports here, or ports checked free on each host over ssh."""
        roles = self.layout.roles()
        if self.placement is None:
            ports = range(self.base_port, self.base_port + len(roles)) if self.base_port else \
                free_ports(len(roles), self.host)
            return [f"{self.host}:{p}" for p in ports]
        ports: dict[str, list[int]] = {}
        for host in dict.fromkeys(self.placement):  # Every host is reached before any task starts.
            taken = [p for chosen in ports.values() for p in chosen]  # Hosts may share a machine.
            ports[host] = self.ssh.probe_ports(host, self.placement.count(host), self.base_port, taken)
        return [f"{hosts_lib.network_name(host)}:{ports[host].pop(0)}" for host in self.placement]

    def start(self) -> None:
        self.cluster = cluster_spec(self.layout, self._addresses())
        self._print(f"tfdist-launch: cluster {json.dumps(self.cluster)}\n")
        self._budget_threads()
        for i, (role, index) in enumerate(self.layout.roles()):
            if self._signal is not None:  # Ctrl-C while starting: the tasks not yet started never are.
                self._signal_all(signal.SIGTERM, [t for t in self._targets() if t not in self._signalled])
                return
            self.tasks.append(self._spawn(role, index, self.placement[i] if self.placement else None))

    def _budget_threads(self) -> None:
        """Sets `thread_env` for the tasks of this launch (an elastic relaunch counts them again) and says what it
        is, once, and again only when a relaunch changes it."""
        if self.placement is None:  # Here, what the tasks inherit from the launcher is the user's too.
            budget = threads.local(self.threads_per_task, len(self.layout.roles()), {*self.env, *self.task_env})
        else:  # Over ssh the tasks get only --env from here.
            budget = threads.remote(self.threads_per_task, self.placement, set(self.task_env))
        self.thread_env = budget.env
        if budget.line is not None and budget.line != self._threads_line:
            self._print(budget.line + "\n")
        self._threads_line = budget.line

    def _spawn(self, role: str, index: int, host: Optional[str] = None) -> _Task:
        label = f"{role}:{index}"
        task_env = {**self.thread_env, **self.task_env, "TF_CONFIG": tf_config(self.cluster, role, index),
                    "PYTHONUNBUFFERED": "1"}
        if host is None:
            command, env, stdin = self.command, dict(self.env, **task_env), subprocess.DEVNULL
        else:
            command, env, stdin = self.ssh.task_command(host, label, self.command, task_env), self.env, subprocess.PIPE
        process = subprocess.Popen(
            command, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, start_new_session=True, errors="replace",
        )
        tail, watch = collections.deque(maxlen=self.tail_lines), ErrorWatch()
        reader = threading.Thread(target=self._pump, args=(label, process.stdout, tail, watch), daemon=True)
        reader.start()
        how = f"ssh pid {process.pid}" if host else f"pid {process.pid}"
        self._print(f"tfdist-launch: started {label} ({how}) at {self.cluster[role][index]}\n")
        return _Task(role, index, process, tail, reader, host, errors=watch)

    @property
    def _chief_led(self) -> bool:
        """Parameter-server jobs: the chief drives; workers and servers follow it."""
        return self.layout.chief

    def _signal_all(self, sig: int, tasks: Optional[list[_Task]] = None) -> None:
        for task in tasks if tasks is not None else self.tasks:
            task.send(sig)

    def _any_running(self) -> bool:
        """Polls every task (not stopping at the first running one, so every exit is noticed).

        Notes when each task is first seen to have exited before the launcher began stopping the job:
        those ended on their own, and only they can be blamed for a failure.
        """
        running = 0
        for task in self.tasks:
            if task.process.poll() is None:
                running += 1
            elif task.ended is None and not self._stopping:
                task.ended = time.time()
        return running > 0

    def _wait_all(self, seconds: float) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline and self._any_running():
            time.sleep(0.05)

    def _stop_all(self) -> None:
        """SIGTERM everything still running; SIGKILL what is left after the grace period."""
        self._any_running()  # Whatever exited by now ended on its own.
        self._stopping = True
        self._signal_all(signal.SIGTERM)
        self._wait_all(self.grace_s)
        for task in self.tasks:
            task.unanswered = task.process.poll() is None
        self._signal_all(signal.SIGKILL)
        for task in self.tasks:
            task.reap()

    def _targets(self) -> list[_Task]:
        """Who a Ctrl-C is forwarded to: every task, or in a parameter-server job the chief only (the others
        must stay up while it drains its in-flight steps, and leave when it is gone)."""
        return [t for t in self.tasks if t.role == "chief"] if self._chief_led else list(self.tasks)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signal is not None:  # Second Ctrl-C: no more waiting.
            self._signal_all(signal.SIGKILL)
            return
        self._signal = signum
        targets = self._targets()
        self._signalled = set(targets)
        if not targets:
            return  # Still starting: no task is started after this.
        self._print(f"tfdist-launch: got {signal.Signals(signum).name}; forwarding SIGTERM to "
                    f"{', '.join(t.label for t in targets)} (checkpoint, then exit).\n")
        self._signal_all(signal.SIGTERM, targets)

    def _report(self, task: _Task, verdict: str) -> int:
        code = task.process.returncode
        tail, said = "\n".join(f"  {line}" for line in task.tail), f"{task.describe()}{verdict}{task.errors.said}"
        self._print(f"tfdist-launch: {task.label} {said}. Its last lines:\n{tail}\n")
        return 128 - code if code < 0 else code

    def wait(self) -> int:
        """Supervises until every task has exited; returns the launcher's exit status."""
        return self._wait_chief_led() if self._chief_led else self._wait_all_equal()

    def _first_failure(self) -> Optional[_Task]:
        """The failed task that most likely caused the others to fail.

        One that told the others of its error (its output read to its end), then a task killed by a signal
        (rather than the peers that then lost contact with it); otherwise the first in task order.
        """
        failed = [t for t in self.tasks if t.process.returncode not in (None, 0)]
        return first_told(failed) or min(failed, key=lambda t: not t.killed, default=None)

    def _wait_all_equal(self) -> int:
        """Synchronous jobs: any task failing fails the job; all stop together."""
        self._stopping = False
        while self._any_running():
            failed = self._first_failure()
            if failed is not None:
                if self._signal is None:
                    told = telling(self.tasks)  # A task that told the others of its error exits once they have it.
                    if told or self.membership is not None:  # Exits that follow within seconds are the job's own.
                        self._wait_all(self.settle_s)
                    failed = self._first_failure() if told else failed
                    self._print(f"tfdist-launch: {failed.label} {failed.describe()}; stopping the other tasks.\n")
                self._stop_all()
                break
            time.sleep(0.1)
        for task in self.tasks:
            task.reap()
        failed = self._first_failure()
        if failed is None:
            self._print(f"tfdist-launch: all {len(self.tasks)} task(s) finished.\n")
            return 0
        self._culprit = self._blame()
        return self._report(self._culprit or failed, self._silence(self._culprit))

    def _silence(self, task: Optional[_Task]) -> str:
        """For a task blamed for not answering: what it did, after its describe()."""
        if task is None or task.ended is not None or task.errors.told_at is not None:
            return ""
        return (f" after not ending within {self.grace_s:g} s of SIGTERM, once its peers had failed: its process or "
                "host stopped answering")

    def _blame(self) -> Optional[_Task]:
        """The task whose failure ended a synchronous job; None when every task failed alike (the program did).

        First a task that told the others of its error (`ErrorWatch`): theirs followed from it. Else only tasks
        that ended on their own count. In an elastic job, when two or more of them failed alike (their peers lost
        them, perhaps all by the same abort) and a task never answered the SIGTERM that followed, that silent one
        is blamed: a host that is gone keeps its ssh session open for half a minute, while its peers fail within
        seconds. Otherwise, earliest first: one killed by a signal, then one whose SSH connection dropped (status
        255), then the first that failed.
        """
        if (told := first_told(self.tasks)) is not None:
            return told
        own = sorted((t for t in self.tasks if t.ended is not None and t.process.returncode != 0),
                     key=lambda t: t.ended)
        if not own:
            return None
        alike = len({t.process.returncode for t in own}) == 1
        if alike and len(own) == len(self.tasks) > 1:
            return None
        silent = [t for t in self.tasks if t.unanswered]
        if self.membership is not None and alike and len(own) >= 2 and silent:
            return silent[0]  # Its peers lost it alike (even by the same signal, e.g. an abort) and it is silent.
        for sign in (lambda t: t.killed, lambda t: t.host is not None and t.process.returncode == 255):
            marked = [t for t in own if sign(t)]
            if marked:
                return marked[0]
        return own[0]

    def _start(self) -> None:
        """Starts the tasks; an elastic job drops the hosts that do not answer and starts on the rest."""
        while True:
            try:
                return self.start()
            except HostUnreachable as error:
                if self.membership is None or error.host not in self.membership.slots:
                    raise
                self.membership.drop(error.host)
                why = one_paragraph(str(error)).removesuffix(" No task was started.")
                if not self.membership.enough:
                    raise UserError(f"{why} Without {error.host}, {self.membership.num_workers} worker slot(s) are "
                                    f"left, fewer than --min_workers={self.membership.min_workers}; no task was "
                                    "started.") from None
                self._print(f"tfdist-launch: elastic: {error.host} does not answer ({why}); it is dropped, and the "
                            f"job starts on {self.membership.num_workers} worker(s).\n")
                self._resize()

    def _shrink(self, restart: int) -> bool:
        """Elastic: charges the failure to the failed worker's slot; False (giving up) below --min_workers.

        When every worker failed alike, the program failed rather than a slot or host: no one is charged,
        and the job relaunches on the same workers (a host that is gone is dropped when it does not answer).
        """
        membership = self.membership
        culprit = self._culprit
        if culprit is None:
            failed = self._first_failure()
            self._print(f"tfdist-launch: elastic: every worker failed alike ({failed.describe()}), so the program "
                        f"failed, not one slot or host; none is charged; {self._relaunch_line(restart)}")
            return True
        slot = membership.slots[self.tasks.index(culprit)]
        dropped = membership.charge(slot)
        event = (f"tfdist-launch: elastic: {culprit.label} {culprit.describe()}{self._silence(culprit)}; "
                 f"{membership.verdict(slot, dropped)}")
        if not membership.enough:
            self._print(f"{event}, leaving {membership.num_workers} worker(s), fewer than --min_workers="
                        f"{membership.min_workers}; giving up.\n")
            return False
        self._print(f"{event}; {self._relaunch_line(restart)}")
        self._resize()
        return True

    def _relaunch_line(self, restart: int) -> str:
        return (f"restart {restart} of {self.max_restarts}: relaunching on {self.membership.num_workers} worker(s) in "
                f"{self.restart_backoff_s:g} s (tfdist-train resumes from its --workdir's last checkpoint, with the "
                "same global batch).\n")

    def _resize(self) -> None:
        """The next launch runs one worker per slot the elastic membership has left."""
        self.layout = ClusterLayout(self.membership.num_workers)
        if self.placement is not None:
            self.placement = list(self.membership.slots)

    def run(self) -> int:
        """Starts the job, supervises it, relaunches it after a failure up to `max_restarts` times."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            restart, code = 0, 0
            while True:
                try:
                    self._start()
                except UserError as error:
                    if restart == 0:
                        raise
                    self._print(f"tfdist-launch: restart {restart} could not start the job: "
                                f"{one_paragraph(str(error))} Giving up with the last run's status ({code}).\n")
                    return code
                if self._signal is not None and not self.tasks:
                    self._print(f"tfdist-launch: got {signal.Signals(self._signal).name} before any task started; "
                                "none was started.\n")
                    return 128 + self._signal
                code = self.wait()
                if code == 0 or self._signal is not None or restart >= self.max_restarts:
                    break
                restart += 1
                if self.membership is None:
                    self._print(f"tfdist-launch: restart {restart} of {self.max_restarts}: relaunching all "
                                f"{len(self.tasks)} task(s) in {self.restart_backoff_s:g} s with the same command "
                                "(tfdist-train resumes from its --workdir's last checkpoint).\n")
                elif not self._shrink(restart):
                    return code
                deadline = time.time() + self.restart_backoff_s
                while time.time() < deadline and self._signal is None:
                    time.sleep(0.05)
                if self._signal is not None:
                    break
                self.tasks, self.restarts, self._culprit = [], {}, None
            if code != 0 and self.max_restarts and self._signal is None:
                self._print(f"tfdist-launch: the job failed again after {restart} restart(s); giving up "
                            f"(--max_restarts={self.max_restarts}).\n")
            return code
        finally:
            self._signal_all(signal.SIGKILL)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
