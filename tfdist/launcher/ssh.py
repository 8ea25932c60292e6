"""Starting tasks on other machines with the system `ssh` client.

`SshConfig.task_command` builds the `ssh` command line that runs one task on
its host: in the launcher's working directory, with the launcher's Python's
bin directory first on PATH, its TF_CONFIG and the variables the user passed
with `--env`, under a small watchdog (`REMOTE_WATCHDOG`) that runs the task in
its own process group and reads the SSH session's stdin: `TERM` forwards
SIGTERM, `KILL` forwards SIGKILL, and end-of-file -- the launcher closed the
session, died, or the connection dropped -- kills the whole group. So no
remote task outlives its SSH session, and no SSH session outlives the launcher
(the launcher holds the other end of each session's stdin).

`SshConfig.probe_ports` runs before any task starts: it checks that each host
is reachable and accepts the key (BatchMode: never a password prompt), and
chooses ports that are free there.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from typing import Optional, Sequence

from tfdist.errors import UserError, one_paragraph

class HostUnreachable(UserError):
    """A host that did not answer over SSH (ssh status 255 or a time-out) before the job started."""

    def __init__(self, host: str, message: str):
        super().__init__(message)
        self.host = host


# Status of `SshConfig.run` when the launcher's working directory is missing on the host.
NO_CWD = 97

# Runs on the remote host as `python -c REMOTE_WATCHDOG LABEL COMMAND...`.
REMOTE_WATCHDOG = r"""
import os, signal, subprocess, sys, threading
label, command = sys.argv[1], sys.argv[2:]
where = os.uname().nodename + " (" + (os.environ.get("SSH_CONNECTION", "").split() or ["", "", "?"])[2] + ")"
try:
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
except OSError as e:
    print("tfdist-launch: " + label + " could not start " + repr(command[0]) + " on " + where + ": " + str(e),
          file=sys.stderr, flush=True)
    sys.exit(127)
print("tfdist-launch: " + label + " runs as pid " + str(child.pid) + " on " + where, file=sys.stderr, flush=True)

def kill(sig):
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

def watch():
    for line in sys.stdin:
        word = line.strip()
        if word == "TERM":
            kill(signal.SIGTERM)
        elif word == "KILL":
            kill(signal.SIGKILL)
    kill(signal.SIGKILL)  # End of file: the launcher or its SSH session is gone.

threading.Thread(target=watch, daemon=True).start()
code = child.wait()
kill(signal.SIGKILL)  # Whatever the task left behind in its group goes with it.
os._exit(128 - code if code < 0 else code)
"""

# Runs on the remote host as `python -c PORT_PROBE COUNT BASE EXCLUDE`: prints COUNT free ports.
PORT_PROBE = r"""
import socket, sys
count, base = int(sys.argv[1]), int(sys.argv[2])
exclude = {int(p) for p in sys.argv[3].split(",") if p}
held, ports = [], []
for port in (range(base, base + count) if base else iter(int, 1)):
    s = socket.socket()
    try:
        s.bind(("", port if base else 0))
    except OSError:
        print("busy " + str(port))
        sys.exit(3)
    held.append(s)
    if s.getsockname()[1] not in exclude:
        ports.append(s.getsockname()[1])
    if len(ports) == count:
        break
