"""The run directory (``--workdir``): its lock, its files and their atomic writes (docs/run-directory.md).

Only the chief writes; non-chief workers write only a private scratch directory, removed on every exit path.
`RunDir` takes an exclusive ``flock`` on a local workdir (a second run is refused, naming the holder), writes
every replacing file through a temporary name and an atomic rename, and turns a failed write into a
`WriteError` naming the path, the cause and the last good checkpoint. What a checkpoint holds, and resuming
from one, is `tfdist.training.checkpoints`.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from typing import Any, Iterator, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.errors import UserError

LOCK_NAME = ".lock"
MEMBERSHIP_FILE = "membership.json"
# The TensorFlow errors a failed file write raises (ENOSPC is ResourceExhausted,
# EACCES/EROFS PermissionDenied, a vanished directory NotFound). Errors of lost
# peers (Unavailable, DeadlineExceeded, Cancelled, Aborted) are not among them.
WRITE_ERRORS = (OSError, tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError,
                tf.errors.NotFoundError, tf.errors.FailedPreconditionError, tf.errors.DataLossError,
                tf.errors.UnknownError, tf.errors.InternalError)


class WriteError(UserError):
    """A write into the run directory failed; the run stopped (exit status 1)."""

    exit_code = 1


def cause(error: BaseException) -> str:
    """The reason of a failed write in a few words (the OS error text where there is one)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = (getattr(error, "message", None) or str(error)).strip().split("\n")[0]
    text = re.sub(r"\{\{[^}]*\}\}", "", text)
    text = re.sub(r"\[Op:[^\]]*\]", "", text)
    text = " ".join(text.split())
    return (text.rsplit("; ", 1)[-1] if "; " in text else text)[:300]


def _advice(error: BaseException) -> str:
    code = getattr(error, "errno", None)
    text = cause(error).lower()
    if code in (errno.ENOSPC, errno.EDQUOT) or "no space" in text or "quota" in text:
        return "free space"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "permission" in text or "read-only" in text:
        return "make it writable"
    return "fix the cause"


