"""The run directory: configuration, checkpoints, summaries, export, metrics, and its lock.

Layout of ``--workdir``::

  config.json       the resolved configuration (repeat a run with it)
  flags.txt         the same as an absl flagfile: tfdist-train --flagfile=W/flags.txt
  plan.json         the resolved plan a resume must match (written by tfdist.fit)
  membership.json   one entry per start of training in this workdir: the step it started or resumed
                    at, and its workers and replicas (a change is a job that shrank or grew)
  checkpoints/      tf.train checkpoints (ckpt-STEP), newest kept: model, optimizer, step and
                    every random seed generator's state (`training_checkpoint`)
  tensorboard/      TensorBoard summaries (and profiler traces)
  model.keras       the final model
  saved_model/      with the saved_model export: a SavedModel for serving
  metrics.json      the run's results
  .lock             only while a run is live: its host, pid and start time

Only the chief writes. `RunDir` is used as a context manager (or
``acquire()`` ... ``cleanup()``): on a local path the chief first takes an
exclusive ``flock`` on the workdir, so a second run on a live workdir is
refused at once, naming the holder; a lock left by a killed run is released by
the kernel and taken over with a log line. Non-chief workers write only a
private scratch directory, removed by ``cleanup()`` on every exit path.

Every write that replaces a file goes through a temporary name and an atomic
rename, so a failed run never leaves a half written export or metrics file;
checkpoints are only ever added (the CheckpointManager keeps the newest
``--keep_checkpoints``) and TensorFlow records a checkpoint in the
``checkpoint`` state file only after its data is complete. A write that fails
(disk full, permission denied, a vanished mount) becomes a `WriteError`: one
paragraph naming the path, the cause and the last good checkpoint, after the
failed write's partial files are removed. A resume starts from the newest
checkpoint that reads back whole (`RunDir.readable_checkpoint`), skipping
damaged ones with a log line.
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


def _cause(error: BaseException) -> str:
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
    cause = _cause(error).lower()
    if code in (errno.ENOSPC, errno.EDQUOT) or "no space" in cause or "quota" in cause:
        return "free space"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "permission" in cause or "read-only" in cause:
        return "make it writable"
    return "fix the cause"


def default_workdir(strategy: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{strategy}-{os.getpid()}")


def _is_local(path: str) -> bool:
    return "://" not in path


def unreadable_checkpoint(path: str) -> Optional[str]:
    """Why checkpoint `path` does not read back whole, or None when every tensor in it reads.

    Reads each tensor once (the bundle reader checks each one's length and
    checksum), before anything is restored into the model.
    """
    if not tf.io.gfile.exists(path + ".index"):
        return "its index file is missing"
    try:
        reader = tf.train.load_checkpoint(path)
        for key in sorted(reader.get_variable_to_shape_map()):
            reader.get_tensor(key)
    except (tf.errors.OpError, IndexError, ValueError, OSError, RuntimeError) as e:
        return _cause(e)
    return None


# What the checkpoint holds besides the model and optimizer -------------------------
SEED_CHILD = "seed_generators"


class SeedStates(tf.__internal__.tracking.AutoTrackable):
    """The state variables of the model's `keras.random.SeedGenerator`s, as one checkpoint child.

    A `SeedGenerator` (Dropout, RandomFlip, GaussianNoise, ...) is a plain
    Python object, not a TensorFlow ``Trackable``: TensorFlow's attribute
    tracking never reaches its ``state`` variable, so ``Checkpoint(model=...)``
    leaves it out. Held here (``seed_generators/states/I``, I in the order
    of ``model.variables``), it is saved and restored without any change to
    the model.
    """

    def __init__(self, states: list):
        super().__init__()
        self.states = list(states)


def seed_generator_states(model: Any) -> list:
    """The ``state`` variable of every SeedGenerator the model's layers hold, in ``model.variables`` order."""
    ids = {id(generator.state) for layer in model._flatten_layers(include_self=True)
           for generator in getattr(layer, "_seed_generators", [])}
    states, seen = [], set()
    for variable in model.variables:
        if id(variable) in ids and id(variable) not in seen:
            states.append(variable)
            seen.add(id(variable))
    return states


