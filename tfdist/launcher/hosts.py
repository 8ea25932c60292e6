"""Host lists for tfdist-launch: `--hosts=HOST[:SLOTS],...` and `--hostfile=FILE`.

A host list says which machines a job runs on and how many of its tasks each
takes (its slots), as DeepSpeed and MPI hostfiles do. Tasks are placed in the
launcher's task order (chief, workers, ps) filling each host's slots before
the next host's. The old `--hosts` form, one `host:port` per task, is refused
with the equivalent new form (`--hosts=HOST[:SLOTS] --port=BASE`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Sequence

from tfdist.errors import UserError

MAX_SLOTS = 256
_EXAMPLE = "e.g. --hosts=node1:2,node2:2 (two tasks on each), or --hosts=node1,node2 (one each)"


@dataclasses.dataclass(frozen=True)
class Host:
    """A machine of the job and how many of its tasks it runs."""

    name: str
    slots: int = 1


def _old_form_hint(entries: Sequence[str]) -> str:
    """The new-form equivalent of an old `host:port`-per-task list."""
    counts: dict[str, int] = {}
    ports = []
    for entry in entries:
        name, _, port = entry.rpartition(":")
        counts[name] = counts.get(name, 0) + 1
        ports.append(int(port))
    hosts = ",".join(name if n == 1 else f"{name}:{n}" for name, n in counts.items())
    return f"--hosts={hosts} --port={min(ports)}"


def _check_unique(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise UserError(f"{where} lists {host.name!r} twice; give each host once with its task count, "
                            f"{_EXAMPLE}.")
        seen.add(host.name)
    if not hosts:
        raise UserError(f"{where} lists no host; {_EXAMPLE}.")
    return hosts


def parse_hosts(spec: str) -> list[Host]:
    """`"node1:2,node2"` -> [Host("node1", 2), Host("node2", 1)]; raises UserError on bad input."""
    entries = [entry.strip() for entry in spec.split(",")]
    hosts = []
    for i, entry in enumerate(entries):
        if not entry:
            raise UserError(f"--hosts={spec!r} has an empty entry (number {i + 1}); write HOST[:SLOTS] entries "
                            f"separated by commas, {_EXAMPLE}.")
        name, _, slots = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        if not name or not re.fullmatch(r"[A-Za-z0-9_.@-]+", name):
            raise UserError(f"--hosts entry {entry!r} has no valid host name; {_EXAMPLE}.")
        if not slots.isdigit() or not 1 <= int(slots) <= MAX_SLOTS:
            hint = ""
            if slots.isdigit() and int(slots) > MAX_SLOTS and all(re.fullmatch(r".+:\d+", e) for e in entries):
                hint = (f" --hosts used to take one host:port per task (for --print_tf_config); it now takes "
                        f"HOST[:SLOTS], the number of tasks on each host, with ports counting up from --port on "
                        f"each host. The same cluster in the new form: {_old_form_hint(entries)}.")
            raise UserError(f"--hosts entry {entry!r} has a bad slot count {slots!r}: the number of tasks on "
                            f"that host must be a whole number from 1 to {MAX_SLOTS}, {_EXAMPLE}.{hint}")
        hosts.append(Host(name, int(slots)))
    return _check_unique(hosts, f"--hosts={spec!r}")


def parse_hostfile(path: str) -> list[Host]:
    """Reads `host slots=N` lines (`#` comments and blank lines ignored; `host` alone is one slot)."""
    if not os.path.isfile(path):
        raise UserError(f"--hostfile={path!r} does not exist (or is not a file); write one line per host, "
                        "'HOST slots=N', e.g. 'node1 slots=2'.")
    hosts = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            match = re.fullmatch(r"([A-Za-z0-9_.@-]+)(?:\s+slots\s*=\s*(\d+))?", text)
            if not match or (match.group(2) is not None and not 1 <= int(match.group(2)) <= MAX_SLOTS):
                raise UserError(f"--hostfile={path!r} line {number} ({text!r}) does not parse: each line must be "
                                f"'HOST slots=N' with N from 1 to {MAX_SLOTS} (or just 'HOST' for one slot), "
                                "e.g. 'node1 slots=2'.")
            hosts.append(Host(match.group(1), int(match.group(2) or 1)))
    return _check_unique(hosts, f"--hostfile={path!r}")


def place(hosts: Sequence[Host], num_tasks: int) -> list[str]:
    """The host of each of `num_tasks` tasks, filling each host's slots in order."""
    slots = [host.name for host in hosts for _ in range(host.slots)]
    if num_tasks > len(slots):
        raise UserError(f"The job has {num_tasks} task(s) but the hosts offer only {len(slots)} slot(s) "
                        f"({', '.join(f'{h.name}:{h.slots}' for h in hosts)}); add slots or hosts, or ask for "
                        "fewer --num_workers/--num_ps.")
    return slots[:num_tasks]


def network_name(host: str) -> str:
    """The name other tasks reach `host` by: `user@node1` -> `node1`."""
    return host.rpartition("@")[2]


def addresses(placement: Sequence[str], base_port: int) -> list[str]:
    """host:port per task, ports counting up from `base_port` on each host."""
    used: dict[str, int] = {}
    result = []
    for host in placement:
        result.append(f"{network_name(host)}:{base_port + used.get(host, 0)}")
        used[host] = used.get(host, 0) + 1
    return result
