"""Serving export: a TensorFlow SavedModel with a `serving_default` signature.

`export_saved_model` writes a Keras 3 model as a SavedModel that TensorFlow
Serving, `tf.saved_model.load` and `saved_model_cli` read: one
`serving_default` signature whose inputs are the model's own inputs (their
names, dtypes and shapes, e.g. tfdist's CNN takes `image`, uint8, `(None, 28,
28, 1)`; dict inputs keep their keys) and whose output is the model's output.
It is written into a temporary sibling directory and renamed into place, so a
failed or interrupted export never leaves a half-written directory and never
replaces a good one. `parse_export_formats` validates the `--export` flag's
value.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras

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


def export_saved_model(model: keras.Model, path: str) -> str:
    """Writes `model` as a SavedModel at `path` (replacing an earlier export there); returns the path.

    The signature `serving_default` takes the model's inputs by name and returns
    its output as `output_0`. Call it from one process only (the chief).
    """
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
