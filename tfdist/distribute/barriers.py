"""Where the tasks of a synchronous multi-worker job wait for one another outside a step, and how a task that
fails tells the others.

Two waits, both barriers of TensorFlow's coordination service where the job has one (MultiWorkerMirroredStrategy;
Horovod's ranks gather instead):
- at the end of every `tfdist.fit` (`wait_for_peers`): no task returns before every task has finished the fit,
  the chief's callbacks and exports included, so a file they wrote (a `ModelCheckpoint`'s) is there for every
  worker's next line;
- at exit (`leave_last`): no training task exits while another still works, since the coordination service runs
  inside one of them.

A task that ends with an uncaught exception (`report_failures` installs the hook, once a process) reports its
error to the coordination service, skips the exit barrier, and exits without the interpreter's teardown of
TensorFlow's server. Every other task's barrier and
collective then ends at once with that error (TensorFlow aborts them), so a job never waits for a task that has
failed, and the task prints `cluster.failure_line`, by which tfdist-launch names it.
"""

from __future__ import annotations

import atexit
import itertools
import re
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from tfdist.distribute.cluster import failure_line
from tfdist.distribute.runner import wait_until_closed
from tfdist.errors import one_paragraph

# How long the coordination-service leader waits at exit for the other tasks to exit.
LEADER_EXIT_WAIT_S = 60.0
# How long a task of a synchronous multi-worker job waits at exit for the others to finish their work.
PEER_EXIT_WAIT_S = 600.0
# How long a task waits at the end of a fit for the others (the chief's last callbacks may save a large model).
FIT_END_WAIT_S = 3600.0
# How long a leader that failed waits for the others to exit (they learn of its error from its service), and
# how long a task waits for its error report to be taken.
FAILED_LEADER_WAIT_S, REPORT_WAIT_S = 10.0, 10.0
EXIT_BARRIER = "tfdist_exit"
_LEAVING_LAST: list[str] = []  # Labels of backends whose exit hook is registered (one per process).
_STATE: dict[str, Any] = {}  # "label": set once the failure hook is installed; "failed": this task's error.
_FIT_ENDS = itertools.count()  # Every task ends its fits in the same order: one barrier name each.
_REPORTED = re.compile(r"tfdist task (\S+) failed: (.+?)(?= \[type\.googleapis\.com/|$)")
UNKNOWN = 2  # tf.errors.UNKNOWN: the code a reported error carries.


class PeerFailed(RuntimeError):
    """Another task of the job failed while this one waited for it; the message names that task's error."""


def coordination(backend: Any) -> Optional[tuple[bool, list[str]]]:
    """(whether this task hosts the coordination service, the other training tasks' addresses), on a
    synchronous multi-worker job; None elsewhere."""
    cluster = backend.cluster
    if not backend.all_tasks_save or backend.num_workers < 2 or cluster.task_type not in ("chief", "worker"):
        return None
    from tensorflow.python.eager import context

    config = context.context().coordination_service
    if config is None:
        return None
    me = f"/job:{cluster.task_type}/replica:0/task:{cluster.task_index}"
    others = [address for job in ("chief", "worker") for i, address in enumerate(cluster.cluster.get(job, ()))
              if (job, i) != (cluster.task_type, cluster.task_index)]
    return config.service_leader == me, others


