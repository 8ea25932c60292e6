"""Elastic synchronous jobs (tfdist-launch --min_workers): which worker slots each relaunch uses.

A job of N workers starts on N slots: one per worker, named by its host with
--hosts, else "slot i" on this machine. When a worker fails, the launcher ends
the job, charges the failure to that worker's slot (a host is charged once for
all its slots), and, after `blacklist_after` failures, drops the slot -- with
--hosts, every slot of that host. The job then relaunches on the slots left,
with TF_CONFIG written for the new count, as long as at least `min_workers`
remain. tfdist's global batch and data order do not depend on the worker count,
so the relaunched job resumes the same trajectory from the last checkpoint.
"""

from __future__ import annotations

import collections
import math
import os
import re
import shlex
import subprocess
import uuid
from typing import Callable, Optional, Sequence

from tfdist.errors import UserError
from tfdist.mnist.config import DEFAULT_GLOBAL_BATCH_SIZE


class Membership:
    """The worker slots an elastic job may still use, and each slot's failures."""

    def __init__(self, slots: Sequence[str], min_workers: int, blacklist_after: int = 1):
        self.slots = list(slots)
        self.min_workers = min_workers
        self.blacklist_after = blacklist_after
        self.failures: collections.Counter = collections.Counter()
        self.dropped: list[str] = []

    @classmethod
    def local(cls, num_workers: int, min_workers: int, blacklist_after: int = 1) -> "Membership":
        return cls([f"slot {i}" for i in range(num_workers)], min_workers, blacklist_after)

    @property
    def num_workers(self) -> int:
        return len(self.slots)

    @property
    def enough(self) -> bool:
        return len(self.slots) >= self.min_workers

    def charge(self, slot: str) -> bool:
        """Counts one failure of `slot`; True if that was its last allowed one and it (its host) is dropped."""
        self.failures[slot] += 1
        if self.failures[slot] < self.blacklist_after:
            return False
        self.drop(slot)
        return True

    def drop(self, slot: str) -> None:
        """Drops `slot` (with --hosts: every slot of that host) at once, e.g. a host that does not answer."""
        self.slots = [s for s in self.slots if s != slot]
        self.dropped.append(slot)

    def verdict(self, slot: str, dropped: bool) -> str:
        """What became of `slot` after a charge, for the launcher's event line."""
        count = self.failures[slot]
        if dropped:
            return (f"{slot} is dropped after {count} failure(s) (--blacklist_after={self.blacklist_after})")
        return f"{slot} has failed {count} of the {self.blacklist_after} time(s) allowed and is kept"


def validate(num_workers: int, min_workers: Optional[int], *, num_ps: int, max_restarts: int,
             blacklist_after: int) -> None:
    """Refuses an elastic setting that cannot work, before any task starts."""
    if min_workers is None:
        if blacklist_after != 1:
            raise UserError("--blacklist_after applies to elastic jobs only; give --min_workers too.")
        return
    if not 1 <= min_workers <= num_workers:
        raise UserError(f"--min_workers={min_workers} must be from 1 to --num_workers={num_workers} (the most "
                        "workers the job runs on).")
    if num_ps:
        raise UserError("--min_workers is for synchronous jobs (MultiWorkerMirroredStrategy, Horovod-free "
                        "launches without --num_ps). A parameter-server job already carries on without a lost "
                        "worker: leave --min_workers out, and use --restart_workers to bring workers back.")
    if max_restarts < 1:
        raise UserError(f"--min_workers={min_workers} shrinks the job by relaunching it, and --max_restarts="
                        f"{max_restarts} allows no relaunch; give --max_restarts=N (N >= 1, each shrink or retry "
                        "uses one).")
    if blacklist_after < 1:
        raise UserError(f"--blacklist_after={blacklist_after} must be 1 or more (failures of one slot or host "
                        "before it is dropped).")


def flag_value(command: Sequence[str], name: str) -> Optional[str]:
    """The value of `--name=V` or `--name V` in a command line, else None (the last one wins)."""
    value = None
    for i, arg in enumerate(command):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(command):
            value = command[i + 1]
    return value


