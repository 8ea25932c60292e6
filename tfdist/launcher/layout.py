"""The shape of a launched job's cluster: `ClusterLayout` (how many tasks of each role),
the ports they listen on (`free_ports`, `isolate_network` for a private loopback),
and the cluster spec and TF_CONFIG each task is given (`cluster_spec`, `tf_config`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import os
import socket
import struct
from typing import Sequence

from tfdist.errors import UserError


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
    """How many tasks of each role a job has."""

    num_workers: int
    num_ps: int = 0
    chief: bool = False  # A separate chief task (parameter-server jobs need one).

    def validate(self) -> "ClusterLayout":
        if self.num_workers < 1:
            raise UserError(f"--num_workers={self.num_workers} must be 1 or more.")
        if self.num_ps < 0:
            raise UserError(f"--num_ps={self.num_ps} must be 0 or more.")
        return self

    def roles(self) -> list[tuple[str, int]]:
        """Every task as (role, index), chief first, then workers, then ps."""
        tasks = [("chief", 0)] if self.chief else []
        tasks += [("worker", i) for i in range(self.num_workers)]
        tasks += [("ps", i) for i in range(self.num_ps)]
        return tasks


_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def isolate_network() -> None:
    """Moves this process (and so every task it starts) into a private network namespace.

    TensorFlow's gRPC servers listen on every interface whatever address
    TF_CONFIG gives them; inside a private namespace the only interface is
    this job's own loopback, so no other machine (and no other process on
    this one) can reach the tasks' ports. Must run before any thread starts.
    Raises OSError when the kernel or sandbox does not allow it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
    if libc.unshare(flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare: {os.strerror(code)}")
    if flags & _CLONE_NEWUSER:  # Keep the same identity inside the new user namespace.
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            try:
                with open(path, "w") as f:
                    f.write(text)
            except FileNotFoundError:
                if path != "/proc/self/setgroups":
                    raise
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # Bring the new loopback up.
        request = struct.pack("16sH14x", b"lo", 0)
        current = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", current | _IFF_UP))


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports that were free on `host` a moment ago (all held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cluster_spec(layout: ClusterLayout, addresses: Sequence[str]) -> dict[str, list[str]]:
    """Assigns `addresses` (one per task, in `layout.roles()` order) to roles."""
    roles = layout.roles()
    if len(addresses) != len(roles):
        raise UserError(
            f"{len(addresses)} address(es) given for {len(roles)} task(s) "
            f"({', '.join(f'{r}:{i}' for r, i in roles)}); give exactly one host:port per task."
        )
    cluster: dict[str, list[str]] = {}
    for (role, _), address in zip(roles, addresses):
        cluster.setdefault(role, []).append(address)
    return cluster


def tf_config(cluster: dict[str, list[str]], role: str, index: int) -> str:
    """The TF_CONFIG value of task `role`:`index` in `cluster`."""
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}, separators=(",", ":"))