def report_failures(backend: Any) -> None:
    """Installs, once a process, the hook that tells the job's other tasks of this task's uncaught error (after
    Python has printed it); a no-op where the job has no coordination service."""
    found = coordination(backend)
    if "label" in _STATE or found is None:
        return
    _STATE["label"] = backend.task_label
    previous, (leader, others) = sys.excepthook, found

    def hook(kind: type, error: BaseException, trace: Any) -> None:
        previous(kind, error, trace)
        if hasattr(sys, "ps1") or kind.__module__ == "tfdist.training.preemption":
            return  # An interactive session goes on; a preemption stops every task alike.
        message = one_paragraph(str(error))[:1000]
        tell_the_others(f"{kind.__name__}: {message}" if message else kind.__name__)
        if leader:  # The others learn of the error from this task's service: let them take it first.
            wait_until_closed(others, FAILED_LEADER_WAIT_S)
        exit_now(130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook


def exit_now(code: int) -> None:
    """Ends a failed task as Python would (exit handlers, streams, the status), without the interpreter's teardown
    of TensorFlow's server and coordination agent, which can stall once the job is in error (seen here past 3 s
    under load)."""
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def tell_the_others(error: str) -> bool:
    """Reports this task's `error` ("Type: message") to the coordination service, which ends every other task's
    barrier and collective with it; True if it was taken (False: the job was already failing, a peer's error
    first, or the service is gone). This task then skips the exit barrier."""
    label = _STATE.get("label", "?")
    _STATE["failed"] = error
    taken: list[bool] = []

    def report() -> None:
        from tensorflow.python.eager import context

        try:
            context.context().report_error_to_cluster(UNKNOWN, f"tfdist task {label} failed: {error}")
            taken.append(True)
        except Exception:  # Already in error (a peer's first) or the leader is gone: nothing to tell.
            pass

    reporter = threading.Thread(target=report, name="tfdist-report-error", daemon=True)
    reporter.start()
    reporter.join(REPORT_WAIT_S)
    if taken:
        print(failure_line(label, error), file=sys.stderr, flush=True)
    return bool(taken)


def peer_error(error: BaseException, cluster: Any = None) -> str:
    """What a failed barrier says, in one paragraph: the failed task's own error where it reported one, in the
    barrier's error or, where this task had already taken the job's error ("Agent must be in CONNECTED state"),
    in the `cluster`'s task states."""
    text = one_paragraph(str(error))
    for said in [text, *(_task_errors(cluster) if cluster is not None else [])]:
        reported = _REPORTED.search(said)
        if reported:
            return f"{reported.group(1)} failed: {reported.group(2)}"
    return text[:1000] or type(error).__name__


def _task_errors(cluster: Any) -> list[str]:
    """The errors TensorFlow's coordination service holds for the training tasks of `cluster` (a ClusterInfo)."""
    from tensorflow.python.eager import context

    jobs = [(job, len(cluster.cluster[job])) for job in ("chief", "worker") if cluster.cluster.get(job)]
    try:
        return [one_paragraph(str(state)) for state in context.context().get_task_states(jobs) if state is not None]
    except Exception:  # The service is gone: the barrier's own error is all there is.
        return []


def _timed_out(error: BaseException) -> bool:
    return type(error).__name__ == "DeadlineExceededError" or "Barrier timed out" in str(error)


def wait_for_peers(backend: Any) -> None:
    """The end of a fit on a synchronous multi-worker job: returns once every training task has finished it.

    Raises `PeerFailed` with a peer's error if one failed meanwhile; a wait past `FIT_END_WAIT_S` (a peer still
    busy) logs a warning and returns.
    """
    if backend.single_controller or backend.asynchronous:
        return
    report_failures(backend)
    name = f"tfdist_fit_end_{next(_FIT_ENDS)}"
    if coordination(backend) is None:  # Horovod: a gather every rank joins.
        backend.gather_from_tasks(np.zeros([1], np.int64))
        return
    from absl import logging
    from tensorflow.python.eager import context

    try:
        context.context().wait_at_barrier(name, int(FIT_END_WAIT_S * 1000))
    except Exception as error:
        if _timed_out(error):
            logging.warning("[%s] fit returns without the other tasks, still busy after %.0f s: a file the chief's "
                            "callbacks write may not be there yet.", backend.task_label, FIT_END_WAIT_S)
            return
        raise PeerFailed(f"[{backend.task_label}] another task of the job failed before the end of fit: "
                         f"{peer_error(error, backend.cluster)}") from None


def leave_last(backend: Any) -> None:
    """On a synchronous multi-worker job: no training task exits while another still works.

    Every task of a MultiWorkerMirroredStrategy job heartbeats to TensorFlow's
    coordination service, which runs inside the leader (worker 0, or the
    chief). Two ways the end of a job can then abort a task whose work is done
    (SIGABRT at interpreter exit):
    - a task still shutting down when the leader has exited sees its
      heartbeats fail;
    - a task that exits while the leader still works (evaluates, exports, or
      runs the user's own code after `tfdist.fit`) is flagged unhealthy after
      the heartbeat timeout, and the leader aborts its collectives.
    So at exit every training task waits at a coordination-service barrier
    (up to `PEER_EXIT_WAIT_S`), and the leader then waits (up to
    `LEADER_EXIT_WAIT_S`) until no other task's server listens any more. A task
    that failed (`report_failures`) does not wait at the barrier: its error has
    ended the others' waits.
    """
    found = coordination(backend)
    if found is None or _LEAVING_LAST:
        return
    _LEAVING_LAST.append(backend.task_label)
    report_failures(backend)
    atexit.register(_leave, backend.task_label, *found, backend.cluster)


def _leave(label: str, leader: bool, others: list[str], cluster: Any) -> None:
    from absl import logging
    from tensorflow.python.eager import context

    if "failed" in _STATE:  # Its error ended the others' waits (`report_failures`).
        return
    start = time.monotonic()
    try:
        context.context().wait_at_barrier(EXIT_BARRIER, int(PEER_EXIT_WAIT_S * 1000))
    except Exception as error:  # A task that failed or already left: nothing to wait for.
        logging.warning("[%s] exiting without waiting for the other tasks: %s", label, peer_error(error, cluster))
    if leader:
        left = wait_until_closed(others, LEADER_EXIT_WAIT_S)
        if left:
            logging.warning("[%s] exiting although the task(s) at %s still run after %.0f s.", label,
                            ", ".join(left), LEADER_EXIT_WAIT_S)
    if time.monotonic() - start > 1.0:
        logging.info("[%s] waited %.1f s at exit for the other tasks of the job (they share one "
                     "coordination service).", label, time.monotonic() - start)