class _Named(tf.__internal__.tracking.Trackable):
    """A checkpoint node whose children are the given (name -> variable) pairs."""

    def __init__(self, children: dict):
        self._named = dict(children)

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        return dict(self._named)


def _table(parts: list, name: str) -> Any:
    """One logical variable saved in row slices: restores into any number of parts (2 shards -> 3)."""
    from tensorflow.python.distribute import sharded_variable

    from tfdist.distribute.backend import tf_variable

    return sharded_variable.ShardedVariable([tf_variable(p) for p in parts], name=name)


def _slot_owner(slot: Any, references: list) -> tuple[int, str] | None:
    """(index in `references`, slot name) of a Keras optimizer slot, from its name (``{path}_{slot}``)."""
    best = None
    for index, reference in enumerate(references):
        prefix = reference.path.replace("/", "_") + "_"
        if slot.name.startswith(prefix) and (best is None or len(prefix) > best[2]):
            best = (index, slot.name[len(prefix):], len(prefix))
    return None if best is None else best[:2]


def sharded_checkpoint_views(model: Any) -> tuple[Any, Any]:
    """The model and its optimizer as checkpoint nodes whose keys do not depend on any table's shard count.

    Keras' own checkpoint keys are positions in its variable lists, which move
    when a `ShardedEmbedding` has another number of shards. Here each table, and
    each optimizer slot of a table, is one variable saved in row slices
    (``tables/J``, ``table_slots/J/NAME``); every other variable keeps its
    position among the variables that are not shards (``variables/I``,
    ``slots/I/NAME``, ``other/K``).
    """
    from tfdist.layers.sharded_embedding import sharded_tables

    from tfdist.training.keras_hooks import optimizers as keras_optimizers

    tables = [table for table in sharded_tables(model) if table.shards]  # An unbuilt layer holds nothing yet.
    shard_of = {id(shard): (j, k) for j, table in enumerate(tables) for k, shard in enumerate(table.shards)}
    model_children, seen = {}, set()
    for variable in model.variables:
        if id(variable) in seen or id(variable) in shard_of:
            continue
        seen.add(id(variable))
        model_children[f"variables/{len(model_children)}"] = variable
    for j, table in enumerate(tables):
        model_children[f"tables/{j}"] = _table(table.shards, f"{table.name}/embeddings")
    optimizer = model.optimizer
    # What the optimizer was built for (a table frozen since keeps its slots).
    inner = keras_optimizers(optimizer)[-1]
    references = list(getattr(inner, "_trainable_variables", None) or model.trainable_variables)
    plain = [v for v in references if id(v) not in shard_of]
    position = {id(v): i for i, v in enumerate(plain)}
    children: dict = {}
    table_slots: dict = {}
    others = 0

    def add(key: str, variable: Any) -> None:
        if key in children:
            raise UserError(f"tfdist cannot checkpoint this model's optimizer: two of its variables map to {key!r} "
                            "(layers whose variable paths coincide once '/' is read as '_'). Rename a layer.")
        children[key] = variable

    for variable in optimizer.variables:
        owner = _slot_owner(variable, references)
        if owner is None:
            add(f"other/{others}", variable)
            others += 1
        elif id(references[owner[0]]) in shard_of:
            j, k = shard_of[id(references[owner[0]])]
            parts = table_slots.setdefault((j, owner[1]), {})
            if k in parts:
                raise UserError(f"tfdist cannot checkpoint ShardedEmbedding {tables[j].name!r}: two optimizer "
                                f"variables name its shard {k}'s slot {owner[1]!r}. Rename a layer.")
            parts[k] = variable
        else:
            add(f"slots/{position[id(references[owner[0]])]}/{owner[1]}", variable)
    for (j, name), parts in sorted(table_slots.items()):
        if sorted(parts) != list(range(len(tables[j].shards))):
            raise UserError(f"tfdist cannot checkpoint ShardedEmbedding {tables[j].name!r}: its optimizer slot "
                            f"{name!r} exists for shards {sorted(parts)} of {len(tables[j].shards)}.")
        add(f"table_slots/{j}/{name}", _table([parts[k] for k in sorted(parts)], f"{tables[j].name}/{name}"))
    return _Named(model_children), _Named(children)