def default_workdir(strategy: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{strategy}-{os.getpid()}")


def _is_local(path: str) -> bool:
    return "://" not in path


class RunDir:
    """The workdir as seen by one process; writes only on the chief.

    Use it as a context manager (``with RunDir(...) as rundir:``), or call
    `acquire` (which takes the lock) and make sure `cleanup` runs.
    """

    def __init__(self, path: str, *, is_chief: bool):
        self.path = path
        self.is_chief = is_chief
        self._scratch: Optional[str] = None
        self._lock_fd: Optional[int] = None

    def __enter__(self) -> "RunDir":
        self.acquire()
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        """Releases the lock and removes scratch; a failed write into the workdir becomes a `WriteError`.

        Writes outside the `RunDir` methods (TensorBoard summaries, written as
        the loop runs) fail with a TensorFlow error naming the file; when that
        file is in the workdir or the scratch directory, it is reported like
        any other failed write.
        """
        try:
            if isinstance(exc, WRITE_ERRORS) and not isinstance(exc, WriteError):
                path = self._path_named_by(exc)
                if path is not None:
                    # Outside the write methods the failing operation may have been a read
                    # (restoring a damaged checkpoint), unless the cause is a write's.
                    surely_a_write = isinstance(exc, (tf.errors.ResourceExhaustedError,
                                                      tf.errors.PermissionDeniedError)) or (
                        isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS))
                    raise self._write_error(path, path, exc, verb="write" if surely_a_write else "read or write"
                                            ) from None
        finally:
            self.cleanup()

    def _path_named_by(self, error: BaseException) -> Optional[str]:
        """The path in this run's directories that a failed write names, if it names one."""
        roots = {self.path, os.path.abspath(self.path)} if _is_local(self.path) else {self.path}
        if self._scratch:
            roots.add(self._scratch)
        if isinstance(error, OSError):
            names = [str(error.filename)] if error.filename else []
        else:
            text = getattr(error, "message", None) or str(error)
            names = [name.rstrip(":.") for name in re.findall(r"[^\s;,'\"]+", text)]
        for name in names:
            if any(name == root or name.startswith(root.rstrip("/") + "/") for root in roots):
                return name
        return None

    # The workdir and its lock -------------------------------------------------
    @property
    def lock_path(self) -> str:
        return self.join(LOCK_NAME)

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def _unusable(self, why: str) -> UserError:
        return UserError(
            f"--workdir={self.path} cannot be used as the run directory: {why}. Give a --workdir that is a "
            "directory this process can write, or that it can create."
        )

    def check_usable(self) -> None:
        """Refuses a workdir that is a file, or that the chief cannot create or write."""
        if not _is_local(self.path):
            if self.is_chief:
                try:
                    tf.io.gfile.makedirs(self.path)
                except tf.errors.OpError as e:
                    raise self._unusable(cause(e)) from None
            return
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise self._unusable("it is a file, not a directory")
        if not self.is_chief:
            return
        try:
            os.makedirs(self.path, exist_ok=True)
        except FileExistsError:
            raise self._unusable("it is a file, not a directory") from None
        except OSError as e:
            where = f" ({e.filename})" if e.filename and e.filename != self.path else ""
            raise self._unusable(f"it cannot be created: {e.strerror}{where}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise self._unusable("this process may not write it (permission denied)")

    def acquire(self) -> None:
        """Checks the workdir and, on the chief, takes its exclusive lock (idempotent).

        Only the chief writes the workdir, so only the chief locks it. A lock
        held by a live process is a `UserError` naming it; the kernel releases
        the lock of a process that died, and the next run takes it over.
        """
        if self._lock_fd is not None:
            return
        self.check_usable()
        if not (self.is_chief and _is_local(self.path)):
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self._read_holder()
            who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('started', '?')}"
                   if holder else "a process that has not recorded itself yet")
            raise UserError(
                f"--workdir={self.path} is in use by another live run ({who}); two runs writing one workdir would "
                "corrupt its checkpoints. Wait for that run to finish or stop it, then rerun to resume; or give a "
                "new --workdir."
            ) from None
        except OSError as e:  # A filesystem without flock (some network mounts): run unlocked.
            os.close(fd)
            logging.warning("Could not lock --workdir=%s (%s); running without a lock. Make sure no other run "
                            "uses it.", self.path, e.strerror)
            return
        self._lock_fd = fd
        stale = self._read_holder()
        if stale:
            logging.warning("Took over the lock of --workdir=%s from a run that is gone (host %s, pid %s, since %s).",
                            self.path, stale.get("host", "?"), stale.get("pid", "?"), stale.get("started", "?"))
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)[:500]}
        try:
            self.write_text(LOCK_NAME, json.dumps(holder) + "\n")
        except WriteError:
            self.release()
            raise
        self._remove_partial_checkpoints()

    def _read_holder(self) -> dict[str, Any]:
        try:
            with open(self.lock_path) as f:
                holder = json.load(f)
            return holder if isinstance(holder, dict) else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        """Removes the lock record and releases the lock (idempotent)."""
        if self._lock_fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.lock_path)
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = None

    # Guarded writes -------------------------------------------------------------
    @contextlib.contextmanager
    def guard_write(self, what: str, path: str, *, partial: tuple[str, ...] = ()) -> Iterator[None]:
        """Turns a failed write of `what` to `path` into a `WriteError`, removing `partial` files first."""
        try:
            yield
        except WRITE_ERRORS as e:
            for pattern in partial:
                self._remove(pattern)
            raise self._write_error(what, path, e) from None

    def _write_error(self, what: str, path: str, error: BaseException, verb: str = "write") -> WriteError:
        target = f"{what} to {path}" if what != path else path
        return WriteError(
            f"Could not {verb} {target}: {cause(error)}. {self._last_good()} {_advice(error).capitalize()} "
            "and rerun the same command to resume."
        )

    def _last_good(self) -> str:
        try:
            latest = self.latest_checkpoint()
        except Exception:  # noqa: BLE001 - the state file itself may be unreadable now.
            latest = None
        if latest:
            return f"The run stopped; its last good checkpoint {os.path.basename(latest)} is intact."
        return "The run stopped before its first checkpoint."

    @staticmethod
    def _remove(pattern: str) -> None:
        for leftover in glob.glob(pattern):
            with contextlib.suppress(OSError):
                if os.path.isdir(leftover):
                    shutil.rmtree(leftover)
                else:
                    os.remove(leftover)

    def save_checkpoint(self, manager: tf.train.CheckpointManager, step: int) -> str:
        """``manager.save(step)``; a failed save is a `WriteError`, and leaves no partial ckpt-STEP files."""
        directory = manager.directory
        prefix = os.path.join(directory, f"ckpt-{step}")
        try:
            with self.guard_write(f"checkpoint ckpt-{step}", directory):
                return manager.save(checkpoint_number=step)
        except WriteError:
            latest = tf.train.latest_checkpoint(directory) if _is_local(directory) else None
            if latest != prefix and _is_local(directory):
                # Not recorded in the state file: remove what the failed save left.
                self._remove(prefix + ".*")
                self._remove(prefix + "_temp*")
            raise

    def _remove_partial_checkpoints(self) -> None:
        """Removes temporary directories of saves a killed run left (under the lock, on the chief)."""
        if _is_local(self.path):
            self._remove(os.path.join(self.join("checkpoints"), "ckpt-*_temp*"))

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def checkpoint_dir(self) -> str:
        """Where this process saves checkpoints.

        Non-chief workers of a multi-worker job must take part in every save
        (TensorFlow requires it); they save to a private scratch directory that
        `cleanup()` removes.
        """
        if self.is_chief:
            return self.join("checkpoints")
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="tfdist-worker-ckpt-")
        return self._scratch

    def latest_checkpoint(self) -> Optional[str]:
        """The newest checkpoint in the workdir (read by every process to resume)."""
        return tf.train.latest_checkpoint(self.join("checkpoints"))

    def write_json(self, name: str, values: dict[str, Any]) -> None:
        if self.is_chief:
            # A metric with one value per class (F1Score(average=None)) as its list.
            self.write_text(name, json.dumps(values, indent=2, sort_keys=True,
                                             default=lambda v: np.asarray(v).tolist()) + "\n")

    def record_membership(self, step: int, num_workers: int, num_replicas: int) -> list[dict[str, Any]]:
        """Appends this start (step, workers, replicas) to membership.json; returns the whole record."""
        if not self.is_chief:
            return []
        path = self.join(MEMBERSHIP_FILE)
        entries: list[dict[str, Any]] = []
        if tf.io.gfile.exists(path):
            try:
                with tf.io.gfile.GFile(path) as f:
                    entries = list(json.load(f))
            except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
                logging.warning("%s is damaged; starting it anew.", path)
        entries.append({"step": step, "num_workers": num_workers, "num_replicas": num_replicas,
                        "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
        self.write_text(MEMBERSHIP_FILE, json.dumps(entries, indent=2) + "\n")
        return entries

    def write_text(self, name: str, text: str) -> None:
        """Writes `name` through a temporary file and an atomic rename; a failure is a `WriteError`."""
        if not self.is_chief:
            return
        final = self.join(name)
        tmp = f"{final}.tmp-{os.getpid()}"
        with self.guard_write(name, final, partial=(tmp,) if _is_local(tmp) else ()):
            tf.io.gfile.makedirs(self.path)
            with tf.io.gfile.GFile(tmp, "w") as f:
                f.write(text)
            tf.io.gfile.rename(tmp, final, overwrite=True)

    def export_model(self, model: Any, name: str = "model.keras") -> Optional[str]:
        """Saves the model through a temporary file, then renames it into place."""
        if not self.is_chief:
            return None
        final = self.join(name)
        staged = f"{final}.tmp-{os.getpid()}"
        with self.guard_write(f"the model export {name}", final, partial=(staged,) if _is_local(staged) else ()):
            tf.io.gfile.makedirs(self.path)
            with tempfile.TemporaryDirectory(prefix="tfdist-export-") as tmp_dir:
                local = os.path.join(tmp_dir, name)
                model.save(local)
                tf.io.gfile.copy(local, staged, overwrite=True)
                tf.io.gfile.rename(staged, final, overwrite=True)
        return final

    def export_saved_model(self, model: Any, name: str = "saved_model") -> Optional[str]:
        """Writes a SavedModel with a serving signature (staged, then renamed into place); chief only."""
        if not self.is_chief:
            return None
        from tfdist.training.export import export_saved_model

        final = self.join(name)
        with self.guard_write(f"the SavedModel export {name}/", final):
            return export_saved_model(model, final)

    def summary_writer(self) -> tf.summary.SummaryWriter:
        if self.is_chief:
            with self.guard_write("TensorBoard summaries", self.join("tensorboard")):
                return tf.summary.create_file_writer(self.join("tensorboard"))
        return tf.summary.create_noop_writer()

    def cleanup(self) -> None:
        """Removes this process's scratch directory and releases the lock; safe to call more than once."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        self.release()