print(" ".join(map(str, ports)))
"""


@dataclasses.dataclass(frozen=True)
class SshConfig:
    """How to reach the hosts: port, identity file, extra `-o` options, the remote Python and directory."""

    port: Optional[int] = None
    identity: Optional[str] = None
    options: tuple[str, ...] = ()
    python: str = sys.executable
    cwd: str = dataclasses.field(default_factory=os.getcwd)
    connect_timeout_s: int = 10

    def ssh_argv(self, host: str) -> list[str]:
        """The `ssh` client and its options, up to and including the host."""
        client = shutil.which("ssh")
        if client is None:
            raise UserError("--hosts starts tasks with the OpenSSH client, and `ssh` is not on PATH; install it "
                            "(Debian/Ubuntu: apt-get install openssh-client) or launch on one machine without "
                            "--hosts.")
        argv = [client, "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout_s}",
                "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        for option in self.options:
            argv += ["-o", option]
        return argv + ["--", host]

    def task_command(self, host: str, label: str, command: Sequence[str], env: dict[str, str]) -> list[str]:
        """The local command that runs `command` on `host` under the watchdog, with `env` set there."""
        bindir = os.path.dirname(self.python)
        assignments = [f"PATH={shlex.quote(bindir)}:\"$PATH\""]
        assignments += [shlex.quote(f"{name}={value}") for name, value in env.items()]
        remote = (f"cd {shlex.quote(self.cwd)} && exec env {' '.join(assignments)} "
                  f"{shlex.join([self.python, '-c', REMOTE_WATCHDOG, label, *command])}")
        return self.ssh_argv(host) + [remote]

    def run(self, host: str, shell: str) -> subprocess.CompletedProcess:
        """Runs a shell command on `host` in the launcher's working directory.

        Status 255: ssh could not connect (or it timed out); `NO_CWD`: that directory is missing there.
        """
        argv = self.ssh_argv(host) + [f"cd {shlex.quote(self.cwd)} 2>/dev/null || exit {NO_CWD}; {shell}"]
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=self.connect_timeout_s + 30,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 255, "", "timed out")

    def probe_ports(self, host: str, count: int, base_port: int = 0, exclude: Sequence[int] = ()) -> list[int]:
        """Free ports on `host` (from `base_port` up if given, else any not in `exclude`).

        Raises `HostUnreachable` when ssh cannot connect or times out, and `UserError` for what the user
        must fix (a refused key, an unknown host key, a busy --port, no Python or directory there).
        """
        remote = f"cd {shlex.quote(self.cwd)} && " + shlex.join(
            [self.python, "-c", PORT_PROBE, str(count), str(base_port), ",".join(map(str, exclude))])
        argv = self.ssh_argv(host) + [remote]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=self.connect_timeout_s + 30,
                                    stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise HostUnreachable(host, f"{host} did not answer over SSH within {self.connect_timeout_s + 30} s; check "
                                  "the host name and network. No task was started.") from None
        said = one_paragraph(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "")
        target = f"{host} (ssh port {self.port or 22}{', key ' + self.identity if self.identity else ''})"
        if result.returncode == 255:
            if "Permission denied" in said or "publickey" in said:
                problem = (f"{target} refused the SSH key ({said}). Add the public key to the remote "
                           "~/.ssh/authorized_keys or pass the right one with --ssh_identity; tfdist-launch runs "
                           "ssh with BatchMode=yes, so it never asks for a password.")
            elif "Host key verification failed" in said:
                problem = (f"{target} has a host key this machine does not know ({said}). Connect once with ssh "
                           "to accept it, or pass --ssh_option=StrictHostKeyChecking=accept-new.")
            else:
                reason = said or "ssh exited with status 255"
                raise HostUnreachable(host, f"cannot reach {target} over SSH ({reason}). Check the host name, that "
                                      "sshd listens on that port (--ssh_port), and the network. No task was started.")
            raise UserError(f"{problem} No task was started.")
        if result.returncode == 3 and result.stdout.startswith("busy"):
            raise UserError(f"Port {result.stdout.split()[1]} is in use on {host}; the job needs ports "
                            f"{base_port}-{base_port + count - 1} there. Choose another --port, or leave it out "
                            "to use free ports. No task was started.")
        ports = result.stdout.split()
        if result.returncode != 0 or len(ports) != count or not all(p.isdigit() for p in ports):
            raise UserError(f"Checking ports on {host} over SSH failed (status {result.returncode}: "
                            f"{said or result.stdout.strip()[:200]}). The remote side runs {self.python} in "
                            f"{self.cwd}; both must exist there (the same path on every host). No task was started.")
        return [int(p) for p in ports]
