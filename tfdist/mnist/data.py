"""Data sources for the MNIST program.

A source (`load_dataset`) returns `Digits`: the evaluation split as in-memory
arrays, and the training split either as arrays (which `tfdist.fit` trains on in
its topology-independent order, `tfdist.training.inputs`) or, for ``tfds:NAME``,
as a `Stream`: a dataset function that reads the prepared tfds files, so a
training split larger than memory is never held whole.

Sources, chosen by name:
  * ``mnist``: the real MNIST digits bundled in the package (the 10,000-digit
    MNIST test split; every fifth digit, indices 4, 9, 14, ..., is held out
    for evaluation, the other 8,000 train).
  * ``tfds:NAME``: a tensorflow-datasets dataset with 28x28x1 images
    (``train`` and ``test`` splits). The train split is streamed from its
    files (see `_tfds_stream`); the test split is read into memory, so
    evaluation counts every example exactly once.
  * ``idx:DIR``: a directory of standard MNIST IDX files.
  * ``synthetic``: random MNIST-shaped tensors, for throughput measurement.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.mnist import idx
from tfdist.mnist.model import IMAGE_SHAPE, NUM_CLASSES
from tfdist.training.inputs import DatasetFn, options
from tfdist.errors import UserError

BUNDLED_DIR = os.path.join(os.path.dirname(__file__), "digits")
EVAL_EVERY = 5  # In the bundled split, digit i is held out when i % 5 == 4.
SYNTHETIC_TRAIN, SYNTHETIC_EVAL = 8192, 1024
SHUFFLE_BUFFER = 10_000  # Examples, per input pipeline, when streaming a tfds train split.



@dataclasses.dataclass(frozen=True)
class Stream:
    """A training split read from its files by every input pipeline; never held whole in memory.

    `dataset_fn(global_batch, seed)` returns a dataset function for `tfdist.fit`: it
    takes a `tf.distribute.InputContext` and returns that pipeline's per-replica
    batches (images uint8 [b,28,28,1], labels int32 [b]) for one pass over its
    share of the files. `seed=None` gives every pipeline an unseeded order of its
    own (parameter-server workers).
    """

    num_examples: int
    num_files: int
    dataset_fn: Callable[[int, Optional[int]], DatasetFn]


@dataclasses.dataclass(frozen=True)
class Digits:
    """Images uint8 [N,28,28,1], labels int32 [N]: the eval split in memory, the train split in memory or streamed.

    Exactly one of (`train_images`, `train_labels`) and `train_stream` is given.
    """

    name: str
    train_images: Optional[np.ndarray]
    train_labels: Optional[np.ndarray]
    eval_images: np.ndarray
    eval_labels: np.ndarray
    train_stream: Optional[Stream] = None

    def __post_init__(self) -> None:
        if (self.train_labels is None) == (self.train_stream is None):
            raise ValueError("Digits needs either train arrays or a train stream, not both or neither.")

    @property
    def num_train(self) -> int:
        if self.train_stream is not None:
            return self.train_stream.num_examples
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
        _check_tfds_features(builder, name)  # From the builder's metadata: no data is read, none downloaded.
        if download:
            builder.download_and_prepare()
        elif not builder.is_prepared():
            raise UserError(
                f"--dataset=tfds:{name}: no prepared copy in {builder.data_dir} and "
                "--download is off. Prepare it on a machine with internet access "
                f"(tfds build {name} --data_dir=DIR) and pass --data_dir=DIR, or add "
                "--download to fetch it now."
            )
        splits = builder.info.splits
        missing = [s for s in ("train", "test") if s not in splits]
        if missing:
            raise UserError(f"--dataset=tfds:{name} has no {' or '.join(missing)} split (it has: "
                            f"{', '.join(sorted(splits)) or 'none'}); tfdist trains on train and evaluates on test.")
        test_images, test_labels = _to_arrays(builder.as_dataset(split="test", as_supervised=True))
        stream = _tfds_stream(builder, name)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"--dataset=tfds:{name}: could not load it: {e}") from None
    return Digits(f"tfds:{name}", None, None, test_images.astype(np.uint8), test_labels.astype(np.int32),
                  train_stream=stream)


def _check_tfds_features(builder, name: str) -> None:
    """The (image, label) pair must be MNIST-like; checked from the builder's features, not the data."""
    import tensorflow_datasets as tfds

    keys = builder.info.supervised_keys
    if not (isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str) for k in keys)):
        raise UserError(f"--dataset=tfds:{name} has no (image, label) supervised keys ({keys!r}); tfdist reads "
                        "(image, label) pairs (as_supervised=True).")
    image, label = (builder.info.features[k] for k in keys)
    if tuple(image.shape) != IMAGE_SHAPE:
        raise UserError(
            f"--dataset=tfds:{name} has images of shape {tuple(image.shape)}; "
            f"tfdist's model takes {IMAGE_SHAPE} (MNIST-like datasets)."
        )
    if isinstance(label, tfds.features.ClassLabel) and label.num_classes > NUM_CLASSES:
        raise UserError(f"--dataset=tfds:{name} has {label.num_classes} classes; tfdist's model has "
                        f"{NUM_CLASSES} outputs (MNIST-like datasets).")


