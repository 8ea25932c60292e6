"""Shard checkpoints: each replica's optimizer state saved by variable, read back on any replica count.

Beside ``checkpoints/ckpt-STEP`` every process writes ``checkpoints/zero-STEP/replica-R-of-N`` for each of its
replicas (a TensorFlow checkpoint bundle, `tf.raw_ops.SaveV2`). Each slot of each shard is saved as the pieces
of the variables it holds: ``var{i}_{slot}/{start}`` is elements ``[start, start + length)`` of variable i's
flattened slot, and ``var{i}/shape`` its shape; state that belongs to no variable (Nadam's running product) is
``global_{k}``, a loss scale's ``loss_scale.*``, and ``replica`` the file's replica index and count (so an
optimizer without state writes its files too). A restore assembles each owned piece from whichever saved pieces
overlap it, so neither the replica count nor the bucket layout needs to match; a model of another shape, a
missing piece or a missing replica's file is refused with a `UserError`.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdist.errors import UserError
from tfdist.training.workdir import cause

SHARD_DIR = "zero-{step}"
SHARD_FILE = "replica-{replica}-of-{replicas}"


def _pieces(sharded: Any, shard: Any) -> dict[str, tf.Tensor]:
    """What one replica's file holds: its state by variable piece, shapes, global state and loss scale, and
    ``replica`` (its index and the replica count: plain SGD has no state, and SaveV2 needs a tensor)."""
    out: dict[str, tf.Tensor] = {"replica": tf.constant([shard.replica, sharded.backend.num_replicas], tf.int64)}
    for key, variable in shard.slots().items():
        match = re.fullmatch(r"b(\d+)_(.+)", key)
        if not match:
            out[key] = tf.convert_to_tensor(variable)
            continue
        bucket, slot = sharded.layout[int(match.group(1))], match.group(2)
        for p in bucket.pieces(shard.replica):
            out[f"var{p.index}_{slot}/{p.start}"] = tf.convert_to_tensor(variable)[p.offset:p.offset + p.length]
            out[f"var{p.index}/shape"] = tf.constant(list(sharded.variables[p.index].shape) or [0], tf.int64)
    return out


def save(sharded: Any, directory: str, step: int) -> None:
    """Writes each local replica's state under ``directory/zero-{step}/replica-{r}-of-{N}``, first removing
    what a run on another replica count left there unrecorded (it died between its parts and its checkpoint)."""
    where = os.path.join(directory, SHARD_DIR.format(step=step))
    replicas = sharded.backend.num_replicas
    if tf.io.gfile.exists(where):
        for name in tf.io.gfile.listdir(where):
            count = re.match(r"replica-\d+-of-(\d+)", name)
            if count and int(count.group(1)) != replicas:
                stale = os.path.join(where, name.rstrip("/"))
                try:
                    tf.io.gfile.rmtree(stale) if tf.io.gfile.isdir(stale) else tf.io.gfile.remove(stale)
                except tf.errors.NotFoundError:  # Another process of this job removed it first.
                    pass
    tf.io.gfile.makedirs(where)
    for replica, shard in sharded.shards.items():
        tensors = _pieces(sharded, shard)
        names = sorted(tensors)
        tf.raw_ops.SaveV2(prefix=os.path.join(where, SHARD_FILE.format(replica=replica, replicas=replicas)),
                          tensor_names=names, shape_and_slices=[""] * len(names),
                          tensors=[tensors[n] for n in names])


def _readers(where: str, step: int) -> list[Any]:
    # A replica's file is there once its index is (written last; a killed save leaves its data, or temporaries).
    files = sorted(f[:-len(".index")] for f in tf.io.gfile.listdir(where) if f.endswith(".index")) \
        if tf.io.gfile.exists(where) else []
    counts = {re.sub(r".*-of-", "", f) for f in files}
    if len(counts) == 1:
        n = int(counts.pop())
        names = [SHARD_FILE.format(replica=r, replicas=n) for r in range(n)]
        if sorted(files) == sorted(names):
            return [tf.train.load_checkpoint(os.path.join(where, name)) for name in names]
    raise UserError(f"Cannot resume with zero_stage: the sharded optimizer state of step {step} ({where}) "
                    "is missing or incomplete (every replica's file is needed). Was the run written "
                    "without zero_stage? Resume it with the zero_stage it was written with, or start a "
                    "new run with a new workdir.")


def unreadable(directory: str, step: int) -> Optional[str]:
    """Why the sharded state of a step (``directory/zero-{step}``) does not read back whole: a replica's file is
    missing, or a tensor does not read (truncated, a checksum mismatch). None when it reads whole, or when there
    is none (an unsharded run's checkpoint)."""
    where = os.path.join(directory, SHARD_DIR.format(step=step))
    if not tf.io.gfile.exists(where):
        return None
    try:
        for reader in _readers(where, step):
            for key in sorted(reader.get_variable_to_shape_map()):
                reader.get_tensor(key)
    except UserError:
        return f"{SHARD_DIR.format(step=step)} lacks a replica's file"
    except (tf.errors.OpError, IndexError, ValueError, OSError, RuntimeError) as e:
        return f"{SHARD_DIR.format(step=step)}: {cause(e)}"
    return None


def restore(sharded: Any, directory: str, step: int) -> None:
    """Reads the state of this process's shards from a step's files, written on any replica count."""
    where = os.path.join(directory, SHARD_DIR.format(step=step))
    readers = _readers(where, step)
    saved: dict[str, list] = {}  # "var{i}_{slot}" -> [(start, reader, key)]
    other: dict[str, tuple] = {}  # Global state and shapes: replica 0's first.
    for reader in readers:
        for key in reader.get_variable_to_shape_map():
            match = re.fullmatch(r"(var\d+_.+)/(\d+)", key)
            if match:
                saved.setdefault(match.group(1), []).append((int(match.group(2)), reader, key))
            else:
                other.setdefault(key, (reader, key))
    for shard in sharded.shards.values():
        for key, variable in shard.slots().items():
            match = re.fullmatch(r"b(\d+)_(.+)", key)
            if match:
                value = _assemble(sharded, shard, int(match.group(1)), match.group(2), saved, other, where)
            elif key in other:
                value = other[key][0].get_tensor(key)
            else:
                raise UserError(f"Cannot resume from {where}: it holds no optimizer state for {key!r}; the "
                                "checkpoint was written for another model or optimizer. Use the model and "
                                "optimizer it was written with, or a new workdir.")
            variable.assign(value)


def _assemble(sharded: Any, shard: Any, k: int, slot: str, saved: dict, other: dict, where: str) -> np.ndarray:
    """One replica's [shard] of a slot, from the saved pieces that overlap each of its own."""
    bucket = sharded.layout[k]
    out = np.zeros([bucket.shard], bucket.dtype.as_numpy_dtype)
    for p in bucket.pieces(shard.replica):
        name = f"var{p.index}_{slot}"
        shape = tuple(sharded.variables[p.index].shape)
        if name not in saved:
            raise UserError(f"Cannot resume from {where}: it holds no optimizer state for {name!r}; the "
                            "checkpoint was written for another model or optimizer. Use the model and "
                            "optimizer it was written with, or a new workdir.")
        reader, key = other.get(f"var{p.index}/shape", (None, None))
        written = tuple(int(d) for d in reader.get_tensor(key)) if reader is not None else None
        if written is not None and written != (shape or (0,)):
            raise UserError(f"Cannot resume from {where}: its optimizer state {name!r} has shape {written}, "
                            f"this model's {shape}; the checkpoint was written for a model of another shape. "
                            "Use that model, or a new workdir.")
        filled = 0
        for start, piece_reader, piece_key in sorted(saved[name], key=lambda s: s[0]):
            a, b = max(start, p.start), min(start + _length(piece_reader, piece_key), p.start + p.length)
            if a < b:
                values = piece_reader.get_tensor(piece_key)
                out[p.offset + a - p.start:p.offset + b - p.start] = values[a - start:b - start]
                filled += b - a
        if filled != p.length:
            raise UserError(f"Cannot resume from {where}: the optimizer state {name!r} is incomplete; the "
                            "checkpoint was written for a model of another shape. Use that model, or a new "
                            "workdir.")
    return out


def _length(reader: Any, key: str) -> int:
    return int(reader.get_variable_to_shape_map()[key][0])


def _slot_key(path: str, optimizer_name: str, paths: Sequence[str]) -> str:
    """``var{index}_{slot}`` for a slot Keras named ``{optimizer}/{variable path}_{slot}``."""
    rest = path[len(optimizer_name) + 1:] if path.startswith(optimizer_name + "/") else path
    for index, variable_path in sorted(enumerate(paths), key=lambda pair: -len(pair[1])):
        prefix = variable_path.replace("/", "_") + "_"
        if rest.startswith(prefix):
            return f"var{index}_{rest[len(prefix):]}"
    return rest


def seed_from(sharded: Any, user: Any, inner: Any) -> None:
    """A user's optimizer already built (a loaded model, an earlier Keras fit) hands over its state to the
    shards; its life cycle during the fit is `handover`'s."""
    from tfdist.training.zero import handover
    handover.seed_from(sharded, user, inner)