def _is_tfdist_train(command: Sequence[str]) -> bool:
    return any(os.path.basename(arg) == "tfdist-train" or arg == "tfdist.cli.train" for arg in command)


def check_global_batch(command: Sequence[str], num_workers: int, min_workers: int) -> None:
    """The command's batch flags must keep the global batch and learning rate fixed at every worker count.

    Checks tfdist-train's flags as that program reads them (--global_batch_size defaults to 128 there);
    for another program, an explicit --global_batch_size only (it checks its own batch at each launch).
    """
    train = _is_tfdist_train(command)
    if train and flag_value(command, "per_replica_batch_size") is not None:
        raise UserError("--per_replica_batch_size makes the global batch per-replica batch x replicas, so it would "
                        "change when an elastic job (--min_workers) shrinks, and with it the training; give "
                        "--global_batch_size instead (it stays fixed, and each replica's share follows the count).")
    scaling = flag_value(command, "lr_scaling") if train else None
    if scaling not in (None, "none"):
        raise UserError(f"--lr_scaling={scaling} scales the learning rate with the replica count, so it would change "
                        "when an elastic job (--min_workers) shrinks; leave it out (or give --lr_scaling=none) and set "
                        "--learning_rate for the fixed global batch.")
    value = flag_value(command, "global_batch_size") or (str(DEFAULT_GLOBAL_BATCH_SIZE) if train else None)
    accum = flag_value(command, "grad_accum_steps") if train else None
    if value is None or not re.fullmatch(r"\d+", value) or not re.fullmatch(r"\d*", accum or ""):
        return  # Not given, or not a number: the program itself refuses it.
    batch, accum_steps = int(value), int(accum or 1) or 1
    counts = [n for n in range(min_workers, num_workers + 1) if batch % (n * accum_steps)]
    if counts:
        unit = math.lcm(*range(min_workers, num_workers + 1)) * accum_steps
        given = "" if flag_value(command, "global_batch_size") else " (tfdist-train's default)"
        per = f" x --grad_accum_steps={accum_steps}" if accum_steps > 1 else ""
        raise UserError(
            f"--global_batch_size={batch}{given} does not divide by {', '.join(map(str, counts))} worker(s){per}, "
            f"which --min_workers={min_workers} and --num_workers={num_workers} let the job shrink to; the global "
            "batch stays fixed when the job shrinks, so every count must divide it. Use a multiple of "
            f"{unit}, or change --min_workers.")


def check_shared_workdir(run: Callable[[str, str], subprocess.CompletedProcess], hosts: Sequence[str],
                         workdir: Optional[str]) -> None:
    """With several hosts, the relaunch's survivors must reach the checkpoints: --workdir must be shared.

    `run(host, shell)` runs a shell command there (`SshConfig.run`: status 1 is only the shell's own). A
    file made in the workdir on the first host that answers must be visible on every other host that
    answers; storage URLs (gs://...) are taken as shared.
    """
    distinct = list(dict.fromkeys(hosts))
    if workdir is None or "://" in workdir or len(distinct) < 2:
        return
    marker = shlex.quote(f"{workdir.rstrip('/')}/.tfdist-shared-{uuid.uuid4().hex}")
    maker = next((host for host in distinct
                  if run(host, f"mkdir -p {shlex.quote(workdir)} && : > {marker}").returncode == 0), None)
    if maker is None:
        return  # No host answers, or none can write there: the start itself reports it.
    try:
        for host in distinct:
            if host != maker and run(host, f"test -e {marker}").returncode == 1:
                raise UserError(
                    f"--min_workers relaunches the job on the hosts left, which resume from --workdir's last "
                    f"checkpoint, but --workdir={workdir} is not shared: a file made there on {maker} is not "
                    f"there on {host} (a per-host local path). Put --workdir on storage every host mounts (NFS, "
                    "a cluster file system, gs://...).")
    finally:
        run(maker, f"rm -f {marker}")