def _tfds_stream(builder, name: str) -> Stream:
    """The train split as a `Stream` read straight from the prepared tfds files.

    Each input pipeline (one per worker or Horovod rank) reads its share of the
    files: ``tfds.ReadConfig(input_context=...)`` shards by file when the file
    count is a multiple of the pipeline count; otherwise (e.g. one file, two
    workers) each pipeline reads an equal contiguous part of the split
    (``tfds.even_splits``). It reads in a file order shuffled by the run's seed,
    through a shuffle buffer of `SHUFFLE_BUFFER` examples, cuts its part of each
    global batch (the last partial one of a pass is dropped) and splits it in
    order among its local replicas. tfds' in-memory auto-cache is off.

    So the examples of a step do not depend on the number of replicas in one
    process, but they do depend on the number of input pipelines: unlike array
    inputs, the order is not the same on every topology, and a run resumed on a
    different number of workers continues (same plan, same step count) with a
    different order. On the same topology the order is deterministic, and a
    resumed run skips exactly the batches already trained on (by reading past
    them, which costs reading time). `tfdist.fit` repeats the pipeline, so an
    epoch (``num_examples // global_batch`` steps) need not end where a pass over
    the files does.
    """
    import tensorflow_datasets as tfds

    split = builder.info.splits["train"]
    num_files = split.num_shards

    def make(global_batch: int, seed: Optional[int]) -> DatasetFn:
        def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            pipelines, index = ctx.num_input_pipelines, ctx.input_pipeline_id
            per_replica = ctx.get_per_replica_batch_size(global_batch)
            by_files = num_files % pipelines == 0
            part = "train" if by_files else tfds.even_splits("train", pipelines)[index]
            read_config = tfds.ReadConfig(input_context=ctx if by_files else None, shuffle_seed=seed,
                                          try_autocache=False)
            logging.info("Input pipeline %d of %d: tfds:%s train split streamed from %s, per-replica batch %d, "
                         "shuffle buffer %d, seed %s (the order depends on the number of pipelines).", index,
                         pipelines, name, f"{num_files // pipelines} of its {num_files} file(s)" if by_files else
                         f"1/{pipelines} of its examples ({num_files} file(s))", per_replica, SHUFFLE_BUFFER, seed)
            ds = builder.as_dataset(split=part, as_supervised=True, shuffle_files=True, read_config=read_config)
            ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=True)
            # This pipeline's part of each global batch, split in order among its replicas: the local
            # replica count does not change which examples a step trains on.
            here = max(1, ctx.num_replicas_in_sync // pipelines)
            ds = ds.batch(per_replica * here, drop_remainder=True).rebatch(per_replica, drop_remainder=True).map(
                lambda image, label: (tf.ensure_shape(tf.cast(image, tf.uint8), (per_replica, *IMAGE_SHAPE)),
                                      tf.cast(label, tf.int32)), num_parallel_calls=tf.data.AUTOTUNE)
            return ds.prefetch(tf.data.AUTOTUNE).with_options(options())

        return dataset_fn

    return Stream(num_examples=split.num_examples, num_files=num_files, dataset_fn=make)


def _to_arrays(dataset: tf.data.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Reads a whole (image, label) dataset into two arrays."""
    images, labels = [], []
    for image_batch, label_batch in dataset.batch(8192).as_numpy_iterator():
        images.append(image_batch)
        labels.append(label_batch)
    if not images:
        return np.zeros((0, *IMAGE_SHAPE), np.uint8), np.zeros((0,), np.int32)
    return np.concatenate(images), np.concatenate(labels)
