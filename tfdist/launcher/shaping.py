"""tfdist-launch --link_rate: a slow network on one machine, for communication-bound measurements.

A local launch runs every task in a private network namespace whose only
interface is its loopback (`launch.isolate_network`). `shape_loopback` puts a
token-bucket filter on that loopback (`tc qdisc add dev lo root tbf`, from
Debian's iproute2), so every byte the tasks exchange -- all-reduce, parameter
reads, the coordination service -- passes at most at the given rate. Both
directions of a ring share the one shaped device, as the tasks of a real
cluster share their hosts' links. `tbf` works in an unprivileged namespace
too (tc is given CAP_NET_ADMIN there as an ambient capability); `netem`
(delay, loss) is not available here, so only the rate is shaped.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from typing import Optional

from tfdist.errors import UserError

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_LOOPBACK_MTU = 65536  # A token bucket smaller than one packet would drop every full-size packet.
_CAP_NET_ADMIN, _CAPABILITY_VERSION_3, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 12, 0x20080522, 47, 2


def _keep_net_admin() -> None:
    """In tc's child before exec: keep CAP_NET_ADMIN across exec as a non-root user (ambient capability).

    Unprivileged, the launcher holds every capability in its own user and network namespace, but exec
    of a program by a non-zero uid drops them; raising CAP_NET_ADMIN into the inheritable and ambient
    sets keeps it for tc. As root nothing is needed, and a failure here leaves tc to report its own error.
    """
    if os.geteuid() == 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # Two (effective, permitted, inheritable) triples: capabilities 0-31, 32-63.
    if libc.capget(header, data) != 0:
        return
    data[2] |= 1 << _CAP_NET_ADMIN
    if libc.capset(header, data) == 0:
        libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_NET_ADMIN, 0, 0)


def parse_rate(text: str) -> float:
    """`--link_rate` as bits per second: a number and kbit, mbit or gbit (tc's units), e.g. 1gbit, 200mbit."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text.strip().lower())
    rate = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if not match or not 1e6 <= rate <= 100e9:
        raise UserError(f"--link_rate={text!r} is not a link rate tfdist-launch can shape: give a number and kbit, "
                        "mbit or gbit, from 1mbit to 100gbit (e.g. --link_rate=1gbit or --link_rate=200mbit).")
    return rate


def burst_bytes(rate: float) -> int:
    """The token bucket: 10 ms at `rate`, and never less than two loopback packets."""
    return max(2 * _LOOPBACK_MTU, int(rate / 8 / 100))


def find_tc() -> Optional[str]:
    """The tc program: on PATH, or in the sbin directories a non-root PATH often leaves out."""
    return shutil.which("tc") or next((p for p in ("/usr/sbin/tc", "/sbin/tc") if shutil.which(p)), None)


def shape_loopback(rate: float) -> str:
    """Shapes this network namespace's loopback to `rate` bits/s; returns the tc command, for the log."""
    tc = find_tc()
    if tc is None:
        raise UserError("--link_rate shapes the job's loopback with tc, which is not installed here; install "
                        "iproute2 (Debian/Ubuntu: apt-get install iproute2) or leave --link_rate out.")
    command = [tc, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate)}bit", "burst",
               str(burst_bytes(rate)), "latency", "100ms"]
    result = subprocess.run(command, capture_output=True, text=True, preexec_fn=_keep_net_admin)
    if result.returncode != 0:
        said = " ".join(result.stderr.split()) or f"status {result.returncode}"
        raise UserError(f"--link_rate could not shape the job's loopback ({' '.join(command[1:])}: {said}); the "
                        "kernel must allow a tbf qdisc in the job's network namespace. Leave --link_rate out.")
    return " ".join(command[1:])