def sync_table_replicas(checkpoint: tf.train.Checkpoint) -> None:
    """After a restore: every local replica of a mirrored table (and its slots) holds the restored value.

    The sliced variables of `sharded_checkpoint_views` restore the first replica's copy only; the value
    is then assigned to all. A checkpoint without such views has nothing to do.
    """
    from tensorflow.python.distribute import sharded_variable

    for node in (checkpoint.model, checkpoint.optimizer):
        for child in getattr(node, "_named", {}).values():
            if isinstance(child, sharded_variable.ShardedVariable):
                for part in child.variables:
                    if len(getattr(part, "values", ())) > 1:  # A MirroredVariable with several local copies.
                        part.assign(part.read_value())


def training_checkpoint(model: Any, step: tf.Variable) -> tf.train.Checkpoint:
    """What a checkpoint holds: the model, its optimizer, the step counter and the seed generators' state.

    A model with `ShardedEmbedding` tables is held through `sharded_checkpoint_views`, so a
    run resumes on another shard count.
    """
    from tfdist.layers.sharded_embedding import sharded_tables

    seeds = {SEED_CHILD: SeedStates(seed_generator_states(model))}
    from tfdist.training.custom_steps import overrides

    # A custom train_step's own optimizers are the model's attributes: Keras' tracking holds them.
    if sharded_tables(model) and not overrides(model, "train_step"):
        model_view, optimizer_view = sharded_checkpoint_views(model)
        return tf.train.Checkpoint(model=model_view, optimizer=optimizer_view, step=step, **seeds)
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step, **seeds)


def restore_checkpoint(checkpoint: tf.train.Checkpoint, path: str) -> None:
    """Restores `path` into `checkpoint` (made by `training_checkpoint`), asserting every object matched.

    A checkpoint written before the seed generators' state was saved is
    restored without it, with a warning: the resumed run's random masks then
    differ from an uninterrupted run's (training is otherwise unchanged).
    """
    states = getattr(checkpoint, SEED_CHILD).states
    keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    if not states or any(key.startswith(SEED_CHILD + "/") for key in keys):
        checkpoint.restore(path).assert_existing_objects_matched()
        return
    core = tf.train.Checkpoint(model=checkpoint.model, optimizer=checkpoint.optimizer, step=checkpoint.step)
    core.restore(path).assert_existing_objects_matched()
    logging.warning("Checkpoint %s holds no state of the model's %d random seed generator(s) (Dropout and other "
                    "random layers; it was written by an older tfdist): resuming with their current state, so the "
                    "random masks of the resumed steps differ from those of an uninterrupted run.",
                    os.path.basename(path), len(states))


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
                    raise self._unusable(_cause(e)) from None
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
            f"Could not {verb} {target}: {_cause(error)}. {self._last_good()} {_advice(error).capitalize()} "
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

    def checkpoints(self) -> list[str]:
        """Every checkpoint the workdir's ``checkpoint`` state file records, newest first."""
        state = tf.train.get_checkpoint_state(self.join("checkpoints"))
        if state is None:
            return []
        paths = list(reversed(state.all_model_checkpoint_paths))
        if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
            paths.insert(0, state.model_checkpoint_path)
        return paths

    def readable_checkpoint(self) -> Optional[str]:
        """The newest checkpoint that reads back whole (None when there is none at all).

        A damaged one (truncated by a full disk or a killed copy, its index
        missing, a checksum mismatch) is skipped with one log line naming it and
        why. Every process of a job reads the same shared files in the same
        order, so all pick the same checkpoint (the loop's agreement check
        compares the restored steps). When none reads back whole: a `UserError`
        naming each.
        """
        paths = self.checkpoints()
        skipped: list[str] = []
        for path in paths:
            why = unreadable_checkpoint(path)
            if why is None:
                if skipped:
                    logging.warning("Skipped damaged checkpoint%s %s in %s; resuming from %s.",
                                    "s" if len(skipped) > 1 else "", "; ".join(skipped),
                                    self.join("checkpoints"), os.path.basename(path))
                return path
            skipped.append(f"{os.path.basename(path)} ({why})")
        if not paths:
            return None
        raise UserError(
            f"Cannot resume the run in --workdir={self.path}: none of its checkpoints reads back whole: "
            f"{'; '.join(skipped)}. Restore {self.join('checkpoints')} from a copy, or start a new run with a new "
            "--workdir.")

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
