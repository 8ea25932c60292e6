"""An OpenSSH server made for one test: host key, client keys, config, known_hosts.

`make_sshd(directory)` writes everything `tests/netns_sshd.py` needs to run
sshd on 127.0.0.2 and 127.0.0.3 (one port, both addresses) accepting only
`client_key` as root, and the ssh options that trust exactly its host key.
`skip_reason()` says why the SSH tests cannot run here (not root, no sshd).
The nox sessions install Debian's openssh-server when they run as root.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from typing import Optional

from tests.conftest import REPO
from tests.netns_sshd import ADDRESSES, SSHD


@dataclasses.dataclass
class Sshd:
    directory: str
    port: int
    config: str
    client_key: str
    wrong_key: str
    known_hosts: str

    def ssh_args(self, key: Optional[str] = None) -> list[str]:
        """tfdist-launch flags that reach this server with `key` (default: the accepted one)."""
        return [f"--ssh_port={self.port}", f"--ssh_identity={key or self.client_key}",
                f"--ssh_option=UserKnownHostsFile={self.known_hosts}", "--ssh_option=StrictHostKeyChecking=yes"]

    def wrap(self, command: list[str]) -> list[str]:
        """`command` run in a fresh network namespace where this server listens."""
        return [sys.executable, os.path.join(REPO, "tests", "netns_sshd.py"), self.config, str(self.port), "--",
                *command]

    def log(self) -> str:
        path = os.path.join(self.directory, "sshd.log")
        return open(path).read() if os.path.exists(path) else ""


def skip_reason() -> Optional[str]:
    if os.geteuid() != 0:
        return ("the SSH tests run an OpenSSH server in a private network namespace, which needs root; "
                "not root here (CI runs them as root)")
    if not os.path.exists(SSHD):
        return (f"{SSHD} is missing: install Debian's openssh-server (the nox sessions do it when run as root: "
                "apt-get install openssh-server)")
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "the OpenSSH client (ssh, ssh-keygen) is missing: apt-get install openssh-client"
    return None


def _keygen(path: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tfdist-test", "-f", path], check=True)
    return path


def make_sshd(directory: str, port: int) -> Sshd:
    os.makedirs(directory, exist_ok=True)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory.
    host_key = _keygen(os.path.join(directory, "host_key"))
    client_key = _keygen(os.path.join(directory, "client_key"))
    wrong_key = _keygen(os.path.join(directory, "wrong_key"))
    authorized = os.path.join(directory, "authorized_keys")
    shutil.copy(client_key + ".pub", authorized)
    known_hosts = os.path.join(directory, "known_hosts")
    with open(host_key + ".pub") as f:
        public = " ".join(f.read().split()[:2])
    with open(known_hosts, "w") as f:
        f.writelines(f"[{address}]:{port} {public}\n" for address in ADDRESSES)
    config = os.path.join(directory, "sshd_config")
    with open(config, "w") as f:
        f.write("\n".join([
            f"Port {port}", *(f"ListenAddress {a}" for a in ADDRESSES), f"HostKey {host_key}",
            f"PidFile {directory}/sshd.pid", f"AuthorizedKeysFile {authorized}", "StrictModes no", "UsePAM no",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
            "MaxStartups 100", "MaxSessions 100", "LogLevel ERROR", "",
        ]))
    return Sshd(directory, port, config, client_key, wrong_key, known_hosts)
