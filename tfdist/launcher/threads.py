"""A thread budget per task (tfdist-launch --threads_per_task): the cores of a machine split between its tasks.

Each TensorFlow process sizes its thread pools for the whole machine, so N tasks on
one host oversubscribe its cores N times over. By default (`auto`) every task the
launcher starts on this machine, when it starts more than one here, gets

  OMP_NUM_THREADS = TF_NUM_INTRAOP_THREADS = max(1, cores // tasks_here)
  TF_NUM_INTEROP_THREADS = max(2, cores // tasks_here)

(cores: this process's CPU affinity). The inter-op pool runs whole ops, among them
collectives and remote calls that block a thread until their peers answer, so it is
never cut below 2 (TensorFlow's own default on a 2-core machine); a parameter-server
task's tf.distribute.Server sizes its own pool from its ConfigProto, which wins over
the variable there. `off` sets nothing; `N` gives every task N threads (inter-op
max(2, N)), on every host. A variable the user set -- in the launcher's environment
or with --env -- is never replaced. Tasks started over ssh run on machines whose
cores the launcher does not know: `auto` leaves them as they are.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Collection, Optional, Sequence, Union

from tfdist.errors import UserError

OMP, INTRA, INTER = "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"
VARIABLES = (OMP, INTRA, INTER)
MIN_INTER_OP = 2
OFF_HINT = "--threads_per_task=off keeps TensorFlow's defaults"

Setting = Union[str, int]  # "auto", "off", or a thread count of 1 or more.


def parse(value: Setting) -> Setting:
    """`"auto"`, `"off"` or a whole number of 1 or more (as text or int); anything else is a UserError."""
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return text
    if text.isdecimal() and text.isascii() and int(text) >= 1:
        return int(text)
    raise UserError(f"--threads_per_task={value!r} is not a thread budget: give auto (the default: split this "
                    "machine's cores between the tasks started on it), off (set nothing: TensorFlow's defaults) "
                    "or a whole number of threads per task, 1 or more, e.g. --threads_per_task=2.")


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def values(threads: int) -> dict[str, str]:
    """The three variables for `threads` threads per task."""
    return {OMP: str(threads), INTRA: str(threads), INTER: str(max(MIN_INTER_OP, threads))}


@dataclasses.dataclass(frozen=True)
class Budget:
    """What every task of one launch gets (`env`), and the line that says so (None: nothing to say)."""

    env: dict[str, str]
    line: Optional[str] = None


def _given(env: dict[str, str], user: Collection[str]) -> tuple[dict[str, str], str]:
    """`env` without the variables the user set, and a note naming those."""
    kept = [name for name in VARIABLES if name in user]
    note = f"{', '.join(kept)} {'is' if len(kept) == 1 else 'are'} yours and kept; " if kept else ""
    return {k: v for k, v in env.items() if k not in user}, note


def _assignments(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())


def local(setting: Setting, tasks: int, user: Collection[str], cores: Optional[int] = None) -> Budget:
    """The budget of `tasks` tasks started on this machine; `user`: the variable names the user set."""
    if setting == "off" or (setting == "auto" and tasks <= 1):
        return Budget({})
    if setting == "auto":
        cores = cores or machine_cores()
        env, note = _given(values(max(1, cores // tasks)), user)
        where = f"{tasks} tasks on this host, {cores} core{'s' if cores != 1 else ''}"
    else:
        env, note = _given(values(int(setting)), user)
        where = f"--threads_per_task={setting}"
    if not env:
        return Budget({})
    return Budget(env, f"tfdist-launch: {where}: each task gets {_assignments(env)} ({note}{OFF_HINT}).")


def remote(setting: Setting, placement: Sequence[str], user: Collection[str]) -> Budget:
    """The budget of tasks started over ssh on the hosts of `placement` (one entry per task).

    A given count applies on every host; `auto` sets nothing there (the launcher does not know
    those machines' cores) and names the hosts that run more than one task.
    """
    if setting == "off":
        return Budget({})
    if setting != "auto":
        return local(setting, len(placement), user)
    counts = {host: placement.count(host) for host in dict.fromkeys(placement)}
    shared = [f"{n} tasks on {host}" for host, n in counts.items() if n > 1]
    if not shared or all(name in user for name in VARIABLES):
        return Budget({})
    return Budget({}, f"tfdist-launch: {', '.join(shared)}: tfdist-launch does not know the cores of hosts it "
                      "reaches over ssh, so those tasks keep TensorFlow's default thread pools, each sized for the "
                      "whole machine; --threads_per_task=N gives every task N threads.")
