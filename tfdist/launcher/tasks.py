"""One launched task's process as the launcher sees it: `_Task` (its role, process, last
lines, and how to signal, reap and describe it, here or over ssh) and `describe_status`
for a process's exit status.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import threading
from typing import Optional


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
