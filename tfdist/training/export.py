"""Serving export: a TensorFlow SavedModel with a `serving_default` signature.

`export_saved_model` writes a Keras 3 model as a SavedModel that TensorFlow
Serving, `tf.saved_model.load` and `saved_model_cli` read: one
`serving_default` signature whose inputs are the model's own inputs (their
names, dtypes and shapes, e.g. tfdist's CNN takes `image`, uint8, `(None, 28,
28, 1)`; dict inputs keep their keys) and whose output is the model's output.
On a local path it is written into a temporary sibling directory and renamed
into place, so a failed or interrupted export never leaves a half-written
directory and never replaces a good one; other filesystems (``gs://``,
``ram://``) are written through tf.io.gfile (see `export_saved_model`).
`parse_export_formats` validates the `--export` flag's value;
`check_exportable` refuses, before any step, a model the ``keras`` export
could not save; `ExportError` is what an export that fails after training
raises, with the run's History on it.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import tempfile
from typing import Any, Optional, Sequence

import keras
import tensorflow as tf
from keras.src.saving.serialization_lib import ObjectSharingScope

from tfdist.errors import UserError

EXPORT_FORMATS = ("keras", "saved_model")


def parse_export_formats(spec: str) -> tuple[str, ...]:
    """`"keras,saved_model"` -> `("keras", "saved_model")`; unknown, empty or repeated names are refused."""
    names = [name.strip() for name in spec.split(",")]
    valid = ", ".join(EXPORT_FORMATS)
    if not spec.strip() or any(not name for name in names):
        raise UserError(f"--export={spec!r} has an empty entry; give a comma-separated list of formats from: "
                        f"{valid} (e.g. --export=keras,saved_model).")
    unknown = [name for name in names if name not in EXPORT_FORMATS]
    if unknown:
        raise UserError(f"--export={spec!r}: unknown format {', '.join(map(repr, unknown))}; valid formats are: "
                        f"{valid} (e.g. --export=keras,saved_model).")
    if len(set(names)) != len(names):
        raise UserError(f"--export={spec!r} names a format twice; give each of {valid} at most once.")
    return tuple(names)


class ExportError(UserError):
    """Training finished and its checkpoint is kept, but an export failed; the History is on `history`."""

    exit_code = 1

    def __init__(self, message: str, history: Any = None):
        super().__init__(message)
        self.history = history


def first_sentence(error: BaseException) -> str:
    text = " ".join(str(error).split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text)[:300] or type(error).__name__


def _serialise(obj: Any) -> None:
    """What `model.save(...keras)` does first: the object's config, as JSON (Keras' saving_lib)."""
    with ObjectSharingScope():
        config = keras.saving.serialize_keras_object(obj)
    json.dumps(config)


def _culprits(model: keras.Model) -> list[tuple[Any, BaseException]]:
    """The layers that cannot be serialised although each of their own sublayers can."""
    failing = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        try:
            _serialise(layer)
        except Exception as e:  # noqa: BLE001 - whatever Keras raises is the reason.
            failing.append((layer, e))
    failing_ids = {id(layer) for layer, _ in failing}
    return [(layer, e) for layer, e in failing
            if not any(id(sub) in failing_ids for sub in layer._flatten_layers(include_self=False))]


def check_exportable(model: keras.Model, formats: Sequence[str]) -> None:
    """Refuses, before any step, a model the ``keras`` export could not save after training.

    The dry run is what ``model.save("model.keras")`` does first: serialise
    the model's config to JSON (cheap; no weights are written). The
    ``saved_model`` export traces the model and is not rehearsed here; if it
    fails after training, `fit` raises `ExportError` carrying the History.
    """
    if "keras" not in formats:
        return
    try:
        _serialise(model)
        return
    except Exception as e:  # noqa: BLE001
        error = e
    culprits = _culprits(model)
    if culprits:
        named = "; ".join(f"layer {layer.name!r} ({type(layer).__name__}): {first_sentence(e)}"
                          for layer, e in culprits)
        fix = (f"give {', '.join(sorted({type(layer).__name__ for layer, _ in culprits}))} a get_config() that "
               "returns its constructor arguments (and a from_config() if they are not plain values)")
    else:
        named = f"model {model.name!r} ({type(model).__name__}): {first_sentence(error)}"
        fix = f"give {type(model).__name__} a get_config() that returns its constructor arguments"
    raise UserError(
        f"The model cannot be exported as model.keras after training (export includes 'keras'): {named} "
        f"Either {fix}, or pass export=() (tfdist-train: --export=saved_model) to skip it. No step was run.")


def _is_local(path: str) -> bool:
    return "://" not in path


def _copy_tree(source: str, target: str) -> None:
    """Copies a directory with tf.io.gfile, ``saved_model.pb`` last: a copy cut short is not a SavedModel."""
    files = []
    for root, _, names in tf.io.gfile.walk(source):
        relative = root[len(source):].lstrip("/")
        tf.io.gfile.makedirs(posixpath.join(target, relative) if relative else target)
        files += [posixpath.join(relative, name) if relative else name for name in names]
    for name in sorted(files, key=lambda n: n == "saved_model.pb"):
        tf.io.gfile.copy(posixpath.join(source, name), posixpath.join(target, name), overwrite=True)


def export_saved_model(model: keras.Model, path: str) -> str:
    """Writes `model` as a SavedModel at `path` (replacing an earlier export there); returns the path.

    The signature `serving_default` takes the model's inputs by name and returns
    its output as `output_0`. Call it from one process only (the chief).

    On a local path the export is written into a temporary sibling directory
    and renamed into place (atomic). On other filesystems (``gs://``, any
    scheme tf.io.gfile knows) directory renames are not atomic, or not
    supported (``ram://`` renames only the name): the export is staged in a
    local temporary directory, and once it is complete the old export is
    removed and the new one copied in with tf.io.gfile, ``saved_model.pb``
    last, so an interrupted copy never looks like a whole SavedModel.
    """
    if not _is_local(path):
        path = path.rstrip("/")
        with tempfile.TemporaryDirectory(prefix="tfdist-saved-model-") as local:
            staged = os.path.join(local, "saved_model")
            model.export(staged, format="tf_saved_model", verbose=False)
            if tf.io.gfile.exists(path):
                tf.io.gfile.rmtree(path)
            _copy_tree(staged, path)
        return path
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        model.export(staging, format="tf_saved_model", verbose=False)
        if os.path.exists(path):
            # Two renames: the old export stays whole until the new one is complete.
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(path, os.path.join(old, name))
            os.rename(staging, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, path)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return path


def write_exports(rundir: Any, model: Any, export: Sequence[str], result: Any, latest: Optional[str]) -> None:
    """Writes the exports; one that fails raises `ExportError` with the History on it (checkpoints are kept)."""
    from tfdist.training import workdir as workdir_lib

    for name, write in (("keras", rundir.export_model), ("saved_model", rundir.export_saved_model)):
        if name not in export:
            continue
        try:
            write(model)
        except Exception as e:  # noqa: BLE001 - any failure: keep the History, say what failed.
            cause = str(e) if isinstance(e, workdir_lib.WriteError) else \
                f"{type(e).__name__}: {first_sentence(e)}"
            kept = (f"checkpoint {os.path.basename(latest)} in {os.path.dirname(latest)} holds the trained model"
                    if latest else "no checkpoint was written")
            raise ExportError(
                f"Training finished at step {result.steps} and {kept}, but the {name} export failed: {cause} The "
                "History is on model.history and on this error's .history. Fix the cause and rerun the same call "
                "(it resumes at the last checkpoint and exports again), or pass export=() to skip the export.",
                history=result.history) from e
