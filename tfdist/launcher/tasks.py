"""One launched task's process as the launcher sees it: `_Task` (its role, process, last
lines, and how to signal, reap and describe it, here or over ssh), `ErrorWatch` (the error
its output names) and `describe_status` for a process's exit status.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import threading
import time
from typing import Optional

from tfdist.distribute.cluster import failure_in
from tfdist.errors import one_paragraph


class ErrorWatch:
    """What a task's output says of its failure: the exception line of its last Python traceback, or the error it
    told the other tasks of (`cluster.failure_line`: it failed first, they followed), and when it told them."""

    def __init__(self) -> None:
        self.error: Optional[str] = None
        self.told_at: Optional[float] = None
        self._in_traceback = False

    @property
    def said(self) -> str:
        """": <the error>" to follow a task's exit status, or "" when its output names none."""
        return f": {self.error.rstrip('.')}" if self.error else ""

    def feed(self, line: str) -> None:
        told = failure_in(line)
        if told is not None:
            self.error, self.told_at = told, time.time()
        elif line.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
        elif self._in_traceback and line.strip() and not line[0].isspace():
            self._in_traceback = False  # The exception's own line ends the traceback.
            if self.told_at is None:
                self.error = one_paragraph(line)[:1000]


@dataclasses.dataclass(eq=False)  # Compared and hashed by identity: a restarted task is a new one.
class _Task:
    role: str
    index: int
    process: subprocess.Popen
    tail: collections.deque
    reader: threading.Thread
    host: Optional[str] = None  # Set when the task runs on another host, through ssh.
    ended: Optional[float] = None  # When the launcher saw it exit before stopping the job (it ended on its own).
    unanswered: bool = False  # Still running when the grace period after SIGTERM ran out (needed SIGKILL).
    errors: ErrorWatch = dataclasses.field(default_factory=ErrorWatch)  # What its output says of its error.

    @property
    def label(self) -> str:
        return f"{self.role}:{self.index}"

    @property
    def killed(self) -> bool:
        """Whether it died of a signal (over ssh: the remote watchdog's 128+signal status)."""
        code = self.process.returncode
        return code is not None and (code < 0 or (self.host is not None and 128 < code < 128 + 65))

    def describe(self) -> str:
        code = self.process.returncode
        if self.host is not None and code == 255:
            return f"lost its SSH connection to {self.host} (ssh exited with status 255)"
        if self.host is None or not self.killed:
            return describe_status(code) + (f" on {self.host}" if self.host else "")
        return f"{describe_status(128 - code)} on {self.host}"

    def send(self, sig: int) -> None:
        """SIGTERM/SIGKILL to the task: its process group here, or through its SSH session's watchdog."""
        if self.process.poll() is not None:
            return
        if self.host is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass
            return
        try:
            self.process.stdin.write("KILL\n" if sig == signal.SIGKILL else "TERM\n")
            self.process.stdin.flush()
            if sig == signal.SIGKILL:
                self.process.stdin.close()  # End of file: the watchdog kills the task's group.
        except (BrokenPipeError, OSError, ValueError):
            pass

    def reap(self, timeout: float = 10.0) -> None:
        """Waits for the process; an ssh client that does not end by itself is killed."""
        try:
            self.process.wait(timeout=timeout if self.host else None)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        self.reader.join(timeout=5)


def describe_status(code: int) -> str:
    """"exited with status N" or "was killed by SIGNAME" for a Popen returncode."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def first_told(tasks: list[_Task]) -> Optional[_Task]:
    """The failed task that first told the others of its error (`ErrorWatch`): theirs followed from it; or None."""
    failed = [t for t in tasks if t.process.returncode not in (None, 0)]
    for task in failed:
        task.reader.join(timeout=2)  # Its output read to its end: whether it told them.
    told = [t for t in failed if t.errors.told_at is not None]
    return min(told, key=lambda t: t.errors.told_at, default=None)


def telling(tasks: list[_Task]) -> bool:
    """Whether a task that told the others of its error still runs (it exits once they have taken it)."""
    return any(t.errors.told_at is not None and t.process.poll() is None for t in tasks)
