"""What a training checkpoint holds (model, optimizer, step, seed generators, sharded tables), and its save,
restore and resume in the run directory."""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.errors import UserError
from tfdist.training.workdir import cause

# What the checkpoint holds besides the model and optimizer -------------------------
SEED_CHILD = "seed_generators"


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
        return cause(e)
    return None


def unreadable_shards(path: str) -> Optional[str]:
    """Why the sharded optimizer state beside checkpoint `path` (``zero-STEP``) does not read back whole, or
    None (whole, or none: an unsharded run)."""
    from tfdist.training.zero import checkpoint as shards

    step = re.sub(r".*ckpt-", "", path)
    return shards.unreadable(os.path.dirname(path), int(step)) if step.isdigit() else None


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
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step, **seeds,
                               **_inner_optimizers(model.optimizer))


def _inner_optimizers(optimizer: Any) -> dict:
    """A `MultiOptimizer`'s inner optimizers (their slots and step counts), which TensorFlow's checkpoint of the
    optimizer does not reach: Keras holds them in a list of its own."""
    import keras

    from tfdist.training.keras_hooks import optimizers as keras_optimizers

    inner = keras_optimizers(optimizer)[-1]
    if not isinstance(inner, keras.optimizers.MultiOptimizer):
        return {}
    return {"inner_optimizers": _Named({str(i): opt for i, opt in enumerate(inner.optimizers)})}


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


def recorded(rundir: Any) -> list[str]:
    """Every checkpoint the workdir's ``checkpoint`` state file records, newest first."""
    state = tf.train.get_checkpoint_state(rundir.join("checkpoints"))
    if state is None:
        return []
    paths = list(reversed(state.all_model_checkpoint_paths))
    if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.insert(0, state.model_checkpoint_path)
    return paths


def readable(rundir: Any) -> Optional[str]:
    """The newest checkpoint that reads back whole (None when there is none at all).

    A damaged one (truncated by a full disk or a killed copy, its index
    missing, a checksum mismatch; or its sharded optimizer state, zero-STEP,
    lacking a replica's file or damaged) is skipped with one log line naming
    it and why. Every process of a job reads the same shared files in the same
    order, so all pick the same checkpoint (the loop's agreement check
    compares the restored steps). When none reads back whole: a `UserError`
    naming each.
    """
    paths = recorded(rundir)
    skipped: list[str] = []
    for path in paths:
        why = unreadable_checkpoint(path) or unreadable_shards(path)
        if why is None:
            if skipped:
                logging.warning("Skipped damaged checkpoint%s %s in %s; resuming from %s.",
                                "s" if len(skipped) > 1 else "", "; ".join(skipped),
                                rundir.join("checkpoints"), os.path.basename(path))
            return path
        skipped.append(f"{os.path.basename(path)} ({why})")
    if not paths:
        return None
    raise UserError(
        f"Cannot resume the run in --workdir={rundir.path}: none of its checkpoints reads back whole: "
        f"{'; '.join(skipped)}. Restore {rundir.join('checkpoints')} from a copy, or start a new run with a new "
        "--workdir.")


