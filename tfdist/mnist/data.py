"""Data sources and the tf.data input pipelines every backend shares.

A source (`load_dataset`) returns the digits as in-memory arrays, which the MNIST
program hands to `tfdist.fit` (whose input pipelines live in `tfdist.training.inputs`).

Sources, chosen by name:
  * ``mnist``: the real MNIST digits bundled in the package (the 10,000-digit
    MNIST test split; every fifth digit, indices 4, 9, 14, ..., is held out
    for evaluation, the other 8,000 train).
  * ``tfds:NAME``: a tensorflow-datasets dataset with 28x28x1 images
    (``train`` and ``test`` splits).
  * ``idx:DIR``: a directory of standard MNIST IDX files.
  * ``synthetic``: random MNIST-shaped tensors, for throughput measurement.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import numpy as np
import tensorflow as tf

from tfdist.mnist import idx
from tfdist.mnist.model import IMAGE_SHAPE, NUM_CLASSES
from tfdist.errors import UserError

BUNDLED_DIR = os.path.join(os.path.dirname(__file__), "digits")
EVAL_EVERY = 5  # In the bundled split, digit i is held out when i % 5 == 4.
SYNTHETIC_TRAIN, SYNTHETIC_EVAL = 8192, 1024

DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class Digits:
    """A train/eval split held in memory: images uint8 [N,28,28,1], labels int32 [N]."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    eval_images: np.ndarray
    eval_labels: np.ndarray

    @property
    def num_train(self) -> int:
        return len(self.train_labels)

    @property
    def num_eval(self) -> int:
        return len(self.eval_labels)


def load_dataset(spec: str, *, data_dir: str | None = None, download: bool = False) -> Digits:
    """Loads the dataset named by `spec` (see the module docstring)."""
    if spec == "mnist":
        return _bundled()
    if spec == "synthetic":
        return _synthetic()
    if spec.startswith("idx:") and spec[4:]:
        return _idx_dir(spec[4:])
    if spec.startswith("tfds:") and spec[5:]:
        return _tfds(spec[5:], data_dir=data_dir, download=download)
    raise UserError(
        f"--dataset={spec!r} is not a known data source; use one of: mnist (bundled "
        "digits), synthetic, idx:DIR (a directory of MNIST IDX files), tfds:NAME "
        "(a tensorflow-datasets dataset, e.g. tfds:mnist)."
    )


def _bundled() -> Digits:
    images, labels = idx.read_images_and_labels(
        os.path.join(BUNDLED_DIR, "t10k-images-idx3-ubyte.gz"),
        os.path.join(BUNDLED_DIR, "t10k-labels-idx1-ubyte.gz"),
    )
    held_out = np.arange(len(labels)) % EVAL_EVERY == EVAL_EVERY - 1
    return Digits("mnist", images[~held_out], labels[~held_out], images[held_out], labels[held_out])


def _synthetic() -> Digits:
    rng = np.random.default_rng(0)

    def make(n: int) -> tuple[np.ndarray, np.ndarray]:
        images = rng.integers(0, 256, size=(n, *IMAGE_SHAPE), dtype=np.uint8)
        return images, rng.integers(0, NUM_CLASSES, size=n).astype(np.int32)

    return Digits("synthetic", *make(SYNTHETIC_TRAIN), *make(SYNTHETIC_EVAL))


def _find_idx_file(directory: str, stem: str) -> str:
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if tf.io.gfile.exists(path):
            return path
    raise UserError(
        f"--dataset=idx:{directory}: the directory has no {stem} (or {stem}.gz). An IDX "
        "directory needs train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, gzip-compressed or not."
    )


def _idx_dir(directory: str) -> Digits:
    if not tf.io.gfile.isdir(directory):
        raise UserError(f"--dataset=idx:{directory}: no such directory.")
    paths = {
        stem: _find_idx_file(directory, stem)
        for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                     "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    }
    train = idx.read_images_and_labels(paths["train-images-idx3-ubyte"], paths["train-labels-idx1-ubyte"])
    test = idx.read_images_and_labels(paths["t10k-images-idx3-ubyte"], paths["t10k-labels-idx1-ubyte"])
    return Digits(f"idx:{directory}", *train, *test)


def _tfds(name: str, *, data_dir: str | None, download: bool) -> Digits:
    import tensorflow_datasets as tfds  # Imported here: slow, and only this source needs it.

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises several types for unknown names.
        raise UserError(f"--dataset=tfds:{name}: tensorflow-datasets does not know it ({e}).") from None
    try:
        if download:
            builder.download_and_prepare()
        train, test = (_to_arrays(ds) for ds in builder.as_dataset(split=["train", "test"], as_supervised=True))
    except Exception as e:
        if not download and not builder.is_prepared():
            raise UserError(
                f"--dataset=tfds:{name}: no prepared copy in {builder.data_dir} and "
                "--download is off. Prepare it on a machine with internet access "
                f"(tfds build {name} --data_dir=DIR) and pass --data_dir=DIR, or add "
                "--download to fetch it now."
            ) from None
        raise UserError(f"--dataset=tfds:{name}: could not load it: {e}") from None
    (train_images, train_labels), (test_images, test_labels) = train, test
    if train_images.shape[1:] != IMAGE_SHAPE:
        raise UserError(
            f"--dataset=tfds:{name} has images of shape {train_images.shape[1:]}; "
            f"tfdist's model takes {IMAGE_SHAPE} (MNIST-like datasets)."
        )
    return Digits(
        f"tfds:{name}",
        train_images.astype(np.uint8), train_labels.astype(np.int32),
        test_images.astype(np.uint8), test_labels.astype(np.int32),
    )


def _to_arrays(dataset: tf.data.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Reads a whole (image, label) dataset into two arrays."""
    images, labels = [], []
    for image_batch, label_batch in dataset.batch(8192).as_numpy_iterator():
        images.append(image_batch)
        labels.append(label_batch)
    if not images:
        return np.zeros((0, *IMAGE_SHAPE), np.uint8), np.zeros((0,), np.int32)
    return np.concatenate(images), np.concatenate(labels)