class Checkpoints:
    """The run's checkpoints in its run directory (None: none): restored to resume, saved by the Controller."""

    def __init__(self, checkpoint: tf.train.Checkpoint, step_counter: tf.Variable, rundir: Any, backend: Any,
                 keep: int, zero: Any = None):
        """`checkpoint`: what a checkpoint holds (`training_checkpoint`); `keep`: the newest kept. `zero`: a
        sharded optimizer state (`tfdist.training.zero`), saved beside each checkpoint by every process."""
        self.checkpoint, self.zero = checkpoint, zero
        self.step_counter, self.rundir, self.backend, self.keep = step_counter, rundir, backend, keep
        self.manager: Optional[tf.train.CheckpointManager] = None
        self.applied: Optional[int] = None  # The steps applied to the variables at the last save.

    def resume(self, plan: Any, resume: Optional[bool]) -> int:
        """Restores the newest readable checkpoint (after the checks a resume makes); returns the step to start
        from. ``resume``: True requires a checkpoint, False refuses one, None takes what is there."""
        rundir, workdir = self.rundir, self.rundir.path
        latest = readable(rundir)  # Skips damaged ones with a log line; none whole: UserError.
        if latest is not None and resume is False:
            raise UserError(f"--workdir={workdir} already holds checkpoint {os.path.basename(latest)} and resuming "
                            "is off (--noresume / resume=False); tfdist never overwrites a run. Pick a new "
                            "--workdir, or drop --noresume to continue this run.")
        if latest is None and resume:
            raise UserError(f"--resume was given but {rundir.join('checkpoints')} holds no checkpoint; drop "
                            "--resume (resume=True) to start a new run.")
        start_step = 0
        if latest is not None:
            from tfdist.training.plan import check_resume

            check_resume(workdir, plan)
            try:
                restore_checkpoint(self.checkpoint, latest)
            except (AssertionError, ValueError, tf.errors.OpError) as e:
                raise UserError(
                    f"Cannot resume from {latest}: it does not hold this model and optimizer "
                    f"({' '.join(str(e).split())[:200]}). Was the model changed? Use a new workdir, or the model "
                    "the checkpoint was written by.") from None
            with self.backend.scope():
                sync_table_replicas(self.checkpoint)
            self._resume_sharded(latest)
            start_step = int(self.step_counter.numpy())
            logging.info("Resuming from checkpoint %s at step %d.", latest, start_step)
        self.manager = tf.train.CheckpointManager(self.checkpoint, rundir.checkpoint_dir, max_to_keep=self.keep,
                                                  checkpoint_name="ckpt")
        return start_step

    def _resume_sharded(self, latest: str) -> None:
        """A sharded optimizer state from the shards beside `latest`; without one, a checkpoint written
        sharded is refused (its optimizer state is not in it)."""
        step = int(re.sub(r".*ckpt-", "", latest))
        written = tf.io.gfile.exists(os.path.join(os.path.dirname(latest), f"zero-{step}"))
        if self.zero is not None:
            self.zero.restore(os.path.dirname(latest), step)
        elif written:
            raise UserError(f"Cannot resume from {latest} without zero_stage: it was written with the optimizer "
                            "state sharded (zero_stage=1, 2 or 3), which only a sharded run reads. Pass zero_stage=1, "
                            "2 or 3 (any replica count), or start a new run with a new workdir.")

    def save(self, step: int) -> Optional[str]:
        """Saves at `step` (the chief, or every task where the backend needs it); returns the chief's path.
        A sharded optimizer state is written first, by every process (its replicas' parts), then the rest."""
        backend = self.backend
        if self.manager is not None and self.zero is not None:
            directory = self.rundir.join("checkpoints")
            with self.rundir.guard_write(f"sharded optimizer state of step {step}", directory):
                self.zero.save(directory, step)
            if backend.num_workers > 1:  # Every part written before the chief records the checkpoint.
                backend.gather_from_tasks(np.zeros([1], np.int64))
        if self.manager is None or not (backend.is_chief or backend.all_tasks_save):
            return None
        # Saves come after every dispatched execution has finished, so the steps applied (the counter the
        # steps increment) are the steps counted. Fewer: a step was cut short with a killed worker (see the
        # README); the checkpoint records the count the run goes on from. Never assigned backwards.
        applied = self.applied = int(self.step_counter.numpy())
        if applied != step:
            logging.warning("%d step(s) applied to the variables against %d counted; the checkpoint records %d.",
                            applied, step, max(applied, step))
        if applied < step:
            self.step_counter.assign(step)
        path = self.rundir.save_checkpoint(self.manager, step)  # A failed write: WriteError, the last good kept.
        if self.zero is not None and backend.is_chief:
            self._drop_old_shards()
        if backend.is_chief:
            logging.info("Saved checkpoint %s at step %d.", path, step)
        return path if backend.is_chief else None

    def _drop_old_shards(self) -> None:
        """Removes the sharded states of checkpoints the manager no longer keeps."""
        kept = {f"zero-{re.sub(r'.*ckpt-', '', path)}" for path in self.manager.checkpoints}
        directory = self.rundir.join("checkpoints")
        for name in tf.io.gfile.listdir(directory):
            name = name.rstrip("/")
            if re.fullmatch(r"zero-\d+", name) and name not in kept:
                tf.io.gfile.rmtree(os.path.join(directory, name))

    @property
    def latest(self) -> Optional[str]:
        return self.manager.latest_checkpoint if self.manager is not None else None
